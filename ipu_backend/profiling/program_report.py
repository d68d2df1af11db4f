"""The compile report's figures for one compiled program: its schedule, per-IPU memory against
the IPU's capacity, and per stage its FLOPs and operation counts."""

import math

import jax
from jax.sharding import NamedSharding

from ipu_backend.profiling.costs import aten_op_counts, hlo_op_counts, xla_costs
from ipu_backend.profiling.memory_usage import single_ipu_usage
from ipu_backend.profiling.timeline import BACKWARD, UPDATE
from ipu_backend.runtime.memory import in_force
from ipu_backend.runtime.pipeline import MultiIpuProgram

FLOPS_NOTE = ("FLOPs and bytes are XLA's cost analysis of each compiled program; the body of a "
              "loop (device iterations, micro-batches) is counted once, not once per trip.")


def _program_costs(executable) -> dict:
    counts = hlo_op_counts(executable)
    return {**xla_costs(executable), "hlo_ops": sum(counts.values()), "hlo_op_counts": counts}


def _stage(index: int, ipu: int, nodes, programs: dict) -> dict:
    aten = aten_op_counts(nodes)
    costs = {name: _program_costs(executable) for name, executable in programs.items()}
    return {"stage": index, "ipu": ipu, "aten_ops": sum(aten.values()), "aten_op_counts": aten,
            "flops": sum(c["flops"] for c in costs.values()), "programs": costs}


def _manual_passes(compiled) -> list[str] | None:
    """The backward passes and optimizer steps of a manual-optimization step, in order."""
    from ipu_backend.runtime.manual import Backward, Step     # manual.py imports the recorder

    events = getattr(compiled, "events", None)
    return None if events is None else [BACKWARD if isinstance(e, Backward) else UPDATE for e in events
                                        if isinstance(e, (Backward, Step))]


def _schedule(executor, compiled, training: bool) -> dict:
    schedule, call = executor._schedule(), compiled.call
    multi = isinstance(call, MultiIpuProgram)
    manual = _manual_passes(compiled)
    single = "single IPU" if manual is None else "single IPU, manual optimization"
    return {"training": training, "device_iterations": schedule.device_iterations,
            "gradient_accumulation": schedule.accumulation, "replicas": schedule.replicas,
            "stages": len(call.stages) if multi else 1,
            "ipus_per_replica": call.part.num_ipus if multi else 1,
            "execution": ("pipelined" if call.settings.pipelined else "sharded") if multi else single,
            "pipelined": multi and call.settings.pipelined, "manual_passes": manual}


def _mesh_size(call_args: tuple) -> int:
    """Devices the step's replicas are spread over (several replicas share one when fewer)."""
    meshes = [leaf.sharding.mesh for leaf in jax.tree.leaves(call_args[:2])
              if isinstance(getattr(leaf, "sharding", None), NamedSharding)]
    return meshes[0].size if meshes else 1


def describe(executor, compiled, call_args: tuple, compile_seconds: float | None, training: bool) -> dict:
    """The figures of ``compiled`` (an executor's program), first called with ``call_args``."""
    call, spec = compiled.call, in_force(executor.options)[0]
    inputs = call_args[1]
    if isinstance(call, MultiIpuProgram):
        stages = [_stage(s.plan.index, s.plan.ipu, s.plan.nodes, s.programs) for s in call.stages]
        usage = call.memory
    else:
        nodes = compiled.program.graph_module.graph.nodes
        stages = [_stage(0, 0, nodes, {"step": compiled.executable})]
        usage = single_ipu_usage(compiled.executable, call_args[0],
                                 executor._schedule().replicas // _mesh_size(call_args))
    schedule = _schedule(executor, compiled, training)
    samples = math.prod(inputs[0].shape[:4]) if inputs else None       # [D, A, R, m, ...]
    return {
        "kind": "training" if training else "inference",
        "compile_seconds": compile_seconds,
        "ipu_spec": {"name": spec.name, "memory_bytes": spec.memory_bytes, "tiles": spec.tiles},
        "schedule": {**schedule, "samples_per_call": samples},
        "memory": [{**u.as_dict(), "capacity": spec.memory_bytes, "fraction": u.total / spec.memory_bytes}
                   for u in usage],
        "stages": stages,
        "flops_note": FLOPS_NOTE,
    }
