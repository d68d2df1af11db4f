"""Compiled programs in a file: what PopTorch's ``save``, ``compileAndExport``,
``loadExecutable`` and ``poptorch.load`` read and write.

A file holds the XLA executables of a compiled model (``jax.experimental.serialize_executable``;
one step, or each stage's programs of a model split over IPUs), each with a fingerprint of its
program and its devices, the shapes and dtypes of the inputs it was compiled for, the options,
and optionally the model and optimizer (pickled with their weights and state) and the random
state. Loading captures the model again (as PopTorch traces it again) to rebuild what the host
needs around the programs; where the runtime would compile a program, :class:`Loading` checks
that it is the next one saved and loads it instead. Like PopTorch's files, these are pickles:
load only files you trust.
"""

import hashlib
import os
import pickle
import weakref
from dataclasses import dataclass

import jax
import torch
import torch.utils._pytree as torch_pytree
from jax.experimental import serialize_executable

from ipu_backend.errors import Error

FORMAT = "ipu_backend compiled program"
VERSION = 2


@dataclass(frozen=True)
class InputSpec:
    """A tensor input's shape and dtype (the file keeps no data)."""

    shape: tuple
    dtype: torch.dtype


def input_specs(args: tuple):
    """``args`` with each tensor replaced by its :class:`InputSpec`."""
    return torch_pytree.tree_map(
        lambda x: InputSpec(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x, args)


def example_inputs(specs) -> tuple:
    """Zero tensors of the shapes and dtypes ``specs`` hold: inputs to capture the model with."""
    return torch_pytree.tree_map(
        lambda x: torch.zeros(x.shape, dtype=x.dtype) if isinstance(x, InputSpec) else x, specs)


_LOADED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
"""Each executable loaded from bytes -> ``(payload, in_tree, out_tree)`` it was loaded from."""


class Unserializable(Error):
    """A program XLA cannot write down: one that calls back into Python."""


def serialized(executable) -> tuple:
    """``(payload, in_tree, out_tree)`` of ``executable``: the bytes it was loaded from, if it was
    loaded (XLA:CPU cannot serialize a loaded executable again: the copy lacks its compiled
    functions), else its serialization."""
    loaded = _LOADED.get(executable)
    if loaded is not None:
        return loaded
    try:
        return serialize_executable.serialize(executable)
    except (ValueError, NotImplementedError, AttributeError, TypeError, pickle.PicklingError) as error:
        raise Unserializable(
            "the program calls back into Python while it runs (a run-time check of its data, an "
            "ipu_print_tensor or a poptorch.CPU op): such a program cannot be saved to a file nor kept "
            f"in the executable cache, and compiles in each process ({type(error).__name__}: {error})") from error


def deserialized(payload: bytes, in_tree, out_tree, devices: list):
    """The executable ``payload`` holds, loaded onto ``devices`` (and remembered with its bytes)."""
    executable = serialize_executable.deserialize_and_load(payload, in_tree, out_tree, execution_devices=devices)
    _LOADED[executable] = (payload, in_tree, out_tree)
    return executable


def fingerprint(lowered) -> str:
    """What identifies a program: a hash of its lowered text and of its argument and result
    structures (two stages' programs may lower to one text, their parameters named apart)."""
    return hashlib.sha256(f"{lowered.as_text()} {lowered.in_tree} {lowered.out_tree}".encode()).hexdigest()


def device_ids(executable) -> list[int]:
    """The ids of the devices an executable runs on, in its device order."""
    sharding = jax.tree.leaves(executable.input_shardings)[0]
    mesh = getattr(sharding, "mesh", None)
    devices = list(mesh.devices.flat) if mesh is not None else sorted(sharding.device_set, key=lambda d: d.id)
    return [device.id for device in devices]


def devices_with_ids(ids: list[int]) -> list:
    """The JAX devices with ``ids`` (as :func:`device_ids` gives them), in that order."""
    by_id = {device.id: device for device in jax.devices()}
    return [by_id[i] for i in ids]


class Recording:
    """An executable source (``xla_compile.executables_from``) that hands back the ``executables``
    already compiled, in the order the runtime asks for them, and notes each one's program:
    building a model again under it gives what :func:`write` saves."""

    def __init__(self, executables: list):
        self._executables = iter(executables)
        self.programs: list[dict] = []

    def __call__(self, lowered):
        executable = next(self._executables)
        payload, _, _ = serialized(executable)
        self.programs.append({"executable": payload, "fingerprint": fingerprint(lowered),
                              "devices": device_ids(executable)})
        return executable


class Loading:
    """An executable source that loads the saved programs in order, each after checking that the
    program the runtime asks for is the one saved."""

    def __init__(self, data: dict, filename: str):
        self._programs, self._filename, self.used = data["programs"], filename, 0

    def _mismatch(self) -> Error:
        return Error(f"the executable in {self._filename} was compiled for another program: the model, "
                     "its options, its optimizer or the inputs differ from those it was saved with. "
                     "Compile the model again (or export it again)")

    def __call__(self, lowered):
        if self.used >= len(self._programs) or self._programs[self.used]["fingerprint"] != fingerprint(lowered):
            raise self._mismatch()
        saved = self._programs[self.used]
        self.used += 1
        return deserialized(saved["executable"], lowered.in_tree, lowered.out_tree, devices_with_ids(saved["devices"]))

    def check_complete(self) -> None:
        """Every saved program was loaded (none when the model was compiled already)."""
        if self.used not in (0, len(self._programs)):
            raise self._mismatch()


def destination(filename: str) -> str:
    """PopTorch's rules: missing folders are made; a folder gets ``model.poptorch`` inside."""
    folder = os.path.dirname(filename)
    if folder:
        os.makedirs(folder, exist_ok=True)
    if os.path.isdir(filename):
        return os.path.join(filename, "model.poptorch")
    return filename


def write(filename: str, data: dict) -> None:
    with open(filename, "wb") as file:
        pickle.dump({"format": FORMAT, "version": VERSION, **data}, file, protocol=4)


def read(filename: str) -> dict:
    """The contents of a file written by :func:`write`, or PopTorch's "Invalid file" error."""
    try:
        with open(filename, "rb") as file:
            data = pickle.load(file)
    except (OSError, pickle.UnpicklingError, EOFError) as error:
        raise Error(f"Invalid file {filename}: {error}") from error
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise Error(f"Invalid file {filename}: not a compiled program saved by ipu_backend")
    if data.get("version") != VERSION:
        raise Error(f"Invalid file {filename}: format version {data.get('version')}, this ipu_backend "
                    f"reads version {VERSION}")
    return data
