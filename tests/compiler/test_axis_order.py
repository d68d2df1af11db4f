"""Axes: a tensor described as the atoms of an earlier one, through views and permutes.

Each chain is applied to an ``arange`` with numpy and mirrored on :class:`Axes`; the one
transpose ``arranged`` builds from the description must give the same array. The lowerings
that use it (mm/addmm/bmm reordering their rows) are checked against torch in test_ops_linalg.
"""

import jax
import numpy as np
import pytest
import torch

from ipu_backend.compiler import axis_order
from ipu_backend.compiler.axis_order import Axes

# (source shape, steps): ("p", perm) permutes, ("r", shape) reshapes row-major.
CHAINS = [
    ((2, 3), [("p", (1, 0))]),
    ((16, 4, 8, 6), [("p", (2, 0, 1, 3)), ("r", (128, 24))]),                  # attention rows
    ((8, 2, 12), [("r", (8, 2, 3, 4)), ("p", (2, 1, 0, 3)), ("r", (3, 16, 4))]),
    ((6, 4, 5), [("p", (1, 0, 2)), ("r", (24, 5)), ("r", (2, 2, 6, 5)), ("p", (2, 0, 1, 3))]),
    ((1, 6, 1, 4), [("p", (3, 1, 0, 2)), ("r", (2, 2, 6)), ("p", (2, 1, 0))]),  # size-1 dims
    ((4, 6), [("r", (2, 12)), ("p", (1, 0)), ("r", (6, 2, 2)), ("p", (0, 2, 1))]),
]


def _mirror(shape, steps):
    expected = np.arange(int(np.prod(shape))).reshape(shape)
    axes = Axes.of_shape(shape)
    for kind, arg in steps:
        expected = np.transpose(expected, arg) if kind == "p" else np.reshape(expected, arg)
        axes = axes.permuted(arg) if kind == "p" else axes.reshaped(arg)
        assert axes is not None
    return expected, axes


@pytest.mark.parametrize("shape,steps", CHAINS, ids=str)
def test_arranged_equals_the_chain(shape, steps):
    expected, axes = _mirror(shape, steps)
    source = np.arange(int(np.prod(shape))).reshape(shape)
    actual = axis_order.arranged(source, axes, axis_order.flat(axes.dims), expected.shape)
    np.testing.assert_array_equal(np.asarray(actual), expected)


def test_refined_axes_still_describe_the_tensor():
    """Splitting an atom later (a view after a product) refines the earlier description."""
    _, rows = _mirror((6, 4, 5), [("p", (1, 0, 2)), ("r", (24, 5))])
    later = rows.reshaped((2, 2, 6, 5))
    refined = rows.refined_as(later)
    assert len(refined.dims[0]) == 3
    source = np.arange(120).reshape(6, 4, 5)
    actual = axis_order.arranged(source, refined, axis_order.flat(refined.dims), (24, 5))
    np.testing.assert_array_equal(np.asarray(actual), source.transpose(1, 0, 2).reshape(24, 5))


def test_uneven_split_is_not_described():
    """(2, 3) transposed then viewed (2, 3) would cut the size-3 atom in two: no description."""
    axes = Axes.of_shape((2, 3)).permuted((1, 0)).reshaped((6,))
    assert axes.reshaped((2, 3)) is None


class _Chain(torch.nn.Module):
    def forward(self, x, y):
        return x.permute(2, 0, 1).reshape(4, 6), y.reshape(4, 6)


def test_traced_back_follows_the_views_to_a_held_source():
    graph = torch.export.export(_Chain(), (torch.zeros(2, 3, 4), torch.zeros(2, 3, 4))) \
        .run_decompositions().graph_module.graph
    x, y = [n for n in graph.nodes if n.op == "placeholder"]
    outputs = next(n for n in graph.nodes if n.op == "output").args[0]
    values = {x: jax.numpy.arange(24).reshape(2, 3, 4), y: jax.numpy.arange(24).reshape(2, 3, 4)}
    source, axes = axis_order.traced_back(outputs[0], values.get)
    assert source is values[x]
    np.testing.assert_array_equal(
        np.asarray(axis_order.arranged(source, axes, axis_order.flat(axes.dims), (4, 6))),
        np.arange(24).reshape(2, 3, 4).transpose(2, 0, 1).reshape(4, 6))
    assert axis_order.traced_back(outputs[1], values.get) is None      # no permute: nothing to gain
    assert axis_order.traced_back(outputs[0], {}.get) is None          # source not held
