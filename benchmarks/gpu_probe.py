"""One matrix product, ONNX Runtime against torch: which kernel runs, how fast, and does alignment decide it?

GPT-2 small's fp16 step spends 13 ms of ONNX Runtime's 41 ms of kernels in matrix products on
``cutlass_75 … s1688gemm`` kernels, where ``torch.compile`` runs Hopper's ``nvjet_sm90`` kernels.
The language-model head multiplies by a 50257-wide matrix, whose rows are 100514 bytes apart: not a
multiple of 16, which Hopper's TMA kernels need. This probe times the head's three products (the
forward ``x · Wᵀ``, the backward ``dY · W`` and ``dYᵀ · x``) at ``M × K × N`` = 4096 × 768 × V for
V = 50257 and 50304 (the next multiple of 64), with two aligned products of the same step beside them
(the MLP's 768 → 3072 and the attention projection's 768 → 768):

- ``torch``: ``torch.mm`` on the layouts the step has (transposes as strided views);
- ``ort-matmul``: ONNX Runtime's ``MatMul`` after an explicit ``Transpose`` (what an unfused graph runs);
- ``ort-gemm``: ``Gemm`` with ``transA`` / ``transB`` (what ``graph_optimizations.transposed_products``
  writes);
- ``ort-fusedmatmul``: ``com.microsoft.FusedMatMul`` (what ONNX Runtime's ``MatmulTransposeFusion`` writes);
- ``ort-padded``: ``Gemm`` on operands whose N is padded with zeros to a multiple of 64 inside the graph
  (``Concat`` with zeros), the result sliced back to N (``Slice``): what a padded vocabulary costs and gains in all,
  copies included. Equal to the unpadded product (the padding multiplies zeros).

A fourth product, ``bias``, is the forward with a bias vector ``c`` (``x · Wᵀ + c``, every layer's projection):
``torch.addmm`` (cuBLASLt adds the bias in its epilogue: ``graph_optimizations.torch_products``), ``Gemm`` with ``C``
(ONNX Runtime writes ``c`` broadcast into the output, then adds the product with ``beta = 1``) and ``MatMul`` then
``Add``.

Each case: the median of ``--repeat`` timed runs (CUDA events around each; ONNX Runtime's runs bound
to torch's buffers with ``IOBinding``, so no copy is timed), TFLOP/s, and the names of the kernels
that ran (``torch.profiler`` over CUPTI, which records ONNX Runtime's kernels as it does torch's).
One JSON line per case goes to ``--results`` as it is measured; the table is printed at the end.
The process also records which cuBLAS libraries it loaded (ONNX Runtime's may differ from torch's).

On a machine without a GPU, ``--device cpu`` runs every case at toy size (``make test`` does), so
that the script is known to work before a GPU is at hand.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import onnx
from onnx import TensorProto, helper

DTYPES = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16, "fp32": TensorProto.FLOAT}
BACKENDS = ("torch", "ort-matmul", "ort-gemm", "ort-fusedmatmul", "ort-padded")
PAD_TO = 64  # ort-padded: N padded up to a multiple of this (nanoGPT's 50304)
# name: (rows of A as stored, the product) — "fwd": Y[M,N] = X[M,K]·W[N,K]ᵀ; "dx": dX[M,K] = dY[M,N]·W[N,K];
# "dw": dW[N,K] = dY[M,N]ᵀ·X[M,K]
PRODUCTS = ("fwd", "dx", "dw", "bias")  # bias: fwd + a bias vector c[N]
BIAS_BACKENDS = ("torch", "ort-matmul", "ort-gemm")  # the backends that write the bias product


def _shapes(product: str, m: int, k: int, n: int) -> tuple[tuple[int, int], tuple[int, int], bool, bool]:
    """``(A's stored shape, B's stored shape, transA, transB)`` of one product."""
    return {"fwd": ((m, k), (n, k), False, True), "bias": ((m, k), (n, k), False, True),
            "dx": ((m, n), (n, k), False, False), "dw": ((m, n), (m, k), True, False)}[product]


def onnx_product(backend: str, product: str, m: int, k: int, n: int, dtype: str) -> onnx.ModelProto:
    """A one-product ONNX model computing ``product`` the way ``backend`` writes it."""
    elem = DTYPES[dtype]
    a_shape, b_shape, trans_a, trans_b = _shapes(product, m, k, n)
    nodes, opset = [], [helper.make_opsetid("", 17)]
    if backend == "ort-padded" and n % PAD_TO:
        return _padded_product(product, m, k, n, elem, a_shape, b_shape, trans_a, trans_b)
    bias = ["C"] if product == "bias" else []
    if backend in ("ort-gemm", "ort-padded"):
        nodes.append(helper.make_node("Gemm", ["A", "B", *bias], ["Y"], transA=int(trans_a), transB=int(trans_b)))
    elif backend == "ort-fusedmatmul":
        nodes.append(helper.make_node("FusedMatMul", ["A", "B"], ["Y"], domain="com.microsoft", alpha=1.0,
                                      transA=int(trans_a), transB=int(trans_b)))
        opset.append(helper.make_opsetid("com.microsoft", 1))
    else:
        a, b = "A", "B"
        if trans_a:
            nodes.append(helper.make_node("Transpose", ["A"], ["At"], perm=[1, 0]))
            a = "At"
        if trans_b:
            nodes.append(helper.make_node("Transpose", ["B"], ["Bt"], perm=[1, 0]))
            b = "Bt"
        nodes.append(helper.make_node("MatMul", [a, b], ["P" if bias else "Y"]))
        if bias:
            nodes.append(helper.make_node("Add", ["P", "C"], ["Y"]))
    out_rows = a_shape[1] if trans_a else a_shape[0]
    out_cols = b_shape[0] if trans_b else b_shape[1]
    inputs = [helper.make_tensor_value_info("A", elem, a_shape), helper.make_tensor_value_info("B", elem, b_shape)]
    inputs += [helper.make_tensor_value_info("C", elem, (out_cols,))] if bias else []
    graph = helper.make_graph(nodes, "probe", inputs,
                              [helper.make_tensor_value_info("Y", elem, (out_rows, out_cols))])
    # IR 8: what every onnxruntime this project supports reads (onnx's newest may be past it)
    return helper.make_model(graph, opset_imports=opset, ir_version=8)


def _padded_product(product, m, k, n, elem, a_shape, b_shape, trans_a, trans_b) -> onnx.ModelProto:
    """``Gemm`` of the operands with N padded to a multiple of ``PAD_TO``; the result sliced back to N."""
    extra = -n % PAD_TO
    # the N axis of each stored operand: fwd's W[N, K] (rows), dx's and dw's dY[M, N] (columns)
    axes = {"fwd": {"B": 0}, "dx": {"A": 1, "B": 0}, "dw": {"A": 1}}[product]
    nodes, names = [], {"A": "A", "B": "B"}
    shapes = {"A": list(a_shape), "B": list(b_shape)}
    item = {TensorProto.FLOAT16: 2, TensorProto.BFLOAT16: 2, TensorProto.FLOAT: 4}[elem]
    for name, axis in axes.items():  # zeros concatenated, as graph_optimizations.aligned_products does
        zeros_shape = list(shapes[name])
        zeros_shape[axis] = extra
        nodes.append(helper.make_node("Constant", [], [f"{name}_zeros"], value=helper.make_tensor(
            f"{name}_zeros_value", elem, zeros_shape, b"\0" * (item * zeros_shape[0] * zeros_shape[1]), raw=True)))
        nodes.append(helper.make_node("Concat", [name, f"{name}_zeros"], [f"{name}_padded"], axis=axis))
        names[name] = f"{name}_padded"
    out_shape = {"fwd": (m, n), "dx": (m, k), "dw": (n, k)}[product]
    gemm_out = "Y" if product == "dx" else "Y_padded"
    nodes.append(helper.make_node("Gemm", [names["A"], names["B"]], [gemm_out], transA=int(trans_a),
                                  transB=int(trans_b)))
    if product != "dx":
        axis = 1 if product == "fwd" else 0
        for what, value in (("starts", 0), ("ends", n), ("axes", axis)):
            nodes.append(helper.make_node("Constant", [], [what], value=helper.make_tensor(
                f"{what}_value", TensorProto.INT64, [1], [value])))
        nodes.append(helper.make_node("Slice", ["Y_padded", "starts", "ends", "axes"], ["Y"]))
    graph = helper.make_graph(nodes, "probe_padded", [helper.make_tensor_value_info("A", elem, a_shape),
                                                      helper.make_tensor_value_info("B", elem, b_shape)],
                              [helper.make_tensor_value_info("Y", elem, out_shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


class Timer:
    """Times a callable on the device: CUDA events on a GPU, the wall clock on the CPU."""

    def __init__(self, torch, device: str):
        self.torch, self.cuda = torch, device.startswith("cuda")

    def median_ms(self, run, repeat: int) -> float:
        """The median of ``repeat`` runs after two untimed ones."""
        for _ in range(2):
            run()
        times = []
        for _ in range(repeat):
            if self.cuda:
                start, end = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                started = time.perf_counter()
                run()
                times.append(1000 * (time.perf_counter() - started))
        return statistics.median(times)


def kernels(torch, run, device: str) -> list[str]:
    """The names of the GPU kernels one ``run()`` launches (CPU: the torch operators it calls)."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.startswith("cuda")
    with profile(activities=[ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]) as prof:
        run()
        if on_gpu:
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "trace.json")
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as trace:
            events = json.load(trace).get("traceEvents", [])
    wanted = ("kernel",) if on_gpu else ("cpu_op",)
    return sorted({event["name"][:120] for event in events if event.get("cat") in wanted})


def _runner(torch, backend: str, product: str, a, b, case: tuple[int, int, int, str], device: str, c=None):
    """A callable computing one product with ``backend`` on the buffers ``a`` and ``b`` (and the bias ``c``)."""
    if backend == "torch":
        if product == "bias":
            return lambda: torch.addmm(c, a, b.t())
        if product == "fwd":
            return lambda: torch.mm(a, b.t())
        if product == "dx":
            return lambda: torch.mm(a, b)
        return lambda: torch.mm(a.t(), b)
    import onnxruntime as ort

    m, k, n, dtype = case
    model = onnx_product(backend, product, m, k, n, dtype)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    providers = ["CUDAExecutionProvider"] if device.startswith("cuda") else ["CPUExecutionProvider"]
    session = ort.InferenceSession(model.SerializeToString(), options, providers=providers)
    out = torch.empty({"fwd": (m, n), "bias": (m, n), "dx": (m, k), "dw": (n, k)}[product], dtype=a.dtype,
                      device=a.device)
    kind, index = ("cuda", a.device.index or 0) if device.startswith("cuda") else ("cpu", 0)
    binding = session.io_binding()
    # a pointer's element type: a NumPy type, or the ONNX type for bfloat16 (NumPy has none)
    elem = DTYPES[dtype] if dtype == "bf16" else {"fp16": np.float16, "fp32": np.float32}[dtype]
    for name, tensor in (("A", a), ("B", b), *((("C", c),) if product == "bias" else ())):
        binding.bind_input(name, kind, index, elem, tuple(tensor.shape), tensor.data_ptr())
    binding.bind_output("Y", kind, index, elem, tuple(out.shape), out.data_ptr())
    options_run = ort.RunOptions()
    options_run.log_severity_level = 3

    def run():
        session.run_with_iobinding(binding, options_run)
    run.out = out
    return run


def cublas_libraries() -> list[str]:
    """The cuBLAS shared libraries this process has loaded (``/proc/self/maps``)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            return sorted({line.split()[-1] for line in maps if "cublas" in line and "/" in line})
    except OSError:
        return []


def measure(args) -> list[dict]:
    """Every case of ``args``, one dict each (also appended to ``args.results`` as it is measured)."""
    import torch

    torch_dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    device = args.device
    timer = Timer(torch, device)
    generator = torch.Generator(device="cpu").manual_seed(0)
    m, k = args.tokens, args.hidden
    widths = [int(w) for w in args.widths.split(",")]
    rows = []
    for dtype in args.precisions.split(","):
        for n in widths:
            for product in PRODUCTS:
                a_shape, b_shape, _, _ = _shapes(product, m, k, n)
                a = torch.randn(a_shape, generator=generator).to(device=device, dtype=torch_dtypes[dtype])
                b = torch.randn(b_shape, generator=generator).to(device=device, dtype=torch_dtypes[dtype])
                c = torch.randn(n, generator=generator).to(device=device, dtype=torch_dtypes[dtype])
                reference = None
                for backend in args.backends.split(","):
                    if product == "bias" and backend not in BIAS_BACKENDS:
                        continue
                    row = {"backend": backend, "product": product, "m": m, "k": k, "n": n, "precision": dtype,
                           "device": device}
                    try:
                        run = _runner(torch, backend, product, a, b, (m, k, n, dtype), device, c)
                        result = run() if backend == "torch" else (run(), run.out)[1]
                        result = result.float().cpu()
                        reference = result if reference is None else reference
                        row["max_abs_vs_first"] = float((result - reference).abs().max())
                        row["ms"] = timer.median_ms(run, args.repeat)
                        row["tflops"] = 2 * m * k * n / row["ms"] / 1e9
                        row["kernels"] = kernels(torch, run, device)
                    except Exception as error:  # noqa: BLE001 - a backend that cannot run this case is a result
                        row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                    rows.append(row)
                    if args.results:
                        with open(args.results, "a", encoding="utf-8") as out:
                            out.write(json.dumps(row) + "\n")
    info = {"libraries": cublas_libraries(), "torch": torch.__version__,
            "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"}
    try:
        import onnxruntime

        info["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    if args.results:
        with open(args.results, "a", encoding="utf-8") as out:
            out.write(json.dumps({"process": info}) + "\n")
    print(json.dumps({"process": info}))
    return rows


def table(rows: list[dict]) -> str:
    """The cases as a markdown table."""
    lines = ["| precision | product | M × K × N | backend | ms | TFLOP/s | kernels |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            cells = ["—", "—", row["error"][:100]]
        else:
            cells = [f"{row['ms']:.3f}", f"{row['tflops']:.1f}", "; ".join(f"`{name[:70]}`" for name in row["kernels"][:3])]
        lines.append(f"| {row['precision']} | {row['product']} | {row['m']} × {row['k']} × {row['n']} | "
                     f"{row['backend']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Parse the arguments, measure, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precisions", default="fp16,bf16")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--tokens", type=int, default=4096, help="M: tokens per step (GPT-2 small 8 × 512)")
    parser.add_argument("--hidden", type=int, default=768, help="K: the model width")
    parser.add_argument("--widths", default="50257,50304,3072,768", help="N: the output widths, comma-separated")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--results", default="", help="append one JSON line per case to this file")
    args = parser.parse_args(argv)
    rows = measure(args)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
