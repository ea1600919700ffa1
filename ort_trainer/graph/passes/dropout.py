"""Joint-graph passes on Dropout: its backward, and masks drawn on the host.

- ``dropout_gradient``: the decomposition of ``native_dropout_backward`` is ``g · (Cast(mask) ·
  s)``, three passes over the tensor. Where that product only feeds ``· x``, ``x`` the Dropout's
  own input (the softmax backward of an attention dropout: ``t = g_y · p`` with ``p`` the
  attention probabilities), it becomes ``g · y`` with ``y = Dropout(x)`` the forward output,
  which the backward keeps alive anyway (the gradient of ``V`` reads it): the three passes and the
  mask's float copy disappear. ``y`` is ONNX Runtime's ``mask · x / (1 - ratio)``, so the product
  is rounded in another order: elements differ by at most a few float32 ulps, and NaN or inf in
  ``g`` or ``x`` propagate to the same elements as before. The other dropouts get ``Cast(mask) · s``
  as one ``DequantizeLinear`` of the mask cast to bytes (bit-equal). (``Where(mask, g · s, 0)``
  is slower on the CPU: its kernel took 0.7 ms where ``Cast`` + ``Mul`` took 0.3 on a [8, 4, 128,
  128] mask, and it would hide a NaN in ``g`` that PyTorch propagates.)
- ``host_dropout_masks`` (CPU graphs only, ``Device.host_dropout_masks``): each
  static-shape training Dropout as ``x · m`` with ``m`` a graph input the engine fills from the
  host every step (``ort_trainer/dropout_masks.py``); runs before ``dropout_gradient``, whose
  backward forms it writes itself.
- ``seeded_dropout`` (a GPU's step that is captured, ``device.cuda_graph``, or whose sublayers
  ``layer_recompute`` copies; it runs before that pass): each training Dropout as one
  ``SeededDropout(x, seed)`` node of ort_trainer's kernel library, whose draws are a function of a
  seed input the engine writes every step (``DROPOUT_SEED_INPUT``), read on the device: a replayed
  CUDA graph draws new masks each step, where ONNX Runtime's Dropout would replay the same ones, and
  a recomputed copy draws the forward's masks again.

Each has a name under ``graph_optimizations`` and is checked against float64 PyTorch gradients
(``tests/test_joint_passes.py``, ``tests/test_rewrites.py``).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ...kernels import DOMAIN as KERNELS_DOMAIN, OPSET as KERNELS_OPSET
from ..names import KEEPER_SUFFIX
from ._graph import _Graph, _attrs, _elem_types, _import_domain, _is, _keep, _other, _sole_consumer


# ---- dropout_gradient ------------------------------------------------------------------------
def dropout_gradient(model: onnx.ModelProto) -> int:
    """The decomposed dropout backward ``Mul(g, Mul(Cast(mask), s))`` in fewer passes.

    Where the product feeds nothing but one multiplication with the Dropout's input ``x`` (an
    attention dropout followed by the softmax backward), ``Mul(Mul(g, cs), x)`` becomes ``Mul(g, y)``
    with ``y, mask = Dropout(x)``; the mask, read by nothing then, gets a no-op reader
    (``keep_dropouts``), else ONNX Runtime would drop the Dropout. Elsewhere the float mask scaled by
    ``s`` comes from ``DequantizeLinear(Cast(mask, uint8), s)``: one byte per element written by the
    Cast instead of four, and no separate pass for the scale (bit-equal).

    Returns:
        The number of Dropout backwards rewritten.
    """
    g = _Graph(model)
    types = _elem_types(model)
    dead: set[int] = set()
    count = 0
    zero_point = "ort_trainer/dropout_gradient/zero_point"
    for drop in [n for n in model.graph.node if _is(n, "Dropout")]:
        found = _match_dropout_backward(g, types, drop)
        if found is None:
            continue
        count += 1
        cast, scale_mul, grad_mul, through = found
        if through is not None:
            dead |= _gradient_times_output(found, drop)
            continue
        scale = _other(scale_mul, cast.output[0])
        next(a for a in cast.attribute if a.name == "to").i = TensorProto.UINT8
        scale_mul.op_type = "DequantizeLinear"
        scale_mul.input[:] = [cast.output[0], scale, zero_point]
        for info in model.graph.value_info:
            if info.name == cast.output[0]:
                info.type.tensor_type.elem_type = TensorProto.UINT8
    if count > len(dead) // 3 and zero_point not in g.initializers:
        model.graph.initializer.append(numpy_helper.from_array(np.array(0, np.uint8), zero_point))
    if dead:
        _keep(model, dead)
        keep_dropouts(model)
    return count


def _training_ratio(g: _Graph, drop: onnx.NodeProto) -> float | None:
    """The drop probability of a Dropout that always runs in training mode with a constant ratio;
    None for any other (one that may run in inference mode returns x itself, not mask · x · scale)."""
    if len(drop.input) < 3 or not drop.input[1] or not drop.input[2]:
        return None
    training, ratio = g.const(drop.input[2]), g.const(drop.input[1])
    if training is None or training.size != 1 or not bool(training.flat[0]) or ratio is None or ratio.size != 1:
        return None
    return float(ratio.flat[0])


def _gradient_times_output(found: tuple, drop: onnx.NodeProto) -> set[int]:
    """Rewrite the attention dropout's ``Mul(Mul(g, Cast(mask) · s), x)`` (``found``, from
    ``_match_dropout_backward``, with its last element) as ``Mul(g, y)``, ``y`` the Dropout's
    output; returns the ids of the nodes that become dead."""
    cast, scale_mul, grad_mul, through = found
    through.input[:] = [_other(grad_mul, scale_mul.output[0]), drop.output[0]]
    return {id(cast), id(scale_mul), id(grad_mul)}


def _match_dropout_backward(g: _Graph, types: dict[str, int], drop: onnx.NodeProto) -> tuple | None:
    """``(Cast, Mul(cast, s), Mul(g, cs), Mul(gin, x) or None)`` of the pattern at ``drop``, or None."""
    if len(drop.output) != 2 or not drop.output[1] or drop.output[1] in g.outputs:
        return None
    x, mask = drop.input[0], drop.output[1]
    ratio = _training_ratio(g, drop)
    if ratio is None:
        return None
    if types.get(x) != TensorProto.FLOAT or types.get(drop.output[0]) != TensorProto.FLOAT:
        return None
    cast = _sole_consumer(g, mask)
    if cast is None or not _is(cast, "Cast") or _attrs(cast).get("to") != TensorProto.FLOAT:
        return None
    scale_mul = _sole_consumer(g, cast.output[0])
    if scale_mul is None or not _is(scale_mul, "Mul"):
        return None
    scale = g.const(_other(scale_mul, cast.output[0]))
    if (scale is None or scale.shape != () or scale.dtype != np.float32
            or abs(float(scale) * (1.0 - ratio) - 1.0) > 1e-6):
        return None  # not this Dropout's 1 / (1 - ratio) as a float scalar
    grad_mul = _sole_consumer(g, scale_mul.output[0])
    if grad_mul is None or not _is(grad_mul, "Mul"):
        return cast, scale_mul, None, None
    through = _sole_consumer(g, grad_mul.output[0])
    grad = _other(grad_mul, scale_mul.output[0])
    shape = g.shapes.get(x)
    if (through is None or not _is(through, "Mul") or _other(through, grad_mul.output[0]) != x
            or shape is None or None in shape or g.shapes.get(grad) != shape or types.get(grad) != TensorProto.FLOAT):
        return cast, scale_mul, grad_mul, None  # g · y must have the shape and type of the product it replaces
    return cast, scale_mul, grad_mul, through


def keep_dropouts(model: onnx.ModelProto) -> int:
    """Give every training-mode Dropout whose mask nothing reads a reader: a ``Reshape`` of the mask
    (an alias: no copy) whose output nothing reads.

    ONNX Runtime builds without training code (1.31) remove a Dropout whose mask output is unused
    (``EliminateDropout``, which ignores ``training_mode`` there), so the step would silently train
    without that dropout: one after frozen layers (the backward never reads its mask), or one whose
    mask ``dropout_gradient`` no longer reads. ONNX Runtime keeps a node whose output is unused.

    Returns:
        The number of Dropouts given a reader.
    """
    graph = model.graph
    g = _Graph(model)
    shape_name = "ort_trainer/keep_dropout/shape"
    added: dict[int, list[onnx.NodeProto]] = {}
    for index, drop in enumerate(graph.node):
        if not _is(drop, "Dropout") or len(drop.input) < 3 or not drop.input[2]:
            continue  # without training_mode the Dropout is the identity, rightly removable
        training = g.const(drop.input[2])
        if training is not None and not bool(training.flat[0]):
            continue
        if len(drop.output) < 2 or not drop.output[1]:
            del drop.output[1:]
            drop.output.append(f"{drop.output[0]}/mask")
        mask = drop.output[1]
        if mask in g.outputs or g.consumers.get(mask):
            continue
        added[index] = [helper.make_node("Reshape", [mask, shape_name], [f"{mask}/kept"], name=mask + KEEPER_SUFFIX)]
    if not added:
        return 0
    nodes = []
    for index, node in enumerate(graph.node):
        nodes.append(node)
        nodes.extend(added.get(index, []))
    del graph.node[:]
    graph.node.extend(nodes)
    if shape_name not in g.initializers:
        graph.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), shape_name))
    return len(added)


#: metadata key of a graph whose Dropouts take their masks as inputs: JSON ``{input: drop probability}``
HOST_DROPOUT_MASKS = "ort_trainer.host_dropout_masks"

_MASK_INPUT = "ort_trainer/dropout_mask/"


def host_mask_inputs(model: onnx.ModelProto) -> dict[str, float]:
    """``{input name: drop probability}`` of the mask inputs ``host_dropout_masks`` gave ``model``."""
    entry = next((e.value for e in model.metadata_props if e.key == HOST_DROPOUT_MASKS), None)
    return json.loads(entry) if entry else {}


def host_dropout_masks(model: onnx.ModelProto) -> int:
    """Each training-mode float32 Dropout of a static shape as ``x · m``, ``m`` a graph input the
    engine fills every step with a scaled keep mask drawn on the host (``dropout_masks.draw``).

    ONNX Runtime's CPU Dropout draws one float per element from a Mersenne Twister on one thread:
    4.6 ns per element, 20-25 ms of the GPT-2-like and BERT-like steps (4.46 M elements each); the
    host draws 16-bit integers from NumPy's PCG64 at about 1.5 ns per element, mask included. The
    backward's ``g · (Cast(mask) · s)`` reads ``m`` directly, the attention dropout's ``g · y`` as
    ``dropout_gradient`` would write it; any other reader of the mask gets ``Cast(m, bool)``.
    The inputs and their drop probabilities are listed in the model's metadata under
    ``HOST_DROPOUT_MASKS``. Returns the number of Dropouts rewritten.
    """
    g = _Graph(model)
    types = _elem_types(model)
    dead: set[int] = set()
    replaced: dict[int, list[onnx.NodeProto]] = {}
    masks: dict[str, float] = {}
    for drop in [n for n in model.graph.node if _is(n, "Dropout")]:
        ratio = _training_ratio(g, drop)
        x, shape = drop.input[0], g.shapes.get(drop.input[0])
        if (ratio is None or not 0.0 <= ratio < 1.0 or types.get(x) != TensorProto.FLOAT
                or shape is None or not all(isinstance(d, int) and d > 0 for d in shape)):
            continue  # symbolic shapes: the engine could not size the mask before the run
        name = f"{_MASK_INPUT}{len(masks)}"
        masks[name] = ratio
        model.graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))
        nodes = [helper.make_node("Mul", [x, name], [drop.output[0]], name=f"{name}/apply")]
        mask = drop.output[1] if len(drop.output) > 1 else ""
        found = _match_dropout_backward(g, types, drop) if mask else None
        if found is not None and found[3] is not None:  # the attention dropout: g · y
            dead |= _gradient_times_output(found, drop)
        elif found is not None and found[1].output[0] not in g.outputs:  # g · (Cast(mask) · s) -> g · m
            cast, scale_mul = found[0], found[1]
            for reader in g.consumers.get(scale_mul.output[0], []):
                reader.input[:] = [name if i == scale_mul.output[0] else i for i in reader.input]
            dead |= {id(cast), id(scale_mul)}
        elif mask and (g.consumers.get(mask) or mask in g.outputs):
            nodes.append(helper.make_node("Cast", [name], [mask], to=TensorProto.BOOL, name=f"{name}/as_mask"))
        replaced[id(drop)] = nodes
        dead.add(id(drop))
    if not masks:
        return 0
    _keep(model, dead, after=replaced)
    model.metadata_props.append(onnx.StringStringEntryProto(key=HOST_DROPOUT_MASKS, value=json.dumps(masks)))
    return len(masks)


#: the int64 ``[1]`` input of a graph with ``SeededDropout`` nodes: the step's seed (``dropout_masks.py`` fills it)
DROPOUT_SEED_INPUT = "ort_trainer/dropout_seed"
_SEEDED_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)  # the kernel's x


def seeded_dropout(model: onnx.ModelProto) -> int:
    """Each training-mode Dropout of a constant ratio as ``SeededDropout(x, seed)`` (ort_trainer's kernel library):
    ONNX's Dropout whose draws are a function of ``seed`` (the graph input ``DROPOUT_SEED_INPUT``), the node's number
    (its attribute ``stream``, in graph order) and the element's index alone (Philox4x32-10, ``kernels/csrc/philox.h``).

    ONNX Runtime's CUDA Dropout passes its generator's seed and offset to the kernel it launches: a CUDA graph that
    captured that launch replays it with the same ones, the same mask every step. The kernel reads the seed from the
    device where the node runs, so a replay draws what the step's seed says. The outputs keep their names (the
    backward reads the mask as it read ONNX's); a mask nothing reads but a keeper (``keep_dropouts``) loses the
    keeper (ONNX Runtime keeps a custom node whose output is unread). Dropouts of other dtypes (float64) are left
    as they are. Returns the number of Dropouts rewritten.
    """
    g = _Graph(model)
    types = _elem_types(model)
    replaced: dict[int, list[onnx.NodeProto]] = {}
    dead: set[int] = set()
    for drop in [n for n in model.graph.node if _is(n, "Dropout")]:
        ratio = _training_ratio(g, drop)
        if ratio is None or not 0.0 < ratio < 1.0 or types.get(drop.input[0]) not in _SEEDED_TYPES:
            continue
        mask = drop.output[1] if len(drop.output) > 1 and drop.output[1] else f"{drop.output[0]}/mask"
        dead |= {id(n) for n in g.consumers.get(mask, []) if n.name.endswith(KEEPER_SUFFIX)}
        replaced[id(drop)] = [helper.make_node(
            "SeededDropout", [drop.input[0], DROPOUT_SEED_INPUT], [drop.output[0], mask], name=drop.name,
            domain=KERNELS_DOMAIN, ratio=ratio, stream=len(replaced))]
    if not replaced:
        return 0
    _import_domain(model, KERNELS_DOMAIN, KERNELS_OPSET)
    model.graph.input.append(helper.make_tensor_value_info(DROPOUT_SEED_INPUT, TensorProto.INT64, [1]))
    _keep(model, dead | set(replaced), before=replaced)
    return len(replaced)


__all__ = ["DROPOUT_SEED_INPUT", "HOST_DROPOUT_MASKS", "dropout_gradient", "host_dropout_masks", "host_mask_inputs",
           "keep_dropouts", "seeded_dropout"]
