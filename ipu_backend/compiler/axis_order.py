"""Which axes of an earlier tensor a tensor's dims are, through views and permutes.

torch lays a tensor out again at each ``permute`` a kernel needs contiguous (MultiheadAttention
with ``batch_first`` turns its input sequence-first, then its output batch-first again). A
matrix product that knows its operand is the rows of an earlier tensor, taken in another order,
can multiply that tensor's rows in the order that suits the program and reorder the product,
so that XLA cancels the reorderings instead of copying the data back and forth.

A tensor is described by :class:`Axes`: the source tensor split row-major into *atoms* (a
refinement of its shape; size-1 axes are dropped), and each dim of the tensor as the atoms it
spans, outermost first. Atom keys are tuples that sort in the source's row-major order; an atom
split in two becomes ``key + (0,)`` (outer) and ``key + (1,)`` (inner).
"""

import math
from dataclasses import dataclass

import jax.numpy as jnp
import torch

aten = torch.ops.aten

_RESHAPES = (aten.view.default, aten.squeeze.dims, aten.unsqueeze.default)
_ALIASES = (aten.clone.default, aten.alias.default)


@dataclass(frozen=True)
class Axes:
    sizes: tuple          # ((atom key, size), ...) for every atom of the source
    dims: tuple           # per dim, the atom keys it spans, outermost first

    @classmethod
    def of_shape(cls, shape) -> "Axes":
        sizes = tuple(((i,), n) for i, n in enumerate(shape) if n != 1)
        return cls(sizes, tuple(((i,),) if n != 1 else () for i, n in enumerate(shape)))

    def size(self, key) -> int:
        return dict(self.sizes)[key]

    def source_order(self) -> list:
        """The atoms the dims span, in the source's row-major order."""
        return sorted(key for dim in self.dims for key in dim)

    def permuted(self, perm) -> "Axes":
        return Axes(self.sizes, tuple(self.dims[p % len(self.dims)] for p in perm))

    def reshaped(self, shape) -> "Axes | None":
        """The row-major reshape to ``shape``, splitting atoms where a new dim ends inside one;
        None where an atom would have to be split unevenly."""
        sizes = dict(self.sizes)
        pending = [key for dim in self.dims for key in dim]
        dims = []
        for wanted in shape:
            spans = []
            while wanted > 1:
                if not pending:
                    return None
                key = pending.pop(0)
                size = sizes[key]
                if size <= wanted:
                    if wanted % size:
                        return None
                    spans.append(key)
                    wanted //= size
                    continue
                if size % wanted:
                    return None
                outer, inner = key + (0,), key + (1,)
                del sizes[key]
                sizes[outer], sizes[inner] = wanted, size // wanted
                spans.append(outer)
                pending.insert(0, inner)
                wanted = 1
            dims.append(tuple(spans))
        if pending:
            return None
        return Axes(tuple(sizes.items()), tuple(dims))

    def refined_as(self, finer: "Axes") -> "Axes":
        """These axes with each atom that ``finer`` (a later relabelling of them) splits
        replaced by its parts."""
        table = dict(finer.sizes)

        def parts(key):
            return [key] if key in table else parts(key + (0,)) + parts(key + (1,))

        return Axes(tuple((part, table[part]) for key, _ in self.sizes for part in parts(key)),
                    tuple(tuple(part for key in dim for part in parts(key)) for dim in self.dims))


def _relabel(axes: Axes, node: torch.fx.Node) -> "Axes | None":
    """``axes`` carried through ``node``, a relabelling op; None where a reshape cannot be."""
    if node.target is aten.permute.default:
        return axes.permuted(node.args[1])
    if node.target in _RESHAPES:
        return axes.reshaped(tuple(node.meta["val"].shape))
    return axes


def _is_relabelling(node) -> bool:
    """A view, permute, copy or shape-keeping expand: a node that only relabels its input."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function"):
        return False
    if node.target is aten.expand.default:
        return tuple(node.meta["val"].shape) == tuple(node.args[0].meta["val"].shape)
    return node.target in _RESHAPES + _ALIASES + (aten.permute.default,)


def _static_shape(node) -> tuple | None:
    shape = tuple(node.meta["val"].shape)
    return shape if all(isinstance(n, int) for n in shape) else None


def traced_back(node: torch.fx.Node, value_of):
    """``(source value, Axes of node over it)`` where ``node`` is an earlier value relabelled by
    a chain of views and permutes containing at least one permute, else None. ``value_of``
    looks up computed values; the source is the earliest one of the chain that is held."""
    chain = [node]
    while _is_relabelling(chain[-1]) and isinstance(chain[-1].args[0], torch.fx.Node):
        chain.append(chain[-1].args[0])
    while chain and value_of(chain[-1]) is None:
        chain.pop()
    if len(chain) < 2 or not any(n.target is aten.permute.default for n in chain[:-1]):
        return None
    source = chain[-1]
    shape = _static_shape(source)
    if shape is None:
        return None
    axes = Axes.of_shape(shape)
    for step in reversed(chain[:-1]):
        axes = _relabel(axes, step)
        if axes is None:
            return None
    return value_of(source), axes


def downstream_order(node: torch.fx.Node, axes: Axes) -> "Axes | None":
    """``axes`` (the Axes of ``node``'s value) carried through the views after ``node`` up to
    and through the first permute, where that chain is the only use of each value and keeps
    every element; else None."""
    while len(node.users) == 1:
        (node,) = node.users
        if not _is_relabelling(node):
            return None
        axes = _relabel(axes, node)
        if axes is None:
            return None
        if node.target is aten.permute.default:
            return axes
    return None


def arranged(source, axes: Axes, keys, shape):
    """``source`` split into the atoms of ``axes``, the atoms put in the order ``keys``, then
    reshaped to ``shape``: one transpose between two reshapes, however many views and permutes
    the relabelling took."""
    atoms = axes.source_order()
    split = jnp.reshape(source, [axes.size(key) for key in atoms])
    return jnp.reshape(jnp.transpose(split, [atoms.index(key) for key in keys]), shape)


def flat(dims) -> list:
    return [key for dim in dims for key in dim]


def size_of(axes: Axes, keys) -> int:
    return math.prod(axes.size(key) for key in keys)
