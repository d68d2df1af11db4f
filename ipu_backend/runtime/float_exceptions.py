"""``Options.Precision.enableFloatingPointExceptions(True)``: PopTorch's IPU traps on a floating
point exception (an operation giving a NaN or an infinity: a division by zero, zero times an
infinity, the root of a negative number, an overflow; a comparison with a NaN) and the call
raises. Emulated IPUs compute as torch does, so what a call takes and returns is checked instead:
a NaN in its inputs (the IPU traps where an operation compares it, ``isnan`` included), and a NaN
or an infinity in its outputs, logged values and the state it leaves on the device (weights,
buffers, optimizer state). A NaN or an infinity that an operation removes before any result
(``torch.where``, a maximum) is not seen; the IPU's traps on finite results (a division by an
infinity) are not emulated."""

import jax
import jax.numpy as jnp
import torch
import torch.utils._pytree as torch_pytree

from ipu_backend.errors import Error


def check_inputs(inputs) -> None:
    """Raise when a floating point tensor among the call's ``inputs`` holds a NaN."""
    where = [index for index, x in enumerate(torch_pytree.tree_leaves(inputs))
             if isinstance(x, torch.Tensor) and x.is_floating_point() and bool(torch.isnan(x).any())]
    if where:
        raise Error(f"floating point exception: input {where[0]} of the call holds a NaN, which the IPU "
                    f"traps on where an operation compares it; {_OPTION}")


def check(*results) -> None:
    """Raise when a floating point array among ``results`` holds a NaN or an infinity."""
    where = [path for path, leaf in jax.tree_util.tree_leaves_with_path(results)
             if jnp.issubdtype(leaf.dtype, jnp.inexact) and not bool(jnp.all(jnp.isfinite(leaf)))]
    if where:
        raise Error("floating point exception: the call computed a NaN or an infinity (in "
                    f"{_name(where[0])}{f' and {len(where) - 1} more' if len(where) > 1 else ''}), which the IPU "
                    f"traps on; {_OPTION}")


_OPTION = ("Options.Precision.enableFloatingPointExceptions(True) makes that an error, as PopTorch does. "
           "Set it to False to let NaN and infinity propagate as in torch")


def _name(path) -> str:
    """Where a checked value is, in words: ``state ['params']['fc.weight']``, ``output 0``, ``log 'loss'``."""
    kind, *rest = path
    if kind.idx == 1:
        return f"output {rest[0].idx}" if rest else "the output"
    return ("state " if kind.idx == 0 else "log ") + jax.tree_util.keystr(tuple(rest))
