"""What the runtime tells whoever records its work: a small interface the runtime defines, so
that the reports (:mod:`ipu_backend.profiling`) depend on the runtime and never the reverse.

An executor calls its recorder in the order of a call: :meth:`~NullRecorder.started`,
:meth:`~NullRecorder.compiled` (only when the call compiled), :meth:`~NullRecorder.inputs_on_device`,
:meth:`~NullRecorder.computed`, :meth:`~NullRecorder.finished`; and :meth:`~NullRecorder.close`
when it is destroyed. What it says of a compiled program is a :class:`ProgramFacts`.
"""

from dataclasses import dataclass

from ipu_backend.hardware import IpuSpec
from ipu_backend.runtime.memory import IpuMemory
from ipu_backend.runtime.schedule import Schedule

SINGLE_IPU, MANUAL, PIPELINED, SHARDED = ("single IPU", "single IPU, manual optimization", "pipelined",
                                         "sharded")
"""How a program executes (:attr:`ProgramFacts.execution`)."""
BACKWARD, UPDATE = "backward", "update"
"""The passes of a manual-optimization step (:attr:`ProgramFacts.manual_passes`)."""


@dataclass(frozen=True)
class StageFacts:
    """One stage of a compiled program: where it runs, its graph nodes and its XLA executables."""

    index: int
    ipu: int
    nodes: tuple
    programs: dict


@dataclass(eq=False)
class ProgramFacts:
    """A compiled program as the runtime describes it to a recorder, made once per program (a
    recorder may key its reports by it: equality is identity)."""

    training: bool
    schedule: Schedule
    execution: str                           # SINGLE_IPU, MANUAL, PIPELINED or SHARDED
    ipus_per_replica: int
    stages: tuple[StageFacts, ...]
    memory: list[IpuMemory]                  # the estimate the memory check used, one replica
    ipu_spec: IpuSpec
    compile_started: float                   # time.perf_counter() when its capture started
    manual_passes: tuple[str, ...] | None = None   # BACKWARD/UPDATE in order, manual optimization


class NullRecorder:
    """The recorder interface, recording nothing (profiling off)."""

    times_inputs = False
    """Whether calls should place their inputs on the devices before the program runs, so that
    their copy is timed apart (otherwise the compiled program takes host arrays)."""

    def started(self) -> None:
        """A call starts (before any compilation)."""

    def compiled(self, program: ProgramFacts, call_args: tuple) -> None:
        """The call compiled ``program``; it will run with ``call_args``."""

    def inputs_on_device(self, call_args: tuple) -> None:
        """The call's arguments are placed; the program is about to run."""

    def computed(self, *results) -> None:
        """The program was launched and returned ``results`` (device arrays)."""

    def finished(self, program: ProgramFacts, call_args: tuple) -> None:
        """The call's outputs are on the host."""

    def close(self) -> None:
        """The executor is destroyed."""
