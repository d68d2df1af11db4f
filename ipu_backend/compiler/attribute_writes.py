"""Attributes a step assigns on its module: refused, since the host would never see them.

On the CPU a step's Python runs per batch, so ``self.seen += len(x)`` counts samples and
``self.last_loss = loss`` keeps the latest loss for a hook to read. A compiled step's Python runs
once, at capture, and torch.export puts the module's attributes back afterwards: the counter would
stay where it was, the tensor never arrive. Such writes to the public attributes of the module's
tree (a number changed, a tensor assigned, also into a dict the module holds) are refused with the
ways that work: a hook that runs on the host, a list the step appends to (``list_appends``),
``self.log``, or a buffer written in place. Other assignments (a cache of a Python value the step
computes the same way at every capture) are left alone.
"""

import contextlib

import torch

from ipu_backend.compiler import list_appends, python_reads
from ipu_backend.errors import Error

_NUMBERS = (int, float)
_MISSING = object()

_WAYS = ("keep it in a hook that runs on the host (on_train_batch_end, on_validation_batch_end), append it "
         "to a list the module holds (self.values.append(...)), log it (self.log), or write it into a "
         "buffer in place (self.register_buffer(...) in __init__, then .copy_() or +=)")


def _public(module: torch.nn.Module) -> dict:
    return {name: value for name, value in vars(module).items() if not name.startswith("_")}


def _held(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module, dict, dict]]:
    """Each module of the tree (torchmetrics objects aside) with its public attributes and a
    copy of each dict among them."""
    held = []
    for path, submodule in python_reads.guarded_modules(module):
        attributes = _public(submodule)
        dicts = {name: dict(value) for name, value in attributes.items() if type(value) is dict}
        held.append((path, submodule, attributes, dicts))
    return held


def _written(path: str, submodule: torch.nn.Module, before: dict, dicts: dict) -> str | None:
    """What the step wrote that the host would not see, described, or None."""
    for name, value in _public(submodule).items():
        where = list_appends.where(path, name)
        old = before.get(name, _MISSING)
        if value is old:
            entries = dicts.get(name)
            if entries is not None:
                for key, item in value.items():
                    if isinstance(item, torch.Tensor) and item is not entries.get(key):
                        return f"assigns a tensor to {where}[{key!r}]"
            continue
        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
            return f"assigns a tensor to {where}"
        if type(old) in _NUMBERS and type(value) in _NUMBERS and old != value:
            return f"changes {where} ({old!r} -> {value!r})"
    return None


@contextlib.contextmanager
def refused(module: torch.nn.Module, what: str = "the step"):
    """An error, when the block (``what``, captured) ends, naming an attribute of ``module``'s
    tree it wrote as described in the module docstring."""
    held = _held(module)
    yield
    for path, submodule, before, dicts in held:
        written = _written(path, submodule, before, dicts)
        if written is not None:
            raise Error(f"{what} {written}: a compiled step's Python runs once, at capture, not per "
                        f"batch, and the module keeps its attributes as they were; {_WAYS}")
