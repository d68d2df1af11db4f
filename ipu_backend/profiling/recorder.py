"""The recorder an executor reports to when ``Options.enableProfiling`` is on (the runtime's
interface, :mod:`ipu_backend.runtime.recording`): it notes each compilation and the wall-clock
marks of each call, and writes the reports into the executor's directory.

Files, in ``<profiling dir>/<model>/`` (``training``, ``inference``; for a Lightning step method
``training``, ``validation``, ``test``, ``predict``): ``compile_report.json`` and ``.html`` after
each compilation; ``execution_report.json``, ``.html`` and ``execution_trace.json`` after calls
1, 2, 4, 8, ..., when the executor is destroyed, and at exit.
"""

import atexit
import json
import os
import time
import weakref
from collections import deque

import jax

from ipu_backend.profiling.compile_page import compile_page
from ipu_backend.profiling.execution import Call, CallTotals, summarize
from ipu_backend.profiling.execution_page import execution_page
from ipu_backend.profiling.program_report import describe
from ipu_backend.profiling.trace import chrome_trace
from ipu_backend.runtime.recording import NullRecorder, ProgramFacts

DEFAULT_DIR = "ipu_reports"
"""Where ``IPUStrategy(autoreport=True)`` writes reports when given no ``autoreport_dir``."""
TRACE_CALLS = 3
"""The latest calls drawn in the trace (every call counts in the summary)."""
_MODEL_NAMES = {"training_step": "training", "validation_step": "validation", "test_step": "test",
                "predict_step": "predict"}
_OPEN: "weakref.WeakValueDictionary[str, Recorder]" = weakref.WeakValueDictionary()
"""Directories of the recorders alive in this process: two models never write into one."""


def _directory(root: str, name: str) -> str:
    """``root/name``, or ``root/name_2``, ... while another live recorder writes there."""
    path, suffix = os.path.join(root, name), 2
    while path in _OPEN:
        path, suffix = os.path.join(root, f"{name}_{suffix}"), suffix + 1
    return path


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as file:
        file.write(text)


class Recorder:
    """The reports of one executor (see the module docstring)."""

    times_inputs = True

    def __init__(self, root: str, name: str, training: bool):
        self.name, self.training = name, training
        self.directory = _directory(os.path.abspath(root), name)
        _OPEN[self.directory] = self
        self.reports: list[dict] = []
        self.totals: list[CallTotals] = []       # per report
        self.latest: deque[Call] = deque(maxlen=TRACE_CALLS)
        self.calls = 0
        self._programs = weakref.WeakKeyDictionary()     # a compiled program's facts -> report index
        self._marks: dict[str, float] = {}
        self._written_calls = 0
        atexit.register(_flush_at_exit, weakref.ref(self))

    # --- the executor's hooks, in the order of a call --------------------------------------------
    def started(self) -> None:
        self._marks = {"started": time.perf_counter()}

    def compiled(self, program: ProgramFacts, call_args: tuple) -> None:
        """Just compiled: the program's figures, compile time from the start of the call (capture,
        partitioning and XLA compilation)."""
        now = time.perf_counter()
        self._add(program, call_args, now - self._marks.get("started", program.compile_started))
        self._marks["compiled"] = now

    def inputs_on_device(self, call_args) -> None:
        jax.block_until_ready(call_args[1])
        self._marks["inputs"] = time.perf_counter()

    def computed(self, *results) -> None:
        jax.block_until_ready(results)
        self._marks["computed"] = time.perf_counter()

    def finished(self, program: ProgramFacts, call_args: tuple) -> None:
        if program not in self._programs:       # compiled earlier for another executor
            self._add(program, call_args, None)
        marks = self._marks
        start = max(marks["started"], marks.get("compiled", marks["started"]))
        call = Call(self._programs[program], start, marks["inputs"], marks["computed"], time.perf_counter())
        self.totals[call.program].add(call)
        self.latest.append(call)
        self.calls += 1
        if self.calls & (self.calls - 1) == 0:
            self.write_execution_report()

    def close(self) -> None:
        """The executor is destroyed: final reports; the directory is free for another model."""
        self.write_execution_report()
        _OPEN.pop(self.directory, None)

    # --- reports -----------------------------------------------------------------------------
    def _add(self, program: ProgramFacts, call_args: tuple, seconds: float | None) -> None:
        self._programs[program] = len(self.reports)
        self.reports.append(describe(program, call_args, seconds))
        self.totals.append(CallTotals())
        os.makedirs(self.directory, exist_ok=True)
        _write(os.path.join(self.directory, "compile_report.json"),
               json.dumps({"model": self.name, "programs": self.reports}, indent=1))
        _write(os.path.join(self.directory, "compile_report.html"), compile_page(self.name, self.reports))

    def write_execution_report(self) -> None:
        if not self.reports or self._written_calls == self.calls:
            return
        self._written_calls = self.calls
        summaries = [summarize(report, totals) for report, totals in zip(self.reports, self.totals)]
        _write(os.path.join(self.directory, "execution_report.json"),
               json.dumps({"model": self.name, "programs": summaries}, indent=1))
        _write(os.path.join(self.directory, "execution_trace.json"),
               json.dumps(chrome_trace(self.reports, list(self.latest), self.calls)))
        _write(os.path.join(self.directory, "execution_report.html"),
               execution_page(self.name, self.reports, summaries))


def _flush_at_exit(recorder: "weakref.ref[Recorder]") -> None:
    live = recorder()
    if live is not None:
        live.write_execution_report()


def recorder_for(options, training: bool, step_method: str | None):
    """The recorder of an executor: a :class:`Recorder` when ``options`` enable profiling."""
    if options.profiling_dir is None:
        return NullRecorder()
    name = _MODEL_NAMES.get(step_method, step_method) or ("training" if training else "inference")
    return Recorder(options.profiling_dir, name, training)
