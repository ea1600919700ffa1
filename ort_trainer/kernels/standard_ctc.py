"""CTC loss in standard ONNX operators: what ``save_as_onnx`` writes for a ``CTCLoss`` node of ort_trainer's torch
operators (``graph/export/ctc.py``, ``csrc/torch_ops.cc``), so that a stock ``InferenceSession`` runs the model.

The forward recursion of CTC (Graves et al., 2006) in log space, one ``Loop`` iteration per frame, as torch's CPU
kernel computes it: the extended target ``l'`` (a blank before, between and after the labels, ``L = 2·S + 1``
positions for the longest target ``S``), ``alpha_0 = log_probs[0, l'_0 and l'_1]``, and for each frame ``t``

    alpha_t[l] = logsumexp(alpha_{t-1}[l], alpha_{t-1}[l-1], alpha_{t-1}[l-2] where l'_l is no blank and differs
                 from l'_{l-2}) + log_probs[t, l'_l]

kept unchanged from a sequence's ``input_length`` on; the loss is ``-logsumexp(alpha[2·target_length],
alpha[2·target_length - 1])``. Targets are read as torch reads them: ``[batch, longest]`` rows (padded past each
target's length) or concatenated (each one after the previous ones' lengths). The node's ``blank`` attribute
is kept; ``zero_infinity`` only concerns the gradient.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from . import TORCH_OPS_DOMAIN


class _Nodes:
    """Nodes under construction, each one's output named ``prefix + name``."""

    def __init__(self, prefix: str):
        self.prefix, self.nodes = prefix, []

    def __call__(self, op: str, inputs: list[str], name: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op, inputs, [self.prefix + name], **attrs))
        return self.prefix + name

    def constant(self, name: str, value, dtype=np.int64) -> str:
        return self("Constant", [], name, value=numpy_helper.from_array(np.array(value, dtype=dtype)))

    def logsumexp(self, values: list[str], neg_inf: str, name: str) -> str:
        """log(sum(exp(v))) of same-shaped tensors, -inf where all are -inf (their maximum is taken out first)."""
        top = self("Max", values, name + "_max")
        zero = self("CastLike", [self.constant(name + "_zero", 0.0, np.float32), neg_inf], name + "_0")
        none = self("Equal", [top, neg_inf], name + "_none")
        safe = self("Where", [none, zero, top], name + "_shift")
        exps = [self("Exp", [self("Sub", [v, safe], f"{name}_d{i}")], f"{name}_e{i}") for i, v in enumerate(values)]
        total = self("Add", [safe, self("Log", [self("Sum", exps, name + "_sum")], name + "_log")], name + "_any")
        # (-inf written out: an Exp that clamps its input, ONNX Runtime 1.19's, gives the smallest normal number)
        return self("Where", [none, neg_inf, total], name)


def _body(prefix: str, emissions: str, none: str, skip: str, input_lengths: str, neg_inf: str,
          elem_type: int) -> onnx.GraphProto:
    """The loop's body: iteration i computes frame t = i + 1's alpha from alpha_{t-1} (outer values: the
    emissions [frames, batch, L], -inf [batch, L], the skip mask, the input lengths)."""
    n = _Nodes(prefix)
    one, axis1 = n.constant("1", 1), n.constant("axis1", [1])
    t = n("Add", [prefix + "i", one], "t")
    emitted = n("Gather", [emissions, t], "emitted", axis=0)
    alpha = prefix + "alpha_in"
    width = n("Shape", [alpha], "width")
    columns = n("Gather", [width, one], "columns")
    shifted = []
    for k in (1, 2):  # alpha_{t-1}[l-k]: -inf columns in front, the last k columns gone
        head = n("Slice", [none, n.constant(f"s{k}", [0]), n.constant(f"e{k}", [k]), axis1], f"pad{k}")
        tail = n("Slice", [alpha, n.constant(f"z{k}", [0]), n("Sub", [n("Unsqueeze", [columns, n.constant(
            f"ax{k}", [0])], f"cols{k}"), n.constant(f"k{k}", [k])], f"keep{k}"), axis1], f"tail{k}")
        shifted.append(n("Concat", [head, tail], f"shift{k}", axis=1))
    two_back = n("Where", [skip, shifted[1], none], "two_back")
    updated = n("Add", [n.logsumexp([alpha, shifted[0], two_back], neg_inf, "lse"), emitted], "updated")
    running = n("Unsqueeze", [n("Less", [t, input_lengths], "running_flat"), axis1], "running")
    n.nodes.append(helper.make_node("Where", [running, updated, alpha], [prefix + "alpha_out"]))
    n.nodes.append(helper.make_node("Identity", [prefix + "cond_in"], [prefix + "cond_out"]))
    return helper.make_graph(
        n.nodes, "ctc_frame",
        [helper.make_tensor_value_info(prefix + "i", TensorProto.INT64, []),
         helper.make_tensor_value_info(prefix + "cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info(prefix + "alpha_in", elem_type, ["batch", "L"])],
        [helper.make_tensor_value_info(prefix + "cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info(prefix + "alpha_out", elem_type, ["batch", "L"])])


def _nodes(node: onnx.NodeProto, elem_type: int) -> list[onnx.NodeProto]:
    """The standard nodes computing ``node``'s output (a ``CTCLoss`` of log-probabilities of the ONNX dtype
    ``elem_type``) from its inputs."""
    log_probs, targets, input_lengths, target_lengths = node.input
    blank = next((a.i for a in node.attribute if a.name == "blank"), 0)
    n = _Nodes(f"{node.output[0]}/ctc/")
    zero, one, two, minus_one = n.constant("0", 0), n.constant("1", 1), n.constant("2", 2), n.constant("-1", -1)
    axis0, axis1, axis2 = n.constant("axis0", [0]), n.constant("axis1", [1]), n.constant("axis2", [2])
    blank = n.constant("blank", blank)
    neg_inf = n("CastLike", [n.constant("-inf32", -np.inf, np.float32), log_probs], "-inf")
    shape = n("Shape", [log_probs], "shape")
    frames, batch = n("Gather", [shape, zero], "frames"), n("Gather", [shape, one], "batch")
    # each target's labels as a row of [batch, S]: padded rows as they are, concatenated ones from their start
    flat = n("Reshape", [targets, n.constant("flat", [-1])], "flat_targets")
    targets_shape = n("Shape", [targets], "targets_shape")
    padded = n("Equal", [n("Size", [targets_shape], "rank"), two], "padded")
    row = n("Gather", [targets_shape, minus_one], "row")  # (padded: a row's length)
    starts = n("Where", [padded, n("Mul", [n("Range", [zero, batch, one], "rows"), row], "row_starts"),
                         n("Sub", [n("CumSum", [target_lengths, zero], "ends"), target_lengths], "after")], "starts")
    longest = n("ReduceMax", [target_lengths], "longest", keepdims=0)
    positions = n("Range", [zero, longest, one], "positions")
    index = n("Add", [n("Unsqueeze", [starts, axis1], "start_column"), positions], "index")
    last = n("Max", [n("Sub", [n("Size", [flat], "count"), one], "last_"), zero], "last")
    index = n("Max", [n("Min", [index, last], "below_last"), zero], "clamped")
    valid = n("Less", [positions, n("Unsqueeze", [target_lengths, axis1], "length_column")], "valid")
    blanks = n("Expand", [blank, n("Shape", [index], "index_shape")], "blanks")
    labels = n("Where", [valid, n("Gather", [flat, index], "gathered"), blanks], "labels")
    # l': a blank before each label and one after the last, [batch, L = 2·S + 1]
    pairs = n("Concat", [n("Unsqueeze", [blanks, axis2], "blank_pairs"), n("Unsqueeze", [labels, axis2],
                                                                              "label_pairs")], "pairs", axis=2)
    batch_1 = n("Unsqueeze", [batch, axis0], "batch_1")
    interleaved = n("Reshape", [pairs, n("Concat", [batch_1, n("Unsqueeze", [n("Mul", [longest, two], "twice"),
                                                                             axis0], "twice_1")],
                                         "interleaved_shape", axis=0)], "interleaved")
    blank_column = n("Expand", [blank, n("Concat", [batch_1, n.constant("one_1", [1])], "column_shape", axis=0)],
                     "blank_column")
    extended = n("Concat", [interleaved, blank_column], "extended", axis=1)
    width = n("Shape", [extended], "width")
    columns = n("Gather", [width, one], "columns")
    emissions = n("GatherElements", [log_probs, n("Expand", [
        n("Unsqueeze", [extended, axis0], "extended_3d"),
        n("Concat", [n("Unsqueeze", [frames, axis0], "frames_1"), width], "emission_shape", axis=0)],
        "emission_index")], "emissions", axis=2)  # log_probs[t, n, l'_l]: [frames, batch, L]
    # l-2 -> l allowed where l'_l is no blank and differs from l'_{l-2}
    but_two = n("Slice", [extended, n.constant("from", [0]), n("Unsqueeze", [n("Sub", [columns, two], "L-2"), axis0],
                                                               "L-2_1"), axis1], "but_two")
    before = n("Concat", [blank_column, blank_column, but_two], "two_before", axis=1)
    skip = n("And", [n("Not", [n("Equal", [extended, blank], "is_blank")], "no_blank"),
                     n("Not", [n("Equal", [extended, before], "repeat")], "no_repeat")], "skip")
    none = n("Expand", [neg_inf, width], "none")  # -inf: [batch, L]
    starting = n("Less", [n("Range", [zero, columns, one], "ls"), two], "starting")
    alpha0 = n("Where", [starting, n("Gather", [emissions, zero], "first", axis=0), none], "alpha0")
    body = _body(f"{n.prefix}body/", emissions, none, skip, input_lengths, neg_inf, elem_type)
    alpha = n("Loop", [n("Sub", [frames, one], "steps"), "", alpha0], "alpha", body=body)
    # -logsumexp(alpha[2·length], alpha[2·length - 1]), the second only for a target that is not empty
    end = n("Unsqueeze", [n("Mul", [target_lengths, two], "end_flat"), axis1], "end")
    at_end = n("GatherElements", [alpha, end], "at_end", axis=1)
    at_before = n("GatherElements", [alpha, n("Max", [n("Sub", [end, one], "end-1"), zero], "before_end")],
                  "at_before_any", axis=1)
    at_before = n("Where", [n("Greater", [end, zero], "nonempty"), at_before,
                            n("Expand", [neg_inf, n("Shape", [end], "end_shape")], "none_end")], "at_before")
    total = n.logsumexp([at_end, at_before], neg_inf, "total")
    n.nodes.append(helper.make_node("Neg", [n("Squeeze", [total, axis1], "total_flat")], [node.output[0]]))
    return n.nodes


def standard_ctc(nodes: list[onnx.NodeProto], types: dict[str, int]) -> list[onnx.NodeProto]:
    """``nodes`` with each ``CTCLoss`` of ort_trainer's torch operators written in standard operators; ``types``:
    the ONNX dtype of values by name (a log-probabilities' missing: float32)."""
    out = []
    for node in nodes:
        if node.domain == TORCH_OPS_DOMAIN and node.op_type == "CTCLoss":
            out.extend(_nodes(node, types.get(node.input[0], TensorProto.FLOAT)))
        else:
            out.append(node)
    return out


__all__ = ["standard_ctc"]
