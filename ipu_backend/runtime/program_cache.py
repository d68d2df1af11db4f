"""Compiled programs kept in memory, bounded, least recently used first out.

Each executor keeps the programs of its own input signatures; the process keeps the programs
any executor compiled, keyed by what they compute (the captured program's identity, the
options that change the program, the optimizer's structure, the inputs), so that a new executor
of an equal model (a second ``Trainer.fit``, an ``inferenceModel`` made again) reuses one
instead of compiling it again. Both are bounded: a loop over many input shapes keeps only the
latest ``IPU_BACKEND_PROGRAM_CACHE_SIZE`` programs (16 unless set).
"""

import os
from collections import OrderedDict

from ipu_backend.errors import Error

SIZE_VARIABLE = "IPU_BACKEND_PROGRAM_CACHE_SIZE"
DEFAULT_SIZE = 16


def capacity() -> int:
    """How many programs a cache keeps (``$IPU_BACKEND_PROGRAM_CACHE_SIZE``, else 16)."""
    text = os.environ.get(SIZE_VARIABLE, "")
    if not text:
        return DEFAULT_SIZE
    if not text.isdigit() or int(text) < 1:
        raise Error(f"{SIZE_VARIABLE}={text!r}: give a positive number of programs")
    return int(text)


class ProgramCache:
    """A mapping that keeps its ``size`` most recently used entries."""

    def __init__(self, size: int | None = None):
        self.size = capacity() if size is None else size
        self._entries: OrderedDict = OrderedDict()

    def get(self, key, default=None):
        entry = self._entries.get(key, default)
        if key in self._entries:
            self._entries.move_to_end(key)
        return entry

    def __setitem__(self, key, value) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def __getitem__(self, key):
        return self._entries[key]

    def __contains__(self, key) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self):
        return iter(self._entries)

    def values(self):
        return self._entries.values()

    def clear(self) -> None:
        self._entries.clear()


SHARED = ProgramCache()
"""The process's compiled programs, by what they compute (see the module docstring)."""
