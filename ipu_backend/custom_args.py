"""PopTorch's custom argument parsers: ``registerCustomArgParser(MyType, parser)`` lets a model
take (and return) objects of ``MyType``; ``parser.yieldTensors(obj)`` lists their tensors and
``parser.reconstruct(original, tensors)`` rebuilds one.

Here a registered type becomes a torch pytree node, so capture, batching and output handling
treat its tensors like those of a tuple. Two objects of the type share a compiled program when
they have the same tensor shapes and equal non-tensor attributes. Inside the compiled program the
tensors are JAX arrays, which a parser written for torch tensors would not list: an object the
program itself rebuilt is flattened back into the arrays it was built from.
"""

import abc
import copy
import weakref
from typing import Any

import torch
import torch.utils._pytree as torch_pytree

from ipu_backend.errors import Error

_PARSERS: dict[type, "ICustomArgParser"] = {}
_REBUILT: dict[int, tuple] = {}
"""``id(obj) -> (weak reference to obj, the values it was rebuilt from)``, for objects rebuilt
from values that are not torch tensors (JAX arrays while the program is traced)."""


class ICustomArgParser(abc.ABC):
    """What ``registerCustomArgParser`` needs for a custom argument type."""

    @abc.abstractmethod
    def yieldTensors(self, struct) -> None:  # noqa: N802
        """Yield every ``torch.Tensor`` of ``struct``, in a deterministic order."""

    @abc.abstractmethod
    def reconstruct(self, original_structure, tensor_iterator) -> Any:
        """A new object like ``original_structure`` whose tensors are taken from
        ``tensor_iterator``, in the order of ``yieldTensors``."""


class _Context:
    """A treespec context: equal for objects that a compiled program can serve alike."""

    def __init__(self, obj, values: list):
        self.original = copy.copy(obj)      # as flattened: a model may set attributes on its input
        self.key = (type(obj), len(values), _static_attributes(obj, values))

    def __eq__(self, other) -> bool:
        return isinstance(other, _Context) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key[:2])

    def __deepcopy__(self, memo) -> "_Context":
        return self          # never changed; its object may hold tensors that cannot be copied

    def __repr__(self) -> str:
        return f"{self.key[0].__name__}({self.key[1]} tensors)"


def _static_attributes(obj, values: list) -> tuple | int:
    """The attributes of ``obj`` other than its tensors ``values`` (compared by ``repr``), or its
    identity when it has no ``__dict__``."""
    attributes = getattr(obj, "__dict__", None)
    if attributes is None:
        return id(obj)
    flattened = {id(v) for v in values}
    return tuple(sorted((name, repr(value)) for name, value in attributes.items()
                        if id(value) not in flattened and not isinstance(value, torch.Tensor)))


def _flatten(obj):
    rebuilt = _REBUILT.get(id(obj))
    if rebuilt is not None and rebuilt[0]() is obj:
        values = rebuilt[1]
    else:
        values = list(_PARSERS[type(obj)].yieldTensors(obj))
    return values, _Context(obj, values)


def _flatten_with_keys(obj):
    values, context = _flatten(obj)
    return [(torch_pytree.SequenceKey(i), v) for i, v in enumerate(values)], context


def _unflatten(values, context: _Context):
    values = list(values)
    obj = _PARSERS[context.key[0]].reconstruct(context.original, iter(values))
    if not all(isinstance(v, torch.Tensor) for v in values):
        try:
            reference = weakref.ref(obj, lambda _, key=id(obj): _REBUILT.pop(key, None))
        except TypeError as error:
            raise Error(f"{type(obj).__name__} objects must support weak references to be model "
                        "inputs or outputs (a class with __slots__ needs '__weakref__')") from error
        _REBUILT[id(obj)] = (reference, values)
    return obj


def registerCustomArgParser(arg_data_type: type, arg_parser: ICustomArgParser | None) -> None:  # noqa: N802
    """Let models take and return objects of ``arg_data_type``, whose tensors ``arg_parser``
    lists and rebuilds. A second registration replaces the first; ``None`` removes it."""
    if arg_data_type in _PARSERS:
        del _PARSERS[arg_data_type]
        torch_pytree._deregister_pytree_node(arg_data_type)
    if arg_parser is None:
        return
    if not isinstance(arg_parser, ICustomArgParser):
        raise Error("arg_parser must inherit from ICustomArgParser")
    _PARSERS[arg_data_type] = arg_parser
    torch_pytree.register_pytree_node(arg_data_type, _flatten, _unflatten,
                                      flatten_with_keys_fn=_flatten_with_keys)
