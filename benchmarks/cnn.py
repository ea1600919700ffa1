"""A convolutional network at a size users train on a CPU: time per step, peak memory and build time of ort_trainer
with each convolution, ReLU gradient and batch norm as torch's kernels, forward and backward
(``graph_optimizations.torch_convolutions`` and ``torch_batch_norm``: oneDNN's, one node each), written in ONNX (both
switches off), and of eager PyTorch.

Run: ``python benchmarks/cnn.py [--rounds 2] [--steps 10] [--out docs/benchmarks_cnn.md]``. The model: a ResNet-18
for 32 x 32 images (CIFAR-10's: a 3 x 3 stem of 64 channels, four stages of two basic blocks, 64 to 512 channels,
batch norm after every convolution, global average pooling, a 10-class head) on batches of 32 random images, trained
with SGD as CIFAR ResNets train, momentum 0.9 and weight decay 5e-4 (``torch.optim.SGD``; ``SGDConfig``, whose
update runs torch's ``_fused_sgd_`` in place); ``--tiny``: a toy size (8 channels, 8 x 8 images, batch 4),
for the test. Each implementation runs in a process of its own, the order alternating from round to round
(``alternating.py``); a step's time is the mean of ``--steps`` steps after the first.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import alternating  # noqa: E402  (benchmarks/alternating.py)

IMPLEMENTATIONS = ("eager", "torch_kernels", "onnx_backward")  # ort_trainer's: both switches on, both off
SGD = {"lr": 0.01, "momentum": 0.9, "weight_decay": 5e-4}  # the same hyper-parameters for torch.optim.SGD and SGDConfig
SIZES = {"real": {"width": 64, "image": 32, "batch": 32}, "tiny": {"width": 8, "image": 8, "batch": 4}}


def _model(width: int):
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self, inputs: int, outputs: int, stride: int):
            super().__init__()
            self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(outputs)
            self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(outputs)
            self.shortcut = nn.Sequential()
            if stride != 1 or inputs != outputs:
                self.shortcut = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False),
                                              nn.BatchNorm2d(outputs))

        def forward(self, x):
            return F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))) + self.shortcut(x))

    class ResNet18(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
            blocks, channels = [], width
            for stage, outputs in enumerate([width, 2 * width, 4 * width, 8 * width]):
                blocks += [Block(channels, outputs, 1 if stage == 0 else 2), Block(outputs, outputs, 1)]
                channels = outputs
            self.blocks = nn.Sequential(*blocks)
            self.head = nn.Linear(channels, 10)

        def forward(self, images, labels):
            features = F.adaptive_avg_pool2d(self.blocks(self.stem(images)), 1).flatten(1)
            return F.cross_entropy(self.head(features), labels)

    return ResNet18()


def worker(impl: str, size: dict, steps: int) -> dict:
    """One process: a first step (the build, for ort_trainer) and ``steps`` timed steps of ``impl``."""
    import torch

    sys.path.insert(0, str(ROOT))
    torch.manual_seed(0)
    model = _model(size["width"])
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(size["batch"], 3, size["image"], size["image"], generator=generator),
                torch.randint(0, 10, (size["batch"],), generator=generator)) for _ in range(2)]

    def trainer():
        from ort_trainer import ORTTrainer
        from ort_trainer.optim import SGDConfig

        desc = {"inputs": [("images", ["batch", 3, size["image"], size["image"]]), ("labels", ["batch"])],
                "outputs": [("loss", [], True)]}
        on = impl == "torch_kernels"
        options = {"graph": {"gradient_source": "torch"},
                   "graph_optimizations": {"torch_convolutions": on, "torch_batch_norm": on}}
        return ORTTrainer(model, desc, SGDConfig(**SGD), options=options)

    return alternating.timed(impl, model, batches, steps, lambda params: torch.optim.SGD(params, **SGD), trainer)


def main(argv: list[str] | None = None) -> None:
    parser = alternating.parser(__doc__.split("\n\n")[0], steps=10)
    args = parser.parse_args(argv)
    size_name = "tiny" if args.tiny else "real"
    if args.worker:
        print(json.dumps(worker(args.worker, SIZES[size_name], args.steps)))
        return
    arguments = ["--steps", str(args.steps)] + (["--tiny"] if args.tiny else [])
    runs = alternating.run_rounds(__file__, IMPLEMENTATIONS, args.rounds, arguments)
    title = f"ResNet-18 training: ort_trainer against eager PyTorch ({size_name} size)"
    alternating.report(runs, title, "python benchmarks/cnn.py", args.steps, IMPLEMENTATIONS, args.out)


if __name__ == "__main__":
    main()
