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

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
    started = time.perf_counter()
    if impl == "eager":
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

        def step(*batch):
            optimizer.zero_grad(set_to_none=True)
            loss = model(*batch)
            loss.backward()
            optimizer.step()
            return float(loss)
    else:
        from ort_trainer import ORTTrainer
        from ort_trainer.optim import AdamConfig

        inputs = [("tokens", ["steps", "batch"]), ("labels", ["steps", "batch"])]
        if packed:  # one padded length, as docs/export_limits.md advises for packed batches
            inputs = [("tokens", [size["steps"], "batch"]), ("labels", [size["steps"], "batch"]),
                      ("lengths", ["batch"])]
        desc = {"inputs": inputs, "outputs": [("loss", [], True)]}
        options = {"graph": {"gradient_source": "torch"}, "graph_optimizations": {"fused_lstm": impl == "fused"}}
        trainer = ORTTrainer(model, desc, AdamConfig(lr=1e-3), options=options)

        def step(*batch):
            return float(trainer.train_step(*batch))
    step(*batches[0])
    first = time.perf_counter() - started
    started = time.perf_counter()
    losses = [step(*batches[i % len(batches)]) for i in range(steps)]
    return {"impl": impl, "first_s": first, "step_ms": (time.perf_counter() - started) / steps * 1000,
            "loss": losses[-1], "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def table(runs: list[dict], size_name: str, steps: int, packed: bool = False) -> str:
    """The markdown page of ``runs`` (``worker``'s results, in the order they ran)."""
    by = {impl: [r for r in runs if r["impl"] == impl] for impl in IMPLEMENTATIONS}

    def warm(rows: list[dict]) -> list[dict]:  # the rounds after the first (the first alone where there is one)
        return rows[1:] or rows

    eager_ms = statistics.median(r["step_ms"] for r in warm(by["eager"]))
    eager_mb = max(r["peak_mb"] for r in warm(by["eager"]))
    what = "packed LSTM" if packed else "LSTM"
    command = "python benchmarks/lstm.py" + (" --packed" if packed else "")
    lines = [f"# {what} training: ort_trainer against eager PyTorch ({size_name} size)", "",
             f"`{command}`, {os.cpu_count()} cores of {_cpu()}, {len(by['eager'])} rounds of {steps} steps per "
             "process, processes alternating. Step: each round's mean; the speed-up is of the warm rounds' median "
             "over eager's (the rounds after the first; in the first, the ort_trainer processes build their graphs "
             "and, from this run's empty cache, the torch operators' library). Peak RSS: the whole process's, cold "
             "(the first round's) / warm (the later rounds': the graph cache), and warm over eager's.", "",
             "| implementation | step (ms) | speed-up | first step (s) | peak RSS cold / warm (MB) | warm / eager |",
             "|---|---|---|---|---|---|"]
    for impl in IMPLEMENTATIONS:
        rows = by[impl]
        median = statistics.median(r["step_ms"] for r in warm(rows))
        warm_mb = max(r["peak_mb"] for r in warm(rows))
        steps_ms = " / ".join(f"{r['step_ms']:.0f}" for r in rows)
        firsts = " / ".join(f"{r['first_s']:.1f}" for r in rows)
        lines.append(f"| {impl} | {steps_ms} | {eager_ms / median:.2f}× | {firsts} | {rows[0]['peak_mb']:.0f} / "
                     f"{warm_mb:.0f} | {warm_mb / eager_mb:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="a toy size (the test's)")
    parser.add_argument("--packed", action="store_true",
                        help="sequences of their own lengths, packed (pack_padded_sequence) into the LSTM")
    parser.add_argument("--out", help="write the table there too")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    size_name = "tiny" if args.tiny else "real"
    if args.worker:
        print(json.dumps(worker(args.worker, SIZES[size_name], args.steps, args.packed)))
        return
    runs = []
    with tempfile.TemporaryDirectory() as cache:
        for round_ in range(args.rounds):
            order = IMPLEMENTATIONS if round_ % 2 == 0 else IMPLEMENTATIONS[::-1]
            for impl in order:
                command = [sys.executable, __file__, "--worker", impl, "--steps", str(args.steps)]
                command += (["--tiny"] if args.tiny else []) + (["--packed"] if args.packed else [])
                done = subprocess.run(command, capture_output=True, text=True,
                                      env={**os.environ, "ORT_TRAINER_CACHE_DIR": cache}, check=True)
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(json.dumps(runs[-1]), flush=True)
    runs.sort(key=lambda r: IMPLEMENTATIONS.index(r["impl"]))  # (stable: each implementation's rounds in order)
    page = table(runs, size_name, args.steps, args.packed)
    print(page)
    if args.out:
        Path(args.out).write_text(page)


if __name__ == "__main__":
    main()
