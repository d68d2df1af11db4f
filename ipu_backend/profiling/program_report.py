"""The compile report's figures for one compiled program: its schedule, per-IPU memory against
the IPU's capacity, and per stage its FLOPs and operation counts."""

import math

from ipu_backend.compiler.hints import hints_of, multi_convs_of, name_scope_counts
from ipu_backend.profiling.costs import aten_op_counts, hlo_op_counts, xla_costs
from ipu_backend.runtime.recording import PIPELINED, ProgramFacts, StageFacts

FLOPS_NOTE = ("FLOPs and bytes are XLA's cost analysis of each compiled program; the body of a "
              "loop (device iterations, micro-batches, repeated layers) is counted once, not once "
              "per trip.")


def _program_costs(executable) -> dict:
    counts = hlo_op_counts(executable)
    return {**xla_costs(executable), "hlo_ops": sum(counts.values()), "hlo_op_counts": counts}


def _stage(stage: StageFacts) -> dict:
    aten = aten_op_counts(stage.nodes)
    costs = {name: _program_costs(executable) for name, executable in stage.programs.items()}
    return {"stage": stage.index, "ipu": stage.ipu, "aten_ops": sum(aten.values()), "aten_op_counts": aten,
            "flops": sum(c["flops"] for c in costs.values()), "programs": costs,
            "hints": hints_of(stage.nodes), "name_scopes": name_scope_counts(stage.nodes),
            "multi_convs": multi_convs_of(stage.nodes)}


def _schedule(program: ProgramFacts) -> dict:
    schedule = program.schedule
    return {"training": program.training, "device_iterations": schedule.device_iterations,
            "gradient_accumulation": schedule.accumulation, "replicas": schedule.replicas,
            "stages": len(program.stages), "ipus_per_replica": program.ipus_per_replica,
            "execution": program.execution, "pipelined": program.execution == PIPELINED,
            "manual_passes": None if program.manual_passes is None else list(program.manual_passes)}


def describe(program: ProgramFacts, call_args: tuple, compile_seconds: float | None) -> dict:
    """The figures of ``program``, called with ``call_args``."""
    spec = program.ipu_spec
    inputs = call_args[1]
    samples = math.prod(inputs[0].shape[:4]) if inputs else None       # [D, A, R, m, ...]
    return {
        "kind": "training" if program.training else "inference",
        "compile_seconds": compile_seconds,
        "ipu_spec": {"name": spec.name, "memory_bytes": spec.memory_bytes, "tiles": spec.tiles},
        "schedule": {**_schedule(program), "samples_per_call": samples},
        "memory": [{**u.as_dict(), "capacity": spec.memory_bytes, "fraction": u.total / spec.memory_bytes}
                   for u in program.memory],
        "stages": [_stage(s) for s in program.stages],
        "flops_note": FLOPS_NOTE,
    }
