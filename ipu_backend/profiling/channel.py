"""PopTorch's ``poptorch.profiling.Channel``: tracepoints for PopVision's System Analyser.

PopTorch makes them no-ops unless Graphcore's ``libpvti`` library is loaded; it never is here (the
reports in ``docs/reports.md`` take its place), so a channel accepts its calls and records nothing.
"""

import contextlib


class Channel:
    """``with Channel("MyApp").tracepoint("step"): ...`` and ``instrument(obj, "method")``, as in
    PopTorch without ``libpvti``: accepted, no effect."""

    def __init__(self, name: str):
        self.name = name

    def instrument(self, obj, *methods: str):
        """Return ``obj`` unchanged (PopTorch wraps ``methods`` in tracepoints when it can)."""
        return obj

    def tracepoint(self, name: str) -> contextlib.AbstractContextManager:
        """A context that records nothing."""
        return contextlib.nullcontext()
