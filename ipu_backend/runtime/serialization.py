"""Compiled programs in a file: what PopTorch's ``save``, ``compileAndExport``,
``loadExecutable`` and ``poptorch.load`` read and write.

A file holds the XLA executable of a compiled step (``jax.experimental.serialize_executable``),
the shapes and dtypes of the inputs it was compiled for, the options, a fingerprint of the
program, and optionally the model and optimizer (pickled with their weights and state) and the
random state. Loading captures the model again (as PopTorch traces it again) to rebuild what the
host needs around the program, checks that the program is the one saved, and loads the
executable instead of compiling it. Like PopTorch's files, these are pickles: load only files you
trust.
"""

import hashlib
import os
import pickle
from dataclasses import dataclass

import torch
import torch.utils._pytree as torch_pytree
from jax.experimental import serialize_executable

from ipu_backend.errors import Error

FORMAT = "ipu_backend compiled program"
VERSION = 1


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


def fingerprint(lowered) -> str:
    """What identifies a program: a hash of its lowered text."""
    return hashlib.sha256(lowered.as_text().encode()).hexdigest()


def executable_bytes(executable) -> bytes:
    payload, _, _ = serialize_executable.serialize(executable)
    return payload


def load_executable(data: dict, lowered, filename: str, devices: list):
    """The executable saved in ``data`` for the program ``lowered``, after checking it is that
    program, loaded onto ``devices`` (those of the program's mesh)."""
    if data["fingerprint"] != fingerprint(lowered):
        raise Error(f"the executable in {filename} was compiled for another program: the model, its "
                    "options, its optimizer or the inputs differ from those it was saved with. "
                    "Compile the model again (or export it again)")
    return serialize_executable.deserialize_and_load(data["executable"], lowered.in_tree, lowered.out_tree,
                                                     execution_devices=devices)


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
