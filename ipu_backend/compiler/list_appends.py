"""Lists a module holds that a compiled step appends to (Lightning's epoch-end pattern,
``self.validation_step_outputs.append(loss)``): what the step appends becomes outputs of the
program, which the host appends after each call.

On the CPU a step's Python runs once per batch; a compiled step's runs once, at capture. While a
step is captured, each list its module tree holds as an attribute stands in as a
:class:`Watched` copy that notes what the step appends and whether it otherwise read the list.
Each tensor appended (or each tensor of an appended tuple, list or dict) is an extra logged output
of the step, marked by its :class:`ListAppend`; the call returns it for every micro-batch whatever
the output mode (:data:`EVERY_MICRO_BATCH`), and the host appends each micro-batch's items in the
order of the combined batch, as the step would have per batch (``lightning_ipu``). A list the
step both appends to and reads, or changes otherwise, cannot be emulated and is refused, as is a
non-tensor item (its value would be the capture's at every step).
"""

import contextlib
import contextvars
from dataclasses import dataclass

import torch
import torch.utils._pytree as torch_pytree

from ipu_backend.errors import Error

APPEND_PREFIX = "list_append:"
"""Logged outputs named ``list_append:<list>[<item>].<leaf>`` carry an appended tensor."""

EVERY_MICRO_BATCH = "every"
"""How a call returns an appended tensor among its totals: every micro-batch's value, unreduced."""

_READS = ("__len__", "__iter__", "__reversed__", "__getitem__", "__contains__", "__eq__", "__ne__", "__lt__",
          "__le__", "__gt__", "__ge__", "__add__", "__mul__", "__rmul__", "index", "count", "copy")
_CHANGES = ("insert", "pop", "remove", "clear", "sort", "reverse", "__setitem__", "__delitem__", "__imul__")


@dataclass(frozen=True)
class ListAppend:
    """One tensor a step appended: the list (``module``: the holder's path, "" for the root;
    ``attribute``: its name), which append of the step (``item``), which tensor of the appended
    value (``leaf`` of the item's ``spec``) and its shape per micro-batch."""

    module: str
    attribute: str
    item: int
    leaf: int
    spec: torch_pytree.TreeSpec
    shape: tuple[int, ...]

    @property
    def where(self) -> str:
        return where(self.module, self.attribute)

    @property
    def name(self) -> str:
        """The logged output carrying this tensor."""
        return f"{APPEND_PREFIX}{self.where}[{self.item}].{self.leaf}"


def where(module: str, attribute: str) -> str:
    """``self.<path>.<attribute>``, as the user's code names the list."""
    return f"self.{module}.{attribute}" if module else f"self.{attribute}"


_ON_HOST = contextvars.ContextVar("ipu_backend_lists_on_host", default=False)


@contextlib.contextmanager
def on_host():
    """While the block runs, the stand-in lists act as plain lists: for host code a capture
    runs (a ``poptorch.CPU`` function called once for its output shapes), whose uses of the
    lists are not the compiled step's."""
    token = _ON_HOST.set(True)
    try:
        yield
    finally:
        _ON_HOST.reset(token)


class Watched(list):
    """A copy of a list a module holds, standing in for it while a step is captured: appended
    items are noted (not added), other uses noted as reads, and any other change refused."""

    def __init__(self, original: list, module: str, attribute: str):
        super().__init__(original)
        self.module, self.attribute = module, attribute
        self.appended: list = []
        self.read: str | None = None
        """The first operation that read the list's items, if any."""

    def append(self, item) -> None:
        if _ON_HOST.get():
            list.append(self, item)
        else:
            self.appended.append(item)

    def extend(self, items) -> None:
        if _ON_HOST.get():
            list.extend(self, items)
        else:
            self.appended.extend(items)

    def __iadd__(self, items):
        self.extend(items)
        return self


def _noting_read(operation: str):
    def read(self, *args, **kwargs):
        if self.read is None and not _ON_HOST.get():
            self.read = operation
        return getattr(list, operation)(self, *args, **kwargs)
    return read


def _refusing(operation: str):
    def change(self, *args, **kwargs):
        if _ON_HOST.get():
            return getattr(list, operation)(self, *args, **kwargs)
        raise Error(f"the step changes {where(self.module, self.attribute)}, a list the module holds, "
                    f"with {operation}: a compiled step's Python runs once, at capture, not per batch, "
                    "so it may only append to such lists (what it appends reaches the list after "
                    "each call); change the list in a hook that runs on the host (on_*_epoch_end)")
    return change


for _operation in _READS:
    setattr(Watched, _operation, _noting_read(_operation))
for _operation in _CHANGES:
    setattr(Watched, _operation, _refusing(_operation))


class Watch:
    """The :class:`Watched` lists standing in for a module tree's lists during one capture, and
    the lists held one level deeper (in a list or dict attribute), with their lengths then."""

    def __init__(self, lists: list[tuple[torch.nn.Module, str, list, Watched]], nested: list[tuple[str, list, int]],
                 mappings: list[tuple[str, dict, frozenset]]):
        self._lists = lists
        self._nested = nested
        self._mappings = mappings

    def appends(self) -> list[tuple[ListAppend, torch.Tensor]]:
        """Each tensor the step appended, with its :class:`ListAppend`, in order; an error for a
        list that was both appended to and read, or assigned a longer list, an item that is not
        made of tensors, or a list held deeper that the step changed."""
        self._refuse_nested_changes("the step")
        found = []
        for submodule, attribute, _, watched in self._lists:
            now = submodule.__dict__.get(attribute)
            if now is not watched and type(now) is list and len(now) > list.__len__(watched):
                raise Error(f"the step assigns {where(watched.module, watched.attribute)} a longer list: a compiled "
                            "step's Python runs once, at capture, not per batch, so the list would keep only "
                            "the capture's items; append to it instead (.append, .extend or +=), and what the "
                            "step appends reaches the list after each call")
            if not watched.appended:
                continue
            name = where(watched.module, watched.attribute)
            if watched.read is not None:
                raise Error(f"the step appends to {name} and reads it ({watched.read}): a compiled step's "
                            "Python runs once, at capture, so what it reads of the list would be the "
                            "capture's at every step; only append to the list in the step, and read it "
                            "in a hook that runs on the host (on_*_epoch_end)")
            for item, value in enumerate(watched.appended):
                leaves, spec = torch_pytree.tree_flatten(value)
                for leaf, tensor in enumerate(leaves):
                    if not isinstance(tensor, torch.Tensor):
                        raise Error(f"the step appends a value of type {type(tensor).__name__} to {name}: a "
                                    "compiled step appends tensors (or tuples, lists or dicts of them) only, "
                                    "since any other value would be the one computed at capture, at every "
                                    "step; append it as a tensor (torch.tensor(value))")
                    shape = tuple(int(size) for size in tensor.shape)
                    found.append((ListAppend(watched.module, watched.attribute, item, leaf, spec, shape), tensor))
        return found

    def refuse_appends(self, what: str) -> None:
        """An error naming a list ``what`` (a model's forward) appended to, where that is not
        emulated."""
        self._refuse_nested_changes(what)
        for _, _, _, watched in self._lists:
            if watched.appended:
                raise Error(f"{what} appends to {where(watched.module, watched.attribute)}, a list the "
                            "module holds: a compiled model's Python runs once, at capture, not per "
                            "call, so the list would not see the values of later calls; return the "
                            "values from forward instead")

    def _refuse_nested_changes(self, what: str) -> None:
        changed = [name for name, held, length in self._nested if len(held) != length]
        changed += [f"{name}[{key!r}]" for name, mapping, keys in self._mappings
                    for key, value in mapping.items() if key not in keys and type(value) is list and value]
        if changed:
            raise Error(f"{what} changes {changed[0]}, a list inside a list or dict the module holds: a "
                        "compiled step's Python runs once, at capture, not per batch, and only lists held "
                        "directly as attributes get what a step appends (self.<name> = [] in __init__)")


@contextlib.contextmanager
def watching(module: torch.nn.Module):
    """While the block runs, each list (exactly ``list``) ``module``'s tree holds as an
    attribute is a :class:`Watched` copy; the block gets the :class:`Watch`. The lists are put
    back as they were."""
    lists, nested, mappings = [], [], []
    for path, submodule in module.named_modules():
        for attribute, value in vars(submodule).items():
            name = where(path, attribute)
            if type(value) is list:
                lists.append((submodule, attribute, value, Watched(value, path, attribute)))
                nested += [(f"{name}[{index}]", item, len(item)) for index, item in enumerate(value)
                           if type(item) is list]
            elif isinstance(value, dict) and not attribute.startswith("_"):
                nested += [(f"{name}[{key!r}]", item, len(item)) for key, item in value.items() if type(item) is list]
                mappings.append((name, value, frozenset(value)))
    for submodule, attribute, _, watched in lists:
        submodule.__dict__[attribute] = watched
    try:
        yield Watch(lists, nested, mappings)
    finally:
        for submodule, attribute, original, watched in lists:
            if submodule.__dict__.get(attribute) is watched:
                submodule.__dict__[attribute] = original


def every_micro_batch(logs) -> dict:
    """Logged name -> :data:`EVERY_MICRO_BATCH` for each appended tensor among a program's
    ``self.log`` calls (``logs``): the call returns these for every micro-batch."""
    return {call.name: EVERY_MICRO_BATCH for call in logs if call.appended is not None}
