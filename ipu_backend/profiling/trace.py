"""Chrome/Perfetto trace of the recorded calls: ``pid`` is the IPU (one more for the host), ``tid``
the replica (a lane per stage when an IPU holds several stages); times in microseconds."""

from ipu_backend.profiling.execution import MODEL_NOTE, Call, program_timeline, stages_by_ipu
from ipu_backend.profiling.timeline import BACKWARD, FORWARD

MAX_EVENTS_PER_CALL = 50_000
"""Device iterations past this many events are left out of a call's trace (the trace says so)."""
_LETTER = {FORWARD: "F", BACKWARD: "B"}


def _complete(name: str, category: str, pid: int, tid: int, start: float, end: float, args: dict) -> dict:
    return {"name": name, "cat": category, "ph": "X", "pid": pid, "tid": tid,
            "ts": start * 1e6, "dur": max(end - start, 0.0) * 1e6, "args": args}


def _metadata(kind: str, pid: int, tid: int | None, name: str) -> dict:
    event = {"name": kind, "ph": "M", "pid": pid, "args": {"name": name}}
    return event if tid is None else {**event, "tid": tid}


def host_pid(reports: list[dict]) -> int:
    return max(max(stages_by_ipu(r)) for r in reports) + 1


def _call_events(report: dict, call: Call, index: int, origin: float, host: int) -> tuple[list, int]:
    line, repeats = program_timeline(report)
    replicas = report["schedule"]["replicas"]
    lanes = {stage: lane for stages in stages_by_ipu(report).values() for lane, stage in enumerate(stages)}
    per_lane = {ipu: len(stages) for ipu, stages in stages_by_ipu(report).items()}
    ipu_of = {s["stage"]: s["ipu"] for s in report["stages"]}
    drawn = max(1, min(repeats, MAX_EVENTS_PER_CALL // max(1, len(line.slots) * replicas)))
    unit = (call.computed - call.inputs) / (repeats * line.length)
    events = [_complete("host → IPU (inputs)", "host", host, 0, call.start - origin, call.inputs - origin,
                        {"call": index}),
              _complete("IPU → host (outputs)", "host", host, 0, call.computed - origin,
                        call.finished - origin, {"call": index})]
    for repeat in range(drawn):
        offset = call.inputs - origin + repeat * line.length * unit
        for slot in line.slots:
            ipu = ipu_of[slot.stage]
            name = "update" if slot.micro_batch is None else f"{_LETTER[slot.role]}{slot.micro_batch}"
            args = {"call": index, "stage": slot.stage, "micro_batch": slot.micro_batch,
                    "device_iteration": repeat if report["schedule"]["training"] else slot.micro_batch}
            for replica in range(replicas):
                events.append(_complete(name, slot.role, ipu, replica * per_lane[ipu] + lanes[slot.stage],
                                        offset + slot.start * unit, offset + slot.end * unit,
                                        {**args, "replica": replica}))
    return events, repeats - drawn


def chrome_trace(reports: list[dict], shown: list[Call], calls_recorded: int) -> dict:
    """The trace of the calls ``shown``, the latest of the ``calls_recorded`` (their programs'
    figures are ``reports[call.program]``)."""
    host = host_pid(reports)
    origin = shown[0].start if shown else 0.0
    events = [_metadata("process_name", host, None, "Host"), _metadata("thread_name", host, 0, "transfers")]
    for ipu, stages in stages_by_ipu(reports[-1]).items():
        events.append(_metadata("process_name", ipu, None, f"IPU {ipu} (stage {', '.join(map(str, stages))})"))
        for replica in range(reports[-1]["schedule"]["replicas"]):
            for lane, stage in enumerate(stages):
                suffix = f", stage {stage}" if len(stages) > 1 else ""
                events.append(_metadata("thread_name", ipu, replica * len(stages) + lane, f"replica {replica}{suffix}"))
    left_out = 0
    for index, call in enumerate(shown, start=calls_recorded - len(shown)):
        call_events, missing = _call_events(reports[call.program], call, index, origin, host)
        events += call_events
        left_out += missing
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"note": MODEL_NOTE, "calls_recorded": calls_recorded, "calls_drawn": len(shown),
                          "device_iterations_left_out": left_out}}
