"""One measured process of ``benchmarks/gpu.py``: one model, one precision, one implementation.

Implementations, all with AdamW (lr 1e-4, weight decay 0.01) and the gradient norm clipped at 1.0,
each step's batch taken from host memory (as from a data loader) and its loss read back to the host:

- ``ort``: ``ORTTrainer`` (``mixed_precision`` float16 with its dynamic loss scaler, or bfloat16);
- ``eager``: PyTorch eager, under ``torch.autocast`` (+ ``GradScaler`` for float16) for fp16/bf16;
- ``compile``: the same as ``eager`` with the model wrapped in ``torch.compile``.

Models (random-init Hugging Face configurations, dropout 0, the same initial weights and batches in
every process): ``bert-base`` (BertForMaskedLM, 15 % of the tokens masked), ``gpt2`` (GPT-2 small),
and ``bert-tiny`` / ``gpt2-tiny`` for the CPU run of ``make test``.

The process prints one JSON line: the seconds of every step (the first one builds), the losses, and
the peak memory of the whole process: on a GPU the device memory in use (``cudaMemGetInfo``, sampled
every 10 ms and after every step, so ONNX Runtime's arena and the CUDA context count as PyTorch's
caching allocator does); on the CPU the peak resident set.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import tempfile
import threading
import time

from real_sizes import workload  # benchmarks/ is on sys.path: this script's folder, or gpu.py puts it there

PRECISIONS = ("fp32", "fp16", "bf16")
IMPLS = ("ort", "eager", "compile")

# name: (batch, sequence) at which this benchmark trains it; the models are benchmarks/real_sizes.py's
# (gpt2-1024: GPT-2 small at its full context, the row that fills the GPU, timed at the batch the probe finds)
MODELS = {"bert-base": (32, 128), "gpt2": (8, 512), "gpt2-1024": (16, 1024), "bert-tiny": (4, 16), "gpt2-tiny": (4, 16)}
WORKLOADS = {"bert-base": "bert", "gpt2-1024": "gpt2"}  # real_sizes.workload's name where it differs
DISTINCT_BATCHES = 4  # taken in turn


def build(name: str, batch: int | None = None):
    """``(model, description, batches, tokens per batch)`` of ``name`` (``real_sizes.workload``'s model and
    batches at this benchmark's batch and sequence: weights from seed 0, batches from seed 1)."""
    batch = batch or MODELS[name][0]
    seq = MODELS[name][1]
    model, desc, batch_of = workload(WORKLOADS.get(name, name), batch=batch, seq=seq)
    return model, desc, [batch_of() for _ in range(DISTINCT_BATCHES)], batch * seq


class PeakMemory:
    """Peak device memory in use while this object is open (``cudaMemGetInfo``, the whole GPU: run alone)."""

    def __init__(self, device: str):
        import torch

        self.cuda = device.startswith("cuda")
        self.peak = 0
        self._stop = threading.Event()
        # set while ONNX Runtime may capture a CUDA graph (device.cuda_graph): its capture is global to the
        # process, and a cudaMemGetInfo from this thread during it could invalidate the capture
        self.held = threading.Event()
        if self.cuda:
            self._torch = torch
            self.sample()
            self.at_start = self.peak
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()

    def sample(self) -> float | None:
        """Read the memory in use now (MB; None on the CPU)."""
        if not self.cuda:
            return None
        free, total = self._torch.cuda.mem_get_info()
        self.peak = max(self.peak, total - free)
        return (total - free) / 2**20

    def _poll(self) -> None:
        while not self._stop.wait(0.01):
            if not self.held.is_set():
                self.sample()

    def close(self) -> dict:
        """Stop sampling; the figures in MB."""
        if not self.cuda:
            return {"peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "memory": "peak RSS"}
        self._stop.set()
        self._thread.join()
        self.sample()
        return {"peak_mb": self.peak / 2**20, "context_mb": self.at_start / 2**20, "memory": "device in use",
                "torch_allocated_peak_mb": self._torch.cuda.max_memory_allocated() / 2**20}


def ort_options(device: str, precision: str, optimizations: dict | None = None) -> dict:
    """ort_trainer's options for a run: ``optimizations`` are graph_optimizations switches, but for a
    name ``device.X``, the device option ``X`` (``device.cuda_graph``)."""
    optimizations = dict(optimizations or {})
    device_options = {name.split(".", 1)[1]: optimizations.pop(name) for name in list(optimizations)
                      if name.startswith("device.")}
    return {"device": {"id": device, **device_options},
            "mixed_precision": {"enabled": precision != "fp32",
                                "dtype": {"fp16": "float16", "bf16": "bfloat16"}.get(precision, "float16")},
            "graph_optimizations": optimizations}


def _ort_step(model, desc, device: str, precision: str, optimizations: dict | None = None):
    from ort_trainer import ORTTrainer
    from ort_trainer.optim import AdamConfig

    options = ort_options(device, precision, optimizations)
    trainer = ORTTrainer(model, desc, AdamConfig(lr=1e-4, lambda_coef=0.01), options=options)
    trainer._train_step_info.fetches = ["loss"]  # the loss alone, as the PyTorch loop reads it

    def step(inputs) -> float:
        return float(trainer.train_step(*inputs))

    step.trainer = trainer  # (run() reads where ONNX Runtime placed the graph's nodes)
    return step


def _torch_step(model, device: str, precision: str, compiled: bool, backend: str):
    import torch

    target = torch.device(device)
    model.to(target).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    scaler = torch.amp.GradScaler(target.type, enabled=precision == "fp16")
    forward = torch.compile(model, backend=backend) if compiled else model

    def step(inputs) -> float:
        ids, mask, labels = (t.to(target, non_blocking=False) for t in inputs)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(target.type, dtype=dtype, enabled=dtype is not None):
            loss = forward(input_ids=ids, attention_mask=mask, labels=labels).loss
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        return float(loss)

    return step


# Kernel name -> what it does, first match wins (cuBLAS/CUTLASS, ONNX Runtime's, aten's and inductor's names).
CATEGORIES = (
    ("attention (fused)", r"flash|fmha|efficient_attention|attention"),
    ("matrix products", r"gemm|matmul|addmm|::mm\b|bmm|cutlass|xmma|wgmma|cublas|_mma|s[0-9]+_tensorop|sm[0-9]+_"),
    ("softmax", r"softmax"),
    ("layer norm", r"layer_?norm|layernorm|triton_per_fused.*native_layer_norm"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("copies and casts", r"memcpy|memset|copy|cast|convert|transpose|concat|slice|gather|scatter|expand"),
    ("reductions", r"reduce|triton_red|triton_per"),
    ("element-wise", r"elementwise|vectorized|unrolled|binary|unary|pointwise|triton_poi|gelu|where|fill|_kernel"),
)


def _category(name: str) -> str:
    lowered = name.lower()
    return next((label for label, pattern in CATEGORIES if re.search(pattern, lowered)), "other")


def profile(step, batches, steps: int, device: str) -> dict:
    """Where ``steps`` more steps go: on a GPU every kernel of the process (``torch.profiler`` over
    CUPTI, which records ONNX Runtime's kernels as it does torch's), summed by ``CATEGORIES``, in ms
    per step; on the CPU the profiler sees only torch's operators (ONNX Runtime's run is opaque)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    on_gpu = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    started = time.perf_counter()
    with torch_profile(activities=activities) as prof:
        for index in range(steps):
            step(batches[index % len(batches)])
    wall = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "trace.json")
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as trace:
            events = json.load(trace).get("traceEvents", [])
    kinds = ("kernel", "gpu_memcpy", "gpu_memset") if on_gpu else ("cpu_op",)
    by_name: dict[str, float] = {}
    for event in events:
        if event.get("cat") in kinds and "dur" in event:
            by_name[event["name"]] = by_name.get(event["name"], 0.0) + event["dur"] / 1000 / steps
    by_category: dict[str, float] = {}
    for name, ms in by_name.items():
        by_category[_category(name)] = by_category.get(_category(name), 0.0) + ms
    top = sorted(by_name.items(), key=lambda item: -item[1])[:8]
    return {"step_ms": 1000 * wall / steps, "busy_ms": sum(by_name.values()) if on_gpu else None,
            "categories": {k: round(v, 3) for k, v in sorted(by_category.items(), key=lambda item: -item[1])},
            "top": [[name[:90], round(ms, 3)] for name, ms in top], "what": "GPU kernels" if on_gpu else "torch CPU ops"}


def _is_out_of_memory(error: BaseException) -> bool:
    text = f"{type(error).__name__}: {error}".lower()
    return any(mark in text for mark in ("out of memory", "outofmemory", "failed to allocate", "cudaerrormemoryallocation",
                                         "bfcarena"))


def _placement(step) -> dict:
    """``{"placed_elsewhere": {op type: nodes}}``: ort_trainer's floating-point nodes that ONNX Runtime placed off
    the device's provider (``Sessions.placed_elsewhere``), where there are any."""
    trainer = getattr(step, "trainer", None)
    engine = getattr(trainer, "_engine", None)
    placed = getattr(getattr(engine, "sessions", None), "placed_elsewhere", None)
    return {"placed_elsewhere": dict(placed)} if placed else {}


def run(args) -> dict:
    """Build one implementation and take ``args.steps`` steps; the JSON-able result."""
    import torch

    if args.device.startswith("cuda"):
        torch.cuda.init()
    memory = PeakMemory(args.device)
    model, desc, batches, tokens = build(args.model, args.batch)
    n_params = sum(p.numel() for p in model.parameters())
    started = time.perf_counter()
    import onnxruntime

    result = {"model": args.model, "impl": args.impl, "precision": args.precision, "device": args.device,
              "versions": f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}",
              "batch": len(batches[0][0]), "tokens": tokens, "params": n_params}
    if args.impl == "ort" and json.loads(args.ort_optimizations):
        result["ort_optimizations"] = json.loads(args.ort_optimizations)  # an A/B's setting, kept with its row
    step = None
    try:
        if args.impl == "ort":
            step = _ort_step(model, desc, args.device, args.precision, json.loads(args.ort_optimizations))
        else:
            step = _torch_step(model, args.device, args.precision, args.impl == "compile", args.compile_backend)
        seconds, losses = [], []
        # device.cuda_graph: the first step runs as usual, a later one captures after ONNX Runtime's two warm-up
        # runs (within one call, or over the next calls in older versions): no sampling from this thread until
        # then (the arena keeps what the capture took, so the samples after it still see the step's peak)
        captures = args.impl == "ort" and bool(json.loads(args.ort_optimizations).get("device.cuda_graph"))
        for index in range(args.steps):
            if captures and index < 4:
                memory.held.set()
            begin = time.perf_counter()
            losses.append(step(batches[index % len(batches)]))  # reads the loss back: the step is done on the device
            seconds.append(time.perf_counter() - begin)
            memory.held.clear()
            now = memory.sample()
            result.setdefault("step_mb", []).append(now)  # device memory after each step: where it grows
            if memory.cuda:  # torch's pool's part of it (the rest: ONNX Runtime's arena, the context, cuBLAS's)
                result.setdefault("torch_reserved_mb", []).append(torch.cuda.memory_reserved() / 2**20)
            if index == 0:  # what the steps after the first add shows a second copy of the activations
                result["after_first_step_mb"] = now
    except Exception as error:  # noqa: BLE001  (reported: an out-of-memory ends a probe, anything else is a failure)
        result.update(memory.close(), error=f"{type(error).__name__}: {str(error)[:600]}",
                      out_of_memory=_is_out_of_memory(error), **_placement(step))
        return result
    result.update(_placement(step))
    result.update(memory.close(), step_s=seconds, losses=losses, build_s=time.perf_counter() - started - sum(seconds[1:]),
                  device_name=torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu")
    if args.profile_steps:  # after the timed steps and the memory peak: a profiler that fails costs only itself
        try:
            result["profile"] = profile(step, batches, args.profile_steps, args.device)
        except Exception as error:  # noqa: BLE001
            result["profile_error"] = f"{type(error).__name__}: {str(error)[:300]}"
    return result


def main() -> None:
    """Command line (``benchmarks/gpu.py`` starts it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--impl", choices=IMPLS, required=True)
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=None, help="override the model's batch (the largest-batch probe)")
    parser.add_argument("--profile-steps", type=int, default=0, help="profile this many more steps (0: none)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile's backend (aot_eager on the CPU test)")
    parser.add_argument("--ort-optimizations", default="{}",
                        help="ort_trainer's graph_optimizations, as JSON (an A/B of one pass: '{\"gelu\": false}'); "
                        "a name device.X is the device option X ('{\"device.cuda_graph\": true}')")
    args = parser.parse_args()
    print(json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()
