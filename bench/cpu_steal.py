"""The share of CPU time the hypervisor gave to other machines while a benchmark ran.

On a shared virtual machine, steal time slows every variant, but not alike: a busy moment can
halve one epoch and spare the next. Benchmarks record it next to their ratios, so that a reader
can tell a quiet run from a contended one.
"""

import pathlib

_STAT = pathlib.Path("/proc/stat")


def _cpu_ticks() -> list[int] | None:
    """The machine's total CPU ticks by kind (user, nice, system, idle, iowait, irq, softirq,
    steal, ...), or None where the kernel does not report them."""
    if not _STAT.exists():
        return None
    return [int(v) for v in _STAT.read_text().split("\n", 1)[0].split()[1:]]


class StealMeter:
    """``with StealMeter() as meter: ...``, then ``meter.share``: stolen ticks over busy and
    stolen ones (None where unknown)."""

    def __enter__(self):
        self._start = _cpu_ticks()
        self.share = None
        return self

    def __exit__(self, *exc):
        end = _cpu_ticks()
        if self._start is not None and end is not None:
            delta = [b - a for a, b in zip(self._start, end)]
            busy = delta[0] + delta[1] + delta[2] + delta[5] + delta[6]
            steal = delta[7] if len(delta) > 7 else 0
            self.share = steal / (busy + steal) if busy + steal else 0.0
        return False
