"""``nn.AdaptiveLogSoftmaxWithLoss`` without its Python branch on the batch's targets, on both routes.

PyTorch's forward selects each cluster's rows (``target_mask.nonzero()``) and skips a cluster no target falls in
(``if row_indices.numel() == 0: continue``), then checks that every row was used. The number of rows is read from
the data: ``torch.export`` stops at the branch ("Could not guard on data-dependent expression"), and the
TorchScript tracer would freeze the traced batch's outcome (a cluster empty in that batch skipped at every later
step, its rows' outputs left out). During the export (``guard.ExportGuard.watching``) the forward below computes
the same values without the branch: each cluster's tail for every row, the log-probability of a row's target taken
where the row's target is in that cluster (``where``), the head's target column chosen the same way, and the loss
``(-output).mean()``, PyTorch's arithmetic in PyTorch's order for every row it computes. The tails' products then
cover the rows of other clusters too: still low-rank (a tail is ``in_features / div_value^k`` wide), so a step stays
well below a full softmax's cost, and no tensor is ever empty (ONNX Runtime 1.19's Gemm refuses a product of zero
rows, as a cluster with no target in a batch would make). The check that every target is in ``[0, n_classes)`` is
not made per batch (a target outside picks a column outside the head, which the step refuses as an index out of
range).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.nn.modules.adaptive import _ASMoutput

from .trace_tools import methods_replaced


def forward(module: torch.nn.AdaptiveLogSoftmaxWithLoss, input_: torch.Tensor, target_: torch.Tensor) -> _ASMoutput:
    """``AdaptiveLogSoftmaxWithLoss.forward`` without a branch on the targets (module docstring)."""
    batched = target_.dim() > 0
    input = input_ if batched else input_.unsqueeze(0)
    target = target_ if batched else target_.unsqueeze(0)
    output = input.new_zeros(target.shape[0])
    gather_inds = target
    cutoffs = [0, *module.cutoffs]
    for cluster in range(1, len(cutoffs) - 1):
        low, high = cutoffs[cluster], cutoffs[cluster + 1]
        in_cluster = (target >= low) & (target < high)
        cluster_logprob = F.log_softmax(module.tail[cluster - 1](input), dim=1)
        local_logprob = cluster_logprob.gather(1, torch.where(in_cluster, target - low, 0).unsqueeze(1)).squeeze(1)
        output = torch.where(in_cluster, local_logprob, output)
        gather_inds = torch.where(in_cluster, module.shortlist_size + cluster - 1, gather_inds)
    head_logprob = F.log_softmax(module.head(input), dim=1)
    output = output + head_logprob.gather(1, gather_inds.unsqueeze(1)).squeeze(1)
    loss = (-output).mean()
    return _ASMoutput(output if batched else output.squeeze(0), loss)


@contextlib.contextmanager
def without_branches() -> Iterator[None]:
    """Around one trace: ``nn.AdaptiveLogSoftmaxWithLoss`` computes ``forward`` (on the tracing thread)."""
    with methods_replaced({torch.nn.AdaptiveLogSoftmaxWithLoss: {"forward": lambda _, *args: forward(*args)}}):
        yield


__all__ = ["forward", "without_branches"]
