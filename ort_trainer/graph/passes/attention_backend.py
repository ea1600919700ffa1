"""``torch_attention_choice``: on CUDA, each fused attention runs the kernel torch's own attention would pick.

``fused_attention``'s nodes run torch's memory-efficient kernel on CUDA (``kernels/csrc/torch_ops.cc``): it takes
any bias and every dtype. Where torch's ``scaled_dot_product_attention`` would run another one for the same tensors
(its ``_fused_sdp_choice``: on Hopper cuDNN's attention, or flash attention, which takes no bias), the attribute
``backend`` 1 set here has the nodes run that one, forward and backward; where the choice is neither, the
memory-efficient kernel as before. The same values to the kernels' rounding (each sums the same terms in blocks of
its own). The CPU's nodes run torch's CPU flash attention either way.
"""

from __future__ import annotations

import onnx
from onnx import helper

from ...kernels import TORCH_OPS_DOMAIN


def torch_attention_choice(model: onnx.ModelProto) -> int:
    """Set the attribute ``backend`` 1 on each fused attention node (forward and backward); returns how many."""
    count = 0
    for node in model.graph.node:
        if node.domain != TORCH_OPS_DOMAIN or "Attention" not in node.op_type:
            continue
        kept = [a for a in node.attribute if a.name != "backend"]
        del node.attribute[:]
        node.attribute.extend([*kept, helper.make_attribute("backend", 1)])
        count += 1
    return count


__all__ = ["torch_attention_choice"]
