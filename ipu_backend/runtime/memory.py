"""The emulated IPU's memory: a per-IPU estimate, and the out-of-memory check.

An IPU holds everything in its In-Processor-Memory: weights, optimizer state (unless offloaded
to the host), gradient accumulators, the activations stashed between a micro-batch's forward and
backward passes, and the temporaries of the programs it runs. :func:`estimate` adds these per
IPU — sizes from the arrays the programs hold, temporaries from XLA's memory analysis of each
compiled program — and :func:`check` compares them with the
:class:`~ipu_backend.hardware.IpuSpec`.
"""

import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

import jax
import numpy as np

from ipu_backend.errors import Error
from ipu_backend.hardware import MB, MEMORY_CHECKS, IpuSpec


@dataclass
class IpuMemory:
    """Bytes one IPU needs, by kind."""

    ipu: int
    weights: int = 0
    optimizer: int = 0
    accumulators: int = 0
    stash: int = 0
    temporaries: int = 0
    offloaded: int = 0            # optimizer state kept in host memory (not counted in total)
    stages: list = field(default_factory=list)
    phases: dict = field(default_factory=dict)   # phase -> what it holds (phased strategies)

    @property
    def total(self) -> int:
        return self.weights + self.optimizer + self.accumulators + self.stash + self.temporaries

    def as_dict(self) -> dict:
        return {"ipu": self.ipu, "stages": list(self.stages), "weights": self.weights,
                "optimizer": self.optimizer, "accumulators": self.accumulators,
                "stash": self.stash, "temporaries": self.temporaries,
                "offloaded_to_host": self.offloaded, "total": self.total,
                "phases": {p: dict(held) for p, held in self.phases.items()}}


@dataclass(frozen=True)
class StageMemory:
    """What one stage holds on its IPU (bytes for one replica)."""

    stage: int
    ipu: int
    weights: int
    optimizer: int
    accumulators: int
    stash_per_micro_batch: int
    stashed_micro_batches: int
    temporaries: int
    optimizer_offloaded: bool
    phase: int | None = None


_RESIDENT = ("weights", "optimizer", "accumulators", "stash")
"""What a phased strategy keeps on an IPU only while the phase that uses it runs."""


def tree_bytes(tree) -> int:
    """Bytes of the arrays of ``tree`` (random keys excluded: they are not model state)."""
    return sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree)
               if not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key))


def estimate(stages: Iterable[StageMemory]) -> list[IpuMemory]:
    """Per-IPU usage: stages on one IPU add up, except temporaries (one program runs at a time).
    In a phased strategy a phase's tensors are on its IPUs only while it runs (loaded from and
    written back to host memory between phases): an IPU needs what its largest phase holds."""
    stages = list(stages)
    if any(stage.phase is not None for stage in stages):
        return _phased_estimate(stages)
    ipus: dict[int, IpuMemory] = {}
    for stage in stages:
        usage = ipus.setdefault(stage.ipu, IpuMemory(stage.ipu))
        usage.stages.append(stage.stage)
        usage.weights += stage.weights
        usage.accumulators += stage.accumulators
        usage.stash += stage.stash_per_micro_batch * stage.stashed_micro_batches
        usage.temporaries = max(usage.temporaries, stage.temporaries)
        if stage.optimizer_offloaded:
            usage.offloaded += stage.optimizer
        else:
            usage.optimizer += stage.optimizer
    return [ipus[i] for i in sorted(ipus)]


def _phased_estimate(stages: list[StageMemory]) -> list[IpuMemory]:
    per_phase: dict[tuple[int, int], IpuMemory] = {}
    for stage in stages:
        phase = 0 if stage.phase is None else stage.phase
        per_phase.setdefault((stage.ipu, phase), IpuMemory(stage.ipu))
        [held] = estimate([StageMemory(**{**stage.__dict__, "phase": None})])
        usage = per_phase[stage.ipu, phase]
        for kind in _RESIDENT + ("offloaded",):
            setattr(usage, kind, getattr(usage, kind) + getattr(held, kind))
        usage.temporaries = max(usage.temporaries, held.temporaries)
        usage.stages.append(stage.stage)
    ipus: dict[int, IpuMemory] = {}
    for (ipu, phase), held in sorted(per_phase.items()):
        usage = ipus.setdefault(ipu, IpuMemory(ipu))
        usage.stages += held.stages
        usage.phases[phase] = {"stages": list(held.stages), "total": held.total,
                               **{kind: getattr(held, kind) for kind in _RESIDENT}}
        peak = max(usage.phases.values(), key=lambda p: p["total"])
        for kind in _RESIDENT:
            setattr(usage, kind, peak[kind])
        usage.temporaries = max(usage.temporaries, held.temporaries)
        usage.offloaded += held.offloaded
    return [ipus[i] for i in sorted(ipus)]


def _mb(n: int) -> str:
    """Bytes as a person reads them: ``512 B``, ``12.3 kB``, ``1,234.5 MB``."""
    if n < 1_000:
        return f"{n} B"
    if n < MB:
        return f"{n / 1_000:.1f} kB"
    return f"{n / MB:,.1f} MB"


def describe(usage: list[IpuMemory], spec: IpuSpec) -> str:
    lines = [f"  IPU{u.ipu} (stages {', '.join(map(str, u.stages))}): {_mb(u.total)} of {_mb(spec.memory_bytes)}"
             f" — weights {_mb(u.weights)}, optimizer {_mb(u.optimizer)}"
             f"{f' (+{_mb(u.offloaded)} on the host)' if u.offloaded else ''}, accumulators "
             f"{_mb(u.accumulators)}, stashed activations {_mb(u.stash)}, temporaries {_mb(u.temporaries)}"
             for u in usage]
    return "\n".join(lines)


class OutOfMemoryError(Error):
    """The model does not fit the emulated IPUs' memory."""


def check(usage: list[IpuMemory], spec: IpuSpec, mode: str = "error") -> None:
    """Raise :class:`OutOfMemoryError` (or warn, per ``mode``) when an IPU is over its memory."""
    if mode not in MEMORY_CHECKS:
        raise Error(f"the memory check must be one of {MEMORY_CHECKS}, got {mode!r}")
    over = [u for u in usage if u.total > spec.memory_bytes]
    if not over or mode == "off":
        return
    message = (f"Out of memory on {len(over)} of {len(usage)} IPU(s) ({spec.name}, "
               f"{_mb(spec.memory_bytes)} each):\n{describe(usage, spec)}\n"
               "To fit: split the model over more stages (more poptorch.Block / Stage on more IPUs), "
               "recompute activations (recomputationCheckpoint and opts._Popart.set("
               "'autoRecomputation', 3)), offload the optimizer state (opts.TensorLocations."
               "setOptimizerLocation(poptorch.TensorLocationSettings().useOnChipStorage(False))), "
               "or reduce the micro-batch size.")
    if mode == "warn":
        warnings.warn(message, stacklevel=4)
        return
    raise OutOfMemoryError(message)


def single_ipu_usage(executable, state: dict, replicas_per_device: int,
                     optimizer_offloaded: bool = False) -> list[IpuMemory]:
    """The estimate of one replica of a single-IPU program called with ``state``: its weights,
    buffers and optimizer state are the arrays it is called with, and its temporaries
    (activations and gradients of the micro-batch being run, gradient sums included) come from
    XLA's memory analysis; nothing is stashed between programs."""
    analysis = executable.memory_analysis()
    temporaries = 0 if analysis is None else int(analysis.temp_size_in_bytes) // replicas_per_device
    stage = StageMemory(
        stage=0, ipu=0, weights=tree_bytes(state["params"]) + tree_bytes(state["buffers"]),
        optimizer=tree_bytes(state.get("opt")), accumulators=0, stash_per_micro_batch=0,
        stashed_micro_batches=0, temporaries=temporaries, optimizer_offloaded=optimizer_offloaded)
    return estimate([stage])
