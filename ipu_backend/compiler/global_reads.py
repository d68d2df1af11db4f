"""The plain Python values outside the module that a capture's code can read: the globals and
closure variables of the module's ``forward`` methods (and of a step method), of the functions
and methods they call, the attributes they load straight off a global (a Python module's
``config.SCALE``, a class's, an ``argparse`` namespace's ``args.temperature``), and the fields
they load off an object a module holds (a config's ``self.config.dropout``).

A capture bakes them into the program as it bakes the module's own attributes
(``python_reads``), so they are guards too: each is taken before the capture runs, so that one
the model itself changes while it runs (a global counter) no longer holds at the next call and
the program is captured again, as torch would run ``forward`` again. The code is read, not run:
every global it loads counts, also in a branch the capture did not take. Library code (torch,
JAX, NumPy, Lightning, this package, Python's own) is not read. A global tensor is a constant
of the program: its guard is the tensor's state (``python_reads.TensorState``).
"""

import dataclasses
import dis
import functools
import importlib.util
import inspect
import os
import sysconfig
import types
from collections.abc import Mapping

import torch

from ipu_backend.compiler import python_reads


@dataclasses.dataclass(frozen=True)
class NameRead:
    """A global or closure variable (or an attribute loaded straight off a global) the capture
    could read, its value before the capture (a ``python_reads.snapshot``)."""

    namespace: object
    """The globals dict that holds the variable, or its closure cell."""
    name: str
    field: str | None
    """The attribute read off the global (``SCALE`` of ``config.SCALE``), or None."""
    attribute: str
    """How a message names it: ``<module>.<name>[.<field>]``, or ``<function>.<name>`` for a
    closure variable."""
    value: object

    def current(self):
        if isinstance(self.namespace, types.CellType):
            try:
                return self.namespace.cell_contents
            except ValueError:
                return python_reads.MISSING
        value = self.namespace.get(self.name, python_reads.MISSING)
        if self.field is None:
            return value
        fields = getattr(value, "__dict__", None)
        return fields.get(self.field, python_reads.MISSING) if isinstance(fields, Mapping) else python_reads.MISSING

    def holds(self, value) -> bool:
        return python_reads.holds(self.value, value)


def reads(module: torch.nn.Module, method: str | None = None) -> tuple[NameRead, ...]:
    """The :class:`NameRead` of every plain value outside ``module`` that the ``forward`` of its
    modules (and ``method`` of ``module``) can read, with its value now."""
    found, seen, fields = {}, set(), {}
    modules = python_reads.guarded_modules(module)
    for _, submodule in modules:
        _walk(inspect.getattr_static(type(submodule), "forward", None), type(submodule), found, seen, fields)
    if method is not None:
        _walk(inspect.getattr_static(type(module), method, None), type(module), found, seen, fields)
    for path, submodule in modules:
        held = {}
        for attribute, field in fields.get(type(submodule), ()):
            held.setdefault(attribute, []).append(field)
        for attribute, names in held.items():
            value = submodule.__dict__.get(attribute, python_reads.MISSING)
            _note_fields(found, submodule.__dict__, attribute, f"{path or type(submodule).__name__}.{attribute}",
                         value, names)
    return tuple(found.values())


def _walk(function, cls, found: dict, seen: set, fields: dict) -> None:
    """Add the reads of ``function`` (a method of ``cls``, or a plain function with ``cls`` None)
    and of what it calls to ``found``, keyed by namespace and name, and the fields it loads off
    objects ``self`` holds (``self.config.scale``) to ``fields[cls]``."""
    function = getattr(function, "__func__", function)          # staticmethod, classmethod
    code = getattr(function, "__code__", None)
    if code is None or code in seen or is_library(code.co_filename):
        return
    seen.add(code)
    namespace = function.__globals__
    globals_, attributes, methods, held = _loads(code)
    if cls is not None:
        fields.setdefault(cls, set()).update(held)
    where = namespace.get("__name__", "?")
    for name in globals_:
        value = namespace.get(name, python_reads.MISSING)
        if isinstance(value, types.FunctionType):
            _walk(value, None, found, seen, fields)
            continue
        if value is not python_reads.MISSING:
            _note(found, NameRead(namespace, name, None, f"{where}.{name}", value), value)
        owner = value.__name__ if isinstance(value, types.ModuleType) else f"{where}.{name}"
        _note_fields(found, namespace, name, owner, value, attributes.get(name, ()))
    for name, cell in zip(code.co_freevars, function.__closure__ or ()):
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if isinstance(value, types.FunctionType):
            _walk(value, None, found, seen, fields)
        else:
            _note(found, NameRead(cell, name, None, f"{function.__qualname__}.{name}", None), value)
    if cls is not None:
        for name in methods:
            _walk(inspect.getattr_static(cls, name, None), cls, found, seen, fields)


def _note_fields(found: dict, namespace, name: str, owner: str, value, fields) -> None:
    """Add the reads of the ``fields`` of ``value`` (held in ``namespace`` as ``name``) that
    hold it in its ``__dict__``."""
    held = getattr(value, "__dict__", None)
    if isinstance(held, Mapping) and not isinstance(value, (torch.nn.Module, torch.Tensor)):
        for field in fields:
            if field in held:
                _note(found, NameRead(namespace, name, field, f"{owner}.{field}", None), held[field])


def _note(found: dict, read: NameRead, value) -> None:
    """Add ``read`` with the snapshot of ``value`` (a tensor's state), where that is a guard."""
    frozen = python_reads.TensorState.of(value) if isinstance(value, torch.Tensor) else python_reads.snapshot(value)
    key = (id(read.namespace), read.name, read.field)
    if python_reads.is_guard(read.field or read.name, value, frozen) and key not in found:
        found[key] = dataclasses.replace(read, value=frozen)


@functools.cache
def _loads(code: types.CodeType) -> tuple[frozenset, dict, frozenset, frozenset]:
    """What ``code`` and the code nested in it (lambdas, comprehensions, inner functions) load:
    the global names, the attributes loaded straight off each global (``config.SCALE``), every
    attribute name loaded (the methods it may call on ``self``), and the ``(attribute, field)``
    pairs loaded off its first argument (``self.config.scale``)."""
    first = code.co_varnames[0] if code.co_argcount else None
    globals_, attributes, methods, held = set(), {}, set(), set()
    for nested in _nested(code):
        earlier = previous = None
        for instruction in dis.get_instructions(nested):
            if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                globals_.add(instruction.argval)
            elif instruction.opname in ("LOAD_ATTR", "LOAD_METHOD"):
                methods.add(instruction.argval)
                if previous is not None and previous.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                    attributes.setdefault(previous.argval, set()).add(instruction.argval)
                if (previous is not None and previous.opname == "LOAD_ATTR" and earlier is not None
                        and earlier.opname in ("LOAD_FAST", "LOAD_DEREF") and earlier.argval == first):
                    held.add((previous.argval, instruction.argval))
            earlier, previous = previous, instruction
    return (frozenset(globals_), {name: frozenset(names) for name, names in attributes.items()},
            frozenset(methods), frozenset(held))


def _nested(code: types.CodeType):
    yield code
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _nested(constant)


@functools.cache
def is_library(filename: str) -> bool:
    """Whether ``filename`` is library code, whose globals are its own settings, not the model's."""
    return os.path.realpath(filename).startswith(_LIBRARY_DIRS)


def _library_dirs() -> tuple[str, ...]:
    import jax
    import numpy
    dirs = [sysconfig.get_paths()["stdlib"], os.path.dirname(os.path.dirname(__file__)),
            *(os.path.dirname(package.__file__) for package in (torch, jax, numpy))]
    for name in ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_ipu", "torchmetrics"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin is not None:
            dirs.append(os.path.dirname(spec.origin))
    return tuple(os.path.realpath(directory) + os.sep for directory in dirs)


_LIBRARY_DIRS = _library_dirs()
