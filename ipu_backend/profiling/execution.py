"""The execution report's figures: per program, the modelled timeline and what the measured
calls give (time per call, steps/s, the host transfer and compute split)."""

from collections import defaultdict
from dataclasses import dataclass

from ipu_backend.profiling.timeline import Timeline, bubble_fraction, manual_timeline, timeline, utilization

MODEL_NOTE = ("Timings inside a call are modelled, not sampled: every IPU's programs run fused on "
              "the host's CPU, so the per-micro-batch schedule is the executor's dispatch order "
              "(one slot per forward or backward pass, one per optimizer update) scaled to fill "
              "the measured compute time of the call. Call times, host transfers and compile "
              "times are measured.")


@dataclass
class Call:
    """Wall-clock marks of one call (``time.perf_counter`` seconds)."""

    program: int
    start: float          # the call starts (after any compilation): host-side preparation, inputs moved
    inputs: float         # the inputs are on the emulated IPUs
    computed: float       # the program has finished
    finished: float       # the outputs are on the host

    @property
    def seconds(self) -> float:
        return self.finished - self.start


@dataclass
class CallTotals:
    """Sums over a program's calls: all the summary needs, however long the run."""

    calls: int = 0
    seconds: float = 0.0
    host_to_ipu: float = 0.0
    compute: float = 0.0
    ipu_to_host: float = 0.0

    def add(self, call: Call) -> None:
        self.calls += 1
        self.seconds += call.seconds
        self.host_to_ipu += call.inputs - call.start
        self.compute += call.computed - call.inputs
        self.ipu_to_host += call.finished - call.computed


def program_timeline(report: dict) -> tuple[Timeline, int]:
    """The timeline of a program and how many times it repeats in one call: once per device
    iteration in training; once per call in inference (the iterations are its micro-batches)."""
    schedule = report["schedule"]
    if schedule["manual_passes"] is not None:
        return manual_timeline(schedule["manual_passes"]), schedule["device_iterations"]
    if schedule["training"]:
        return timeline(True, schedule["gradient_accumulation"], schedule["stages"],
                        schedule["pipelined"]), schedule["device_iterations"]
    return timeline(False, schedule["device_iterations"], schedule["stages"], schedule["pipelined"]), 1


def stages_by_ipu(report: dict) -> dict[int, list[int]]:
    by_ipu = defaultdict(list)
    for stage in report["stages"]:
        by_ipu[stage["ipu"]].append(stage["stage"])
    return dict(sorted(by_ipu.items()))


def summarize(report: dict, totals: CallTotals) -> dict:
    """Bubble fraction and per-IPU utilization of the schedule; measured rates of the calls."""
    line, repeats = program_timeline(report)
    ipus = stages_by_ipu(report)
    schedule = report["schedule"]
    summary = {
        "schedule_slots": line.length, "repeats_per_call": repeats,
        "bubble_fraction": bubble_fraction(line, [set(s) for s in ipus.values()]),
        "utilization": {str(ipu): utilization(line, set(s)) for ipu, s in ipus.items()},
        "calls": totals.calls,
    }
    if totals.calls:
        samples = schedule["samples_per_call"]
        summary.update({
            "seconds_per_call": totals.seconds / totals.calls,
            "steps_per_second": schedule["device_iterations"] * totals.calls / totals.seconds,
            "samples_per_second": samples * totals.calls / totals.seconds if samples else None,
            "host_to_ipu_seconds": totals.host_to_ipu / totals.calls,
            "compute_seconds": totals.compute / totals.calls,
            "ipu_to_host_seconds": totals.ipu_to_host / totals.calls,
        })
    return summary
