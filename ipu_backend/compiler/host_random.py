"""Random numbers drawn on the host while a model or step is captured: refused.

A captured program's Python runs once, so ``if random.random() < 0.5: x = x.flip(-1)`` or
``x * np.random.uniform(0.5, 1.5)`` bakes the one draw made at capture into every call, where
torch on the CPU draws anew at each. The generators such code draws from (Python's ``random``
module, NumPy's global generator, and ``random.Random``, ``np.random.Generator`` or
``np.random.RandomState`` objects the module tree holds) are compared before and after the
capture; any that moved is named in an error. torch's own random functions are ops of the
program, which draws anew every step.
"""

import contextlib
import random

import numpy as np
import torch

from ipu_backend.compiler import python_reads
from ipu_backend.errors import Error

_GENERATORS = (random.Random, np.random.Generator, np.random.RandomState)


def _state(generator):
    if isinstance(generator, random.Random):
        return generator.getstate()
    if isinstance(generator, np.random.Generator):
        return generator.bit_generator.state
    return generator.get_state(legacy=False)


def _same(a, b) -> bool:
    """Equal generator states (nested dicts, tuples and arrays)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    return a == b


def _generators(module: torch.nn.Module | None) -> list[tuple[str, object]]:
    """Each generator a capture could draw from, with how the user's code names it."""
    found = [("Python's random module", random._inst), ("NumPy's global generator (np.random)", np.random.mtrand._rand)]
    if module is not None:
        for path, submodule in python_reads.guarded_modules(module):
            for name, value in vars(submodule).items():
                if isinstance(value, _GENERATORS):
                    found.append((f"self.{path}.{name}" if path else f"self.{name}", value))
    return found


@contextlib.contextmanager
def kept():
    """The global generators' states put back after the block: user code run once at capture for
    its shapes only (``poptorch.CPU`` functions) must not consume the draws of its later runs."""
    states = [(generator, _state(generator)) for _, generator in _generators(None)]
    try:
        yield
    finally:
        for generator, state in states:
            if isinstance(generator, random.Random):
                generator.setstate(state)
            else:
                generator.set_state(state)


@contextlib.contextmanager
def refused(module: torch.nn.Module, what: str):
    """An error, when the block (the capture of ``what``) ends, naming each generator it drew from."""
    generators = [(name, generator, _state(generator)) for name, generator in _generators(module)]
    yield
    moved = [name for name, generator, state in generators if not _same(state, _state(generator))]
    if moved:
        raise Error(f"the {what} draws random numbers from {', '.join(moved)} while it is captured: its Python "
                    "runs once, at capture, so every call would reuse that one draw, where torch on the CPU "
                    "draws anew each time. Draw with torch instead (torch.rand, torch.randint, torch.bernoulli, "
                    "torch.randperm: ops of the compiled program, which draws anew every step), or on the host "
                    "in the dataset or a transform")
