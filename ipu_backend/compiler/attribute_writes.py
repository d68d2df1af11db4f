"""Attributes a step or a model's forward assigns on its module: carried to the host after each
call, or refused.

On the CPU a step's Python runs per batch (a forward's per call), so ``self.warmed_up = True`` is
on the module after it, ``self.seen += len(x)`` counts samples and ``self.last_loss = loss`` keeps
the latest loss for a hook to read. A compiled program's Python runs once, at capture, and
torch.export puts the module's attributes back afterwards (copying the lists and dicts among
them). So, for the attributes of the module's tree (its own and its submodules', private ones
too, torch's own bookkeeping aside) and what the dicts, lists and records (a configuration
namespace or dataclass, Lightning's ``hparams``) among them hold, nested too:

- a Python value the capture leaves different (a flag, a string, a new number, any object
  without tensors) is an :class:`Assignment`, which the executor makes on the host after each
  call. A value the program reads and changes is a guard of it (``python_reads``), so the next
  call captures it again with the new value; a call that runs it several times, whose later
  runs would see the new value on the CPU, is refused (:func:`refuse_read_and_changed`);
- a number it reads and changes (a counter), a tensor assigned and a list held in a container
  or record that changes length are refused, with the ways that work: a Lightning hook that
  runs on the host, a list the step appends to (``list_appends``), ``self.log``, an output of
  the forward, or a buffer written in place.
"""

import contextlib
import copy
import weakref
from dataclasses import dataclass

import torch
import torch.utils._pytree as torch_pytree
from torch.nn.utils import prune
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from ipu_backend.compiler import list_appends, python_reads
from ipu_backend.errors import Error

_NUMBERS = (int, float)
_MODULE_STATE = frozenset(vars(torch.nn.Module()))
"""What every module holds for torch itself (parameters, buffers, submodules, hooks, ``training``)."""

_BUFFER = "write it into a buffer in place (self.register_buffer(...) in __init__, then .copy_() or +=)"
_WAYS = {
    True: ("keep it in a hook that runs on the host (on_train_batch_end, on_validation_batch_end), append it "
           f"to a list the module holds (self.values.append(...)), log it (self.log), or {_BUFFER}"),
    False: f"return it from forward, or {_BUFFER}",
}
"""The ways that work, for a step (True) and for a model's forward."""


_DEPTH = 4
"""How many containers and records deep, below a module's attribute, its writes are followed."""
ITEM, FIELD = "item", "field"
"""The two ways into a container: a dict's entry or a list's item, and a record's field."""


@dataclass(frozen=True, eq=False)
class Assignment:
    """``self.<path>.<name> = value``, or, where ``keys`` go into what the attribute holds,
    ``self.<path>.<name>[key].<field> = value`` and so on, as the captured code left it."""

    module: weakref.ref
    path: str
    name: str
    keys: tuple
    """``(ITEM, key)`` or ``(FIELD, name)`` for each step from the attribute to the value set."""
    value: object
    """What the code left; ``python_reads.MISSING`` where it deleted the attribute or entry."""

    @property
    def where(self) -> str:
        return _where(list_appends.where(self.path, self.name), self.keys)

    def apply(self) -> None:
        """Make the assignment on the host module (nothing once the module is gone)."""
        module = self.module()
        if module is None:
            return
        *way, (kind, key) = ((ITEM, self.name),) + self.keys
        owner = module.__dict__
        for depth, (inner_kind, inner_key) in enumerate(way):
            owner = _entry(owner, inner_kind, inner_key)
            if owner is python_reads.MISSING:
                raise Error(f"the compiled program sets {self.where}, but the host's module no longer holds "
                            f"{_where(list_appends.where(self.path, self.name), self.keys[:depth])}: the code "
                            "would fail on the CPU too")
        _set(owner, kind, key, self.value)

    def changes(self, read: python_reads.Read) -> bool:
        """Whether ``read`` (a guard of the same attribute, made at capture) saw another value
        than the code leaves."""
        return not read.holds(_with(read.current(), self.keys, self.value))


def _where(text: str, keys: tuple) -> str:
    for kind, key in keys:
        text += f".{key}" if kind == FIELD else f"[{key!r}]"
    return text


def _entries(value) -> tuple[str, dict] | None:
    """``(ITEM, entries)`` of a dict or list, ``(FIELD, fields)`` of a record
    (``python_reads.record_fields``), as they are now; None for anything else."""
    if isinstance(value, dict):
        return ITEM, dict(value)
    if isinstance(value, list):
        return ITEM, dict(enumerate(list.copy(value)))      # list's own: a stand-in notes reads
    fields = python_reads.record_fields(value)
    return None if fields is None else (FIELD, fields)


def _entry(owner, kind: str, key):
    """What ``owner`` holds at ``key`` (``python_reads.MISSING`` where nothing)."""
    if kind == FIELD:
        return getattr(owner, key, python_reads.MISSING)
    if isinstance(owner, list):
        return owner[key] if 0 <= key < len(owner) else python_reads.MISSING
    return owner.get(key, python_reads.MISSING) if isinstance(owner, dict) else python_reads.MISSING


def _set(owner, kind: str, key, value) -> None:
    if kind == FIELD:
        if value is not python_reads.MISSING:
            setattr(owner, key, value)
        elif hasattr(owner, key):
            delattr(owner, key)
    elif value is not python_reads.MISSING:
        owner[key] = value
    else:
        owner.pop(key, None)


def _with(value, keys: tuple, new):
    """``value`` with what ``keys`` lead to set to ``new``, copied on the way down (the host's
    value once an :class:`Assignment` is made, left untouched); ``python_reads.MISSING`` where
    the way is gone."""
    if not keys:
        return new
    (kind, key), rest = keys[0], keys[1:]
    inner = _entry(value, kind, key)
    if inner is python_reads.MISSING and rest:
        return python_reads.MISSING
    copied = copy.copy(value)
    _set(copied, kind, key, _with(inner, rest, new))
    return copied


@dataclass(frozen=True)
class _Held:
    """A container or record the module's tree holds, and each of its entries as it was: the
    value, and the entry's own :class:`_Held` where it is a container or record too."""

    value: object
    kind: str
    entries: dict

    @classmethod
    def of(cls, value, depth: int = _DEPTH, seen: frozenset = frozenset()) -> "_Held | None":
        found = _entries(value) if depth and id(value) not in seen else None
        if found is None:
            return None
        kind, entries = found
        inner = seen | {id(value)}
        return cls(value, kind, {key: (item, cls.of(item, depth - 1, inner)) for key, item in entries.items()})

    def changes(self, keys: tuple, where: str):
        """``(keys, old, new)`` for each entry, at any depth, that differs now."""
        now = _entries(self.value)[1]
        if isinstance(self.value, list_appends.Watched):        # what a step appends to these is its output
            now = {index: item for index, item in now.items() if index in self.entries}
        elif isinstance(self.value, list) and len(now) != len(self.entries):
            raise Error(f"changes the length of {_where(where, keys)}, a list held in what the module holds")
        for key in self.entries.keys() | now.keys():
            old, held = self.entries.get(key, (python_reads.MISSING, None))
            new = now.get(key, python_reads.MISSING)
            if new is not old:
                yield keys + ((self.kind, key),), old, new
            elif held is not None:
                yield from held.changes(keys + ((self.kind, key),), where)


def _attributes(module: torch.nn.Module) -> dict:
    return {name: value for name, value in vars(module).items() if name not in _MODULE_STATE}


def _held(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module, dict, dict]]:
    """Each module of the tree (torchmetrics objects aside) with its attributes and the
    :class:`_Held` of each container or record among them."""
    held = []
    for path, submodule in python_reads.guarded_modules(module):
        attributes = _attributes(submodule)
        inner = {name: found for name, value in attributes.items() if (found := _Held.of(value)) is not None}
        held.append((path, submodule, attributes, inner))
    return held


def _changed(before: dict, after: dict):
    """``(key, old, new)`` for each key whose value differs between the two mappings
    (``python_reads.MISSING`` where there is none)."""
    for name in after.keys() | before.keys():
        old, new = before.get(name, python_reads.MISSING), after.get(name, python_reads.MISSING)
        if new is not old:
            yield name, old, new


def _changes(path: str, before: dict, inner: dict, after: dict):
    """``(name, keys, old, new)`` for each attribute, or value held in a container or record
    attribute, that the code left different (``python_reads.MISSING`` where there was none, or
    is none now)."""
    for name, old, new in _changed(before, after):
        yield name, (), old, new
    for name, held in inner.items():
        if after.get(name) is before[name]:
            for keys, old, new in held.changes((), list_appends.where(path, name)):
                yield name, keys, old, new


def _refusal(where: str, old, new, read: bool) -> str | None:
    """Why the code's change of ``where`` cannot be carried to the host, or None."""
    if any(isinstance(leaf, torch.Tensor) and not isinstance(leaf, torch.nn.Parameter)
           for leaf in torch_pytree.tree_leaves(new)):
        return f"assigns a tensor to {where}"
    if read and type(old) in _NUMBERS and type(new) in _NUMBERS and old != new:
        return f"changes {where} ({old!r} -> {new!r})"
    return None


def _same(old, new) -> bool:
    """Equal plain values (``python_reads.snapshot``): an assignment that changes nothing."""
    frozen = python_reads.snapshot(old)
    return frozen is not None and python_reads.holds(frozen, new)


def _recomputed(module: torch.nn.Module) -> set[str]:
    """The attributes of ``module`` that torch's reparametrizing forward pre-hooks recompute from
    its parameters at every call (``torch.nn.utils.prune``: ``weight = weight_orig * weight_mask``;
    ``weight_norm``, ``spectral_norm``): values of the program, not of the host."""
    names = set()
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, prune.BasePruningMethod):
            names.add(hook._tensor_name)
        elif isinstance(hook, (WeightNorm, SpectralNorm)):
            names.add(hook.name)
    return names


def _assignments(held: list, step: bool) -> list[Assignment]:
    """The changes to the attributes of each module ``held`` (see :func:`_held`) since, refused
    as the module docstring says."""
    found = []
    what = "the step" if step else "the model's forward"
    for path, submodule, before, inner in held:
        notes = python_reads.noted(submodule)
        recomputed = _recomputed(submodule)
        try:
            changes = list(_changes(path, before, inner, _attributes(submodule)))
        except Error as error:
            raise Error(f"{what} {error}: a compiled program's Python runs once, at capture, not at every call; "
                        f"{_WAYS[step]}") from None
        for name, keys, old, new in changes:
            if name in recomputed:
                continue
            where = _where(list_appends.where(path, name), keys)
            refusal = _refusal(where, old, new, read=notes is None or name in notes)
            if refusal is not None:
                raise Error(f"{what} {refusal}: a compiled program's Python runs once, at capture, not at "
                            f"every call, and the module keeps its attributes as they were; {_WAYS[step]}")
            if old is python_reads.MISSING or new is python_reads.MISSING or not _same(old, new):
                found.append(Assignment(weakref.ref(submodule), path, name, keys, new))
    return found


@contextlib.contextmanager
def noted(module: torch.nn.Module):
    """While the block (a step, captured) runs, note what it assigns on ``module``'s tree: the
    list it yields holds the :class:`Assignment` s once the block ends, or an error names a
    write the host cannot be given (see the module docstring)."""
    held = _held(module)
    found: list[Assignment] = []
    yield found
    found.extend(_assignments(held, step=True))


@contextlib.contextmanager
def noted_in_forward(module: torch.nn.Module):
    """:func:`noted` for a model's forward, which torch.export calls itself: each call of
    ``module`` while the block runs is noted from its forward pre-hook to its forward hook, and
    the list holds the last one's assignments."""
    found: list[Assignment] = []
    held: list = []

    def before(*_):
        held[:] = _held(module)

    def after(*_):
        found[:] = _assignments(held, step=False)

    handles = [module.register_forward_pre_hook(before, prepend=True), module.register_forward_hook(after)]
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


def differing(first, second) -> str | None:
    """An attribute (``self.<path>.<name>``) that two captures' assignments leave different, or None."""
    def by_place(assignments):
        return {(a.path, a.name, a.keys): a for a in assignments}
    ones, others = by_place(first), by_place(second)
    for place in ones.keys() | others.keys():
        one, other = ones.get(place), others.get(place)
        if one is None or other is None or not (one.value is other.value or _same(one.value, other.value)):
            return (one or other).where
    return None


def refuse_read_and_changed(assignments, reads, steps_per_call: int, what: str, step: bool) -> None:
    """An error when a call runs ``what`` (a step when ``step``, else a model's forward) several
    times (``steps_per_call``: device iterations × micro-batches) and it changes a value it reads
    (a guard among ``reads``): on the CPU the runs after the first would see the new value, while
    one call makes them all as captured."""
    if steps_per_call == 1:
        return
    guards = {(id(read.module()), read.name): read for read in reads if isinstance(read, python_reads.Read)}
    for assignment in assignments:
        read = guards.get((id(assignment.module()), assignment.name))
        if read is not None and assignment.changes(read):
            where = "in a hook that runs on the host between calls (on_train_batch_start)" if step else \
                "on the host between calls"
            runs = "step" if step else "forward"
            raise Error(f"the {what} reads {assignment.where} and changes it: on the CPU the later of the "
                        f"{steps_per_call} {runs}s one call runs (device iterations x gradient accumulation) "
                        f"would see the new value, but a compiled call runs them all as captured. Change it "
                        f"{where}, or run one {runs} per call")
