"""GPU benchmark: ort_trainer on CUDA against PyTorch eager, in fp32 and in fp16 mixed precision.

Run by ``make gpu-check`` on a machine with a GPU, ``onnxruntime-gpu`` and a CUDA build of torch;
it writes ``docs/benchmarks_gpu.md``. Each (model, precision, implementation) runs in a process of
its own, once per round, and the order of the implementations is reversed every other round, so
neither side's threads, caches or allocator state slow the other.

- fp32: ``ORTTrainer(device.id="cuda")`` against eager PyTorch on the same GPU.
- fp16: ``ORTTrainer(mixed_precision={"enabled": True, "dtype": "float16"})`` (dynamic loss scaler)
  against eager PyTorch under ``torch.autocast("cuda", torch.float16)`` with a ``GradScaler``.

Both sides train with AdamW (lr 1e-4, weight decay 0.01), clip the gradient norm at 1.0, take
their batch from host memory each step (as from a data loader) and read the loss back to the host.
Targets (issue 12): fp32 ≥ 1.0× torch eager, fp16 ≥ 1.0× torch autocast.

Usage: ``python benchmarks/gpu.py [--models bert,gpt2] [--rounds 3] [--steps 30] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(1, str(ROOT))

IMPLS = ("ort", "torch")
PRECISIONS = ("fp32", "fp16")
TARGET = 1.0


def _ort(work, model, precision: str):
    from ort_trainer import ORTTrainer
    from ort_trainer.optim import AdamConfig

    options = {"device": {"id": "cuda"},
               "mixed_precision": {"enabled": precision == "fp16", "dtype": "float16"}}
    trainer = ORTTrainer(model, work.desc, AdamConfig(lr=1e-4, lambda_coef=0.01), loss_fn=work.loss_fn,
                         options=options)
    trainer._train_step_info.fetches = list(work.fetches)

    def train() -> float:
        out = trainer.train_step(*work.batch)
        loss = out[0] if isinstance(out, (list, tuple)) else out
        return float(loss)

    return train


def _torch(work, model, precision: str):
    import torch

    device = torch.device("cuda")
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")

    def loss_of(batch):
        if work.loss_fn is None:
            return model(*batch)[0]
        return work.loss_fn(model(*batch[:-1]), batch[-1])

    def train() -> float:
        model.train()
        batch = tuple(t.to(device) for t in work.batch)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=precision == "fp16"):
            loss = loss_of(batch)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        return float(loss)

    return train


def worker(args) -> dict:
    """Step times of one implementation in this process (after warm-up)."""
    import torch

    from models import workload as make_workload

    torch.manual_seed(0)
    work = make_workload(args.model)
    model = work.make_model()
    started = time.perf_counter()
    train = (_ort if args.impl == "ort" else _torch)(work, model, args.precision)
    for _ in range(args.warmup):
        train()
    torch.cuda.synchronize()
    warmup = time.perf_counter() - started
    times, losses = [], []
    for _ in range(args.steps):
        begin = time.perf_counter()
        losses.append(train())  # reads the loss back: the step is finished on the device
        times.append(time.perf_counter() - begin)
    return {"train": times, "warmup_s": warmup, "last_loss": losses[-1],
            "peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20,
            "device": torch.cuda.get_device_name()}


def _spawn(model: str, impl: str, precision: str, args) -> dict:
    command = [sys.executable, __file__, "--worker", "--model", model, "--impl", impl, "--precision", precision,
               "--steps", str(args.steps), "--warmup", str(args.warmup)]
    result = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {result.returncode}: " + " | ".join(tail)[:400]}
    return json.loads(lines[-1])


def run(args) -> dict:
    """Every (model, precision) pair, both implementations, ``args.rounds`` alternating rounds."""
    report = {}
    for model in args.models.split(","):
        for precision in PRECISIONS:
            entry = {impl: {"train": [], "round_medians_ms": [], "errors": []} for impl in IMPLS}
            for round_index in range(args.rounds):
                for impl in IMPLS if round_index % 2 == 0 else reversed(IMPLS):
                    print(f"== {model} {precision}: round {round_index + 1}/{args.rounds}, {impl}", flush=True)
                    result = _spawn(model, impl, precision, args)
                    if "error" in result:
                        entry[impl]["errors"].append(result["error"])
                        continue
                    entry[impl]["train"] += result["train"]
                    entry[impl]["round_medians_ms"].append(round(1000 * statistics.median(result["train"]), 2))
                    for name in ("last_loss", "peak_gpu_mb", "device", "warmup_s"):
                        entry[impl][name] = result[name]
            report[f"{model}/{precision}"] = entry
    return report


def _ms(times: list[float]) -> float | None:
    return 1000 * statistics.median(times) if times else None


def write_report(report: dict, out: Path, args) -> list[str]:
    """Write the markdown table; returns the targets missed (empty when every one is met)."""
    import onnxruntime
    import torch

    device = next((e[i].get("device") for e in report.values() for i in IMPLS if e[i].get("device")), "unknown")
    lines = [
        "# GPU benchmark (`make gpu-check`)",
        "",
        f"Device: {device}; torch {torch.__version__}; onnxruntime {onnxruntime.__version__}; "
        f"{args.rounds} rounds × {args.steps} steps per implementation, each in its own process "
        f"(order reversed every other round), after {args.warmup} warm-up steps.",
        "",
        "Step time in ms (median of every timed step). Ratio = PyTorch / ort_trainer (> 1: ort_trainer is faster). "
        "fp16 is compared with `torch.autocast` + `GradScaler`.",
        "",
        "| model | precision | ort_trainer | PyTorch | ratio | target | per-round medians (ort / torch) | "
        "peak GPU MB (ort / torch) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    missed = []
    for key, entry in report.items():
        model, precision = key.split("/")
        ort_ms, torch_ms = _ms(entry["ort"]["train"]), _ms(entry["torch"]["train"])
        ratio = torch_ms / ort_ms if ort_ms and torch_ms else None
        met = ratio is not None and ratio >= TARGET
        if not met:
            missed.append(f"{key}: ratio {ratio:.2f}" if ratio is not None else f"{key}: not measured")
        fmt = lambda v: f"{v:.1f}" if v is not None else "failed"  # noqa: E731
        rounds = f"{entry['ort']['round_medians_ms']} / {entry['torch']['round_medians_ms']}"
        memory = " / ".join(f"{entry[i].get('peak_gpu_mb', float('nan')):.0f}" for i in IMPLS)
        lines.append(f"| {model} | {precision} | {fmt(ort_ms)} | {fmt(torch_ms)} | "
                     f"{f'{ratio:.2f}×' if ratio else '—'} | ≥ {TARGET:.1f}×: {'met' if met else 'MISSED'} | "
                     f"{rounds} | {memory} |")
    errors = [(key, impl, error) for key, entry in report.items() for impl in IMPLS for error in entry[impl]["errors"]]
    if errors:
        lines += ["", "## Failures", ""] + [f"- {key} {impl}: {error}" for key, impl, error in errors]
    lines += ["", "Peak GPU MB is `torch.cuda.max_memory_allocated()`: memory ONNX Runtime allocates through its "
              "own arena (activations) is not in the ort_trainer column, only the trainer's buffers.", ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = out.with_suffix(out.suffix + ".tmp")
    temporary.write_text("\n".join(lines), encoding="utf-8")
    temporary.replace(out)
    return missed


def preflight() -> list[str]:
    """What this environment lacks for the GPU check (empty when it has everything)."""
    problems = []
    try:
        import torch
        if not torch.cuda.is_available():
            problems.append(f"torch {torch.__version__} sees no GPU (a CUDA build of torch and a GPU are needed)")
    except ImportError as error:
        problems.append(f"torch does not import: {error}")
    try:
        import onnxruntime
        if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
            problems.append(f"onnxruntime {onnxruntime.__version__} has no CUDAExecutionProvider: "
                            "pip install \"ort_trainer[cuda]\" (onnxruntime-gpu) in place of onnxruntime")
    except ImportError as error:
        problems.append(f"onnxruntime does not import: {error}")
    try:
        import ort_trainer  # noqa: F401  (checks that exactly one ONNX Runtime is installed)
    except ImportError as error:
        problems.append(str(error))
    return problems


def main() -> None:
    """Command line: the orchestrator, or (``--worker``) one measured process."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--preflight", action="store_true", help="only check the environment (exit 2 if lacking)")
    parser.add_argument("--model", default="bert")
    parser.add_argument("--impl", choices=IMPLS, default="ort")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument("--models", default="bert,gpt2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks_gpu.md")
    args = parser.parse_args()
    if args.preflight:
        problems = preflight()
        for problem in problems:
            print(f"gpu-check cannot run: {problem}", file=sys.stderr)
        sys.exit(2 if problems else 0)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    missed = write_report(run(args), args.out, args)
    print(args.out.read_text(encoding="utf-8"))
    if missed:
        print("targets missed: " + "; ".join(missed), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
