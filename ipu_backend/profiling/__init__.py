"""Reports a person opens: per compiled model, a compile report (per-IPU memory against the
IPU's capacity, FLOPs and operation counts per stage, compile time) and an execution report
(what each IPU did over time, as a Chrome/Perfetto trace and a pipeline diagram), written when
``Options.enableProfiling(dir)`` or ``IPUStrategy(autoreport=True)`` is on. See docs/reports.md."""

from ipu_backend.profiling.channel import Channel
from ipu_backend.profiling.recorder import DEFAULT_DIR, NullRecorder, Recorder, recorder_for

__all__ = ["Channel", "DEFAULT_DIR", "NullRecorder", "Recorder", "recorder_for"]
