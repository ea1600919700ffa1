"""Where a real-size trainer's memory goes: resident memory after each phase, and the bytes each
component holds (the user's module, the engine's flat buffers, graph protos kept alive).

Run: ``python benchmarks/memory_breakdown.py --model gpt2`` (the rows of ``real_sizes.py``: Hugging
Face ``transformers``, random weights: GPT-2 small, 124 M weights, B4×S128; ``bert``: BERT-base
MLM, 110 M; ``gpt2-656m``; ``gpt2-tiny``).
Eager PyTorch (AdamW, clipping) runs the same steps in its own process with ``--eager``. Prints
one JSON object: the phases' resident memory (current and peak, MB) and the components' sizes (MB).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_sizes import SIZES, eager_loss, workload  # noqa: E402


def _rss_mb() -> tuple[float, float]:
    """(current, peak) resident memory of this process in MB."""
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status if ":" in line)
    current = int(fields["VmRSS"].split()[0]) / 1024
    return current, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _unique_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SIZES), default="gpt2")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--eager", action="store_true", help="eager PyTorch + AdamW instead of ort_trainer")
    args = parser.parse_args()

    import torch

    phases = {"imported": _rss_mb()}
    model, desc, batch_of = workload(args.model)
    inputs = batch_of()
    phases["model built"] = _rss_mb()
    mb = 2.0 ** 20
    components = {"module weights and buffers": _unique_bytes([*model.parameters(), *model.buffers()]) / mb}
    seconds = []
    if args.eager:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for step in range(args.steps):
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = eager_loss(args.model, model, inputs)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            seconds.append(time.perf_counter() - started)
            phases[f"step {step + 1}"] = _rss_mb()
    else:
        from ort_trainer import ORTTrainer
        from ort_trainer.optim import AdamConfig

        trainer = ORTTrainer(model, desc, AdamConfig(lr=1e-4))
        trainer._train_step_info.fetches = ["loss"]
        phases["trainer constructed"] = _rss_mb()
        for step in range(args.steps):
            started = time.perf_counter()
            trainer.train_step(*inputs)
            seconds.append(time.perf_counter() - started)
            phases[f"step {step + 1}"] = _rss_mb()
        engine = trainer._engine
        module = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        flat = [*engine.weights_flat, engine.grads_flat, engine.accumulated_flat,
                *(t for parity in engine.states_flat for t in parity.values())]
        components.update({
            "engine weights (flat)": _unique_bytes(engine.weights_flat) / mb,
            "engine gradients (flat)": _unique_bytes([engine.grads_flat, engine.accumulated_flat]) / mb,
            "engine optimizer states (flat)": _unique_bytes([t for p in engine.states_flat for t in p.values()]) / mb,
            "engine fixed tensors (frozen weights, buffers)": _unique_bytes(list(engine.fixed_tensors.values())) / mb,
            "module storage shared with the engine": sum(
                t.untyped_storage().nbytes() for t in flat if t.untyped_storage().data_ptr() in module) / mb,
            "gradient graph proto": trainer._graphs.gradient.ByteSize() / mb,
        })
    report = {"model": args.model, "implementation": "eager" if args.eager else "ort_trainer",
              "batch": SIZES[args.model][0], "seq": SIZES[args.model][1],
              "weights": sum(p.numel() for p in model.parameters()),
              "phases_mb": {k: {"rss": round(v[0]), "peak": round(v[1])} for k, v in phases.items()},
              "components_mb": {k: round(v, 3) for k, v in components.items()},
              "step_seconds": [round(s, 3) for s in seconds]}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
