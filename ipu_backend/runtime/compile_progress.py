"""Feedback while a program compiles: PopTorch's "Graph compilation" display on the terminal, and
each phase's time in the log.

A compilation runs in phases: *capture* (``torch.export`` and decomposition), *lowering* (JAX
traces the lowered ops and emits MLIR) and *XLA compile*; what the executor does around them
(weights and optimizer state placed, memory checked) is *other*. An executor opens a
:func:`compilation` around a call that may compile; the runtime marks each phase with
:func:`phase`. A call that finds its program compiled shows and logs nothing.

The display is one line on standard error, redrawn in place with the current phase and the time
elapsed, and left as a summary when the compilation ends. It is silent when standard error is
not a terminal, when ``Options.showCompilationProgressBar(False)`` is set, or when the
environment variable :data:`ENVIRONMENT_VARIABLE` is ``0``. Where another display owns the
terminal (Lightning's progress bar), :func:`shown_by` hands the updates to it instead. The
phases' times are logged at INFO on the ``ipu_backend`` logger whatever is shown.
"""

import contextlib
import contextvars
import logging
import os
import sys
import threading
import time
from typing import Protocol

from ipu_backend.runtime import collector_pause

logger = logging.getLogger("ipu_backend")

ENVIRONMENT_VARIABLE = "IPU_BACKEND_COMPILATION_PROGRESS"
"""``0`` (or ``false``, ``off``, ``no``) turns the display off in every executor."""

CAPTURE, LOWERING, XLA_COMPILE, OTHER = "capture", "lowering", "XLA compile", "other"
PHASES = (CAPTURE, LOWERING, XLA_COMPILE)

REDRAW_SECONDS = 0.2
"""How often the terminal line's elapsed time is redrawn while a phase runs."""

_OFF_VALUES = {"0", "false", "off", "no"}


class Status:
    """Where a compilation stands: the phase running (None between phases), each phase's seconds
    so far, and the seconds since it started (``perf_counter`` time ``started``): counted up to
    now while it runs, fixed once it has ended."""

    def __init__(self, phase: str | None, seconds: dict, started: float, ended: float | None = None):
        self.phase, self.seconds = phase, seconds
        self._started, self._ended = started, ended

    @property
    def elapsed(self) -> float:
        return (self._ended if self._ended is not None else time.perf_counter()) - self._started

    def line(self) -> str:
        """``Graph compilation: <phase>... [<elapsed> s] (<other phase> <s> s, ...)`` while it runs."""
        done = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.seconds.items() if name != self.phase)
        return f"Graph compilation: {self.phase or ''}... [{self.elapsed:.1f} s]" + (f" ({done})" if done else "")

    def summary(self) -> str:
        """``Graph compilation: done in <total> s (<phase> <s> s, ...)`` once it has ended."""
        return f"Graph compilation: done in {self.elapsed:.1f} s ({self.breakdown()})"

    def failure(self) -> str:
        """``Graph compilation: failed after <total> s`` (the error follows)."""
        return f"Graph compilation: failed after {self.elapsed:.1f} s ({self.breakdown()})"

    def breakdown(self) -> str:
        return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.seconds.items())


class Display(Protocol):
    """What shows a compilation's progress: told of each change and of the end
    (``status.summary()``, or ``status.failure()`` when it raised)."""

    def update(self, status: Status) -> None: ...

    def close(self, status: Status, failed: bool) -> None: ...


class TerminalLine:
    """The status as one line of ``stream`` redrawn in place (a thread redraws the elapsed time
    while a phase runs), left as the summary at the end."""

    def __init__(self, stream, redraw_seconds: float = REDRAW_SECONDS):
        self._stream = stream
        self._lock = threading.Lock()
        self._latest: Status | None = None
        self._stop = threading.Event()
        self._redraw_seconds = redraw_seconds
        self._thread: threading.Thread | None = None

    def update(self, status: Status) -> None:
        with self._lock:
            self._latest = status
            self._write("\r" + status.line() + "\x1b[K")
        if self._thread is None:
            self._thread = threading.Thread(target=self._redraw, name="ipu_backend compile progress", daemon=True)
            self._thread.start()

    def close(self, status: Status, failed: bool) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            self._write("\r" + (status.failure() if failed else status.summary()) + "\x1b[K\n")

    def _redraw(self) -> None:
        while not self._stop.wait(self._redraw_seconds):
            with self._lock:
                if self._latest.phase is not None and not self._stop.is_set():
                    self._write("\r" + self._latest.line() + "\x1b[K")

    def _write(self, text: str) -> None:
        self._stream.write(text)
        self._stream.flush()


_DEFAULT = object()
_DISPLAY = contextvars.ContextVar("ipu_backend_compile_display", default=_DEFAULT)
_CURRENT = contextvars.ContextVar("ipu_backend_compilation", default=None)


def display_enabled() -> bool:
    """Whether :data:`ENVIRONMENT_VARIABLE` leaves the display on."""
    return os.environ.get(ENVIRONMENT_VARIABLE, "1").strip().lower() not in _OFF_VALUES


@contextlib.contextmanager
def shown_by(display: Display | None):
    """Within the block, compilations report to ``display`` instead of standard error (None:
    nothing is shown; the log still gets the phases' times)."""
    token = _DISPLAY.set(display)
    try:
        yield
    finally:
        _DISPLAY.reset(token)


def _display(show: bool) -> Display | None:
    if not show or not display_enabled():
        return None
    chosen = _DISPLAY.get()
    if chosen is not _DEFAULT:
        return chosen
    stream = sys.stderr
    isatty = getattr(stream, "isatty", None)
    return TerminalLine(stream) if isatty is not None and isatty() else None


class Compilation:
    """The phases of one compilation, timed; the innermost phase open gets the time. From its
    first phase to its end the garbage collector leaves older objects alone
    (``collector_pause``)."""

    def __init__(self, label: str, display: Display | None):
        self.label = label
        self._display = display
        self._started = self._mark = time.perf_counter()
        self._open: list[str] = []
        self._closed = False
        self.seconds: dict[str, float] = {}

    def begin(self, name: str) -> None:
        if not self.seconds and not self._closed:
            collector_pause.hold()
        self._charge()
        self._open.append(name)
        self.seconds.setdefault(name, 0.0)
        self._show()

    def end(self, name: str) -> None:
        self._charge()
        self._open.remove(name)
        self._show()

    def status(self) -> Status:
        seconds = {name: self.seconds[name] for name in sorted(self.seconds, key=_phase_order)}
        return Status(self._open[-1] if self._open else None, seconds, self._started)

    def close(self, failed: bool = False, how: str = "compiled") -> None:
        """The end: the display left with the summary and the phases' times logged (nothing if no
        phase ran: the program was compiled already), ``how`` saying where the executable came
        from (``compiled``, ``loaded`` from disk, ``reused`` from memory). Once only."""
        if not self.seconds or self._closed:
            return
        self._closed = True
        collector_pause.release()
        ended = time.perf_counter()
        seconds = self.status().seconds
        seconds[OTHER] = max(0.0, ended - self._started - sum(seconds.values()))
        status = Status(None, seconds, self._started, ended)
        if not failed:
            logger.info("%s the %s program in %.2f s (%s)", how, self.label, status.elapsed, status.breakdown())
        if self._display is not None:
            self._display.close(status, failed)

    def _charge(self) -> None:
        now = time.perf_counter()
        if self._open:
            self.seconds[self._open[-1]] += now - self._mark
        self._mark = now

    def _show(self) -> None:
        if self._display is not None and not self._closed:
            self._display.update(self.status())


def _phase_order(name: str) -> int:
    return PHASES.index(name) if name in PHASES else len(PHASES)


@contextlib.contextmanager
def compilation(label: str, show: bool = True):
    """Within the block, :func:`phase` marks report to one compilation of the ``label`` program
    (``training``, ``inference``...), shown when ``show`` (``Options.showCompilationProgressBar``)
    and the display allow, and logged when the block ends if any phase ran. Nested blocks join
    the outer one."""
    if _CURRENT.get() is not None:
        yield _CURRENT.get()
        return
    current = Compilation(label, _display(show))
    token = _CURRENT.set(current)
    try:
        yield current
    except BaseException:
        current.close(failed=True)
        raise
    else:
        current.close()
    finally:
        _CURRENT.reset(token)


def finish(how: str = "compiled") -> None:
    """The compilation open has its executable (``how``: ``compiled``, ``loaded`` or ``reused``):
    it ends now (shown and logged), not when its block ends, which may go on to run the program."""
    current = _CURRENT.get()
    if current is not None:
        current.close(how=how)


@contextlib.contextmanager
def phase(name: str):
    """Time the block as phase ``name`` of the compilation open (nothing outside one)."""
    current = _CURRENT.get()
    if current is None:
        yield
        return
    current.begin(name)
    try:
        yield
    finally:
        current.end(name)
