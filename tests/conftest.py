"""Shared fixtures: an isolated graph cache per test session, deterministic seeds."""

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    os.environ["ORT_TRAINER_CACHE_DIR"] = str(tmp_path_factory.mktemp("graph_cache"))
    yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    np.random.seed(0)
    yield
