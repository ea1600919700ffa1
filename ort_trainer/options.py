"""``ORTTrainerOptions``: the trainer's settings, typed and validated.

Options are a nested dict with attribute access (``opts.batch.gradient_accumulation_steps``).
Every key is declared in ``_SCHEMA`` (this module) with its type, default, range and one line of
documentation; an unknown key, a wrong type or an out-of-range value raises one ``ValueError``
that lists every problem with the key's path.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import onnxruntime as ort

from . import _runtime, devices
from ._option_checks import cross_field_problems
from .distributed import BACKENDS

_SENTINEL = object()


def _has_cuda() -> bool:
    """Whether ``device.id`` defaults to ``"cuda"``: the CUDA runtime, a CUDA build of torch and a GPU are here."""
    return devices.default_device_id() == "cuda"


@dataclass(frozen=True)
class _Field:
    types: tuple
    default: Any
    doc: str
    check: Callable[[Any], str | None] | None = None  # returns a problem or None


def _at_least(low: int) -> Callable[[Any], str | None]:
    return lambda v: None if v >= low else f"must be >= {low}, got {v}"


def _one_of(*allowed: Any) -> Callable[[Any], str | None]:
    return lambda v: None if v in allowed else f"must be one of {list(allowed)}, got {v!r}"


def _in_range(low: int, high: int) -> Callable[[Any], str | None]:
    return lambda v: None if low <= v <= high else f"must be between {low} and {high}, got {v}"


def _check_device(value: str) -> str | None:
    """'cpu', 'cuda' or 'cuda:N', usable here: the CUDA runtime, a CUDA torch and that GPU (devices.py)."""
    return devices.device_problem(value)


def _check_str_list(value: list) -> str | None:
    bad = [v for v in value if not isinstance(v, str)]
    return f"expected a list of weight names (str), got items {bad!r}" if bad else None


def _check_callable(value: Any) -> str | None:
    return None if value is None or callable(value) else f"expected a callable or None, got {type(value).__name__}"


def _check_scheduler(value: Any) -> str | None:
    from .optim.lr_scheduler import _LRScheduler

    ok = value is None or isinstance(value, _LRScheduler)
    return None if ok else f"expected an ort_trainer.optim.lr_scheduler scheduler or None, got {type(value).__name__}"


def _check_loss_scaler(value: Any) -> str | None:
    from .amp.loss_scaler import LossScaler

    ok = value is None or isinstance(value, LossScaler)
    return None if ok else f"expected an ort_trainer.amp.LossScaler or None, got {type(value).__name__}"


_ANY = (object,)
_BOOL = (bool,)
_INT = (int,)
_STR = (str,)

# The full key set of api.md section 5 (with graph.gradient_source), plus ort_trainer's graph_optimizations.
_SCHEMA: dict[str, _Field] = {
    "batch.gradient_accumulation_steps": _Field(
        _INT, 1, "micro-batches whose gradients are summed before one optimizer update", _at_least(1)
    ),
    "device.id": _Field(
        _STR, _SENTINEL, "'cpu', 'cuda' or 'cuda:N'; default 'cuda' when onnxruntime-gpu, a CUDA build of torch "
        "and a GPU are all present, else 'cpu'",
        _check_device,
    ),
    "device.mem_limit": _Field(_INT, 0, "GPU arena limit in bytes (0: no limit)", _at_least(0)),
    "device.cuda_graph": _Field(
        _BOOL, False, "capture the training step's run as a CUDA graph and replay it (no kernel launches from the "
        "host): a GPU only, no dropout, gradients accumulated outside the graph, the labelled rows not sparse"),
    "device.torch_allocator": _Field(
        _BOOL, False, "a GPU's ONNX Runtime memory (the graph's activations) from torch's caching allocator, the pool "
        "of the trainer's weights, gradients and optimizer states, instead of an arena of ONNX Runtime's own: one "
        "pool for both (no CUDA graph, no device.mem_limit; built against torch on first use, seconds)"),
    "device.host_threads": _Field(
        _INT, 0, "torch threads for the work a training step does on the host between ONNX Runtime's runs (the "
        "fused optimizer update, the gradient norm, copies), restored after the step; 0: one thread for an update "
        "of at most 4 M weights (torch's OpenMP workers spin for milliseconds after their work, on the cores ONNX "
        "Runtime's next run computes on), torch's own count above", _at_least(0)),
    "distributed.world_rank": _Field(_INT, 0, "this process's rank", _at_least(0)),
    "distributed.world_size": _Field(
        _INT, 1, "number of data-parallel processes", _at_least(1)
    ),
    "distributed.local_rank": _Field(_INT, 0, "this process's rank on its node", _at_least(0)),
    "distributed.allreduce_post_accumulation": _Field(
        _BOOL, False, "all-reduce once per optimizer step instead of per micro-batch"
    ),
    "distributed.deepspeed_zero_optimization.stage": _Field(
        _INT, 0, "ZeRO stage: 0 off, 1 optimizer state sharded across ranks", _one_of(0, 1)
    ),
    "distributed.backend": _Field(
        _STR, "auto", "what moves the gradients between ranks: 'mpi' (mpi4py, host buffers), 'gloo' "
        "(torch.distributed, host buffers, or CUDA buffers through host copies: ranks sharing a GPU), 'nccl' "
        "(torch.distributed, CUDA buffers), 'auto' ('nccl' on CUDA, else 'mpi' under mpirun and 'gloo' under torchrun)", _one_of(*BACKENDS)
    ),
    "lr_scheduler": _Field(
        _ANY, None, "a learning-rate scheduler from ort_trainer.optim.lr_scheduler, or None", _check_scheduler
    ),
    "mixed_precision.enabled": _Field(
        _BOOL, False, "half-precision compute (torch.autocast semantics), fp32 master weights, optimizer states "
        "and loss; needs the 'torch' gradient source"
    ),
    "mixed_precision.dtype": _Field(
        _STR, "float16", "the half-precision dtype with enabled=True: 'float16' (a DynamicLossScaler by default) "
        "or 'bfloat16' (no loss scaler needed)", _one_of("float16", "bfloat16")
    ),
    "mixed_precision.loss_scaler": _Field(
        _ANY, None, "an ort_trainer.amp.LossScaler, or None (with enabled=True and dtype float16: a "
        "DynamicLossScaler(); works in fp32 too)", _check_loss_scaler
    ),
    "utils.frozen_weights": _Field((list, tuple), (), "weight names that are never updated", _check_str_list),
    "utils.grad_norm_clip": _Field(_BOOL, True, "clip the global gradient L2 norm (Adam and Lamb)"),
    "debug.deterministic_compute": _Field(_BOOL, False, "ask ONNX Runtime for deterministic kernels"),
    "debug.check_model_export": _Field(
        _BOOL, False, "compare PyTorch and ONNX Runtime outputs before the first step"
    ),
    "debug.graph_save_paths.model_after_graph_transforms_path": _Field(
        _STR, "", "write the forward graph after the trainability pass and the user hook here"
    ),
    "debug.graph_save_paths.model_with_gradient_graph_path": _Field(
        _STR, "", "write the forward + backward graph here"
    ),
    "debug.graph_save_paths.model_with_training_graph_path": _Field(
        _STR, "", "write the optimizer graph (the step after the gradient graph) here"
    ),
    "_internal_use.extra_postprocess": _Field(
        _ANY, None, "callable(onnx.ModelProto) run on the exported forward graph after the trainability pass",
        _check_callable,
    ),
    "_internal_use.onnx_opset_version": _Field(_INT, 17, "ONNX opset of the export", _in_range(14, 20)),
    "graph_optimizations.shape_specialization": _Field(
        _BOOL, True, "build static-shape graphs for the first input-shape signatures seen (see max_shape_graphs)"
    ),
    "graph_optimizations.max_shape_graphs": _Field(
        _INT, 4, "at most this many shape-specialised graph sets; further shapes use the symbolic graph",
        _at_least(1),
    ),
    "graph_optimizations.sparse_labels": _Field(
        _BOOL, True, "when the logits are not fetched, project only the rows whose label is not ignored (padded "
        "to one of four sizes per power of two, so that ONNX Runtime's arena meets few sizes)"
    ),
    "graph_optimizations.cross_entropy": _Field(
        _BOOL, True, "SoftmaxCrossEntropyLoss as LogSoftmax + GatherElements, with an elementwise LogSoftmax gradient"
    ),
    "graph_optimizations.embedding_gradient": _Field(
        _BOOL, True, "embedding (2-D Gather) gradients as one ScatterElements(add) instead of GatherGrad; with the "
        "'torch' source, identity Transposes around them dropped and tables of at most 64 rows as a one-hot product"
    ),
    "graph_optimizations.tied_embedding_gradient": _Field(
        _BOOL, True, "a table both looked up and multiplied by (a tied input and output embedding): the graph writes "
        "the product's gradient into the gradient buffer and the engine adds the lookup's rows into it "
        "(index_add_), instead of the graph scattering them into a zero table and adding the two, which holds two "
        "temporaries the size of the table (GPT-2 small: 154 MB each) (gradient source 'torch' only)"
    ),
    "graph_optimizations.fast_gelu_gradient": _Field(
        _BOOL, True, "tanh-GELU gradient in elementwise operators instead of the FastGeluGrad kernel"),
    "graph_optimizations.integer_powers": _Field(
        _BOOL, True, "x**2 and x**3 as multiplications instead of Pow (a tanh-GELU written out in Python, when the "
        "gelu pass is off; gradient source 'torch' only)"),
    "graph_optimizations.integer_pads": _Field(
        _BOOL, True, "a constant-mode Pad of an integer tensor (the labels Hugging Face's causal-LM loss pads) as a "
        "Concat with constant fills: ONNX Runtime's CUDA provider has no integer Pad, which ran on the host with "
        "copies inside each run (gradient source 'torch' only)"),
    "graph_optimizations.gelu": _Field(
        _BOOL, True, "GELU (F.gelu, or the tanh/erf formula written out as GPT-2's and BERT's Python code "
        "does) with forward and backward computed together, the forward keeping what the backward reads: "
        "13 elementwise nodes per tanh-GELU instead of 21, 11 per erf-GELU instead of 16 (gradient source "
        "'torch' only)"
    ),
    "graph_optimizations.half_precision_gelu": _Field(
        _BOOL, True, "with gelu, mixed precision: a half GELU's forward and backward in its own dtype (torch source)"),
    # regions as kernels of ort_trainer's own library (ort_trainer/kernels; usage.md "ort_trainer's kernels")
    "graph_optimizations.fused_gelu_gradient": _Field(_BOOL, False, "with gelu: each GELU's backward as one kernel"),
    "graph_optimizations.fused_layer_norm_gradient": _Field(
        _BOOL, False, "each LayerNorm's backward as one kernel (a pre-norm one's with the residual's gradient sum)"),
    "graph_optimizations.fused_layer_norm": _Field(
        _BOOL, False, "mixed precision: a float32 LayerNorm whose output half products read as one kernel that "
        "writes the half output (no float32 output and cast; both where others read the float32 output too)"),
    "graph_optimizations.fused_softmax_gradient": _Field(_BOOL, False, "a softmax's backward as one kernel"),
    "graph_optimizations.fused_safe_softmax": _Field(_BOOL, False, "attention's safe softmax as one kernel"),
    "graph_optimizations.fused_cross_entropy": _Field(_BOOL, False, "a cross-entropy as two kernels, no float32 copy"),
    "graph_optimizations.fused_attention": _Field(
        _BOOL, False, "each scaled_dot_product_attention as torch's fused attention kernels, forward and backward"),
    "graph_optimizations.packed_attention": _Field(
        _BOOL, False, "with fused_attention: q, k and v that one projection packed (GPT-2's) read and their "
        "gradients written where they lie, no Split and Concat copies"),
    "graph_optimizations.causal_attention": _Field(
        _BOOL, False, "with fused_attention: a mask that holds the causal triangle (GPT-2's, with its padding) "
        "computed in the kernel, which skips the scores above the diagonal, and only the rest added as a bias"),
    "graph_optimizations.torch_attention_choice": _Field(
        _BOOL, False, "with fused_attention, on CUDA: each attention runs the kernel torch's own attention picks for "
        "its tensors (cuDNN's, or flash attention without a bias), not always the memory-efficient one"),
    "graph_optimizations.torch_products": _Field(
        _BOOL, False, "each Gemm and MatMul run by torch's BLAS (on a GPU cuBLAS, a bias vector added in the "
        "product's epilogue instead of written into the output first; on the CPU MKL, slower than ONNX Runtime's own "
        "products inside a run); a half product that only a Cast to float32 reads (a weight's gradient) writes "
        "float32 itself, no half copy and Cast; off until a GPU measurement shows it wins"),
    "graph_optimizations.host_dropout_masks": _Field(
        _BOOL, True, "on the CPU, each static-shape training Dropout as x · m with the mask m drawn on the host "
        "(NumPy's PCG64, 16-bit draws, from the step's seed) instead of by ONNX Runtime's Dropout kernel, which "
        "draws 4.6 ns per element on one thread (20-25 ms of the GPT-2-like step; the host takes ~6 ms) and "
        "costs one float per masked element of host memory (18 MB on the GPT-2-like model) (gradient source "
        "'torch' only; GPU graphs keep ONNX Runtime's Dropout)"
    ),
    "graph_optimizations.dropout_gradient": _Field(
        _BOOL, True, "an attention dropout's backward (grad · mask · scale, then · the softmax output) as grad · "
        "the dropout's forward output, three passes over the attention scores fewer; other dropouts' mask · scale "
        "as one DequantizeLinear of the mask cast to bytes (gradient source 'torch' only)"
    ),
    "graph_optimizations.sequences": _Field(
        _BOOL, True, "split outputs (GPT-2's q/k/v) read directly instead of through a tensor sequence, which "
        "copies every tensor twice (gradient source 'torch' only)"
    ),
    "graph_optimizations.output_reshape": _Field(
        _BOOL, True, "a matrix product reshaped into a graph output (GPT-2's logits) computed in the output's shape, "
        "so ONNX Runtime does not copy it (gradient source 'torch' only)"
    ),
    "graph_optimizations.safe_softmax": _Field(
        _BOOL, True, "the fully-masked-row guard of scaled_dot_product_attention's softmax (rows of -inf give 0) "
        "from two row reductions and one Where instead of five passes over the attention scores and a Where "
        "with a full-size zero tensor; bit-equal, NaN rows stay NaN (gradient source 'torch' only)"
    ),
    "graph_optimizations.half_precision_attention": _Field(
        _BOOL, True, "under mixed precision, scaled_dot_product_attention computed in the half dtype (float16 or "
        "bfloat16 products, scores and softmax, as the attention written out in Python runs under autocast) instead "
        "of torch's math attention, which upcasts the inputs and every [batch, heads, seq, seq] tensor to float32 "
        "(gradient source 'torch' only)"
    ),
    "graph_optimizations.loss_pieces": _Field(_BOOL, True, "when the logits are not fetched, a cross-entropy over "
        "a projection with more than loss_piece_elements logits computed in pieces of rows, each piece's backward "
        "right after its forward: none past 2^31 elements, one piece's alive at a time (gradient source 'torch' only)"),
    "graph_optimizations.loss_piece_elements": _Field(_INT, 2**26, "most logits of one loss piece", _at_least(1)),
    "graph_optimizations.half_precision_softmax_gradient": _Field(
        _BOOL, True, "a float16 softmax's gradient (the half-precision attention's) computed in float16, the row sum "
        "accumulated in float32 on CUDA, instead of torch's float32 decomposition between casts: four passes over the "
        "[batch, heads, seq, seq] probabilities instead of seven (gradient source 'torch' only)"
    ),
    "graph_optimizations.bfloat16_softmax_gradient": _Field(
        _BOOL, False, "half_precision_softmax_gradient for bfloat16 softmaxes: the gradient in bfloat16, its row sum "
        "a product by a column of ones that accumulates in float32 (ONNX Runtime's CUDA provider has no bfloat16 "
        "ReduceSum), instead of torch's float32 decomposition between casts: GPT-2 small at 8 x 512 moves ~10 GB "
        "fewer a step. Off by default until a GPU measurement shows it wins (gradient source 'torch' only)"),
    "graph_optimizations.half_precision_loss": _Field(
        _BOOL, False, "under mixed precision, a float32 cross-entropy over half-precision scores (autocast's, and "
        "Hugging Face's logits.float()) computed in the scores' dtype: log-softmax and softmax kernels that "
        "accumulate in float32 and round once, instead of five float32 copies of the [tokens, vocabulary] scores "
        "(GPT-2 small at 8 x 512: 823 MB each, one of them held from the forward to the backward). Each row's "
        "log-probability is rounded to the half dtype before the mean. Off by default until a GPU measurement "
        "shows it wins (gradient source 'torch' only)"
    ),
    "graph_optimizations.half_precision_bias_gradient": _Field(
        _BOOL, False, "under mixed precision, a half-precision product's bias gradient (torch's float32 sum over the "
        "rows of the half output's gradient, cast back to the half dtype) as one half-precision MatMul by ones, "
        "which accumulates in float32 and rounds once: no float32 copy of the gradient (GPT-2 small at 8 x 512: "
        "113 MB a layer). Off by default until a GPU measurement shows it wins (gradient source 'torch' only)"
    ),
    "graph_optimizations.column_sums": _Field(
        _BOOL, True, "sums over the leading axes of a static-shape tensor (bias and LayerNorm weight gradients) as a "
        "matrix product by ones, which ONNX Runtime's CPU kernels run in about half the time of ReduceSum "
        "(gradient source 'torch' only)"
    ),
    "graph_optimizations.transposed_products": _Field(
        _BOOL, True, "a 2-D Transpose read by a MatMul or Gemm folded into a Gemm's transA/transB, so that ONNX "
        "Runtime does not fuse it into a node it runs last: each weight gradient is computed where the backward "
        "reaches it and the layer input it reads is freed there (gradient source 'torch' only)"
    ),
    "graph_optimizations.half_precision_transposed_products": _Field(
        _BOOL, False, "transposed_products for the float16 and bfloat16 MatMul nodes of a mixed-precision graph: "
        "ONNX Runtime's own fusion of them (FusedMatMul, CUDA's too) runs last, so every half weight gradient waited "
        "for the end of the backward and kept its layer's input alive until then. Off by default until a GPU "
        "measurement shows it wins (gradient source 'torch' only)"
    ),
    "graph_optimizations.layer_recompute": _Field(
        _BOOL, False, "`torch` source: each transformer sublayer's values that the backward reads recomputed in the "
        "backward from its LayerNorm's input (checkpointing): the forward keeps two tensors a layer, the step runs "
        "the layers' forward twice; a sublayer with a Dropout drawing masks on the device is left as it is"),
    "graph_optimizations.activation_recompute": _Field(
        _BOOL, True, "an activation's values that the backward reads (a GELU's x/sqrt(2), Phi and output) "
        "recomputed in the backward from its input, so the forward keeps one [batch, seq, 4 x hidden] tensor per "
        "GELU instead of three (with transposed_products, peak RSS BERT-base B4xS128 2558 -> 2490 MB); and each "
        "attention's probabilities recomputed there from q and k (one batched product and softmax more per layer: "
        "BERT-base 2445 -> 2412 MB, GPT-2 small 2923 -> 2789 MB), at the cost of re-running those nodes once per "
        "step (gradient source 'torch' only)"
    ),
    "graph_optimizations.aligned_products": _Field(
        _BOOL, False, "matrix products with a static dimension of 1024 or more that is not a multiple of 8 (a "
        "50257- or 30522-word vocabulary's language-model head, forward and backward) computed on operands padded "
        "with zeros to a multiple of 64, the result sliced back: the 16-byte aligned rows that Hopper's tensor-core "
        "kernels need (with fused_cross_entropy, its kernels read the padded logits and write their gradient padded, "
        "no sliced or padded copy). The same values; off by default until a GPU measurement shows it wins there (on the CPU it "
        "only adds copies) (gradient source 'torch' only)"
    ),
    "graph_optimizations.fused_gradient_sums": _Field(
        _BOOL, False, "mixed precision: each float32 sum of a half-precision gradient (an Add of a Cast to float32: a "
        "weight read by several half products, as GPT-2's tied embedding with loss_pieces) as one AddHalf node of "
        "ort_trainer's kernels, the half tensor widened as it is read (no float32 copy; where it is a padded "
        "product's leading rows, the padded product read directly); the same values. Off by default until a GPU "
        "measurement shows it wins (gradient source 'torch' only)"),
    "graph_optimizations.weight_casts": _Field(
        _BOOL, False, "mixed precision: the weights' half copies (a Cast each) by one node of ort_trainer's kernels "
        "(on CUDA a launch per 64 weights; aligned_products' padded weights written padded); the same values. Off "
        "until a GPU measurement shows it wins (gradient source 'torch' only)"),
    "graph_optimizations.gelu_forward_kernel": _Field(
        _BOOL, False, "each GELU's forward, once its backward recomputes its values (activation_recompute), as one "
        "com.microsoft FastGelu (tanh) or BiasGelu with a zero bias (erf) node instead of five or six element-wise "
        "passes; off by default until a GPU measurement shows it wins (on the CPU the kernel is slower) (gradient "
        "source 'torch' only)"
    ),
    "graph_optimizations.unfused_skip_layer_norm": _Field(
        _BOOL, True, "on the CPU, ONNX Runtime's SkipLayerNormFusion is turned off: its SkipLayerNormalization "
        "kernel took 0.7 ms per [1024, 256] against 0.2 ms for the Add and LayerNormalization it replaces (the "
        "BERT-like eval graph; the gradient graphs have no such pattern)"
    ),
    "graph.gradient_source": _Field(
        _STR, "auto", "where the backward graph comes from: 'torch' (PyTorch's autograd exported to standard "
        "ONNX, any runtime), 'onnxruntime' (ONNX Runtime's gradient builder, training build 1.19.2 only), "
        "'auto' (the gradient builder when the training build is installed, else torch)",
        _runtime.gradient_source_problem,
    ),
    "graph.optimizer": _Field(
        _STR, "fused", "the optimizer update: 'fused' (torch's fused kernels, one in-place pass per parameter "
        "segment, weights and states held once; for SGD and Adam in mode BEFORE_WEIGHT_UPDATE with bias "
        "correction, the ONNX optimizer graph for the rest) or 'graph' (always the ONNX optimizer graph, "
        "double-buffered)", _one_of("fused", "graph")
    ),
    "session_options": _Field(
        _ANY, None, "an onnxruntime.SessionOptions for the trainer's sessions, or None",
        lambda v: None if v is None or isinstance(v, ort.SessionOptions)
        else f"expected an onnxruntime.SessionOptions or None, got {type(v).__name__}",
    ),
    "provider_options": _Field((dict,), {}, "options passed to the execution provider"),
}


class _Group(dict):
    """A dict whose keys are also attributes; nested groups are ``_Group`` too."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"no option {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("options are read-only once validated; build a new ORTTrainerOptions instead")


def _flatten(mapping: Mapping, prefix: str, out: dict, problems: list) -> None:
    for key, value in mapping.items():
        path = f"{prefix}{key}"
        if not isinstance(key, str):
            problems.append(f"{path}: option keys must be str, got {type(key).__name__} {key!r}")
        elif path in _SCHEMA:
            out[path] = value
        elif any(p.startswith(path + ".") for p in _SCHEMA):
            if isinstance(value, Mapping):
                _flatten(value, path + ".", out, problems)
            else:
                inner = sorted({p[len(path) + 1:].split(".")[0] for p in _SCHEMA if p.startswith(path + ".")})
                problems.append(f"{path}: expected a group of options (a dict with keys {inner}), "
                                f"got {type(value).__name__} {value!r}")
        else:
            known = sorted({p[len(prefix):].split(".")[0] for p in _SCHEMA if p.startswith(prefix)})
            guess = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {prefix + guess[0]!r}?" if guess else ""
            problems.append(f"{path}: unknown option; known keys here: {known}{hint}")


def _type_problem(path: str, field: _Field, value: Any) -> str | None:
    types = field.types
    if types == _ANY:
        return None
    if bool not in types and isinstance(value, bool):
        return f"{path}: expected {'/'.join(t.__name__ for t in types)}, got bool {value!r}"
    if list in types and isinstance(value, str):
        return f"{path}: expected a list, got the str {value!r}; write [{value!r}]"
    if not isinstance(value, types):
        return f"{path}: expected {'/'.join(t.__name__ for t in types)}, got {type(value).__name__} {value!r}"
    return None


class ORTTrainerOptions(_Group):
    """Settings of an ``ORTTrainer`` (api.md section 5).

    Build it from a nested dict; keys left out take their defaults:

        ORTTrainerOptions({"batch": {"gradient_accumulation_steps": 1}, "device": {"id": "cpu"}})

    Keys, defaults and meanings are listed by ``ORTTrainerOptions.describe()``.

    Raises:
        ValueError: listing every unknown key, wrong type, out-of-range value, and every value
            whose feature this version does not support yet, each with the key's path.
    """

    def __init__(self, options: Mapping[str, Any] | None = None):
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise ValueError(f"options: expected a dict or ORTTrainerOptions, got {type(options).__name__}")
        given: dict[str, Any] = {}
        problems: list[str] = []
        _flatten(options, "", given, problems)
        values: dict[str, Any] = {}
        for path, field in _SCHEMA.items():
            value = given.get(path, _SENTINEL)
            if value is _SENTINEL:
                value = field.default
                if value is _SENTINEL:  # device.id
                    value = "cuda" if _has_cuda() else "cpu"
                values[path] = list(value) if isinstance(value, tuple) else (
                    dict(value) if isinstance(value, dict) else value
                )
                continue
            problem = _type_problem(path, field, value)
            if problem is None and field.check is not None:
                detail = field.check(value)
                problem = f"{path}: {detail}" if detail else None
            if problem:
                problems.append(problem)
            values[path] = list(value) if isinstance(value, tuple) else value
        problems.extend(cross_field_problems(values, problems))
        if problems:
            raise ValueError("invalid ORTTrainerOptions:\n  " + "\n  ".join(problems))
        _mixed_precision_defaults(values)
        nested: dict[str, Any] = {}
        for path, value in values.items():
            node = nested
            *parents, leaf = path.split(".")
            for parent in parents:
                node = node.setdefault(parent, {})
            node[leaf] = value
        dict.update(self, _to_groups(nested))

    def flat(self) -> dict[str, Any]:
        """The options as ``{dotted.path: value}``."""
        out: dict[str, Any] = {}

        def walk(node: Mapping, prefix: str) -> None:
            for key, value in node.items():
                if isinstance(value, _Group):
                    walk(value, f"{prefix}{key}.")
                else:
                    out[f"{prefix}{key}"] = value

        walk(self, "")
        return out

    @staticmethod
    def describe() -> str:
        """One line per option: path, default, meaning."""
        lines = []
        for path, field in _SCHEMA.items():
            default = "(auto)" if field.default is _SENTINEL else repr(field.default)
            lines.append(f"{path} = {default}: {field.doc}")
        return "\n".join(lines)


def _mixed_precision_defaults(values: dict[str, Any]) -> None:
    """float16 with no scaler gets a ``DynamicLossScaler()`` (api.md section 5), set in the options
    so that the trainer, its checkpoints and the user all see the one object."""
    if values["mixed_precision.enabled"] is True and values["mixed_precision.dtype"] == "float16" \
            and values["mixed_precision.loss_scaler"] is None:
        from .amp.loss_scaler import DynamicLossScaler

        values["mixed_precision.loss_scaler"] = DynamicLossScaler()


def _to_groups(node: dict) -> _Group:
    group = _Group()
    for key, value in node.items():
        # provider_options is a user dict value, not an option group
        dict.__setitem__(group, key, _to_groups(value) if isinstance(value, dict) and key != "provider_options" else value)
    return group
