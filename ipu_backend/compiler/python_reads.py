"""The plain Python values (numbers, strings, ``None``, enum members, torch dtypes, and tuples,
lists, sets, mappings and records of them) that a capture read from the attributes of the
captured module and its submodules.

A capture bakes such a value into the program (``x * self.alpha`` multiplies by the constant
``self.alpha`` had), so the program computes what the module computes only while each of them
is unchanged: they are the program's guards, as torch.compile's are. While a capture runs, each
module's class is swapped for a subclass that notes the plain values its instance attributes
give; :func:`changed` then compares them with the module's current ones. Tensors held as plain
attributes (not parameters or buffers) are constants of the program: each is guarded by its
state after the capture (:func:`tensor_attributes`), and the hooks the capture ran with by their
handles (:class:`HookGuard`).

``training`` is not noted: an executor that captures with the module's own modes guards every
submodule's flag (:func:`modes`); one that sets them for its capture (``inferenceModel``), none.
Nor are the attributes of torchmetrics objects: their states are the program's inputs and
outputs (``metric_states``), and their own bookkeeping (update counts) changes every call.
"""

import argparse
import contextlib
import dataclasses
import enum
import types
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.modules.module as torch_modules
from torch.utils.hooks import RemovableHandle

from ipu_backend.compiler import list_appends, metric_states

_PLAIN = (bool, int, float, str, type(None))
_NOT_GUARDED = frozenset({"training"})
MISSING = object()
"""What a read's ``current()`` gives where its attribute, module or variable is gone."""


@dataclass(frozen=True)
class Read:
    """``<path>.<name>`` of a module read during a capture, its value then (a :func:`snapshot`)."""

    module: weakref.ref
    path: str
    name: str
    value: object

    def current(self):
        """The attribute's value now (``MISSING`` if it, or its module, is gone)."""
        module = self.module()
        return MISSING if module is None else module.__dict__.get(self.name, MISSING)

    def holds(self, value) -> bool:
        return holds(self.value, value)

    @property
    def attribute(self) -> str:
        return f"{self.path}.{self.name}" if self.path else self.name


@dataclass(frozen=True, eq=False)
class ValueRead:
    """A plain value a capture read other than off a module (an optimizer's hyper-parameter, a
    scheduler's rate, a value off the Lightning face's trainer), its value then (a
    :func:`snapshot`), and how to read it now."""

    read_now: Callable[[], object]
    attribute: str
    value: object

    def current(self):
        return self.read_now()

    def holds(self, value) -> bool:
        return holds(self.value, value)


def value_guard(read_now: Callable[[], object], attribute: str, value) -> ValueRead | None:
    """The guard of ``value``, read as ``attribute`` (``read_now()`` reads it again, ``MISSING``
    once gone), or None when it is not a plain value."""
    frozen = snapshot(value)
    if frozen is None and value is not None:
        return None
    return ValueRead(read_now, attribute, frozen)


def holds(captured, value) -> bool:
    """Whether ``value`` gives the program that a read of ``captured`` (a :func:`snapshot` or a
    :class:`TensorState`) gave (``None`` only ``None``)."""
    if value is MISSING:
        return False
    if captured is None:
        return value is None
    if isinstance(captured, TensorState):
        return captured.holds(value)
    return _same(snapshot(value), captured)


@dataclass(frozen=True)
class TensorState:
    """A tensor that is neither a parameter nor a buffer, as a guard compares it: a program bakes
    its values in, so it holds while the same tensor is there, not changed in place since
    (``Tensor._version`` counts in-place changes). The tensor is held weakly: once it is gone,
    the guard no longer holds."""

    tensor: weakref.ref
    version: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorState":
        return cls(weakref.ref(tensor), tensor._version)

    def holds(self, value) -> bool:
        return value is self.tensor() and value._version == self.version


def tensor_attributes(module: torch.nn.Module) -> tuple[Read, ...]:
    """A :class:`Read` of every tensor that ``module``'s tree holds as a plain attribute (not a
    parameter or buffer), in its state now: the guards of the tensor constants a capture baked in."""
    return tuple(Read(weakref.ref(m), path, name, TensorState.of(value))
                 for path, m in guarded_modules(module)
                 for name, value in m.__dict__.items()
                 if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter))


def record_fields(value) -> dict | None:
    """The fields of a plain record (a ``types.SimpleNamespace``, an ``argparse.Namespace``, a
    dataclass instance: a model's configuration), by name; None for anything else."""
    if type(value) in _RECORDS:
        return dict(vars(value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if hasattr(value, "__dict__"):
            return dict(vars(value))
        return {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}     # slots
    return None


_RECORDS = (types.SimpleNamespace, argparse.Namespace)


def snapshot(value):
    """``value`` as a guard compares it: a plain value (an enum member, a torch dtype too) itself;
    a tuple, list, set, mapping (such as Lightning's ``hparams``) or record (:func:`record_fields`)
    of plain values as a tagged tuple of its items; None for anything else (a tensor, a module),
    which is not a guard. A list standing in for the module's own during a capture
    (``list_appends``) is the list it copies."""
    if isinstance(value, list_appends.Watched):
        value = list.copy(value)             # list's own: the stand-in notes its reads
    if type(value) in _PLAIN or isinstance(value, (enum.Enum, torch.dtype)):
        return value
    if isinstance(value, (tuple, list)):
        items = _plain_snapshots(value)
        return None if items is None else (type(value).__name__, items)
    if isinstance(value, (set, frozenset)):
        items = _plain_snapshots(value)
        return None if items is None else ("set", frozenset(items))
    if isinstance(value, Mapping):
        if not all(type(k) in _PLAIN for k in value):
            return None
        items = _plain_snapshots(value.values())
        return None if items is None else ("mapping", tuple(zip(value, items)))
    fields = record_fields(value)
    if fields is not None:
        items = _plain_snapshots(fields.values())
        return None if items is None else (("record", type(value)), tuple(zip(fields, items)))
    return None


def is_guard(name: str, value, frozen) -> bool:
    """Whether ``value``, held under ``name`` and snapshot as ``frozen``, is a guard: a plain
    value or ``None``, but not an empty container under a private name (torch's modules hold
    their parameters, buffers and hooks so, read at every call of every module)."""
    if frozen is None:
        return value is None
    empty = type(frozen) is tuple and not frozen[1]         # a container's tagged snapshot
    return not (empty and name.startswith("_"))


def _plain_snapshots(values) -> tuple | None:
    """The snapshots of ``values``, or None at the first that is not plain (a module's
    ``_parameters`` or ``_modules``, read again and again while a capture runs, stop at once)."""
    items = []
    for value in values:
        item = snapshot(value)
        if item is None and value is not None:
            return None
        items.append(item)
    return tuple(items)


def _same(a, b) -> bool:
    """Equal snapshots of the same types (``1`` and ``1.0`` give different programs)."""
    if type(a) is not type(b):
        return False
    if type(a) is tuple:
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a is b or a == b


_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
"""The hooks that change what a module computes (or, refused on a training model, its backward)."""
_GLOBAL_HOOKS = tuple(f"_global{name}" for name in _HOOKS)


class HookGuard:
    """The forward and backward hooks a capture ran with, of ``module``'s tree and torch's global
    ones, as their handles' ids: a hook added or removed later gives another program. Adding a
    hook anywhere advances torch's handle counter, so only then are all the modules looked at;
    removing one can only take a hook the capture saw, so those are looked at every call."""

    attribute = "the modules' hooks"

    def __init__(self, module: torch.nn.Module):
        self._dicts = ([(weakref.ref(m), name) for _, m in guarded_modules(module) for name in _HOOKS]
                       + [(lambda: torch_modules, name) for name in _GLOBAL_HOOKS])
        self.value = self._ids(self._dicts)
        self._held = [entry for entry, ids in zip(self._dicts, self.value) if ids]
        self._held_ids = tuple(ids for ids in self.value if ids)
        self._counter = RemovableHandle.next_id

    @staticmethod
    def _ids(dicts) -> tuple:
        return tuple(() if owner() is None else tuple(getattr(owner(), name)) for owner, name in dicts)

    def current(self) -> tuple:
        if RemovableHandle.next_id == self._counter and self._ids(self._held) == self._held_ids:
            return self.value
        now = self._ids(self._dicts)
        if now == self.value:
            self._counter = RemovableHandle.next_id
        return now

    def holds(self, value) -> bool:
        return value == self.value


def described(read, value) -> str:
    """What changed, for a message: ``<attribute> (<then> -> <now>)``; a tensor's values unshown."""
    if isinstance(read, HookGuard):
        return f"{read.attribute} (a hook added or removed)"
    if isinstance(read.value, TensorState):
        how = "changed in place" if value is read.value.tensor() else "replaced"
        return f"{read.attribute} (a tensor, {how})"
    return f"{read.attribute} ({_shown(read.value)} -> {value!r})"


def _shown(frozen) -> str:
    """A :func:`snapshot` written as the value it was taken of."""
    if type(frozen) is not tuple:
        return repr(frozen)
    tag, items = frozen
    if tag == "mapping":
        return "{" + ", ".join(f"{key!r}: {_shown(item)}" for key, item in items) + "}"
    if type(tag) is tuple:                                   # ("record", its class)
        return f"{tag[1].__name__}(" + ", ".join(f"{key}={_shown(item)}" for key, item in items) + ")"
    shown = ", ".join(_shown(item) for item in items)
    return {"list": f"[{shown}]", "set": f"{{{shown}}}"}.get(tag, f"({shown}{',' if len(items) == 1 else ''})")


def changed(reads: tuple[Read, ...]) -> list[tuple[Read, object]]:
    """The reads whose attribute no longer has the value the capture saw, with its value now."""
    found = []
    for read in reads:
        value = read.current()
        if not read.holds(value):
            found.append((read, None if value is MISSING else value))
    return found


_TRACKING: dict[type, type] = {}
_NOTES: dict[int, dict] = {}
"""What each module being captured has read, by ``id``: kept off the module, whose attributes
torch.export restores after tracing."""


def _tracking_class(cls: type) -> type:
    """``cls`` with a ``__getattribute__`` that notes the snapshots of plain instance attributes."""
    tracking = _TRACKING.get(cls)
    if tracking is None:
        def __getattribute__(self, name):  # noqa: N807
            value = object.__getattribute__(self, name)
            notes = _NOTES.get(id(self))
            if notes is not None and name not in notes and name not in _NOT_GUARDED:
                if object.__getattribute__(self, "__dict__").get(name, MISSING) is value:
                    frozen = snapshot(value)
                    if is_guard(name, value, frozen):
                        notes[name] = frozen
            return value

        tracking = _TRACKING[cls] = type(cls.__name__, (cls,), {
            "__getattribute__": __getattribute__, "__qualname__": cls.__qualname__,
            "__module__": cls.__module__, "_ipu_tracked_class": cls})
    return tracking


def noted(module: torch.nn.Module) -> dict | None:
    """The plain attributes a capture now running has read of ``module`` so far (name -> value
    first seen), or None when no capture notes its reads."""
    return _NOTES.get(id(module))


def every_attribute(module: torch.nn.Module) -> tuple[Read, ...]:
    """A :class:`Read` of every plain attribute of ``module``'s tree, read or not: the guards of a
    capture whose reads could not be noted (torch traces ``torch.cond`` branches with its
    compiler, which cannot run the noting classes)."""
    return tuple(Read(weakref.ref(m), path, name, frozen)
                 for path, m in guarded_modules(module)
                 for name, value in m.__dict__.items()
                 if name not in _NOT_GUARDED and is_guard(name, value, frozen := snapshot(value)))


def modes(module: torch.nn.Module) -> tuple[Read, ...]:
    """A :class:`Read` of the ``training`` flag of each module of ``module``'s tree: the guards of
    a capture made in the modes the user left (``model.eval()`` between training calls trains as
    torch does in eval mode: batch norms on their running statistics, no dropout)."""
    return tuple(Read(weakref.ref(m), path, "training", m.training) for path, m in guarded_modules(module))


def guarded_modules(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``module``'s tree but torchmetrics objects (metrics, collections) and what they hold."""
    metrics = [path + "." for path, m in module.named_modules()
               if metric_states.is_metric(m) or metric_states.is_metric_collection(m)]
    return [(path, m) for path, m in module.named_modules(remove_duplicate=True)
            if not any((path + ".").startswith(prefix) for prefix in metrics)]


@contextlib.contextmanager
def recorded(module: torch.nn.Module):
    """While the block runs, note what ``module``'s tree reads; the list it yields then holds
    the :class:`Read` of each attribute (first value seen), once the block ends."""
    reads: list[Read] = []
    modules = [(path, m) for path, m in guarded_modules(module) if id(m) not in _NOTES]
    for _, m in modules:
        _NOTES[id(m)] = {}
        m.__class__ = _tracking_class(type(m))
    try:
        yield reads
    finally:
        for path, m in modules:
            m.__class__ = type(m)._ipu_tracked_class
            notes = _NOTES.pop(id(m))
            reads.extend(Read(weakref.ref(m), path, name, value) for name, value in notes.items())


def across_runs(reads: tuple[Read, ...], module: torch.nn.Module, runs) -> tuple[Read, ...]:
    """For each read of the tree of a run's first layer (``runs``: ``repeated_layers``' runs of
    ``module``), the same read of each later layer: a run is captured from its first layer, so
    its program holds for the others only while their attributes are what the first one's were."""
    paths = {id(m): path for path, m in module.named_modules()}
    mirrored = []
    for run in runs:
        first = paths[id(run[0])]
        for read in reads:
            if read.path != first and not read.path.startswith(first + "."):
                continue
            for layer in run[1:]:
                path = paths[id(layer)] + read.path[len(first):]
                mirrored.append(Read(weakref.ref(module.get_submodule(path)), path, read.name, read.value))
    return tuple(mirrored)
