"""Building the multi-IPU program of a model with blocks: partition its graph into stages,
check what PopTorch checks (IPU counts, pipeline depth), compile every stage's programs on its
devices and check the model fits its IPUs' memory."""

import math
import warnings

import jax
import jax.numpy as jnp
import torch
import torch.utils._pytree as torch_pytree

from ipu_backend.compiler import capture
from ipu_backend.compiler.dtypes import jax_dtype
from ipu_backend.compiler.program import split_keywords
from ipu_backend.errors import Error
from ipu_backend.runtime import memory
from ipu_backend.runtime.clipping import GradientClipping
from ipu_backend.runtime.devices import ipu_devices
from ipu_backend.runtime.memory import tree_bytes
from ipu_backend.runtime.module_modes import capture_modes
from ipu_backend.runtime.multi_ipu import MultiIpuProgram
from ipu_backend.runtime.schedule import Schedule, stashed_micro_batches
from ipu_backend.runtime.settings import UNSUPPORTED_STAGING, RunSettings, Staging
from ipu_backend.runtime.stage_program import MultiIpuSettings, StageProgram
from ipu_backend.runtime.stages import Partition, partition, sources_from_export, sources_from_program
from ipu_backend.runtime.step import OutputLayout


def check_ipu_count(num_ipus: int, auto_round: bool) -> int:
    """PopTorch reserves a power of two IPUs: the count to reserve (rounded when allowed)."""
    rounded = 1 << max(0, num_ipus - 1).bit_length()
    if rounded == num_ipus:
        return num_ipus
    common = ", because PopTorch must reserve a power of 2 or maximum of 64 IPUs per process"
    if not auto_round:
        raise Error(f"cannot reserve the IPUs: The model specifies the use of {num_ipus} IPUs, however "
                    f"PopTorch must reserve a minimum of {rounded} in order to allow the model to "
                    f"run{common}. Please reconfigure your model to use a different number of IPUs "
                    "or set poptorch.Options().autoRoundNumIPUs(True).")
    warnings.warn(f"Reserving {rounded} IPUs when the model specifies the use of only {num_ipus}"
                  f"{common}. {rounded - num_ipus} will be reserved but not used.", stacklevel=4)
    return rounded


def _staging(settings: RunSettings) -> Staging:
    staging = settings.staging or Staging()
    if staging.kind == UNSUPPORTED_STAGING:
        raise Error(f"execution strategy {staging.description} is not emulated; use poptorch.PipelinedExecution "
                    "or poptorch.ShardedExecution")
    return staging


def _check_stage_counts(part: Partition, schedule: Schedule, training: bool, pipelined: bool) -> None:
    if not pipelined:
        return
    forward = part.forward_stages
    if training and schedule.accumulation < 2 * forward - 1:
        raise Error(f"poptorch.Options().Training.gradientAccumulation must be greater than or equal to "
                    f"the number of pipeline stages ({2 * forward - 1}) when using "
                    f"poptorch.PipelinedExecution. Please note that a model with {forward} pipeline "
                    f"stages in PopTorch will have an additional {forward - 1} stages when training. "
                    f"(It is {schedule.accumulation}.)")
    if not training and schedule.device_iterations < forward:
        raise Error(f"poptorch.Options().deviceIterations must be greater than or equal to the number "
                    f"of pipeline stages ({forward}) when using PopTorch.PipelinedExecution. (It is "
                    f"{schedule.device_iterations}.)")


def _export(model, micro: tuple, training: bool, method: str | None, keywords: tuple = ()):
    target = model if method is None else capture.StepCall(model, method)
    with capture_modes(model, training, method):
        return capture.export(target, *split_keywords(micro, keywords))


def build(model: torch.nn.Module, program, micro: tuple, schedule: Schedule, settings: RunSettings,
          training: bool, rule=None, hyper=None, loss_index: int | None = None,
          method: str | None = None, clipping: GradientClipping | None = None) -> MultiIpuProgram | None:
    """The multi-IPU program of ``program``, the capture of ``model`` (or of its step ``method``)
    on the micro-batch ``micro``, or None when its blocks all run on IPU 0 in one stage (the
    single-IPU step then serves). Training needs the optimizer's ``rule``, its current
    ``hyper``-parameters (for their shapes), the index of the loss among the array results and
    the gradient ``clipping`` (Lightning's) applied before each update, if any."""
    staging = _staging(settings)
    program.refuse_mutated_inputs("a model split over IPUs")
    prefix = "" if method is None else "module."
    sources = sources_from_program(program, prefix)
    graph_module = program.graph_module
    if sources is None:          # lifted constants: their values come from a capture of our own
        exported = _export(model, micro, training, method, program.keywords)
        sources, graph_module = sources_from_export(exported, prefix, program.aliases), exported.graph_module
    part = partition(graph_module, sources, program.mutated_buffers, program.output_spec, staging)
    if len(part.stages) == 1 and part.stages[0].ipu == 0:
        return None
    pipelined = staging.pipelined
    check_ipu_count(part.num_ipus * schedule.replicas, settings.auto_round_num_ipus)   # first, as PopTorch
    _check_stage_counts(part, schedule, training, pipelined)
    devices = ipu_devices(part.num_ipus, schedule.replicas)
    multi = MultiIpuSettings(training=training, pipelined=pipelined, schedule=schedule, loss_index=loss_index,
                             recompute=settings.recomputation if training else 0,
                             offload=training and not settings.optimizer_on_chip,
                             stages=len(part.stages), clipping=clipping if training else None,
                             clip_max_grad_norm=training and math.isfinite(float(hyper["max_grad_norm"])),
                             half_params=tuple(sorted(n for n, p in torch.nn.Module.named_parameters(model)
                                                      if p.dtype in (torch.float16, torch.bfloat16))))

    leaves = torch_pytree.tree_leaves(tuple(micro))
    input_avals = {i: jax.ShapeDtypeStruct((schedule.device_iterations, schedule.accumulation,
                                            schedule.replicas, *leaf.shape), jax_dtype(leaf.dtype))
                   for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)}
    static_inputs = {i: leaf for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor)}
    params = {n: jax.ShapeDtypeStruct(tuple(p.shape), jax_dtype(p.dtype))
              for n, p in torch.nn.Module.named_parameters(model)}
    buffers = {n: jax.ShapeDtypeStruct(tuple(b.shape), jax_dtype(b.dtype))
               for n, b in torch.nn.Module.named_buffers(model)}
    stages = [StageProgram(part, plan, devices[plan.ipu], multi, params, buffers, input_avals,
                           static_inputs, rule)
              for plan in part.stages]
    hyper_avals = None if hyper is None else jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), hyper)
    usage = []
    for stage in stages:
        temporaries = stage.compile(hyper_avals)
        usage.append(memory.StageMemory(
            stage=stage.plan.index, ipu=stage.plan.ipu,
            weights=tree_bytes(stage.param_avals) + tree_bytes(stage.buffer_avals),
            optimizer=tree_bytes(stage.opt_avals()) if training else 0,
            accumulators=tree_bytes(stage.zero_accumulator_avals()) if training else 0,
            stash_per_micro_batch=stage.stash_bytes(),
            stashed_micro_batches=stashed_micro_batches(stage.plan.index, len(stages), pipelined) if training else 0,
            temporaries=max(temporaries.values(), default=0), optimizer_offloaded=multi.offload,
            phase=stage.plan.phase))
    usage = memory.estimate(usage)
    memory.check(usage, *settings.memory())
    # A step method's outputs are (result, logged values): the layout is the result's.
    result_spec = part.out_spec if method is None else part.out_spec.child(0)
    layout = OutputLayout()
    layout.split(torch_pytree.tree_unflatten(
        [jnp.zeros(()) if isinstance(leaf, torch.fx.Node) else leaf
         for leaf in part.output_leaves[:result_spec.num_leaves]], result_spec))
    log_names = tuple(c.name for c in program.logs if c.is_tensor)
    dtypes = [node.meta["val"].dtype for node in part.array_outputs]
    return MultiIpuProgram(part, stages, multi, layout, dtypes, rule, usage,
                           sorted(input_avals), log_names, program.call_totals())
