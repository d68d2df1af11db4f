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
    start: float          # the host starts moving the inputs (after any compilation)
    inputs: float         # the inputs are on the emulated IPUs
    computed: float       # the program has finished
    finished: float       # the outputs are on the host

    @property
    def seconds(self) -> float:
        return self.finished - self.start


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


def summarize(report: dict, calls: list[Call]) -> dict:
    """Bubble fraction and per-IPU utilization of the schedule; measured rates of ``calls``."""
    line, repeats = program_timeline(report)
    ipus = stages_by_ipu(report)
    schedule = report["schedule"]
    summary = {
        "schedule_slots": line.length, "repeats_per_call": repeats,
        "bubble_fraction": bubble_fraction(line, [set(s) for s in ipus.values()]),
        "utilization": {str(ipu): utilization(line, set(s)) for ipu, s in ipus.items()},
        "calls": len(calls),
    }
    if calls:
        total = sum(c.seconds for c in calls)
        steps = schedule["device_iterations"] * len(calls)
        summary.update({
            "seconds_per_call": total / len(calls),
            "steps_per_second": steps / total,
            "samples_per_second": (schedule["samples_per_call"] * len(calls) / total
                                   if schedule["samples_per_call"] else None),
            "host_to_ipu_seconds": sum(c.inputs - c.start for c in calls) / len(calls),
            "compute_seconds": sum(c.computed - c.inputs for c in calls) / len(calls),
            "ipu_to_host_seconds": sum(c.finished - c.computed for c in calls) / len(calls),
        })
    return summary
