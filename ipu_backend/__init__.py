"""PopTorch's programming model rebuilt on JAX/XLA: ``import ipu_backend as poptorch``."""

from ipu_backend.runtime.devices import reserve_cpu_devices

reserve_cpu_devices()

from ipu_backend import optim  # noqa: E402
from ipu_backend.async_accessor import AsynchronousDataAccessor  # noqa: E402
from ipu_backend.autocasting import autocast  # noqa: E402
from ipu_backend.compiler.custom_ops import identity_loss  # noqa: E402
from ipu_backend.control_flow import cond, for_loop  # noqa: E402
from ipu_backend.custom_args import ICustomArgParser, registerCustomArgParser  # noqa: E402
from ipu_backend.data import DataLoader  # noqa: E402
from ipu_backend.enums import (  # noqa: E402
    CommGroupType,
    ConnectionType,
    DataLoaderMode,
    HalfFloatCastingBehavior,
    Liveness,
    MatMulSerializationMode,
    MeanReductionStrategy,
    MultiConvPlanType,
    OutputMode,
    OverlapMode,
    ReductionType,
    SharingStrategy,
    SyncPattern,
    VariableRetrievalMode,
)
from ipu_backend.errors import Error, RecoverableError, UnrecoverableError  # noqa: E402
from ipu_backend.models import inferenceModel, trainingModel  # noqa: E402
from ipu_backend.options import Options, TensorLocationSettings  # noqa: E402
from ipu_backend.point_clouds import fps, nearest  # noqa: E402
from ipu_backend.ops import (  # noqa: E402
    CPU,
    MultiConv,
    NameScope,
    ctc_beam_search_decoder,
    dynamic_slice,
    dynamic_update,
    ipu_print_tensor,
    isRunningOnIpu,
    nop,
    serializedMatMul,
    set_available_memory,
    set_overlap_for_input,
    set_overlap_for_output,
)
from ipu_backend.runtime.compile_hooks import registerPostCompileHook, registerPreCompileHook  # noqa: E402
from ipu_backend.runtime.executor import PoplarExecutor  # noqa: E402
from ipu_backend.runtime.module_repr import module_repr  # noqa: E402
from ipu_backend.saving import load  # noqa: E402
from ipu_backend.system import ipuHardwareIsAvailable, ipuHardwareVersion, setLogLevel  # noqa: E402

__all__ = [
    "CommGroupType", "ConnectionType", "DataLoader", "DataLoaderMode", "Error",
    "HalfFloatCastingBehavior", "Liveness", "MatMulSerializationMode", "MeanReductionStrategy",
    "MultiConvPlanType", "Options", "OutputMode", "OverlapMode", "PoplarExecutor", "ReductionType",
    "SharingStrategy", "SyncPattern", "TensorLocationSettings", "VariableRetrievalMode",
    "cond", "for_loop", "identity_loss", "inferenceModel", "optim", "trainingModel",
    "CPU", "MultiConv", "NameScope", "ctc_beam_search_decoder", "dynamic_slice", "dynamic_update", "ipu_print_tensor", "isRunningOnIpu", "nop",
    "serializedMatMul", "set_available_memory", "set_overlap_for_input", "set_overlap_for_output",
    "module_repr", "registerPostCompileHook", "registerPreCompileHook",
    "ICustomArgParser", "registerCustomArgParser", "ipuHardwareIsAvailable", "ipuHardwareVersion",
    "setLogLevel", "AsynchronousDataAccessor", "load", "autocast", "RecoverableError",
    "UnrecoverableError", "fps", "nearest",
]

from ipu_backend.blocks import (  # noqa: E402
    AutoStage,
    BeginBlock,
    Block,
    BlockFunction,
    ParallelPhasedExecution,
    Phase,
    PipelinedExecution,
    SerialPhasedExecution,
    ShardedExecution,
    Stage,
    recomputationCheckpoint,
    removeBlocks,
)
from ipu_backend.hardware import IpuSpec  # noqa: E402
from ipu_backend.runtime.memory import OutOfMemoryError  # noqa: E402

__all__ += [
    "AutoStage", "BeginBlock", "Block", "BlockFunction", "IpuSpec", "OutOfMemoryError",
    "PipelinedExecution", "ShardedExecution", "Stage", "recomputationCheckpoint", "removeBlocks",
    "ParallelPhasedExecution", "Phase", "SerialPhasedExecution",
]

from ipu_backend.distributed.connection import join_launched_run  # noqa: E402

join_launched_run()
