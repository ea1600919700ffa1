"""A recurrent model at a size users train: time per step, peak memory and build time of ort_trainer's LSTM
layers (``graph_optimizations.fused_lstm``: oneDNN's kernels as one node per layer and direction), of the unrolled
recurrence (the switch off), and of eager PyTorch.

Run: ``python benchmarks/lstm.py [--packed] [--rounds 2] [--steps 20] [--out docs/benchmarks_lstm.md]``. The model:
token embeddings (128), a 2-layer bidirectional ``nn.LSTM`` (hidden 256, dropout 0.1 between the layers), a linear
head over a 5000-word vocabulary and a cross-entropy per token, on batches of 64 sequences of 50 tokens (``--packed``:
sequences of 16 to 50 tokens padded to 50, packed with ``pack_padded_sequence`` and unpacked with
``pad_packed_sequence``, the padding's labels ignored; ``--tiny``: a toy size, for the test), trained with Adam
(``torch.optim.Adam``; ort_trainer's ``AdamConfig``). Each implementation runs in a process of its own, the order
alternating from round to round; the first round's ort_trainer processes build their graphs (cold), the later ones
find them in this run's graph cache (warm). A step's time is the mean of ``--steps`` steps after the first; peak RSS
is the whole process's (``ru_maxrss``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import alternating  # noqa: E402  (benchmarks/alternating.py)
IMPLEMENTATIONS = ("eager", "fused", "unrolled")  # eager PyTorch; ort_trainer with fused_lstm on, off
SIZES = {"real": {"vocab": 5000, "embed": 128, "hidden": 256, "steps": 50, "batch": 64},
         "tiny": {"vocab": 50, "embed": 8, "hidden": 8, "steps": 5, "batch": 3}}


def _model(size: dict, packed: bool):
    import torch
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(size["vocab"], size["embed"])
            self.lstm = torch.nn.LSTM(size["embed"], size["hidden"], num_layers=2, bidirectional=True, dropout=0.1)
            self.head = torch.nn.Linear(2 * size["hidden"], size["vocab"])

        def forward(self, tokens, labels, lengths=None):
            if lengths is None:
                out, _ = self.lstm(self.embed(tokens))
            else:  # each sequence's own steps (labels past its end: -100, ignored)
                out, _ = self.lstm(pack_padded_sequence(self.embed(tokens), lengths, enforce_sorted=False))
                out, _ = pad_packed_sequence(out, total_length=tokens.shape[0])
            return torch.nn.functional.cross_entropy(self.head(out).flatten(0, 1), labels.flatten())

    return Tagger()


def _batches(size: dict, packed: bool) -> list[tuple]:
    """Four batches of ``(tokens, labels)``, and with ``packed`` each sequence's length (from a third of the steps to
    all of them), the labels past it -100."""
    import torch

    generator = torch.Generator().manual_seed(1)
    shape = (size["steps"], size["batch"])
    batches = []
    for _ in range(4):
        tokens, labels = (torch.randint(0, size["vocab"], shape, generator=generator) for _ in range(2))
        if packed:
            lengths = torch.randint(max(1, size["steps"] // 3), size["steps"] + 1, (size["batch"],),
                                    generator=generator)
            labels = labels.masked_fill(torch.arange(size["steps"])[:, None] >= lengths, -100)
            batches.append((tokens, labels, lengths))
        else:
            batches.append((tokens, labels))
    return batches


def worker(impl: str, size: dict, steps: int, packed: bool = False) -> dict:
    """One process: a first step (the build, for ort_trainer) and ``steps`` timed steps of ``impl``."""
    import torch

    sys.path.insert(0, str(ROOT))
    torch.manual_seed(0)
    model = _model(size, packed)
    batches = _batches(size, packed)

    def trainer():
        from ort_trainer import ORTTrainer
        from ort_trainer.optim import AdamConfig

        inputs = [("tokens", ["steps", "batch"]), ("labels", ["steps", "batch"])]
        if packed:  # one padded length, as docs/export_limits.md advises for packed batches
            inputs = [("tokens", [size["steps"], "batch"]), ("labels", [size["steps"], "batch"]),
                      ("lengths", ["batch"])]
        desc = {"inputs": inputs, "outputs": [("loss", [], True)]}
        options = {"graph": {"gradient_source": "torch"}, "graph_optimizations": {"fused_lstm": impl == "fused"}}
        return ORTTrainer(model, desc, AdamConfig(lr=1e-3), options=options)

    return alternating.timed(impl, model, batches, steps, lambda params: torch.optim.Adam(params, lr=1e-3), trainer)


def main(argv: list[str] | None = None) -> None:
    parser = alternating.parser(__doc__.split("\n\n")[0], steps=20)
    parser.add_argument("--packed", action="store_true",
                        help="sequences of their own lengths, packed (pack_padded_sequence) into the LSTM")
    args = parser.parse_args(argv)
    size_name = "tiny" if args.tiny else "real"
    if args.worker:
        print(json.dumps(worker(args.worker, SIZES[size_name], args.steps, args.packed)))
        return
    arguments = ["--steps", str(args.steps)] + (["--tiny"] if args.tiny else []) + (["--packed"] if args.packed else [])
    runs = alternating.run_rounds(__file__, IMPLEMENTATIONS, args.rounds, arguments)
    title = f"{'packed LSTM' if args.packed else 'LSTM'} training: ort_trainer against eager PyTorch ({size_name} size)"
    command = "python benchmarks/lstm.py" + (" --packed" if args.packed else "")
    alternating.report(runs, title, command, args.steps, IMPLEMENTATIONS, args.out)


if __name__ == "__main__":
    main()
