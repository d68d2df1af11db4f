"""How the runtime has XLA compile its programs, and where a saved program can stand in."""

import contextlib
import contextvars
import os

import torch

from ipu_backend.compiler import float32_precision
from ipu_backend.compiler.backend import on_cpu, on_gpu
from ipu_backend.runtime.compile_progress import LOWERING, XLA_COMPILE, phase

CPU_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}
"""XLA:CPU's copy insertion with region analysis: it sees that a device-iterations loop may
update a weight in place once every reader of the old value has run, where the default analysis
copies some weights at the start of every iteration (same numbers, same compile time; the
device time saved is in docs/performance.md)."""

GPU_TRITON_GEMM = "xla_gpu_enable_triton_gemm"
"""XLA's GPU option that has it generate Triton kernels for matrix products, choosing each one's
tiling by compiling and timing candidates: most of a transformer's first call on a GPU, for
products somewhat faster than cuBLAS's (docs/performance.md). Off unless an executor's
``Options.autotuneMatmuls`` asks for it or ``XLA_FLAGS`` sets it."""

GPU_AUTOTUNE_LEVEL = "xla_gpu_autotune_level"
"""XLA's GPU option for how much it tunes kernels while compiling. At its default XLA times
cuDNN's algorithms for each convolution and keeps the fastest whose output passes a loose check:
some are far less exact in float32, and which one wins differs between compilations
(docs/performance.md, GPU). torch times them only under
``torch.backends.cudnn.benchmark``; otherwise cuDNN's heuristics choose, which level 0 asks of
XLA too. So a program with convolutions compiles at level 0 unless that flag is set,
``Options.autotuneMatmuls`` asks for tuning or ``XLA_FLAGS`` names the option."""

_SOURCE = contextvars.ContextVar("ipu_backend_executable_source", default=None)
_AUTOTUNE_MATMULS = contextvars.ContextVar("ipu_backend_autotune_matmuls", default=False)


@contextlib.contextmanager
def matmul_autotuning(enabled: bool):
    """Within the block, programs compiled for GPUs get XLA's Triton matrix-product kernels,
    tuned while compiling, when ``enabled`` (``Options.autotuneMatmuls``); else cuBLAS's."""
    token = _AUTOTUNE_MATMULS.set(enabled)
    try:
        yield
    finally:
        _AUTOTUNE_MATMULS.reset(token)


def compile_options(has_convolutions: bool = False) -> dict | None:
    """The XLA options a program compiled now gets: :data:`CPU_OPTIONS` on XLA:CPU; on GPUs,
    unless autotuning is asked for, :data:`GPU_TRITON_GEMM` off and, for a program with
    convolutions, :data:`GPU_AUTOTUNE_LEVEL` following ``torch.backends.cudnn.benchmark``; an
    option ``XLA_FLAGS`` names is left to it."""
    if on_cpu():
        return CPU_OPTIONS
    if not on_gpu() or _AUTOTUNE_MATMULS.get():
        return None
    options = {}
    if GPU_TRITON_GEMM not in os.environ.get("XLA_FLAGS", ""):
        options[GPU_TRITON_GEMM] = False
    if has_convolutions and not convolutions_autotuned():
        options[GPU_AUTOTUNE_LEVEL] = 0
    return options or None


def convolutions_autotuned() -> bool:
    """Whether XLA times cuDNN's algorithms for the convolutions of GPU programs compiled now
    (:data:`GPU_AUTOTUNE_LEVEL`): under ``torch.backends.cudnn.benchmark``,
    ``Options.autotuneMatmuls`` or an ``XLA_FLAGS`` level other than 0."""
    flags = os.environ.get("XLA_FLAGS", "")
    named = GPU_AUTOTUNE_LEVEL in flags and f"{GPU_AUTOTUNE_LEVEL}=0" not in flags
    return bool(torch.backends.cudnn.benchmark) or _AUTOTUNE_MATMULS.get() or named


def program_settings() -> tuple | None:
    """What of the process's settings a program compiled now bakes in, for the caches of compiled
    programs: nothing on the CPU; on GPUs, torch's float32 precision
    (``float32_precision.program_key``) and whether convolutions are tuned."""
    precision = float32_precision.program_key()
    return None if precision is None else (precision, convolutions_autotuned())


def has_convolutions(lowered) -> bool:
    """Whether a lowered program holds a convolution (cuDNN's algorithms, chosen while compiling)."""
    return "stablehlo.convolution" in lowered.as_text()


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
    """``lowered.compile()`` with :func:`compile_options` (or the executable of
    :func:`executables_from`'s source)."""
    source = _SOURCE.get()
    if source is not None:
        return source(lowered)
    return compile_now(lowered)


def compile_now(lowered):
    """``lowered.compile()`` by XLA with :func:`compile_options` (a source of
    :func:`executables_from` may call it for a program it does not hold)."""
    with phase(XLA_COMPILE):
        return lowered.compile(compile_options(on_gpu() and has_convolutions(lowered)))
