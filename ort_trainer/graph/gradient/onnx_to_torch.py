"""An ONNX model with its loss inside, as a ``torch.nn.Module`` that PyTorch's autograd can train.

ONNX-model input takes the same route as a torch model on the current runtime (``torch.export``,
PyTorch's autograd): ``onnx_to_module`` turns the ``onnx.ModelProto`` into a module whose forward
runs the graph node by node in torch operations. The operators are onnx2fx's (``pip install
onnx2fx``, an ONNX-to-PyTorch converter): each node is handed to onnx2fx's handler for it, with a
builder that runs the handler's torch calls at once instead of recording them into an FX graph.
Added here, for training:

* Dropout, BatchNormalization and SoftmaxCrossEntropyLoss as training runs them
  (``onnx_training_ops.py``), registered through onnx2fx's ``register_op`` on a private domain, so
  onnx2fx's own (inference) handlers stay as they are for everyone else.
* Shape arithmetic on the sizes themselves (``onnx_sizes.py``), as numpy arrays of Python ints or
  ``torch.SymInt``: onnx2fx computes ``Shape -> Gather -> Concat -> Reshape`` on int64 tensors,
  whose values ``torch.export`` cannot read. Other nodes computing from known integers only (the
  pads of Pad, as exporters write ``F.pad``) run in ONNX's reference implementation; known numbers
  a handler needs as a tensor become real tensors, which ``torch.export`` keeps as constants it can
  read.

Parameters are the model's float initializers, at their initializer names where those are dotted
words (``mlp.layers.0.weight``, as torch names parameters), so a ``state_dict`` keeps the ONNX
names; BatchNormalization running statistics are buffers the forward updates in training mode, as
``torch.nn.BatchNorm`` does; every other initializer and Constant is a constant. In ``eval()`` mode
Dropout is the identity and BatchNormalization uses the running statistics, whatever the graph's
``training_mode``.
"""

from __future__ import annotations

import heapq
import re
from typing import Any, Callable

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..._logging import logger
from ...model_desc import ModelDescription, parse_model_desc
from .onnx_sizes import NotStatic, SIZE_OPS, STATIC_LIMIT, STATIC_OPS, StaticValue, TORCH_DTYPES
from .onnx_training_ops import CONVERTER, TRAINING_DOMAIN, UnsupportedOnnxOperatorError, _INSTALL_HINT, register

_TRAINING_OPS = ("Dropout", "BatchNormalization", "SoftmaxCrossEntropyLoss")
_CONTROL_FLOW = ("If", "Loop", "Scan", "SequenceMap")  # onnx2fx builds these from FX subgraphs
_RANDOM_OPS = ("RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli", "Multinomial")
_FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
                onnx.TensorProto.BFLOAT16}


def onnx_to_module(model: onnx.ModelProto, desc: ModelDescription | dict) -> tuple[OnnxModule, dict[str, list[str]]]:
    """Turn an ONNX model whose graph computes the loss into an equivalent ``torch.nn.Module``.

    Args:
        model: the ONNX model (e.g. a ``torch.onnx.export(..., dynamo=False, training=TRAINING)``
            of a module that returns its loss). Not modified.
        desc: the model description: its inputs are the model's graph inputs (any order), its
            outputs a subset of the graph outputs, the loss among them.

    Returns:
        ``(module, torch_keys)``: ``module(*inputs)`` takes the description's inputs in order (or by
        name) and returns a tuple of the description's outputs in order; ``torch_keys`` maps every
        float initializer to ``[its module state_dict key]`` (the initializer name itself when its
        dotted parts are word characters, as torch's parameter names are).

    Raises:
        ImportError: when onnx2fx is not installed (the message says what to install).
        UnsupportedOnnxOperatorError: when the graph uses operators neither onnx2fx nor this module
            covers; the message names each with its nodes and the runtime that trains them.
        ValueError: when the description does not match the model's inputs and outputs.
    """
    desc = parse_model_desc(desc)
    _require_converter()
    _check_io(model, desc)
    unsupported = unsupported_operators(model)
    if unsupported:
        raise UnsupportedOnnxOperatorError(unsupported)
    module = OnnxModule(model, desc)
    logger.info("converted the ONNX model (%d nodes) to a torch module with %s: %d parameters, %d buffers",
                len(model.graph.node), CONVERTER, len(list(module.parameters())), len(list(module.buffers())))
    return module, dict(module.torch_keys)


def unsupported_operators(model: onnx.ModelProto) -> dict[tuple[str, str], list[str]]:
    """The graph's operators that ``onnx_to_module`` cannot convert.

    Args:
        model: the ONNX model.

    Returns:
        ``{(domain, op_type): [node names]}``, empty when every operator is covered.

    Raises:
        ImportError: when onnx2fx is not installed.
    """
    _require_converter()
    import onnx2fx

    opsets = _opsets(model)
    found: dict[tuple[str, str], list[str]] = {}
    for index, node in enumerate(model.graph.node):
        domain = _domain(node)
        covered = (node.op_type == "Constant" and domain == ""
                   or node.op_type not in _CONTROL_FLOW
                   and onnx2fx.is_supported(node.op_type, _dispatch_domain(node), opsets.get(domain, 1)))
        if not covered:
            found.setdefault((domain, node.op_type), []).append(node.name or f"#{index}")
    return found


def _require_converter() -> None:
    try:
        import onnx2fx  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            f"training an ONNX model on the current ONNX Runtime converts it to PyTorch with {CONVERTER}, which is "
            f"not installed: pip install {CONVERTER} (or pass a torch.nn.Module; or install the training runtime, "
            f"whose gradient builder takes ONNX models directly: {_INSTALL_HINT})") from exc
    register()


def _check_io(model: onnx.ModelProto, desc: ModelDescription) -> None:
    initializers = {i.name for i in model.graph.initializer}
    graph_inputs = [i.name for i in model.graph.input if i.name not in initializers]
    graph_outputs = [o.name for o in model.graph.output]
    problems = [f"model_desc input {n!r} is not an input of the ONNX model (inputs: {graph_inputs})"
                for n in desc.input_names if n not in graph_inputs]
    problems += [f"the ONNX model's input {n!r} is missing from model_desc.inputs"
                 for n in graph_inputs if n not in desc.input_names]
    problems += [f"model_desc output {n!r} is not an output of the ONNX model (outputs: {graph_outputs})"
                 for n in desc.output_names if n not in graph_outputs]
    if problems:
        raise ValueError("the ONNX model does not match the model description:\n  " + "\n  ".join(problems))


def _domain(node: onnx.NodeProto) -> str:
    return "" if node.domain in ("", "ai.onnx") else node.domain


def _dispatch_domain(node: onnx.NodeProto) -> str:
    domain = _domain(node)
    return TRAINING_DOMAIN if domain == "" and node.op_type in _TRAINING_OPS else domain


def _opsets(model: onnx.ModelProto) -> dict[str, int]:
    opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}
    opsets[TRAINING_DOMAIN] = opsets.get("", 1)
    return opsets


class Builder:
    """What onnx2fx's handlers use of its GraphBuilder, running their torch calls at once.

    ``get_value`` gives tensors (a static value becomes one), ``call_function`` calls; the training
    handlers of this module also read ``static``, ``training`` and ``is_buffer``.
    """

    def __init__(self, module: OnnxModule, values: dict[str, Any]):
        self._module = module
        self._values = values
        self._tensors: dict[str, torch.Tensor] = {}
        self.env: dict[str, Any] = {}  # handlers of multi-output nodes also write their outputs here
        self.model = module._model
        self.initializer_map = module._initializer_map
        self._opset_versions = module._opset_versions
        self.opset_version = module._opset_versions.get("", 1)
        self.training = module.training

    def get_opset_version(self, domain: str = "") -> int:
        return self._opset_versions.get(domain, 1)

    def get_value(self, name: str) -> Any:
        value = self._values[name]
        if not isinstance(value, StaticValue):
            return value
        if name not in self._tensors:
            self._tensors[name] = self._module._tensor(value)
        return self._tensors[name]

    def has_value(self, name: str) -> bool:
        return name in self._values

    def static(self, name: str) -> StaticValue | None:
        value = self._values.get(name) if name else None
        return value if isinstance(value, StaticValue) else None

    def is_buffer(self, name: str) -> bool:
        return name in self._module._buffer_inputs

    def call_function(self, function: Callable, args: Any = (), kwargs: dict | None = None) -> Any:
        return function(*args, **(kwargs or {}))

    def load_tensor(self, tensor: onnx.TensorProto) -> torch.Tensor:
        return _to_torch(numpy_helper.to_array(tensor), tensor.data_type)

    def is_optional_type(self, name: str) -> bool:
        return any(v.name == name and v.type.HasField("optional_type")
                   for v in [*self.model.graph.input, *self.model.graph.value_info, *self.model.graph.output])


class OnnxModule(torch.nn.Module):
    """An ONNX graph run node by node in torch operations (see the module docstring).

    Built by ``onnx_to_module``. ``forward(*inputs, **named_inputs)`` takes the description's inputs
    and returns the tuple of its outputs. ``torch_keys`` maps each float initializer to its
    ``state_dict`` key.
    """

    def __init__(self, model: onnx.ModelProto, desc: ModelDescription):
        super().__init__()
        register()
        self._model = _without_initializers(model)
        self._input_names = list(desc.input_names)
        self._output_names = list(desc.output_names)
        self._opset_versions = _opsets(model)
        self._constant_holder = torch.nn.Module()  # constants, as plain tensor attributes (not state)
        self._statics: dict[str, StaticValue] = {}
        self._tensor_constants: dict[str, str] = {}  # value name -> attribute of _constant_holder
        self._initializer_map: dict[str, torch.Tensor] = {}  # constants, for handlers' attribute-like inputs
        self._weight_paths: dict[str, str] = {}
        self._buffer_inputs = _running_statistics(model)
        self._steps: list[onnx.NodeProto] = []
        self._handlers: dict[tuple, Callable | None] = {}  # (domain, op) -> onnx2fx handler; not pickled
        self._evaluators: dict[tuple, Any] = {}  # node outputs -> onnx.reference evaluator; not pickled
        self.torch_keys: dict[str, list[str]] = {}

        for initializer in model.graph.initializer:
            array = numpy_helper.to_array(initializer)
            tensor = _to_torch(array, initializer.data_type)
            if initializer.data_type in _FLOAT_TYPES:
                key = self._install(initializer.name, tensor, buffer=initializer.name in self._buffer_inputs)
                self.torch_keys[initializer.name] = [key]
                self._weight_paths[initializer.name] = key
            else:
                self._add_constant(initializer.name, array, tensor)
        graph = self._model.graph
        nodes = _topological_order(graph, set(self._input_names) | {i.name for i in model.graph.initializer})
        for node in nodes:
            if node.op_type == "Constant" and _domain(node) == "":
                array = _constant_value(node)
                self._add_constant(node.output[0], array, _to_torch(array, None))
        self._steps = [n for n in _needed(nodes, self._output_names)
                       if not (n.op_type == "Constant" and _domain(n) == "")]

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()  # onnx2fx's handlers are closures: looked up again after unpickling
        state["_handlers"], state["_evaluators"] = {}, {}
        return state

    # ---- construction ---------------------------------------------------------------------------
    def _install(self, name: str, tensor: torch.Tensor, buffer: bool) -> str:
        """Register a weight at ``name``, with submodules for its dotted parts (``layers.0.fc.weight``,
        as torch names them), or at a sanitised top-level name when the parts are not all word
        characters or the path is taken; returns the state_dict key."""
        parts = name.split(".")
        owner: torch.nn.Module | None = self
        if all(re.fullmatch(r"\w+", p) for p in parts):
            for part in parts[:-1]:
                child = getattr(owner, part, None)
                if child is None:
                    child = torch.nn.Module()
                    owner.add_module(part, child)
                if not isinstance(child, torch.nn.Module) or child is self._constant_holder:
                    owner = None
                    break
                owner = child
            if owner is not None and hasattr(owner, parts[-1]):
                owner = None
        else:
            owner = None
        if owner is None:
            owner, parts = self, [re.sub(r"\W", "_", name)]
            if not parts[0].isidentifier():
                parts[0] = "_" + parts[0]
            while hasattr(self, parts[0]):
                parts[0] += "_"
        if buffer:
            owner.register_buffer(parts[-1], tensor)
        else:
            owner.register_parameter(parts[-1], torch.nn.Parameter(tensor))
        return ".".join(parts)

    def _add_constant(self, name: str, array: np.ndarray, tensor: torch.Tensor) -> None:
        attr = f"c{len(self._tensor_constants)}"
        setattr(self._constant_holder, attr, tensor)
        self._tensor_constants[name] = attr
        self._initializer_map[name] = tensor
        if array.size <= STATIC_LIMIT and array.dtype in TORCH_DTYPES:
            self._statics[name] = StaticValue(array, array.dtype, attr)

    # ---- running --------------------------------------------------------------------------------
    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Run the graph; returns the description's outputs in order."""
        values: dict[str, Any] = dict(self._bind(args, kwargs))
        for name, attr in self._tensor_constants.items():
            values[name] = self._statics.get(name) or getattr(self._constant_holder, attr)
        for name, path in self._weight_paths.items():
            values[name] = self.get_parameter(path) if name not in self._buffer_inputs else self.get_buffer(path)
        builder = Builder(self, values)
        for node in self._steps:
            outputs = self._run(node, values, builder)
            for name, value in zip(node.output, outputs):
                if name:
                    values[name] = value
        return tuple(self._tensor(values[n]) if isinstance(values[n], StaticValue) else values[n]
                     for n in self._output_names)

    def _bind(self, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
        if len(args) > len(self._input_names):
            raise TypeError(f"expected at most {len(self._input_names)} inputs {self._input_names}, got {len(args)}")
        bound = dict(zip(self._input_names, args))
        unknown = [n for n in kwargs if n not in self._input_names or n in bound]
        missing = [n for n in self._input_names if n not in bound and n not in kwargs]
        if unknown or missing:
            raise TypeError(f"inputs are {self._input_names}: unknown or repeated {unknown}, missing {missing}")
        bound.update(kwargs)
        return bound

    def _tensor(self, value: StaticValue) -> torch.Tensor:
        """A static value as a tensor: a constant's own attribute; known numbers as a real tensor even
        while torch.export traces (its fake tensors hide values from handlers that read them, like
        the pads of Pad); sizes with SymInts as a tensor computed from them."""
        if value.attr is not None:
            return getattr(self._constant_holder, value.attr)
        dtype = TORCH_DTYPES[value.dtype]
        if value.symbolic:
            return torch.tensor(value.array.tolist(), dtype=dtype)
        with unset_fake_temporarily():
            return torch.tensor(value.array.tolist(), dtype=dtype)

    def _evaluate(self, node: onnx.NodeProto, inputs: list) -> list:
        """Run one node on known numbers with ONNX's reference implementation (numpy)."""
        from onnx.reference import ReferenceEvaluator

        key = tuple(node.output)
        if key not in self._evaluators:
            named = onnx.NodeProto()
            named.CopyFrom(node)
            named.input[:] = [f"in{i}" if n else "" for i, n in enumerate(node.input)]
            named.output[:] = [f"out{i}" if n else "" for i, n in enumerate(node.output)]
            self._evaluators[key] = ReferenceEvaluator(named, opsets={"": self._opset_versions.get("", 1)})
        feeds = {f"in{i}": v.array for i, v in enumerate(inputs) if v is not None}
        results = self._evaluators[key].run(None, feeds)
        outputs = iter(results)
        return [StaticValue(a, a.dtype) if a.size <= STATIC_LIMIT and a.dtype in TORCH_DTYPES
                else torch.from_numpy(np.array(a, copy=True))
                for a in (next(outputs) if n else None for n in node.output)]

    def _handler(self, node: onnx.NodeProto) -> Callable | None:
        import onnx2fx.op_registry

        key = (_dispatch_domain(node), node.op_type)
        if key not in self._handlers:
            self._handlers[key] = onnx2fx.op_registry.get_handler(node.op_type, key[0],
                                                                  self._opset_versions.get(key[0], 1))
        return self._handlers[key]

    def _run(self, node: onnx.NodeProto, values: dict, builder: Builder) -> list:
        inputs = [values[n] if n else None for n in node.input]
        if _domain(node) == "":
            if node.op_type in STATIC_OPS and all(v is None or isinstance(v, StaticValue) for v in inputs):
                try:
                    return [STATIC_OPS[node.op_type](node, inputs)]
                except NotStatic:
                    pass
            if node.op_type in SIZE_OPS:
                try:
                    return [SIZE_OPS[node.op_type](node, inputs, self._tensor)]
                except NotStatic:
                    pass
            if _integer_constants(node, inputs):
                try:
                    return self._evaluate(node, inputs)
                except Exception as exc:  # onnx.reference lacks some cases (GatherElements, > 64 rows)
                    logger.debug("%s %r runs on tensors: onnx.reference failed (%s)", node.op_type, node.name, exc)
        handler = self._handler(node)
        if handler is None:  # checked by onnx_to_module; reached only by a module built by hand
            raise UnsupportedOnnxOperatorError({(_domain(node), node.op_type): [node.name]})
        result = handler(builder, node)
        if len(node.output) == 1:
            return [result]
        return [result[i] if isinstance(result, (tuple, list)) else result for i in range(len(node.output))]


def _without_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of the model's graph structure (nodes, inputs, outputs), without the weights."""
    graph = onnx.GraphProto(name=model.graph.name, node=model.graph.node, input=model.graph.input,
                            output=model.graph.output, value_info=model.graph.value_info)
    return onnx.ModelProto(ir_version=model.ir_version, opset_import=model.opset_import, graph=graph)


def _to_torch(array: np.ndarray, data_type: int | None) -> torch.Tensor:
    if data_type == onnx.TensorProto.BFLOAT16:  # numpy has no bfloat16 torch can read
        return torch.from_numpy(array.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.array(array, copy=True))


def _integer_constants(node: onnx.NodeProto, inputs: list) -> bool:
    """Whether the node computes from known integers only (index and size arithmetic the shape
    arithmetic does not cover, e.g. the pads of Pad as exporters write them)."""
    present = [v for v in inputs if v is not None]
    return (bool(present) and node.op_type not in _TRAINING_OPS and node.op_type not in _RANDOM_OPS
            and all(isinstance(v, StaticValue) and not v.symbolic and v.dtype.kind in "biu" for v in present))


def _running_statistics(model: onnx.ModelProto) -> set[str]:
    """Float initializers read only as BatchNormalization running mean/variance: buffers, not weights."""
    initializers = {i.name for i in model.graph.initializer if i.data_type in _FLOAT_TYPES}
    statistics, other = set(), set()
    for node in model.graph.node:
        for index, name in enumerate(node.input):
            if name in initializers:
                is_statistic = node.op_type == "BatchNormalization" and _domain(node) == "" and index in (3, 4)
                (statistics if is_statistic else other).add(name)
    return statistics - other


def _constant_value(node: onnx.NodeProto) -> np.ndarray:
    for attribute in node.attribute:
        value = onnx.helper.get_attribute_value(attribute)
        if attribute.name == "value":
            return numpy_helper.to_array(value)
        if attribute.name in ("value_float", "value_floats"):
            return np.asarray(value, dtype=np.float32)
        if attribute.name in ("value_int", "value_ints"):
            return np.asarray(value, dtype=np.int64)
    raise UnsupportedOnnxOperatorError({("", "Constant"): [f"{node.name} (attribute {node.attribute[0].name})"]})


def _topological_order(graph: onnx.GraphProto, available: set[str]) -> list[onnx.NodeProto]:
    """The nodes in an order that computes every input before its use, as close to the graph's own
    order as it allows (random operators then draw in the order of the model they came from)."""
    available = set(available) | {""}
    waiting = {}
    consumers: dict[str, list[int]] = {}
    ready: list[int] = []
    for index, node in enumerate(graph.node):
        missing = {n for n in node.input if n not in available}
        waiting[index] = missing
        for name in missing:
            consumers.setdefault(name, []).append(index)
        if not missing:
            ready.append(index)
    order = []
    while ready:
        index = heapq.heappop(ready)
        order.append(graph.node[index])
        for name in graph.node[index].output:
            for consumer in consumers.pop(name, []):
                waiting[consumer].discard(name)
                if not waiting[consumer]:
                    heapq.heappush(ready, consumer)
    if len(order) != len(graph.node):
        stuck = [graph.node[i].name or graph.node[i].op_type for i, m in waiting.items() if m][:5]
        raise ValueError(f"the ONNX graph has a cycle or reads values nothing computes (at nodes {stuck})")
    return order


def _needed(nodes: list[onnx.NodeProto], outputs: list[str]) -> list[onnx.NodeProto]:
    """The nodes the outputs depend on, in the given order."""
    wanted = set(outputs)
    kept = []
    for node in reversed(nodes):
        if any(o in wanted for o in node.output if o):
            kept.append(node)
            wanted.update(node.input)
    return kept[::-1]


__all__ = ["OnnxModule", "TRAINING_DOMAIN", "UnsupportedOnnxOperatorError", "onnx_to_module",
           "unsupported_operators"]
