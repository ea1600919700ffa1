"""A Python number minus an integer or boolean tensor (``1.0 - mask``, as older Hugging Face models and
BigBird-Pegasus build their attention masks): torch's decomposition of ``rsub`` writes ``sub(1.0, mask)``,
which the exporter's type promotion could not dispatch once it had cast the mask
(``graph/gradient/promotion.py``'s ``_numbers_second``)."""

import pytest
import torch
import torch.nn.functional as F

from ort_trainer import _runtime
from models import sgd_steps_as_pytorch
from tolerances import steps_bound

pytestmark = pytest.mark.skipif(not _runtime.has_onnxscript(), reason="the 'torch' gradient source exports with "
                                "onnxscript")


class Masked(torch.nn.Module):
    """Features scaled by masks built from numbers and an integer or boolean mask (torch refuses a number minus a
    boolean tensor)."""

    def __init__(self):
        super().__init__()
        self.project, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)

    def forward(self, x, mask, y):
        flags = mask > 0
        h = self.project(x) * (1.0 - mask) + (2.5 + flags) * 0.1 + (3 - mask) * 0.01 + (0.5 * mask + 1.5 + flags)
        return F.cross_entropy(self.head(h), y)


def test_a_number_minus_an_integer_or_boolean_mask_trains_as_pytorch():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(6, 4, generator=generator), torch.randint(0, 2, (6, 4), generator=generator),
                torch.randint(0, 3, (6,), generator=generator)) for _ in range(3)]
    desc = {"inputs": [("x", ["b", 4]), ("mask", ["b", 4]), ("y", ["b"])], "outputs": [("loss", [], True)]}
    # float32 sums of at most 4 terms per step, carried through the weights
    sgd_steps_as_pytorch(Masked(), desc, batches, 0.1, lambda step: steps_bound(step + 1, length=4),
                         {"graph": {"gradient_source": "torch"}})
