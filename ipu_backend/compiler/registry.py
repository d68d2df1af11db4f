"""The lowering table: one pure JAX function per ATen op overload.

A lowering is ``rule(ctx, *args, **kwargs)`` with the node's arguments as they appear in the
core-ATen graph (tensors are JAX arrays, everything else is left as torch gave it). ``ctx`` is a
:class:`~ipu_backend.compiler.interpreter.LoweringContext`: the node, its output metadata and
the random key of the node.
"""

from collections.abc import Callable

_LOWERINGS: dict = {}


def lowering(*ops) -> Callable:
    """Register the decorated rule for each op overload given (``aten.add.Tensor``, ...)."""

    def register(rule: Callable) -> Callable:
        for op in ops:
            if op in _LOWERINGS:
                raise ValueError(f"{op} already has a lowering: {_LOWERINGS[op].__qualname__}")
            _LOWERINGS[op] = rule
        return rule

    return register


def lookup(op) -> Callable | None:
    """The rule for ``op``, or None when it has no lowering."""
    _load_lowerings()
    return _LOWERINGS.get(op)


def registered_ops() -> frozenset:
    """Every op overload with a lowering."""
    _load_lowerings()
    return frozenset(_LOWERINGS)


def _load_lowerings() -> None:
    import ipu_backend.compiler.lowerings  # noqa: F401  (registers on import)
