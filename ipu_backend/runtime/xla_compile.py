"""How the runtime has XLA compile its programs, and where a saved program can stand in."""

import contextlib
import contextvars

from ipu_backend.compiler.backend import on_cpu
from ipu_backend.runtime.compile_progress import LOWERING, XLA_COMPILE, phase

CPU_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}
"""XLA:CPU's copy insertion with region analysis: it sees that a device-iterations loop may
update a weight in place once every reader of the old value has run, where the default analysis
copies some weights at the start of every iteration (same numbers, same compile time; the
device time saved is in docs/performance.md)."""

_SOURCE = contextvars.ContextVar("ipu_backend_executable_source", default=None)


@contextlib.contextmanager
def executables_from(source):
    """Within the block, each program the runtime would compile is handed to ``source(lowered)``
    instead, which returns its executable (a saved one: ``runtime/serialization.py``)."""
    token = _SOURCE.set(source)
    try:
        yield source
    finally:
        _SOURCE.reset(token)


def substituted() -> bool:
    """Whether :func:`executables_from` hands out the executables here (a cached one must not
    stand in for it)."""
    return _SOURCE.get() is not None


def compile_jitted(jitted, *args):
    """``jitted`` traced and lowered for ``args``, then :func:`compile_lowered`; each part timed as
    its phase of the compilation (``compile_progress``)."""
    with phase(LOWERING):
        lowered = jitted.lower(*args)
    return compile_lowered(lowered)


def compile_lowered(lowered):
    """``lowered.compile()``, with :data:`CPU_OPTIONS` when it compiles for XLA:CPU (or the
    executable of :func:`executables_from`'s source)."""
    source = _SOURCE.get()
    if source is not None:
        return source(lowered)
    return compile_now(lowered)


def compile_now(lowered):
    """``lowered.compile()`` by XLA, with :data:`CPU_OPTIONS` on XLA:CPU (a source of
    :func:`executables_from` may call it for a program it does not hold)."""
    with phase(XLA_COMPILE):
        return lowered.compile(CPU_OPTIONS if on_cpu() else None)
