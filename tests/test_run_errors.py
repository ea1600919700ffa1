"""An error raised inside ONNX Runtime during a step says what went wrong in the user's terms
(``ort_trainer/_run_errors.py``): the inputs' shapes, the module of the failing node and, when
memory ran out, the size asked for and what to change; the trainer stays usable and exact."""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ort_trainer import ORTTrainer
from ort_trainer._run_errors import StepError, explain
from ort_trainer.optim import SGDConfig

ROOT = Path(__file__).resolve().parents[1]


class _Picker(torch.nn.Module):
    """Indexes its table with ids shifted left by two bits: an index no input check computes (the
    checks do not know the shift), so a bad id fails inside ONNX Runtime's Gather."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(16, 4)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, ids, label):
        picked = self.table(torch.bitwise_left_shift(ids, 2))
        return F.cross_entropy(self.head(picked.mean(1)), label), picked


DESC = {"inputs": [("ids", ["batch", 5]), ("label", ["batch"])],
        "outputs": [("loss", [], True), ("picked", ["batch", 5, 4])]}


def _weights(trainer):
    return {k: v.copy() for k, v in trainer.state_dict()["model"]["full_precision"].items()}


def test_an_error_inside_a_step_names_the_shapes_and_the_module_and_keeps_onnx_runtimes_line_off_stderr(capfd):
    torch.manual_seed(0)
    trainer = ORTTrainer(_Picker(), DESC, SGDConfig(lr=0.1))
    ids, label = torch.randint(0, 4, (3, 5)), torch.randint(0, 3, (3,))
    trainer.train_step(ids, label)
    before = _weights(trainer)
    bad = ids.clone()
    bad[1, 2] = 9  # 9 << 2 = 36 rows of 16
    capfd.readouterr()
    for step in (trainer.train_step, trainer.eval_step):
        with pytest.raises(StepError) as error:
            step(bad, label)
        message = str(error.value)
        # the node's name is the exporter's ('node_embedding', or '/model/table/Gather' on the training build)
        assert re.search(r"at node '(node_embedding|/model/table/Gather)' \(Gather\) of module table", message)
        assert "for inputs of shapes ids [3, 5] int64, label [3] int64" in message
        assert "idx=36 must be within the inclusive range [-16,15]" in message  # ONNX Runtime's own words
        assert error.value.shapes == {"ids": (3, 5), "label": (3,)} and error.value.module == "table"
    assert "onnxruntime" not in capfd.readouterr().err  # its error line stays in the exception
    assert trainer._train_step_info.step == 1
    assert all(np.array_equal(before[k], v) for k, v in _weights(trainer).items())
    trainer.train_step(ids, label)  # and training goes on
    assert trainer._train_step_info.step == 2


def test_an_allocation_failure_says_how_much_and_what_to_change():
    failure = RuntimeError("Error in execution: Non-zero status code returned while running MatMul node. "
                           "Name:'fused node_addmm_4' Status Message: /onnxruntime_src/onnxruntime/core/framework/"
                           "bfc_arena.cc:360 Failed to allocate memory for requested buffer of size 3221225472")
    feeds = {"input_ids": np.zeros((64, 1024), np.int64), "labels": np.zeros((64, 1024), np.int64)}
    error = explain(failure, "the training step (forward and backward)", feeds, {"node_addmm_4": "transformer.h.3.mlp"},
                    training=True, gpu=False)
    message = str(error)
    assert message.startswith("ONNX Runtime ran out of memory in the training step (forward and backward) at node "
                              "'fused node_addmm_4' (MatMul) of module transformer.h.3.mlp: it could not allocate "
                              "3.00 GiB (3221225472 bytes) for inputs of shapes input_ids [64, 1024] int64, labels "
                              "[64, 1024] int64")
    assert "a smaller batch or the same batch in micro-batches (batch.gradient_accumulation_steps" in message
    assert error.requested_bytes == 3221225472 and "device.mem_limit" not in message
    evaluation = str(explain(RuntimeError("CUDA failure 2: out of memory"), "the evaluation", feeds, {}, training=False,
                             gpu=True))
    assert "ran out of memory in the evaluation" in evaluation and "device.mem_limit" in evaluation
    assert "gradient_accumulation_steps" not in evaluation  # an evaluation accumulates nothing


_OUT_OF_MEMORY = textwrap.dedent("""
    import resource, sys
    import numpy as np, torch
    import torch.nn.functional as F
    from ort_trainer import ORTTrainer
    from ort_trainer._run_errors import StepError
    from ort_trainer.optim import SGDConfig

    class Wide(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(16, 8192), torch.nn.Linear(8192, 3)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    desc = {"inputs": [("x", ["batch", 16]), ("label", ["batch"])],
            "outputs": [("loss", [], True), ("logits", ["batch", 3])]}
    torch.manual_seed(0)
    model = Wide()
    trainer = ORTTrainer(model, desc, SGDConfig(lr=0.1), loss_fn=F.cross_entropy)
    reference = ORTTrainer(Wide(), desc, SGDConfig(lr=0.1), loss_fn=F.cross_entropy)
    reference.load_state_dict(trainer.state_dict())
    small = torch.randn(8, 16), torch.randint(0, 3, (8,))
    trainer.train_step(*small), reference.train_step(*small)
    size = int([line for line in open("/proc/self/status") if line.startswith("VmSize")][0].split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (size + 256 * 2**20, resource.RLIM_INFINITY))
    big = torch.randn(32768, 16), torch.randint(0, 3, (32768,))  # 32768 x 8192 float32 activations: 1 GiB each
    try:
        trainer.train_step(*big)
        sys.exit("the step fitted")
    except StepError as error:
        print(error)
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    # the failed step changed nothing: the next one is the reference's
    assert trainer.train_step(*small)[0].item() == reference.train_step(*small)[0].item()
    print("exact after the failure")
""")


def test_a_batch_too_large_for_memory_fails_with_the_size_and_advice_and_the_trainer_stays_exact():
    """A real allocation failure: the process's address space capped 256 MB above what it maps."""
    done = subprocess.run([sys.executable, "-c", _OUT_OF_MEMORY], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ONNX Runtime ran out of memory in the training step (forward and backward)" in done.stdout
    assert "of module up" in done.stdout and "could not allocate 1.00 GiB (1073741824 bytes)" in done.stdout
    assert "for inputs of shapes x [32768, 16] float32, label [32768] int64" in done.stdout
    assert "exact after the failure" in done.stdout
    assert "[E:onnxruntime" not in done.stderr


def test_onnx_runtime_logs_only_what_the_library_logger_asks_for():
    """Fatal lines only by default (a run's error line is in the StepError); errors at INFO; its
    warnings and INFO lines at DEBUG."""
    import logging

    from ort_trainer._logging import logger, ort_severity

    before = logger.level
    try:
        for level, severity in [(logging.WARNING, 4), (logging.INFO, 3), (logging.DEBUG, 1)]:
            logger.setLevel(level)
            assert ort_severity() == severity
    finally:
        logger.setLevel(before)
