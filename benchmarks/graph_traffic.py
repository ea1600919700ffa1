"""Where a GPU step's memory traffic goes, read from the training graph on any machine: the bytes each node of
ort_trainer's joint forward + backward graph reads and writes, summed by kind of operator and by operator, with
the matrix products' FLOPs and the nodes that move the most.

On a GPU an element-wise, cast or reduction kernel is bound by memory: its time is about its bytes over the
bandwidth (an H200 moves ~4.8 TB/s, ~3.5-4 TB/s in practice), so this table predicts the non-product buckets of
``benchmarks/gpu.py``'s kernel profile from the graph alone, and a graph pass's effect on them is measured here
on the CPU before a GPU run (the graph is the same on every device: ``autocast_context``). ONNX Runtime's own
fusions (``Gemm`` from ``MatMul`` + ``Add``, ``FusedMatMul``, ``BiasGelu``...) run after this point and are not
counted; views (``Reshape``, ``Squeeze``, ``Unsqueeze``, ``Identity``...) move no bytes, and a ``Gemm``'s bias is
its ``C`` alone unless ``--bias-copies`` counts ONNX Runtime's copy of it into the output. The graph is built as a
GPU's (the recomputations' waits as ``AliasAfter`` nodes: ``device_barriers``), and the summary counts the copies
between the GPU and the host that ONNX Runtime's CUDA provider would put inside it, and the floating-point values it
would compute on the host (``cuda_placement.py``).

Run: ``python benchmarks/graph_traffic.py --model gpt2 --precision fp16`` (``benchmarks/gpu_worker.py``'s models and
sizes; ``--batch`` and ``--seq`` replace them; ``--optimizations '{"half_precision_loss": true}'`` turns
``graph_optimizations`` switches on or off; ``--compare '{...}'`` prints the difference a second setting makes).
Builds the graph only (no step runs), from an empty graph cache; bfloat16 too on a machine without its kernels
(the graph is built before the session that refuses it).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from unittest import mock

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_placement import host_copies  # noqa: E402

# operators that ONNX Runtime runs without moving the tensor (an alias of its input) or on shapes only
VIEWS = {"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Shape", "Size", "Constant", "ConstantOfShape",
         "AliasAfter"}
PRODUCTS = {"MatMul", "Gemm", "FusedMatMul", "BiasGemm", "GemmToFloat", "MatMulToFloat"}  # (torch_products' too)
# the suffix of a value recomputed in the backward (activation_recompute's, layer_recompute's region N)
RECOMPUTED = re.compile(r"/(?:layer_)?recompute\d*$")
# element-wise: an output's shape is its inputs' broadcast (torchlib's erf function too)
BROADCASTING = {"Mul", "Add", "Sub", "Div", "Neg", "Sigmoid", "Tanh", "Erf", "Exp", "aten_special_erf"}
# ort_trainer's own kernels (ort_trainer/kernels): the input whose shape each output has (LayerNormGrad's partial
# sums, [chunks, 2, hidden], counted as one more weight-sized tensor)
KERNEL_OUTPUTS = {"GeluGrad": (1,), "TanhGeluGrad": (1,), "SoftmaxGrad": (1,), "SafeSoftmax": (0,),
                  "BiasSafeSoftmax": (0,), "LayerNormGrad": (1, 4, 4, 4),
                  # (the residual sum as x, its cast as dy: x's element count in dy's dtype)
                  "LayerNormGradAdd": (1, 4, 4, 4), "LayerNormGradAddCast": (1, 4, 4, 4, 0),
                  # (the cast: x's shape, its value info its dtype)
                  "LayerNormGradToFloat16": (1, 4, 4, 4, 1), "LayerNormGradToBFloat16": (1, 4, 4, 4, 1),
                  # (y as x, its value info its dtype; the statistics counted as gamma: not the row count, ~0.1%)
                  "LayerNormToFloat16": (0, 1, 1), "LayerNormToBFloat16": (0, 1, 1),
                  "LayerNormWithFloat16": (0, 1, 1, 0), "LayerNormWithBFloat16": (0, 1, 1, 0),
                  # (residual, x, gamma, beta: the half y as x, the float32 y and the sum as the residual)
                  "AddLayerNormToFloat16": (1, 2, 2, 0), "AddLayerNormToBFloat16": (1, 2, 2, 0),
                  "AddLayerNormWithFloat16": (0, 2, 2, 1, 0), "AddLayerNormWithBFloat16": (0, 2, 2, 1, 0),
                  # torch's attention (fused_attention): out as q; the row log-sum-exp [batch, heads, seq] counted as
                  # out's size (an overcount by the head dim, ~1% of the node's bytes at head dim 64)
                  "Attention": (0, 0), "BiasAttention": (0, 0), "AttentionGrad": (1, 2, 3),
                  "BiasAttentionGrad": (1, 2, 3),
                  # the scores' gradient as wide as the scores (aligned_products': a padded product's)
                  "CrossEntropyGrad": (1,), "AddHalf": (0,)}
KINDS = {"Cast": "casts", "Transpose": "copies", "Concat": "copies", "Split": "copies", "Slice": "copies",
         "Expand": "copies", "Gather": "copies", "GatherElements": "copies", "ScatterElements": "copies",
         "ScatterND": "copies", "Pad": "copies", "Tile": "copies", "Where": "element-wise",
         "Softmax": "softmax", "LogSoftmax": "softmax", "LayerNormalization": "layer norm",
         "CastsToFloat16": "casts", "CastsToBFloat16": "casts"}  # (weight_casts': every weight's in one node)


def kind(op_type: str) -> str:
    """An operator's bucket: those of ``benchmarks/gpu_worker.py``'s kernel profile (``CATEGORIES``), its
    "copies and casts" split in two."""
    if op_type in PRODUCTS:
        return "matrix products"
    if op_type.startswith("Reduce") or op_type in ("ArgMax", "ArgMin"):
        return "reductions"
    return KINDS.get(op_type, "element-wise")


def _tensor_shapes(model: onnx.ModelProto) -> dict[str, tuple[list[int], int]]:
    """``{name: (dims, bytes per element)}`` of every value whose shape is static after ONNX shape inference."""
    from ort_trainer.graph.onnx_graph import largest_tensors
    from ort_trainer.kernels import TORCH_OPS_DOMAIN

    graph = onnx.shape_inference.infer_shapes(model, data_prop=True).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.value_info, *graph.output]}
    types.update({init.name: init.data_type for init in graph.initializer})
    shapes = {name: (dims, np.dtype(onnx.helper.tensor_dtype_to_np_dtype(types[name])).itemsize)
              for name, dims, _ in largest_tensors(graph) if types.get(name)}
    # activation_recompute's copies (``name/recompute``) have their original's shape, which inference may not reach;
    # an element-wise node's output, the broadcast of its inputs' (where a pass removed the original it copies)
    for node in model.graph.node:
        for name in [*node.input, *node.output]:
            original = RECOMPUTED.sub("", name)
            if name not in shapes and original != name and original in shapes:
                shapes[name] = shapes[original]
        # the no-op Reshape through which a copy reads its region's input (an attention's q): that input's shape
        if node.op_type == "Reshape" and RECOMPUTED.search(node.output[0]) and node.input[0] in shapes:
            shapes.setdefault(node.output[0], shapes[node.input[0]])
        if node.op_type in KERNEL_OUTPUTS and all(node.input[i] in shapes for i in KERNEL_OUTPUTS[node.op_type]):
            for name, source in zip(node.output, KERNEL_OUTPUTS[node.op_type]):
                shapes.setdefault(name, shapes[node.input[source]])
        if node.domain == TORCH_OPS_DOMAIN and node.op_type in PRODUCTS and node.output[0] not in shapes:
            _product_shape(node, shapes)
        known = [shapes.get(name) for name in node.input if name]
        if node.op_type in BROADCASTING and node.output[0] not in shapes and known and None not in known:
            largest = max(known, key=lambda shape: int(np.prod(shape[0])))
            shapes[node.output[0]] = (list(np.broadcast_shapes(*(tuple(shape) for shape, _ in known))), largest[1])
    return shapes


def _is_biased_gemm(node: onnx.NodeProto) -> bool:
    return node.op_type == "Gemm" and node.domain in ("", "ai.onnx") and len(node.input) > 2 and bool(node.input[2])


def _product_shape(node: onnx.NodeProto, shapes: dict) -> None:
    """The output shape of a ``torch_products`` node (ONNX shape inference does not know their domain), from its
    operands' (numpy's matmul after ``transA`` / ``transB``), where both are known."""
    if not all(name in shapes for name in node.input[:2]):
        return
    flags = {attr.name: attr.i for attr in node.attribute if attr.name in ("transA", "transB")}
    (a, size), (b, _) = (shapes[name] for name in node.input[:2])
    a, b = list(a), list(b)
    if "Gemm" in node.op_type:  # an operand of rank > 2 is the matrix of its rows (product_views.py)
        leading = a[:-1] if len(a) > 2 and not flags.get("transA") else None
        a, b = _rows(a), _rows(b)
        if leading is not None:
            shapes[node.output[0]] = (leading + (b[-2:-1] if flags.get("transB") else b[-1:]), size)
            return
    if flags.get("transA") and len(a) >= 2:
        a[-2:] = a[:-3:-1]
    if flags.get("transB") and len(b) >= 2:
        b[-2:] = b[:-3:-1]
    batch = list(np.broadcast_shapes(tuple(a[:-2]), tuple(b[:-2])))
    shapes[node.output[0]] = (batch + a[-2:-1] + b[-1:] if len(b) >= 2 else batch + a[-2:-1], size)


def _rows(shape: list) -> list:
    """A ``Gemm`` operand's 2-D shape: its leading axes flattened into rows."""
    return [int(np.prod(shape[:-1])), shape[-1]] if len(shape) > 2 else shape


def _flops(node: onnx.NodeProto, shapes: dict) -> int:
    """2 x the output's elements x the contracted length of a product."""
    a, out = shapes[node.input[0]][0], shapes[node.output[0]][0]
    if "Gemm" in node.op_type:
        a = _rows(list(a))
    trans_a = any(attr.name == "transA" and attr.i for attr in node.attribute)
    contracted = (a[-2] if trans_a else a[-1]) if len(a) >= 2 else a[0]
    return 2 * int(np.prod(out)) * contracted


def traffic(model: onnx.ModelProto, bias_copies: bool = False) -> dict:
    """``{"kinds": {kind: [bytes, nodes]}, "ops": {op type: [bytes, nodes]}, "flops": the products' FLOPs,
    "unknown": nodes with a value of unknown shape, "nodes": [(bytes, op type, name)] largest first}``.
    ``bias_copies``: count an ONNX ``Gemm``'s output twice more where it has a ``C`` (ONNX Runtime's kernels write
    ``C`` broadcast into the output, then add the product to it)."""
    shapes = _tensor_shapes(model)
    kinds = collections.defaultdict(lambda: [0, 0])
    ops = collections.defaultdict(lambda: [0, 0])
    flops, unknown, nodes = 0, 0, []
    for node in model.graph.node:
        if node.op_type in VIEWS:
            continue
        names = [name for name in [*node.input, *node.output] if name]
        if any(name not in shapes for name in names):
            unknown += 1
            continue
        moved = sum(int(np.prod(shapes[name][0])) * shapes[name][1] for name in names)
        if bias_copies and _is_biased_gemm(node):
            # ONNX Runtime's Gemm (CUDA's and MLAS's) writes C broadcast into Y, then adds the product to it (beta
            # 1): Y written and read once more (torch_products' BiasGemm adds a bias vector as it stores the product)
            moved += 2 * int(np.prod(shapes[node.output[0]][0])) * shapes[node.output[0]][1]
        for table, key in ((kinds, kind(node.op_type)), (ops, node.op_type)):
            table[key][0] += moved
            table[key][1] += 1
        if node.op_type in PRODUCTS:
            flops += _flops(node, shapes)
        nodes.append((moved, node.op_type, node.name or node.output[0]))
    nodes.sort(reverse=True)
    placed = [kind for kind, _, _ in host_copies(model)]
    return {"kinds": dict(kinds), "ops": dict(ops), "flops": flops, "unknown": unknown, "nodes": nodes,
            "nodes_total": len(model.graph.node), "host_floats": placed.count("HostFloats"),
            "host_copies": len(placed) - placed.count("HostFloats")}


def build_graph(model_name: str, precision: str, batch: int | None, seq: int | None, optimizations: dict):
    """The training graph ort_trainer builds for ``model_name`` at ``benchmarks/gpu_worker.py``'s size (or
    ``batch`` x ``seq``), fetching the loss alone as the benchmark does; built from an empty graph cache,
    no step run."""
    from gpu_worker import MODELS, WORKLOADS
    from real_sizes import workload

    batch, seq = batch or MODELS[model_name][0], seq or MODELS[model_name][1]
    with tempfile.TemporaryDirectory() as cache:
        os.environ["ORT_TRAINER_CACHE_DIR"] = cache
        from ort_trainer import ORTTrainer, devices, kernels
        from ort_trainer.amp.kernels import MissingKernelError
        from ort_trainer.optim import AdamConfig

        model, desc, batch_of = workload(WORKLOADS.get(model_name, model_name), batch=batch, seq=seq)
        options = {"device": {"id": "cpu"},
                   "mixed_precision": {"enabled": precision != "fp32",
                                       "dtype": {"bf16": "bfloat16"}.get(precision, "float16")},
                   "graph_optimizations": optimizations}
        # the graph a GPU's session runs: the recomputations' waits as AliasAfter nodes (device_barriers), which the
        # trainer writes only for a device that reads shapes on the host and where CUDA kernels can be had
        with mock.patch.object(devices.CPUDevice, "device_barriers", True), \
                mock.patch.object(kernels, "cuda_kernels_at_hand", lambda: True):
            trainer = ORTTrainer(model, desc, AdamConfig(lr=1e-4, lambda_coef=0.01), options=options)
        trainer._train_step_info.fetches = ["loss"]
        try:
            trainer._ready(trainer._prepare_inputs(batch_of(), {}))
        except MissingKernelError:  # bfloat16 on a CPU: the graph was built, its session refused
            pass
        return trainer._graphs.gradient


def _table(rows: dict, compared: dict | None, top: int, unit: float) -> list[str]:
    """Markdown rows ``| name | moved | nodes |`` (with ``compared``: its bytes and nodes and the difference),
    bytes in ``unit``s."""
    names = sorted(set(rows) | set(compared or {}), key=lambda name: -rows.get(name, [0, 0])[0])[:top]
    lines = []
    for name in names:
        moved, count = rows.get(name, [0, 0])
        line = f"| {name} | {moved / unit:.2f} | {count} |"
        if compared is not None:
            other, other_count = compared.get(name, [0, 0])
            line += f" {other / unit:.2f} | {other_count} | {(other - moved) / unit:+.2f} |"
        lines.append(line)
    return lines


def _summary(result: dict, unit: float, unit_name: str) -> str:
    moved = sum(v[0] for v in result["kinds"].values())
    return (f"{result['nodes_total']} nodes, {moved / unit:.2f} {unit_name} moved, products "
            f"{result['flops'] / 1e12:.3f} TFLOP, {result['unknown']} nodes of unknown shape (not counted), "
            f"{result['host_copies']} copies between a GPU and the host inside the graph and {result['host_floats']} "
            "floating-point values computed on the host (cuda_placement.py)")


def main(argv: list[str] | None = None) -> None:
    """Print the tables (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2", help="a model of benchmarks/gpu_worker.py (gpt2, bert-base...)")
    parser.add_argument("--precision", choices=("fp32", "fp16", "bf16"), default="fp16")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--optimizations", default="{}", help="graph_optimizations as JSON")
    parser.add_argument("--compare", help="a second graph_optimizations setting (JSON, over --optimizations) to "
                                          "set against the first")
    parser.add_argument("--top", type=int, default=20, help="rows of the operator and node tables")
    parser.add_argument("--bias-copies", action="store_true",
                        help="count the copy of a Gemm's C into its output that ONNX Runtime's kernels make, and its "
                             "read back (twice the output's bytes a biased Gemm; torch_products' BiasGemm has none)")
    args = parser.parse_args(argv)
    base = json.loads(args.optimizations)
    result = traffic(build_graph(args.model, args.precision, args.batch, args.seq, base), args.bias_copies)
    other = None
    if args.compare is not None:
        other = traffic(build_graph(args.model, args.precision, args.batch, args.seq,
                                    {**base, **json.loads(args.compare)}), args.bias_copies)
    total = sum(v[0] for v in result["kinds"].values())
    unit, unit_name = (1e9, "GB") if total >= 1e9 else (1e6, "MB")
    print(f"{args.model} {args.precision}, graph_optimizations {json.dumps(base)}: {_summary(result, unit, unit_name)}")
    header = f"| kind | {unit_name} moved | nodes |"
    if other is not None:
        print(f"against {args.compare}: {_summary(other, unit, unit_name)}")
        header += f" {unit_name} moved (compared) | nodes (compared) | difference ({unit_name}) |"
    rule = "|" + "---|" * (header.count("|") - 1)
    print("\n" + header + "\n" + rule)
    print("\n".join(_table(result["kinds"], other and other["kinds"], 100, unit)))
    if args.top:
        print("\n" + header.replace("kind", "operator") + "\n" + rule)
        print("\n".join(_table(result["ops"], other and other["ops"], args.top, unit)))
        print("\n| node | operator | MB moved |\n|---|---|---|")
        for moved, op, name in result["nodes"][:args.top]:
            print(f"| {name} | {op} | {moved / 1e6:.1f} |")


if __name__ == "__main__":
    main()
