"""``device.torch_allocator``: ONNX Runtime's GPU memory from torch's caching allocator
(``ort_trainer/kernels/torch_allocator.py``). On the CPU: the options it refuses, the provider options it
sets, the C++ functions compiled against this torch's headers, and the errors where it cannot be built;
on a GPU (``cuda``): training with it equals training without, and the graph's memory is torch's."""

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from ort_trainer import ORTTrainer, devices
from ort_trainer.kernels import KernelsUnavailable, _compilers, torch_allocator
from ort_trainer.optim import AdamConfig
from ort_trainer.options import ORTTrainerOptions

from models import MLP, MLP_DESC, clone, mlp_batch


def test_the_options_it_cannot_go_with_are_named_together():
    """On a CPU device and with the arena's limit: one error lists both (with a captured CUDA graph, where torch
    cannot give the capture a pool of its own: test_cuda_graph.py)."""
    with pytest.raises(ValueError) as raised:
        ORTTrainerOptions({"device": {"id": "cpu", "torch_allocator": True, "mem_limit": 2**30}})
    message = str(raised.value)
    assert "device.torch_allocator: torch's caching allocator serves GPU memory; device.id is 'cpu'" in message
    assert "device.torch_allocator: device.mem_limit caps ONNX Runtime's own arena" in message
    assert ORTTrainerOptions({"device": {"id": "cpu"}}).device.torch_allocator is False


def test_the_cuda_provider_allocates_through_the_three_functions(monkeypatch):
    """No arena: the three addresses go to the provider's gpu_external_* options, the user's options on top."""
    addresses = {"gpu_external_alloc": "1", "gpu_external_free": "2", "gpu_external_empty_cache": "3"}
    monkeypatch.setattr(devices, "torch_allocator_options", lambda: dict(addresses))
    device = devices.CUDADevice(0)
    _, options = device.providers({"use_tf32": 1}, 0, False, True)[0]
    assert {key: options[key] for key in addresses} == addresses and options["use_tf32"] == "1"
    _, plain = device.providers({}, 0, False)[0]
    assert not set(addresses) & set(plain)


def _stub_for_a_cpu_torch(folder: Path) -> tuple[Path, ...]:
    """A CPU build of torch ships c10/cuda's headers but not the one its CUDA builds generate
    (c10/cuda/impl/cuda_cmake_macros.h): a stand-in with the shared-library setting of those builds."""
    if torch.version.cuda is not None:
        return ()
    header = folder / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    header.parent.mkdir(parents=True)
    header.write_text("#define C10_CUDA_BUILD_SHARED_LIBS\n")
    return (folder,)


def test_the_functions_compile_against_this_torchs_headers(tmp_path):
    """torch_allocator.cc against the installed torch's c10::cuda::CUDACachingAllocator (raw_alloc, raw_delete,
    emptyCache: the API the functions call), compiled as an object (linking needs a CUDA build's libc10_cuda);
    it defines the three functions and needs torch's allocator from libc10_cuda alone."""
    cxx, cuda_include = _compilers()[1], torch_allocator.cuda_include_dir()
    if cxx is None or cuda_include is None:
        pytest.skip("needs a C++ compiler and the CUDA runtime's headers")
    output = tmp_path / "torch_allocator.o"
    command = torch_allocator._command(cxx, output, Path(torch.__file__).parent, cuda_include,
                                       torch._C._GLIBCXX_USE_CXX11_ABI, _stub_for_a_cpu_torch(tmp_path / "stub"))
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    symbols = subprocess.run(["nm", "-C", str(output)], capture_output=True, text=True).stdout
    defined = {line.split()[-1] for line in symbols.splitlines() if " T " in line}
    assert {"OrtTrainerTorchAlloc", "OrtTrainerTorchFree", "OrtTrainerTorchEmptyCache"} <= defined
    assert "c10::cuda::CUDACachingAllocator::allocator" in symbols


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch is a CUDA build")
def test_a_cpu_build_of_torch_is_refused_with_the_fix():
    with pytest.raises(KernelsUnavailable, match=r"needs a CUDA build of torch .*leave device.torch_allocator off"):
        torch_allocator.build()


def test_the_cuda_headers_are_looked_for_where_cuda_home_says(tmp_path, monkeypatch):
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "cuda_runtime_api.h").write_text("")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert torch_allocator.cuda_include_dir() == tmp_path / "include"


# The same kernels on the same values, in the same order; cuBLAS may pick another algorithm for buffers of
# another alignment (torch's blocks against ONNX Runtime's arena chunks), each sum of at most 64 terms 64·u
# apart per step, through 20 steps of AdamW: 20 · 64 · 2^-24 = 7.6e-5 (float32), held to 1e-4.
RTOL = 1e-4


@pytest.mark.cuda
def test_training_from_torchs_pool_equals_training_from_the_arena():
    """20 AdamW steps of the MLP with and without the allocator: losses within RTOL; with it, the graph's
    activations are allocated in torch's pool (its peak grows by them)."""
    model = MLP()
    results = {}
    for on in (False, True):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        trainer = ORTTrainer(clone(model), MLP_DESC, AdamConfig(lr=1e-2), loss_fn=torch.nn.functional.cross_entropy,
                             options={"device": {"id": "cuda", "torch_allocator": on}})
        gen = torch.Generator().manual_seed(3)
        losses = [trainer.train_step(*mlp_batch(gen))[0].item() for _ in range(20)]
        results[on] = losses, torch.cuda.max_memory_allocated()
        del trainer
    np.testing.assert_allclose(results[True][0], results[False][0], rtol=RTOL)
    assert results[True][1] > results[False][1], results


@pytest.mark.cuda
def test_the_functions_build_and_load_against_this_torch(tmp_path, monkeypatch):
    monkeypatch.setenv("ORT_TRAINER_CACHE_DIR", str(tmp_path))
    options = torch_allocator.provider_options()
    assert set(options) == {"gpu_external_alloc", "gpu_external_free", "gpu_external_empty_cache"}
    assert all(int(address) > 0 for address in options.values())
    assert torch_allocator.build().is_relative_to(tmp_path)
    assert os.path.getsize(torch_allocator.build()) > 0
