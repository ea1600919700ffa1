"""The command line's TensorBoard log (``logging: {tensorboard: true}``).

Scalars go to ``OUTPUT_DIR/tensorboard`` through PyTorch's ``torch.utils.tensorboard.SummaryWriter``,
which writes with the ``tensorboard`` package's event-file writer (the ``tensorboard`` extra:
``pip install "ort_trainer[tensorboard]"``), the writer the Hugging Face ``Trainer`` uses for
``report_to="tensorboard"``. Tags: ``train/loss``, ``train/learning_rate``, ``train/samples_per_s``,
``train/loss_scale`` (float16 mixed precision), ``eval/loss`` and, where the job has them, the other
evaluation metrics (``eval/<name>``). A resumed run purges the events after its checkpoint's step, so
TensorBoard shows one line per tag, as ``metrics.jsonl`` keeps one record per step.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

INSTALL = 'pip install "ort_trainer[tensorboard]"'


def tensorboard_problem() -> str | None:
    """Why TensorBoard logging cannot run here (None when it can)."""
    try:
        import tensorboard  # noqa: F401  (the event writer torch.utils.tensorboard needs)
    except ImportError:
        return f"logging.tensorboard: the tensorboard package is not installed; {INSTALL}, or set it to false"
    return None


class TensorBoardLog:
    """Scalars of one run under ``directory``.

    Args:
        directory: ``OUTPUT_DIR/tensorboard``.
        resume_step: the step of the checkpoint a resumed run starts from (its later events are
            dropped); None for a fresh run, whose earlier events are removed first.
    """

    def __init__(self, directory: str | Path, resume_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        directory = Path(directory)
        if resume_step is None and directory.exists():
            shutil.rmtree(directory)
        self._writer = SummaryWriter(log_dir=str(directory),
                                     purge_step=resume_step + 1 if resume_step is not None else None)

    def record(self, record: dict[str, Any]) -> None:
        """Write a ``metrics.jsonl`` record's numbers as scalars at its ``step``: ``loss``, ``lr``,
        ``samples_per_s`` and ``loss_scale`` under ``train/``, ``eval_<name>`` as ``eval/<name>``."""
        step = record["step"]
        names = {"loss": "train/loss", "lr": "train/learning_rate", "samples_per_s": "train/samples_per_s",
                 "loss_scale": "train/loss_scale"}
        for key, value in record.items():
            if key == "step" or not isinstance(value, (int, float)):
                continue
            tag = names.get(key) or (f"eval/{key[len('eval_'):]}" if key.startswith("eval_") else f"train/{key}")
            self._writer.add_scalar(tag, value, step)

    def close(self) -> None:
        """Flush the events to disk and close the file."""
        self._writer.close()


__all__ = ["TensorBoardLog", "tensorboard_problem"]
