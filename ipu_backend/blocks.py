"""PopTorch's model-parallel annotations: blocks, stages and execution strategies.

A *block* is a named part of the model's forward (``with Block("B1"): ...``,
``BeginBlock(layer)``, ``@BlockFunction("B1")``, ``Block.start("B1")``). While the model is
captured, each operation is tagged with the block that is active when torch records it: the
tag travels on the graph node as ``node.meta["custom"][BLOCK_KEY]`` (torch.export keeps
``torch.fx.traceback`` annotations through decomposition). An execution strategy
(:class:`PipelinedExecution`, :class:`ShardedExecution`) then groups blocks into *stages*, each
on one IPU; the runtime receives it as a :class:`~ipu_backend.runtime.settings.Staging` and
partitions the graph accordingly (:mod:`ipu_backend.runtime.stages`).

Outside a capture (a plain torch call of the model) the annotations do nothing, as in PopTorch.

As in PopTorch, operations recorded before the first block belong to stage 0 on IPU 0, a block
opened by ``Block.start`` or ``BeginBlock`` lasts until the next one starts, and operations
recorded after a ``with Block(...)`` scope closes belong to no block, which is an error.
"""

import functools
from collections.abc import Callable

import torch
import torch.fx.traceback as fx_traceback

from ipu_backend.compiler.custom_ops import BLOCK_KEY, recomputation_checkpoint
from ipu_backend.enums import AutoStage, Liveness
from ipu_backend.errors import Error
from ipu_backend.hardware import MEMORY_CHECKS, MK2, IpuSpec
from ipu_backend.runtime.settings import (
    PARALLEL_PHASES,
    PIPELINED_STAGING,
    SERIAL_PHASES,
    SHARDED_STAGING,
    StagePlacement,
    Staging,
)

_AUTO_ID_KEY = "ipu_block_next_auto_id"


def _capturing() -> bool:
    """Whether torch.export is recording the model now (annotations are kept only then)."""
    return fx_traceback.has_preserved_node_meta()


def _annotations() -> dict:
    return fx_traceback.current_meta.get("custom", {})


def _annotate(**values) -> None:
    """Set annotations for the nodes recorded from now on. A new dict each time: nodes recorded
    earlier keep the one they saw. The capture restores the previous annotations when it ends."""
    fx_traceback.current_meta["custom"] = {**_annotations(), **values}


def _next_auto_id() -> str:
    index = _annotations().get(_AUTO_ID_KEY, 0)
    _annotate(**{_AUTO_ID_KEY: index + 1})
    return str(index)


def _check_ipu_id(ipu_id) -> None:
    if ipu_id is not None and (isinstance(ipu_id, bool) or not isinstance(ipu_id, int) or ipu_id < 0):
        raise Error(f"ipu_id must be None or a non-negative int, got {ipu_id!r}")


def _check_user_id(user_id) -> None:
    """PopTorch documents a str and accepts any id; its own tests use ints (``BeginBlock(m, 1, 2)``).
    An int id is a block of its own (``1`` is not ``"1"``) and stages it by IPU, as ``Stage`` names
    take strings."""
    if user_id is not None and (isinstance(user_id, bool) or not isinstance(user_id, (str, int))):
        raise Error(f"a block's user_id must be a str, an int or None, got {user_id!r}")


def _start_block(user_id: str | None, ipu_id: int | None) -> None:
    if _capturing():
        _annotate(**{BLOCK_KEY: (user_id if user_id is not None else _next_auto_id(), ipu_id)})


def _end_block() -> None:
    if _capturing():
        _annotate(**{BLOCK_KEY: None})


class Block:
    """A block of the model: ``with poptorch.Block("Encoder", ipu_id=1): ...``.

    Blocks with the same ``user_id`` form one block; an execution strategy groups blocks into
    stages. ``ipu_id`` places the block on that IPU (unless its stage names another).
    """

    def __init__(self, user_id: str | None = None, ipu_id: int | None = None):
        _check_user_id(user_id)
        _check_ipu_id(ipu_id)
        self._user_id = user_id
        self._ipu_id = ipu_id

    @staticmethod
    def useAutoId() -> None:  # noqa: N802
        """Number the blocks that have no ``user_id`` "0", "1", ... from here on (call it at the
        start of ``forward``)."""
        if _capturing():
            _annotate(**{_AUTO_ID_KEY: 0})

    @staticmethod
    def start(user_id: str | None = None, ipu_id: int | None = None) -> None:
        """Start a block that lasts until the next one starts."""
        _check_user_id(user_id)
        _check_ipu_id(ipu_id)
        _start_block(user_id, ipu_id)

    def __enter__(self) -> "Block":
        _start_block(self._user_id, self._ipu_id)
        return self

    def __exit__(self, *exc_info) -> None:
        _end_block()

    def __repr__(self) -> str:
        return f"Block(user_id={self._user_id!r}, ipu_id={self._ipu_id!r})"


class _BeginBlockHook:
    """Forward pre-hook of a module given to :func:`BeginBlock`."""

    def __init__(self, user_id: str | None, ipu_id: int | None):
        self.user_id, self.ipu_id = user_id, ipu_id

    def __call__(self, module, args) -> None:
        _start_block(self.user_id, self.ipu_id)

    def __repr__(self) -> str:
        return f"BeginBlock(user_id={self.user_id}, ipu_id={self.ipu_id})"


class _BeginBlockFunction:
    """:func:`BeginBlock` of a plain callable: starts the block, then calls it."""

    def __init__(self, function: Callable, user_id: str | None, ipu_id: int | None):
        self._function, self._user_id, self._ipu_id = function, user_id, ipu_id
        functools.update_wrapper(self, function)

    def __call__(self, *args, **kwargs):
        _start_block(self._user_id, self._ipu_id)
        return self._function(*args, **kwargs)


def BeginBlock(layer_to_call, user_id: str | None = None, ipu_id: int | None = None):  # noqa: N802
    """Start a block each time ``layer_to_call`` (a module) runs; the block lasts until the next
    one starts. Returns the module itself (a plain callable is wrapped instead)."""
    _check_user_id(user_id)
    _check_ipu_id(ipu_id)
    if not isinstance(layer_to_call, torch.nn.Module):
        if callable(layer_to_call):
            return _BeginBlockFunction(layer_to_call, user_id, ipu_id)
        raise Error("module is not an instance of torch.nn.Module or function.")
    if any(isinstance(hook, _BeginBlockHook) for hook in layer_to_call._forward_pre_hooks.values()):
        raise Error("module has already been assigned to a block.")
    layer_to_call.register_forward_pre_hook(_BeginBlockHook(user_id, ipu_id))
    return layer_to_call


def removeBlocks(module: torch.nn.Module) -> None:  # noqa: N802
    """Remove every :func:`BeginBlock` annotation from ``module`` and its sub-modules."""
    if not isinstance(module, torch.nn.Module):
        raise Error(f"removeBlocks expects a torch.nn.Module, got {type(module).__name__}")
    for sub in module.modules():
        for handle_id in [key for key, hook in sub._forward_pre_hooks.items()
                          if isinstance(hook, _BeginBlockHook)]:
            del sub._forward_pre_hooks[handle_id]


def annotated_ipu_ids(module: torch.nn.Module) -> set[int]:
    """The IPUs that :func:`BeginBlock` annotations of ``module`` and its sub-modules name."""
    ids = {hook.ipu_id for sub in module.modules() for hook in sub._forward_pre_hooks.values()
           if isinstance(hook, _BeginBlockHook)}
    ids.discard(None)
    return ids


def BlockFunction(user_id: str | None = None, ipu_id: int | None = None):  # noqa: N802
    """Decorator: the decorated function runs inside ``Block(user_id, ipu_id)``."""
    _check_user_id(user_id)
    _check_ipu_id(ipu_id)

    def decorator(function):
        @functools.wraps(function)
        def in_block(*args, **kwargs):
            with Block(user_id, ipu_id):
                return function(*args, **kwargs)

        return in_block

    return decorator


class Stage:
    """One or more blocks running on one IPU: ``Stage("B1", "B2").ipu(0)``."""

    def __init__(self, *block_ids: str):
        if not all(isinstance(b, str) for b in block_ids):
            raise Error(f"Block IDs are supposed to be strings but got {block_ids}")
        self._blocks = tuple(block_ids)
        self._ipu = None

    @property
    def blocks(self) -> tuple[str, ...]:
        return self._blocks

    def ipu(self, ipu: int) -> "Stage":
        """Run this stage on IPU ``ipu``."""
        if isinstance(ipu, bool) or not isinstance(ipu, int) or ipu < 0:
            raise Error(f"a stage's IPU must be a non-negative int, got {ipu!r}")
        self._ipu = ipu
        return self

    @property
    def ipu_id(self) -> int | None:
        return self._ipu

    def __repr__(self) -> str:
        return f"Stage({', '.join(map(repr, self._blocks))}, ipu={self._ipu})"


class PipelinedExecution:
    """Run the stages as a pipeline: ``PipelinedExecution("B1", "B2")``,
    ``PipelinedExecution(Stage("B1", "B2").ipu(0), Stage("B3").ipu(1))``, or with
    ``AutoStage.SameAsIpu`` (the default) / ``AutoStage.AutoIncrement`` when blocks carry IPUs.

    Each argument is a stage: a :class:`Stage`, a block id, or a list of block ids.

    Emulation settings (keywords): ``ipu_spec``, the :class:`~ipu_backend.hardware.IpuSpec`
    each IPU has (Mk2 by default), and ``memory_check``: ``"error"`` (an out-of-memory error when
    a stage does not fit), ``"warn"`` or ``"off"``. ``Options.setIpuSpec`` / ``setMemoryCheck``
    set the same for every model; a setting left at its default in one place gives way to the
    other, and two different values are an error.
    """

    def __init__(self, *args, ipu_spec: IpuSpec = MK2, memory_check: str = "error"):
        if not isinstance(ipu_spec, IpuSpec):
            raise Error(f"ipu_spec must be an ipu_backend.IpuSpec, got {ipu_spec!r}")
        if memory_check not in MEMORY_CHECKS:
            raise Error(f"memory_check must be one of {MEMORY_CHECKS}, got {memory_check!r}")
        self.ipu_spec, self.memory_check = ipu_spec, memory_check
        self._auto_stage = AutoStage.SameAsIpu
        self._stages: tuple[Stage, ...] = ()
        if len(args) == 1 and isinstance(args[0], AutoStage):
            self._auto_stage = args[0]
            return
        stages, seen = [], set()
        for arg in args:
            if isinstance(arg, Stage):
                stage = arg
            elif isinstance(arg, str):
                stage = Stage(arg)
            elif isinstance(arg, (list, tuple)):
                stage = Stage(*arg)
            else:
                raise Error(f"a stage is a poptorch.Stage, a block id or a list of block ids; got {arg!r}")
            for block in stage.blocks:
                if block in seen:
                    raise Error(f"{block} associated with more than one stage")
                seen.add(block)
            stages.append(stage)
        self._stages = tuple(stages)

    @property
    def stages(self) -> tuple[Stage, ...]:
        """The stages given explicitly (empty when they come from the blocks' IPUs)."""
        return self._stages

    @property
    def auto_stage(self) -> AutoStage:
        return self._auto_stage

    @property
    def phases(self) -> tuple:
        """The phases of a phased strategy; none here."""
        return ()

    @property
    def same_as_ipu(self) -> bool:
        """Whether, with no stages named, a block's stage is its IPU (``AutoStage.SameAsIpu``)."""
        return self._auto_stage is AutoStage.SameAsIpu

    def stage(self, block_id: str) -> Stage:
        """The explicit stage holding ``block_id``."""
        for stage in self._stages:
            if block_id in stage.blocks:
                return stage
        raise Error(f"Unknown block {block_id}")

    phased: str | None = None
    """How phases run (a phased strategy's), None without phases."""

    def staging(self) -> Staging:
        """This strategy as the runtime reads it."""
        return Staging(kind=SHARDED_STAGING if isinstance(self, ShardedExecution) else PIPELINED_STAGING,
                       stages=tuple(StagePlacement(stage.blocks, stage.ipu_id) for stage in self._stages),
                       same_as_ipu=self.same_as_ipu, ipu_spec=self.ipu_spec,
                       memory_check=self.memory_check, description=repr(self), phased=self.phased,
                       phases=tuple(tuple(StagePlacement(stage.blocks, stage.ipu_id) for stage in phase.stages)
                                    for phase in self.phases))

    def __repr__(self) -> str:
        inside = [repr(s) for s in self._stages] if self._stages else [f"AutoStage.{self._auto_stage.name}"]
        if self.ipu_spec != MK2:
            inside.append(f"ipu_spec={self.ipu_spec!r}")
        if self.memory_check != "error":
            inside.append(f"memory_check={self.memory_check!r}")
        return f"{type(self).__name__}({', '.join(inside)})"


class ShardedExecution(PipelinedExecution):
    """Run the stages one after the other, one micro-batch at a time (no pipelining)."""


class Phase:
    """One execution phase: stages that run at the same time, each on its IPU.
    ``Phase(Stage("A").ipu(0), Stage("B").ipu(1))``, or ``Phase("A", "B")`` for one stage made
    of blocks ``A`` and ``B``."""

    def __init__(self, *args):
        if args and all(isinstance(arg, Stage) for arg in args):
            self.stages = list(args)
        elif all(isinstance(arg, str) for arg in args):
            self.stages = [Stage(*args)]
        else:
            raise Error("All arguments must either be block IDs (strings) or Stages: "
                        f"{[type(arg) for arg in args]}")

    def stage(self, idx: int) -> Stage:
        return self.stages[idx]

    def ipus(self, *ipus: int) -> "Phase":
        """One IPU for each stage of the phase."""
        if len(ipus) != len(self.stages):
            raise Error(f"Phase contains {len(self.stages)} stages but you provided {len(ipus)} ipus")
        for stage, ipu in zip(self.stages, ipus):
            stage.ipu(ipu)
        return self

    def __repr__(self) -> str:
        return f"Phase({', '.join(map(repr, self.stages))})"


class _PhasedExecution(ShardedExecution):
    """The blocks run phase after phase, each phase's stages on their IPUs (see the subclasses).

    Emulated IPUs compute a phase's blocks one after the other in program order (the numbers of
    running them side by side); the compile report shows what each phase holds on each IPU.
    Each argument is a :class:`Phase`, a list of stages, a list of block ids (one stage) or a
    single stage or block id.
    """

    def __init__(self, *phases, ipu_spec: IpuSpec = MK2, memory_check: str = "error"):
        super().__init__(ipu_spec=ipu_spec, memory_check=memory_check)
        if not phases:
            raise Error("There is currently no AutoStage for PhasedExecution, please explicitly "
                        "specify the phases")
        self._phases: list[Phase] = []
        self._phase_of_block: dict[str, tuple[int, int, Stage]] = {}
        for phase_id, arg in enumerate(phases):
            if not isinstance(arg, Phase):
                arg = Phase(*(arg if isinstance(arg, (list, tuple)) else [arg]))
            self._phases.append(arg)
            for position, stage in enumerate(arg.stages):
                for block in stage.blocks:
                    if block in self._phase_of_block:
                        raise Error(f"{block} associated with more than one stage")
                    self._phase_of_block[block] = (phase_id, position, stage)
        self._stages = tuple(stage for phase in self._phases for stage in phase.stages)
        self._liveness = Liveness.AlwaysLive
        self._separate_backward_phase = False

    def phase(self, phase: int) -> Phase:
        if isinstance(phase, bool) or not isinstance(phase, int) or phase < 0:
            raise Error("Phases are identified by positive integers")
        return self._phases[phase]

    @property
    def phases(self) -> tuple[Phase, ...]:
        return tuple(self._phases)

    def phase_of(self, block_id: str) -> tuple[int, int, Stage] | None:
        """``(phase, position of its stage in the phase, stage)`` of a block, or None."""
        return self._phase_of_block.get(block_id)

    def default_ipu(self, phase: int, position: int) -> int:
        """The IPU of a stage given none (by the stage or its blocks)."""
        return self.staging().default_ipu(phase, position)

    def useSeparateBackwardPhase(self, use: bool = True) -> "_PhasedExecution":  # noqa: N802
        """Give the backward pass phases of its own (PopTorch's phase numbering; the numbers
        computed do not change)."""
        if not isinstance(use, bool):
            raise Error(f"useSeparateBackwardPhase expects a bool, got {use!r}")
        self._separate_backward_phase = use
        return self

    @property
    def tensors_liveness(self) -> Liveness:
        return self._liveness

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(map(repr, self._phases))})"


class ParallelPhasedExecution(_PhasedExecution):
    """Phases alternate between two groups of IPUs: by default phase ``p``'s ``k``-th stage runs
    on IPU ``2k + p % 2`` (phases 0, 2, ... on IPUs 0 and 2; phases 1, 3, ... on IPUs 1 and 3),
    unless its stage or blocks name an IPU."""

    phased = PARALLEL_PHASES

    def sendTensorsOffChipAfterFwd(self, off_chip: bool = True) -> "ParallelPhasedExecution":  # noqa: N802
        """Keep tensors off chip after the forward pass (recorded; no effect on the numbers)."""
        if not isinstance(off_chip, bool):
            raise Error(f"sendTensorsOffChipAfterFwd expects a bool, got {off_chip!r}")
        self._liveness = Liveness.OffChipAfterFwd if off_chip else Liveness.AlwaysLive
        return self


class SerialPhasedExecution(_PhasedExecution):
    """Every phase runs on one group of IPUs, one phase after the other: by default a phase's
    ``k``-th stage runs on IPU ``k``, unless its stage or blocks name an IPU."""

    phased = SERIAL_PHASES

    def setTensorsLiveness(self, liveness: Liveness) -> "SerialPhasedExecution":  # noqa: N802
        """Where tensors live between phases (recorded; no effect on the numbers)."""
        if not isinstance(liveness, Liveness):
            raise Error(f"setTensorsLiveness expects a poptorch.Liveness, got {liveness!r}")
        self._liveness = liveness
        return self


def recomputationCheckpoint(*tensors):  # noqa: N802
    """Keep these tensors between the forward and backward passes of a recomputed stage
    (``opts._Popart.set("autoRecomputation", 3)``): the backward pass then recomputes the forward
    from them rather than from the stage's inputs. Returns the tensors (a tuple for several)."""
    if len(tensors) == 1 and isinstance(tensors[0], (tuple, list)):
        return type(tensors[0])(recomputationCheckpoint(*tensors[0]))
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError("All inputs must be tensors")
    out = tuple(recomputation_checkpoint(t) for t in tensors)
    return out[0] if len(out) == 1 else out
