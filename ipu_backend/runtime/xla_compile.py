"""How the runtime has XLA compile its programs."""

from ipu_backend.compiler.lowerings.backend import on_cpu

CPU_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}
"""XLA:CPU's copy insertion with region analysis: it sees that a device-iterations loop may
update a weight in place once every reader of the old value has run, where the default analysis
copies some weights at the start of every iteration (same numbers, same compile time; the
device time saved is in docs/performance.md)."""


def compile_lowered(lowered):
    """``lowered.compile()``, with :data:`CPU_OPTIONS` when it compiles for XLA:CPU."""
    return lowered.compile(CPU_OPTIONS if on_cpu() else None)
