"""Where a graph reads or writes elements at indices, and which values those indices may take.

torch refuses an index outside the dimension it selects from (``IndexError``: an embedding's
row, a class target of ``cross_entropy``, ``x[i]``, ``gather``); on the device the same index
would read another element, or none. Indices that come from a call's inputs, through views only,
are checked on the host before each call (``Program.index_inputs``); the rest are checked while
the program runs, where their values may leave the dimension (``integer_ranges``).
"""

from dataclasses import dataclass

import torch

aten = torch.ops.aten

HOST_CHECKED = "ipu_host_checked_indices"
"""``node.meta[HOST_CHECKED]``: the numbers (in :func:`index_uses` order) of the node's index
arguments the host checks before each call."""


@dataclass(frozen=True)
class IndexUse:
    """One index argument of an operation: its values must lie in ``[low, size)``."""

    index: object
    """The argument: a graph node, or the value given in its place (:func:`index_uses`)."""
    dim: int
    size: int
    low: int


_VIEWS = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
    aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.clone.default,
    aten.permute.default, aten.t.default, aten.slice.Tensor, aten.select.int, aten.expand.default,
    aten.alias.default, aten._to_copy.default,
})
"""Ops that pass index values through unchanged (between integer tensors: ``_to_copy`` from a
float rounds)."""

ROWS = frozenset({aten.embedding.default, aten._embedding_bag.default,
                   aten._embedding_bag_forward_only.default})
"""Lookups of rows of the first argument at the indices of the second."""
_ALONG_DIM = frozenset({aten.gather.default, aten.index_select.default, aten.scatter.src,
                        aten.scatter.value, aten.scatter_add.default, aten.scatter_reduce.two})
"""``op(x, dim, index, ...)``: indices into ``x``'s dimension ``dim``."""
_ADVANCED = frozenset({aten.index.Tensor, aten.index_put.default})
"""``x[i0, i1, ...]``: one index tensor (or None) per leading dimension; negative ones count
from the end, as in Python."""


def _shape(node) -> tuple | None:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _is_integer(arg) -> bool:
    """An integer tensor node, not a mask (bool, or uint8 as aten still takes masks)."""
    value = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    return (isinstance(value, torch.Tensor) and not value.dtype.is_floating_point
            and value.dtype not in (torch.bool, torch.uint8))


def index_uses(node: torch.fx.Node, values=None) -> list[IndexUse]:
    """The index arguments of ``node`` with the range each must lie in; none for other ops.
    ``values``: the arguments' values, laid out as ``node.args`` (a lowering's), to give in
    place of the graph's nodes."""
    if node.op != "call_function":
        return []
    target, args = node.target, node.args
    values = args if values is None else values
    shape = _shape(args[0]) if args else None
    if shape is None or any(not isinstance(size, int) for size in shape):
        return []
    if target in ROWS:
        return [IndexUse(values[1], 0, shape[0], 0)]
    if target in _ALONG_DIM and shape:
        dim = args[1] % len(shape)
        return [IndexUse(values[2], dim, shape[dim], 0)]
    if target in _ADVANCED:
        return [IndexUse(value, dim, shape[dim], -shape[dim])
                for dim, (index, value) in enumerate(zip(args[1], values[1]))
                if index is not None and _is_integer(index)]
    return []


def input_source(index) -> tuple[torch.fx.Node, object]:
    """The node ``index`` takes its values from through views, and the value a loss's target
    may hold to be ignored (``cross_entropy``'s ``ignore_index``: its decomposition picks
    ``where(target != ignore_index, target, 0)``), or None."""
    ignored = None
    while isinstance(index, torch.fx.Node):
        if index.target in _VIEWS and _is_integer(index) and _is_integer(index.args[0]):
            index = index.args[0]
        elif ignored is None and _ignoring(index):
            ignored = index.args[0].args[1]
            index = index.args[1]
        else:
            break
    return index, ignored


def _ignoring(node) -> bool:
    """``where(t != k, t, 0)``."""
    if node.target is not aten.where.self or not isinstance(node.args[0], torch.fx.Node):
        return False
    condition, kept, other = node.args
    zero = other == 0 if not isinstance(other, torch.fx.Node) else (
        other.target is aten.scalar_tensor.default and other.args[0] == 0)
    return (condition.target is aten.ne.Scalar and condition.args[0] is kept and zero
            and isinstance(condition.args[1], int))
