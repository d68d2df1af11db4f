"""The compilation's progress display and its phase times in the log (runtime/compile_progress.py)."""

import contextlib
import gc
import io
import logging
import re
import time

import pytest
import torch
import torch.nn.functional as F

import ipu_backend as poptorch
from ipu_backend.runtime import compile_progress, program_cache


@pytest.fixture(autouse=True)
def compiles_afresh(monkeypatch):
    """Each test's first call compiles: no program from another test, in memory or on disk."""
    monkeypatch.setattr(program_cache, "SHARED", program_cache.ProgramCache())
    monkeypatch.setenv("IPU_BACKEND_CACHE_DIR", "off")


PHASE_LOG = re.compile(r"compiled the training program in \d+\.\d\d s \(capture \d+\.\d\d s, "
                       r"lowering \d+\.\d\d s, XLA compile \d+\.\d\d s, other \d+\.\d\d s\)")


class Terminal(io.StringIO):
    """Standard error as a terminal."""

    def isatty(self) -> bool:
        return True


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)

    def forward(self, x, y):
        out = self.linear(x)
        return out, F.mse_loss(out, y)


def first_call(options=None, stderr=None) -> str:
    """What two calls of a new model (the first compiles) write to ``stderr``."""
    stderr = stderr if stderr is not None else Terminal()
    net = Regression()
    model = poptorch.trainingModel(net, options or poptorch.Options(),
                                   optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    with contextlib.redirect_stderr(stderr):
        model(torch.randn(4, 3), torch.randn(4, 2))
        model(torch.randn(4, 3), torch.randn(4, 2))
    return stderr.getvalue()


@pytest.fixture(autouse=True)
def display_on(monkeypatch):
    monkeypatch.delenv(compile_progress.ENVIRONMENT_VARIABLE, raising=False)


def test_a_terminal_sees_the_phases_in_order_then_a_summary():
    text = first_call()
    updates = [part for part in text.split("\r") if part]
    phases = [re.match(r"Graph compilation: (capture|lowering|XLA compile)\.\.\.", u) for u in updates]
    seen = [m.group(1) for m in phases if m]
    assert seen == sorted(seen, key=["capture", "lowering", "XLA compile"].index), seen
    assert set(seen) == {"capture", "lowering", "XLA compile"}
    summary = updates[-1]
    assert re.fullmatch(r"Graph compilation: done in \d+\.\d s \(capture \d+\.\d\d s, lowering \d+\.\d\d s, "
                        r"XLA compile \d+\.\d\d s, other \d+\.\d\d s\)\x1b\[K\n", summary), summary
    assert text.count("done in") == 1, "the second call compiles nothing and shows nothing"


def test_the_elapsed_time_is_redrawn_while_a_phase_runs():
    stream = Terminal()
    line = compile_progress.TerminalLine(stream, redraw_seconds=0.01)
    with compile_progress.shown_by(line), compile_progress.compilation("training"):
        with compile_progress.phase(compile_progress.XLA_COMPILE):
            time.sleep(0.5)
    redraws = [u for u in stream.getvalue().split("\r") if u.startswith("Graph compilation: XLA compile...")]
    assert len(redraws) >= 3, "the first update, then redraws with the time elapsed"


def test_not_a_terminal_shows_nothing():
    assert "Graph compilation" not in first_call(stderr=io.StringIO())


def test_the_option_turns_the_display_off():
    assert "Graph compilation" not in first_call(poptorch.Options().showCompilationProgressBar(False))


@pytest.mark.parametrize("value", ["0", "off"])
def test_the_environment_variable_turns_the_display_off(monkeypatch, value):
    monkeypatch.setenv(compile_progress.ENVIRONMENT_VARIABLE, value)
    assert "Graph compilation" not in first_call()


def test_the_log_has_each_phase_time_once_per_compilation(caplog):
    with caplog.at_level(logging.INFO, logger="ipu_backend"):
        first_call(poptorch.Options().showCompilationProgressBar(False))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiled the")]
    assert len(lines) == 1 and PHASE_LOG.fullmatch(lines[0]), lines


def test_nested_phases_charge_the_innermost_and_no_phase_logs_nothing(caplog, monkeypatch):
    with caplog.at_level(logging.INFO, logger="ipu_backend"):
        with compile_progress.compilation("inference", show=False):
            pass
        assert not caplog.records
        clock = iter([0.0, 1.0, 3.0, 6.0, 10.0, 15.0]).__next__
        monkeypatch.setattr(compile_progress.time, "perf_counter", clock)
        with compile_progress.compilation("inference", show=False) as current:   # starts at 0
            with compile_progress.phase(compile_progress.CAPTURE):                # 1
                with compile_progress.phase(compile_progress.LOWERING):           # 3 to 6
                    pass
                                                                                  # capture ends at 10
        monkeypatch.undo()                                                        # closed at 15
    assert current.seconds == {"capture": 2.0 + 4.0, "lowering": 3.0}
    assert caplog.records[-1].getMessage() == (
        "compiled the inference program in 15.00 s (capture 6.00 s, lowering 3.00 s, other 6.00 s)")


class Broken(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)

    def forward(self, x):
        raise ValueError("broken forward")


def test_a_failed_compilation_ends_the_line_and_logs_no_time(caplog):
    stderr = Terminal()
    model = poptorch.inferenceModel(Broken())
    with caplog.at_level(logging.INFO, logger="ipu_backend"), contextlib.redirect_stderr(stderr):
        with pytest.raises(ValueError, match="broken forward"):
            model(torch.randn(4, 3))
    assert re.search(r"\rGraph compilation: failed after \d+\.\d s \(capture \d+\.\d\d s, other \d+\.\d\d s\)"
                     r"\x1b\[K\n$", stderr.getvalue()), stderr.getvalue()
    assert not [r for r in caplog.records if r.getMessage().startswith("compiled the")]


FROZEN_WHEN_TRACED = []


class FreezeWatching(Regression):
    """Notes how many objects the garbage collector has set aside each time it is traced."""

    def forward(self, x, y):
        FROZEN_WHEN_TRACED.append(gc.get_freeze_count())
        return super().forward(x, y)


def train_once(net):
    model = poptorch.trainingModel(net, poptorch.Options().showCompilationProgressBar(False),
                                   optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    model(torch.randn(4, 3), torch.randn(4, 2))


def test_the_collector_leaves_older_objects_alone_while_compiling_only():
    assert gc.get_freeze_count() == 0
    FROZEN_WHEN_TRACED.clear()
    train_once(FreezeWatching())
    assert FROZEN_WHEN_TRACED and all(count > 0 for count in FROZEN_WHEN_TRACED)
    assert gc.get_freeze_count() == 0
    with pytest.raises(ValueError, match="broken forward"):
        poptorch.inferenceModel(Broken())(torch.randn(4, 3))
    assert gc.get_freeze_count() == 0


def test_objects_the_process_froze_stay_frozen():
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        FROZEN_WHEN_TRACED.clear()
        train_once(FreezeWatching())
        # frozen again, the objects created since (the model, the executor) would be counted;
        # unfrozen, none: frozen objects only leave the count when they are freed
        assert FROZEN_WHEN_TRACED and all(0 < count <= before for count in FROZEN_WHEN_TRACED)
        assert 0 < gc.get_freeze_count() <= before
    finally:
        gc.unfreeze()
