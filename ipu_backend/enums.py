"""PopTorch's enumerations, with PopTorch's member names and integer values.

Scripts compare and store these as PopTorch does (``opts.output_mode == OutputMode.All``), and a
saved integer value means the same member here as in PopTorch.
"""

import enum


class OutputMode(enum.IntEnum):
    """Which results a model run returns to the host.

    ``Final``: the last batch's. ``EveryN``: every N-th batch's (N is ``output_return_period``),
    each of its accumulated micro-batches. ``All``: every batch's. ``Sum``: their sum.
    ``Default``: ``All`` for inference, ``Final`` for training.
    """

    Final = 0
    EveryN = 1
    All = 2
    Sum = 3
    Default = 4


class ReductionType(enum.IntEnum):
    """How values are combined: summed, averaged, or left unreduced."""

    Sum = 0
    Mean = 1
    NoReduction = 2


class MeanReductionStrategy(enum.IntEnum):
    """When a mean over accumulated micro-batches and replicas divides by the count.

    ``Running``: keep a running mean. ``Post``: sum, then divide once. ``PostAndLoss``
    (deprecated in PopTorch): divide the loss by the replica count, then the sum by the
    accumulation count.
    """

    Running = 0
    Post = 1
    PostAndLoss = 2


class DataLoaderMode(enum.IntEnum):
    """How :class:`ipu_backend.DataLoader` fetches data.

    ``Sync``: on the calling thread. ``Async``: on a background thread, one combined batch ahead.
    ``AsyncRebatched``: as ``Async``; for an iterable dataset the workers load smaller batches
    which are then cut into combined batches, so less of each worker's data is dropped.
    """

    Sync = 0
    Async = 1
    AsyncRebatched = 2


class SharingStrategy(enum.IntEnum):
    """How PopTorch's asynchronous loader shares data with its worker process (recorded only)."""

    SharedMemory = 0
    FileSystem = 1
    Fork = 2
    ForkServer = 3


class ConnectionType(enum.IntEnum):
    """When PopTorch attaches to IPU hardware (recorded only: emulated IPUs need no attaching)."""

    Always = 0
    OnDemand = 1
    Never = 2


class HalfFloatCastingBehavior(enum.IntEnum):
    """Deprecated in PopTorch: float16 is always up-cast to float32 as torch does."""

    FloatDowncastToHalf = 0
    HalfUpcastToFloat = 1
    Default = 2


class SyncPattern(enum.IntEnum):
    """How IPUs synchronise with each other and the host (recorded only)."""

    Full = 0
    SinglePipeline = 1
    ReplicaAndLadder = 2


class MatMulSerializationMode(enum.Enum):
    """Which dimension of a matrix multiplication PopTorch splits into serial pieces."""

    InputChannels = "input_channels"
    ReducingDim = "reducing_dim"
    OutputChannels = "output_channels"
    Disabled = "none"


class Liveness(enum.IntEnum):
    """Where tensors live between the phases of a phased execution."""

    AlwaysLive = 0
    OffChipAfterFwd = 1
    OffChipAfterFwdNoOverlap = 2
    OffChipAfterEachPhase = 3


class OverlapMode(enum.Enum):
    """How far ahead the host copies inputs to IO tiles."""

    NoOverlap = "no_overlap"
    OverlapAccumulationLoop = "overlap_accumulation_loop"
    OverlapDeviceIterationLoop = "overlap_device_iteration_loop"


class AutoStage(enum.IntEnum):
    """How blocks become stages when the strategy names none (PopTorch's ``AutoStage``):
    ``SameAsIpu``: the stage is the block's IPU; ``AutoIncrement``: each new block is a new stage."""

    SameAsIpu = 0
    AutoIncrement = 1


class MultiConvPlanType(enum.IntEnum):
    """Whether the convolutions of a multi-convolution run in parallel or one after another."""

    Parallel = 0
    Serial = 1


class CommGroupType(enum.IntEnum):
    """How replicas are grouped when an input or a variable is shared among them."""

    All = 0
    Consecutive = 1
    Orthogonal = 2
    NoGrouping = 3


class VariableRetrievalMode(enum.IntEnum):
    """Which replicas' values are read back for a variable grouped across replicas."""

    OnePerGroup = 0
    AllReplicas = 2
