"""PopTorch's timing queries on an executor, backed by times measured on the host.

An emulated IPU has no cycle counter and its programs run as fused XLA code, so nothing inside a
call is sampled. Each call marks four host times (``CallMarks``): the call starts (inputs
requested), the inputs are on the devices and the program is launched, its results are ready,
and the outputs are torch tensors. ``cycleCount`` is the compute interval at an Mk2 IPU's clock;
``getPerfCounters`` gives PopTorch's per-tensor, per-step timestamps, the steps of a call spread
evenly over its compute interval; the latencies follow from them as in PopTorch.
"""

import datetime
import time
from dataclasses import dataclass

from ipu_backend.errors import Error
from ipu_backend.hardware import MK2_CLOCK_HZ


@dataclass(frozen=True)
class CallMarks:
    """``time.perf_counter()`` marks of one executor call (see the module docstring), and how
    many input tensors it had."""

    inputs: int
    started: float
    launched: float
    ready: float
    finished: float


def now() -> float:
    return time.perf_counter()


class ExecutionCounters:
    """PopTorch's ``compilationTime``, ``cycleCount``, ``getPerfCounters`` and latencies; mixed into
    the executor, which sets ``_last_marks`` after each call and ``seconds`` on each compiled
    program, and reads its options as ``_settings`` (a ``RunSettings``)."""

    _last_marks: CallMarks | None = None

    def compilationTime(self) -> datetime.timedelta:  # noqa: N802
        """How long the model's compilation took (capture, lowering and XLA compilation) — the
        program of the last call, or the last compiled."""
        compiled = self._timed_program()
        if compiled is None:
            raise Error("Please compile the model before obtaining compilation time.")
        if not self._settings.show_compilation_progress:
            raise Error("Please set showCompilationProgressBar option to obtain compilation time.")
        return datetime.timedelta(seconds=compiled.seconds)

    def cycleCount(self) -> int:  # noqa: N802
        """The compute time of the last call in Mk2 IPU cycles (measured time × 1.33 GHz);
        needs ``Options.logCycleCount(True)``, as in PopTorch."""
        if not self._settings.log_cycle_count:
            raise Error("Cycle count logging is disabled. Please set option logCycleCount to True "
                        "to enable.")
        marks = self._last_marks
        if marks is None:
            raise Error("Please run the model at least once before obtaining cycle count.")
        return max(1, round((marks.ready - marks.launched) * MK2_CLOCK_HZ))

    def getPerfCounters(self) -> dict:  # noqa: N802
        """Timestamps (seconds, ``time.perf_counter``) of the last call: ``input``,
        ``input_complete``, ``output`` and ``output_complete``, each a list per input (or output)
        tensor of one value per step, as PopTorch counts them: each micro-batch of each replica
        for the inputs, the output mode's steps on each replica for the outputs; none under
        synthetic data, which copies nothing between host and device."""
        marks, compiled = self._last_marks, self._timed_program()
        if marks is None or compiled is None:
            return {"input": [[]], "input_complete": [[]], "output": [[]], "output_complete": [[]]}
        schedule = self._schedule()
        input_steps = schedule.device_iterations * schedule.accumulation * schedule.replicas
        output_steps = self._output_steps(schedule)
        if self._settings.synthetic_data:
            input_steps = output_steps = 0
        spread = [marks.launched + (marks.ready - marks.launched) * (i + 1) / output_steps
                  for i in range(output_steps)]
        inputs = max(1, marks.inputs)
        outputs = max(1, len(compiled.output_dtypes))
        return {"input": [[marks.started] * input_steps for _ in range(inputs)],
                "input_complete": [[marks.launched] * input_steps for _ in range(inputs)],
                "output": [list(spread) for _ in range(outputs)],
                "output_complete": [[marks.finished] * output_steps for _ in range(outputs)]}

    def getHostIpuLatency(self) -> tuple:  # noqa: N802
        """(min, max, mean) seconds from the first input requested to the last input on the IPU."""
        return self._latency("input", min, "input_complete", max)

    def getComputeLatency(self) -> tuple:  # noqa: N802
        """(min, max, mean) seconds from the last input on the IPU to the last output ready."""
        return self._latency("input_complete", max, "output", max)

    def getIpuHostLatency(self) -> tuple:  # noqa: N802
        """(min, max, mean) seconds from the first output ready to the last output on the host."""
        return self._latency("output", min, "output_complete", max)

    def getLatency(self) -> tuple:  # noqa: N802
        """(min, max, mean) round-trip seconds from the first input requested to the last output
        on the host."""
        return self._latency("input", min, "output_complete", max)

    # --- internals -----------------------------------------------------------------------------
    def _timed_program(self):
        """The compiled program of the last call (else the latest one compiled), or None."""
        if self.last_program is not None:
            for compiled in self._compiled.values():
                if compiled.program is self.last_program and compiled.executable is not None:
                    return compiled
        ready = [c for c in self._compiled.values() if c.executable is not None]
        return ready[-1] if ready else None

    @staticmethod
    def _output_steps(schedule) -> int:
        """Output steps as PopTorch counts them, on each replica: every micro-batch (All), those
        of every Nth device iteration (EveryN), one (Final, Sum)."""
        mode = schedule.output_mode
        per_iteration = schedule.accumulation * schedule.replicas      # micro-batches of every replica
        if mode == "all":
            return schedule.device_iterations * per_iteration
        if mode == "every_n":
            return max(1, schedule.device_iterations // schedule.output_period) * per_iteration
        return schedule.replicas

    def _latency(self, start: str, start_reduce, end: str, end_reduce) -> tuple:
        """PopTorch's latency figures between two counters: per output step, the earliest of its
        group of input steps to its end."""
        counters = self.getPerfCounters()
        starts = [start_reduce(values) for values in zip(*counters[start])]
        ends = [end_reduce(values) for values in zip(*counters[end])]
        if not ends:
            return (0.0, 0.0, 0.0)
        group = len(starts) // len(ends)
        durations = [end - min(starts[i * group:(i + 1) * group]) for i, end in enumerate(ends)]
        return (min(durations), max(durations), sum(durations) / len(durations))

