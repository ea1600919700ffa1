"""``graph_optimizations.fused_attention`` (``graph/gradient/attention_ops.py``, ``kernels/torch_ops.py``): each
``scaled_dot_product_attention`` as one ``Attention`` / ``BiasAttention`` node and one ``...Grad`` node running
torch's fused attention kernels inside ONNX Runtime (the CPU's flash attention here, the memory-efficient one on
CUDA under ``make gpu-check``).

Checked against float64 PyTorch: one float32 and one float16 step of a tiny Hugging Face GPT-2 (causal mask and
padding mask, added as a bias), loss and every gradient, the option on and off; attention with no mask and
``is_causal``, a boolean mask, a trained float mask (its gradient from torch's arithmetic), queries and keys of
different lengths; a call with dropout left to the math attention; the library built against this torch, its
CUDA path compiled against torch's CUDA headers. Under a captured CUDA graph: test_cuda_graph.py.
"""

import copy
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from ort_trainer import ORTTrainer, _runtime
from ort_trainer.amp import DynamicLossScaler
from ort_trainer.kernels import _compilers, torch_ops
from ort_trainer.kernels.torch_allocator import cuda_include_dir
from ort_trainer.optim import SGDConfig

from test_fused_kernels import _step
from test_half_loss import _float64, _gpt2_case, _relative
from test_torch_allocator import _stub_for_a_cpu_torch
from tolerances import FLOAT16, FLOAT32, check

pytestmark = [pytest.mark.skipif(not _runtime.has_onnxscript(),
                                 reason="the 'torch' gradient source exports with onnxscript"),
              pytest.mark.skipif(_compilers()[1] is None,
                                 reason="builds a library against torch: needs a C++ compiler")]

# float32 against float64, relative to each tensor's norm: test_fused_kernels.py's bound (~800 roundings of the tiny
# GPT-2's longest chain, 5x margin); torch's flash kernel sums each row's terms in blocks, another order of the same
# float32 sums
FLOAT32_BOUND = 4000 * FLOAT32
# float16: test_half_loss.py's HALF_BOUND (40 roundings of the tiny models' longest float16 chain); the kernel rounds
# the attention's output once where the math attention rounds its scores, probabilities and product
HALF_BOUND = 40 * FLOAT16
# by precision; bfloat16: the same 40 roundings of its own precision
BOUNDS = {"float32": FLOAT32_BOUND, "float16": HALF_BOUND, "bfloat16": 40 * 2.0 ** -8}
OPTIONS = {"graph": {"gradient_source": "torch"}, "utils": {"grad_norm_clip": False}}


def _device_step(model, desc, batch, precision: str, device: str, optimizations: dict):
    """``(trainer, loss, {weight: float32 gradient})`` of one step (SGD lr 0, float16 unscaled) of a copy of
    ``model`` on ``device`` in ``precision`` with ``graph_optimizations`` ``optimizations``."""
    scaler = DynamicLossScaler(loss_scale=1.0, up_scale_window=10 ** 6)
    mixed = ({"enabled": False} if precision == "float32" else
             {"enabled": True, "dtype": precision, **({"loss_scaler": scaler} if precision == "float16" else {})})
    torch.manual_seed(0)
    trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0),
                         options={**OPTIONS, "device": {"id": device}, "mixed_precision": mixed,
                                  "graph_optimizations": optimizations})
    loss = float(trainer.train_step(*[t.to(device) for t in batch])[0].cpu())
    return trainer, loss, {w: g.float().cpu().numpy() for w, g in trainer._engine.grads.items()}


def _kernel_nodes(trainer) -> list[str]:
    return [n.op_type for n in trainer._graphs.gradient.graph.node if n.domain == torch_ops.DOMAIN]


def _heads_swapped(trainer) -> int:
    """The graph's heads-swapping Transposes (attention_layout leaves none around a fused attention)."""
    return sum(n.op_type == "Transpose" and list(n.attribute[0].ints) == [0, 2, 1, 3]
               for n in trainer._graphs.gradient.graph.node)


def _layouts(trainer) -> set[int]:
    return {next((a.i for a in n.attribute if a.name == "layout"), 0)
            for n in trainer._graphs.gradient.graph.node if n.domain == torch_ops.DOMAIN}


@pytest.mark.parametrize("half", [False, True], ids=["float32", "float16"])
def test_gpt2_trains_within_rounding_of_float64(half, record_property):
    """One step of the tiny GPT-2 (two layers), the option on and off: loss and every gradient within the bound of
    float64 PyTorch's, on against off too; on, each layer's attention is one BiasAttention and one
    BiasAttentionGrad node (the causal and padding mask added as a bias) and no Softmax is left."""
    model, desc, batch, _ = _gpt2_case()
    loss64, grads64 = _float64(model, batch, None)
    bound = HALF_BOUND if half else FLOAT32_BOUND
    results, errors = {}, {}
    for on in (True, False):
        trainer, loss, grads = _step(model, desc, batch, None, "fused_attention", on, "float16" if half else None)
        results[on] = grads
        errors[on] = {"loss": abs(loss - loss64) / abs(loss64),
                      **{name: _relative(grads[name], grad) for name, grad in grads64.items()}}
        for name, error in errors[on].items():
            check(error, bound, (on, name))
        nodes = trainer._graphs.gradient.graph.node
        assert _kernel_nodes(trainer) == (["BiasAttention"] * 2 + ["BiasAttentionGrad"] * 2 if on else [])
        assert (sum(n.op_type == "Softmax" for n in nodes) == 0) == on
        if on:  # the nodes read and write [batch, seq, heads, dim]: no head transposes left (8 a layer before)
            assert _layouts(trainer) == {1} and _heads_swapped(trainer) == 0, (_layouts(trainer),
                                                                              _heads_swapped(trainer))
    on_off = {name: _relative(results[True][name], grad) for name, grad in results[False].items()}
    for name, error in on_off.items():
        check(error, bound, ("on/off", name))
    record_property("errors", {**{on: max(e.values()) for on, e in errors.items()}, "on/off": max(on_off.values())})


@pytest.mark.parametrize("precision, device", [
    ("float32", "cpu"), ("float16", "cpu"), pytest.param("float16", "cuda", marks=pytest.mark.cuda),
    pytest.param("bfloat16", "cuda", marks=pytest.mark.cuda)])
def test_packed_attention_reads_gpt2s_packed_projection_bit_for_bit(precision, device):
    """``packed_attention``: each layer's attention reads q, k and v where GPT-2's c_attn packed them and writes
    their gradients so (PackedBiasAttention, PackedBiasAttentionGrad; the layer's Split and Concat gone): the loss
    and every gradient bit for bit those of ``fused_attention`` alone (the same kernels on the same numbers, read
    through strides), on CUDA (``make gpu-check``) too."""
    model, desc, batch, _ = _gpt2_case()
    results = {}
    for packed in (False, True):
        trainer, loss, grads = _device_step(model, desc, batch, precision, device,
                                            {"fused_attention": True, "packed_attention": packed})
        nodes = trainer._graphs.gradient.graph.node
        results[packed] = (loss, grads, sum(n.op_type in ("Split", "Concat") for n in nodes))
        prefix = "Packed" if packed else ""
        assert _kernel_nodes(trainer) == [f"{prefix}BiasAttention"] * 2 + [f"{prefix}BiasAttentionGrad"] * 2
    (loss_off, grads_off, copies_off), (loss_on, grads_on, copies_on) = results[False], results[True]
    assert loss_on == loss_off and copies_on == copies_off - 4, (loss_on, loss_off, copies_on, copies_off)
    for name, grad in grads_off.items():
        assert np.array_equal(grads_on[name], grad), name
    # and within the bounds above of float64 PyTorch
    bound = BOUNDS[precision]
    loss64, grads64 = _float64(model, batch, None)
    check(abs(loss_on - loss64) / abs(loss64), bound, "loss")
    for name, grad in grads64.items():
        check(_relative(grads_on[name].astype(np.float64), grad), bound, name)


class _Attention(torch.nn.Module):
    """q, k, v projections of x (and of y, for keys of another length) and one scaled_dot_product_attention."""

    def __init__(self, mask: str):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(8, 8) for _ in range(3))
        self.mask = mask
        if mask == "trained":  # a trained additive bias, one per head, query and key
            self.bias = torch.nn.Parameter(torch.randn(1, 2, 5, 5))

    def forward(self, x, y, target):
        keys = y if self.mask == "cross" else x

        def heads(t):
            return t.reshape(t.shape[0], t.shape[1], 2, 4).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(keys)), heads(self.v(keys))
        kwargs = {"causal": {"is_causal": True}, "dropout": {"dropout_p": 0.5},
                  "bool": {"attn_mask": torch.ones(5, 5, dtype=torch.bool).tril()},
                  "trained": {"attn_mask": getattr(self, "bias", None)}}.get(self.mask, {})
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
        return torch.nn.functional.mse_loss(out.transpose(1, 2).reshape(x.shape), target)


@pytest.mark.parametrize("mask", ["causal", "bool", "trained", "cross", "dropout"])
def test_masks_and_shapes_within_rounding_of_float64(mask):
    """float32 gradients of every weight (the trained mask's too) within FLOAT32_BOUND of float64 PyTorch's, and
    the nodes: Attention for no mask (is_causal an attribute), BiasAttention for a mask; a call with dropout is left
    to the math attention (no node)."""
    gen = torch.Generator().manual_seed(4)
    batch = tuple(torch.randn(3, n, 8, generator=gen) for n in (5, 7, 5))  # x, y (the cross keys), target
    desc = {"inputs": [("x", [3, 5, 8]), ("y", [3, 7, 8]), ("target", [3, 5, 8])], "outputs": [("loss", [], True)]}
    torch.manual_seed(0)
    model = _Attention(mask)
    trainer = ORTTrainer(copy.deepcopy(model), desc, SGDConfig(lr=0.0),
                         options={**OPTIONS, "graph_optimizations": {"fused_attention": True}})
    trainer.train_step(*batch)
    expected = {"causal": ["Attention", "AttentionGrad"], "cross": ["Attention", "AttentionGrad"], "dropout": [],
                "bool": ["BiasAttention", "BiasAttentionGrad"], "trained": ["BiasAttention", "BiasAttentionGrad"]}
    assert _kernel_nodes(trainer) == expected[mask]
    if mask == "dropout":
        return  # (its values are the dropout's draw)
    assert _layouts(trainer) == {1}
    graph = trainer._graphs.gradient.graph
    swapped = {n.output[0] for n in graph.node if n.op_type == "Transpose" and list(n.attribute[0].ints) == [0, 2, 1, 3]}
    assert not [n.name for n in graph.node if n.domain == torch_ops.DOMAIN and swapped & set(n.input)]
    # none left but, for a trained mask, those its gradient's arithmetic reads (q, k, v, out and dout in
    # [batch, heads, seq, dim], as torch computes it)
    assert (_heads_swapped(trainer) > 0) == (mask == "trained")
    double = copy.deepcopy(model).double()
    double(*(t.double() for t in batch)).backward()
    for name, parameter in double.named_parameters():
        if name == "k.bias":  # adds q·b to every score of a row: its gradient is 0 (roundoff on both sides)
            continue
        check(_relative(trainer._engine.grads[name].numpy().astype(np.float64), parameter.grad.numpy()),
              FLOAT32_BOUND, (mask, name))


def test_the_library_builds_against_this_torch_and_its_cuda_path_compiles(tmp_path):
    """The operators build and load against the installed torch (CUDA kernels where it is a CUDA build), and their
    CUDA path (torch's memory-efficient, flash or cuDNN attention on the session's stream) compiles against torch's
    CUDA headers."""
    path = torch_ops.build()
    assert path.is_file() and torch_ops.has_cuda_kernels(path) == (torch.version.cuda is not None)
    cxx, cuda_include = _compilers()[1], cuda_include_dir()
    if cuda_include is None:
        pytest.skip("no CUDA runtime headers here: the CUDA path is compiled where they are")
    command = torch_ops._command(cxx, tmp_path / "torch_ops.o", Path(torch.__file__).parent,
                                 torch._C._GLIBCXX_USE_CXX11_ABI, cuda_include,
                                 _stub_for_a_cpu_torch(tmp_path / "stub"))
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    symbols = subprocess.run(["nm", "-C", str(tmp_path / "torch_ops.o")], capture_output=True, text=True).stdout
    assert "getStreamFromExternal" in symbols and "_fused_sdp_choice" in symbols  # (torch_attention_choice's kernels)
    for kernel in ("efficient", "flash", "cudnn"):
        assert f"_scaled_dot_product_{kernel}_attention_backward" in symbols, kernel


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpt2_on_cuda_within_rounding_of_float64(dtype, record_property):
    """One mixed-precision step of the tiny GPT-2 on CUDA (torch's memory-efficient attention) within the bound of
    float64 PyTorch's (bfloat16: the same 40 roundings of its own precision)."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    model, desc, batch, _ = _gpt2_case()
    loss64, grads64 = _float64(model, batch, None)
    trainer, loss, grads = _device_step(model, desc, batch, dtype, "cuda", {"fused_attention": True})
    errors = {"loss": abs(loss - loss64) / abs(loss64),
              **{name: _relative(grads[name].astype(np.float64), grad) for name, grad in grads64.items()}}
    for name, error in errors.items():
        check(error, BOUNDS[dtype], name)
    assert _kernel_nodes(trainer) == ["BiasAttention"] * 2 + ["BiasAttentionGrad"] * 2
    record_property("errors", max(errors.values()))


def test_packed_attention_leaves_q_k_v_that_another_node_reads():
    """The rewrite on a hand-built graph (``Split`` of a [2, 4, 48] projection into three heads-last views, the
    attention and its gradient, a ``Concat`` of the gradients' views): the packed nodes and two views in place of
    the Split, the three views, the Concat and the gradients' views; where another node reads q too, nothing."""
    from onnx import TensorProto, helper

    from ort_trainer.graph.passes.packed_attention import packed_attention
    from ort_trainer.kernels import TORCH_OPS_DOMAIN

    f32, i64 = TensorProto.FLOAT, TensorProto.INT64

    def graph(q_read_elsewhere: bool):
        nodes = [helper.make_node("Split", ["x", "sizes"], ["s0", "s1", "s2"], axis=2)]
        nodes += [helper.make_node("Reshape", [f"s{i}", "heads"], [name]) for i, name in enumerate("qkv")]
        nodes += [helper.make_node("BiasAttention", ["q", "k", "v", "bias"], ["out", "lse"], domain=TORCH_OPS_DOMAIN,
                                   layout=1, scale=0.35),
                  helper.make_node("BiasAttentionGrad", ["dout", "q", "k", "v", "bias", "out", "lse"],
                                   ["dq", "dk", "dv"], domain=TORCH_OPS_DOMAIN, layout=1, scale=0.35)]
        nodes += [helper.make_node("Reshape", [f"d{name}", "rows"], [f"r{name}"]) for name in "qkv"]
        nodes += [helper.make_node("Concat", ["rq", "rk", "rv"], ["dx"], axis=2)]
        outputs = [("out", [2, 4, 2, 8]), ("dx", [2, 4, 48])] + ([("q", [2, 4, 2, 8])] if q_read_elsewhere else [])
        inits = [helper.make_tensor("sizes", i64, [3], [16] * 3), helper.make_tensor("heads", i64, [4], [0, 0, 2, 8]),
                 helper.make_tensor("rows", i64, [3], [0, 0, 16])]
        info = [helper.make_tensor_value_info(n, f32, s) for n, s in [
            ("s0", [2, 4, 16]), ("s1", [2, 4, 16]), ("s2", [2, 4, 16]), ("q", [2, 4, 2, 8]), ("k", [2, 4, 2, 8]),
            ("v", [2, 4, 2, 8]), ("lse", [2, 2, 4]), ("dq", [2, 4, 2, 8]), ("dk", [2, 4, 2, 8]),
            ("dv", [2, 4, 2, 8]), ("rq", [2, 4, 16]), ("rk", [2, 4, 16]), ("rv", [2, 4, 16])]]
        return helper.make_model(helper.make_graph(
            nodes, "attention", [helper.make_tensor_value_info(n, f32, s) for n, s in [
                ("x", [2, 4, 48]), ("bias", [2, 1, 4, 4]), ("dout", [2, 4, 2, 8])]],
            [helper.make_tensor_value_info(n, f32, s) for n, s in outputs], inits, value_info=info))

    packed, shared = graph(False), graph(True)
    assert packed_attention(packed) == 1 and packed_attention(shared) == 0
    assert [(n.op_type, list(n.input), list(n.output)) for n in packed.graph.node] == [
        ("Reshape", ["x", "x/qkv_heads/shape"], ["x/qkv_heads"]),
        ("PackedBiasAttention", ["x/qkv_heads", "bias"], ["out", "lse"]),
        ("PackedBiasAttentionGrad", ["dout", "x/qkv_heads", "bias", "out", "lse"], ["dx/qkv_heads"]),
        ("Reshape", ["dx/qkv_heads", "dx/qkv_heads/shape"], ["dx"])]
    assert {a.name: a.i for a in packed.graph.node[1].attribute if a.name == "layout"} == {"layout": 1}
    assert [n.op_type for n in shared.graph.node].count("Split") == 1
