"""``graph/export/program.py``: which weights the loss of a traced program reaches is found by running it on
its fake values with autograd on, and that run must leave the program's symbolic sizes as they are. torch 2.11's fake
tensors turned sizes into ints inside composite operators (``aten.linear`` of a slice, HF GPT-2's
``lm_head``), and each such guard fixed a symbolic dimension of the description to its traced size."""

import operator

import pytest
import torch

from ort_trainer.graph.export import program as traced_program


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.linear(x).sum()


def _sized(x):
    """An operator that reads its input's size as a Python int: on fake tensors, a guard on the symbol."""
    return x * int(x.shape[0])


@pytest.fixture
def program():
    batch = torch.export.Dim("batch", min=2)
    exported = torch.export.export(_Net(), (torch.randn(5, 4),), dynamic_shapes=({0: batch},))
    graph = exported.graph
    linear = next(n for n in graph.nodes if n.target == torch.ops.aten.linear.default)
    with graph.inserting_after(linear):
        sized = graph.call_function(_sized, (linear,))
    linear.replace_all_uses_with(sized, delete_user_cb=lambda user: user is not sized)
    sized.meta["val"] = linear.meta["val"]
    exported.graph_module.recompile()
    return exported


def test_finding_the_weights_the_loss_reaches_guards_on_no_symbol(program):
    x = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name == "x")
    symbol = x.meta["val"].shape[0]
    shape_env = symbol.node.shape_env
    replacements, guards = dict(shape_env.replacements), len(shape_env.guards)
    found = traced_program._weights_reached(program)
    assert {n.name for n in found} == {"p_linear_weight", "p_linear_bias"}  # the input requires no grad
    assert dict(shape_env.replacements) == replacements and len(shape_env.guards) == guards
    assert symbol.node.expr not in shape_env.replacements
    assert operator.index(symbol.node.hint) == 5  # the traced size, still a symbol in the program
