"""What the runtime reads of a model's options, as plain frozen data.

``ipu_backend.Options`` (the API) builds a :class:`RunSettings` with
``Options.runtime_settings()``; the runtime reads nothing else of the options, so it never
imports the API. The execution strategy arrives as a :class:`Staging`.
"""

from dataclasses import dataclass

from ipu_backend.errors import Error
from ipu_backend.hardware import DEFAULT_CHECK, MK2, IpuSpec

PIPELINED_STAGING, SHARDED_STAGING, UNSUPPORTED_STAGING = "pipelined", "sharded", "unsupported"
AUTO_CACHE_DIR = "auto"
"""``executable_cache_dir``'s default: ``$IPU_BACKEND_CACHE_DIR``, else the user's cache directory
(see :mod:`~ipu_backend.runtime.executable_cache`)."""
PARALLEL_PHASES, SERIAL_PHASES = "parallel", "serial"


@dataclass(frozen=True)
class StagePlacement:
    """A stage named in an execution strategy: its block ids and its IPU (None: its blocks')."""

    blocks: tuple[str, ...]
    ipu_id: int | None = None


@dataclass(frozen=True)
class Staging:
    """An execution strategy: how blocks become stages on IPUs, and how the stages run."""

    kind: str = PIPELINED_STAGING           # PIPELINED_STAGING, SHARDED_STAGING or UNSUPPORTED_STAGING
    stages: tuple[StagePlacement, ...] = ()     # the stages named explicitly, if any
    same_as_ipu: bool = True                # with no stages named: a block's stage is its IPU
    ipu_spec: IpuSpec = MK2
    memory_check: str = DEFAULT_CHECK
    description: str = "PipelinedExecution()"   # the strategy as the user wrote it, for messages
    phased: str | None = None               # PARALLEL_PHASES or SERIAL_PHASES for a phased strategy
    phases: tuple[tuple[StagePlacement, ...], ...] = ()     # each phase's stages

    @property
    def pipelined(self) -> bool:
        return self.kind == PIPELINED_STAGING

    def phase_of(self, block_id: str) -> tuple[int, int, StagePlacement] | None:
        """``(phase, position of its stage in the phase, stage)`` of a block, or None."""
        for phase, stages in enumerate(self.phases):
            for position, stage in enumerate(stages):
                if block_id in stage.blocks:
                    return phase, position, stage
        return None

    def default_ipu(self, phase: int, position: int) -> int:
        """The IPU of a phase's stage that names none (nor do its blocks): phases alternate
        between two groups of IPUs in parallel phased execution, and share one in serial."""
        return 2 * position + phase % 2 if self.phased == PARALLEL_PHASES else position


@dataclass(frozen=True)
class RunSettings:
    """The options as the runtime reads them (see ``ipu_backend.Options`` for each setting)."""

    device_iterations: int = 1
    replication_factor: int = 1             # replicas of this process
    processes: int = 1                      # host processes the replicas are spread over
    process_index: int = 0                  # this process's index among them
    gradient_accumulation: int = 1
    mean_reduction: bool = True             # accumulation and replication reduce by the mean
    running_mean: bool = False              # MeanReductionStrategy.Running
    output_mode: str | None = None          # "all" | "final" | "sum" | "every_n"; None: the default
    output_period: int = 1
    auto_loss_scaling: bool = False
    stochastic_rounding: bool = False
    floating_point_exceptions: bool = False   # a call whose results hold a NaN or an infinity raises
    master_weights: bool = False
    optimizer_on_chip: bool = True
    broadcast_buffers: bool = True
    random_seed: int | None = None
    executable_cache_dir: str | None = AUTO_CACHE_DIR     # None: off
    auto_round_num_ipus: bool = False
    recomputation: int = 0                  # PopART's autoRecomputation (a RecomputationType value)
    ipu_spec: IpuSpec = MK2
    memory_check: str = DEFAULT_CHECK
    staging: Staging | None = None          # None: no strategy set (a default PipelinedExecution)
    loop_repeated_layers: bool = True       # runs of identical layers compile once, as one loop
    autotune_matmuls: bool = False          # XLA tunes Triton kernels for matrix products on GPUs
    updatable_named_buffers: tuple[str, ...] = ()   # what copyNamedBuffersToDevice copies
    log_cycle_count: bool = False           # cycleCount answers
    show_compilation_progress: bool = True  # showCompilationProgressBar: the display; compilationTime answers
    synthetic_data: int = 0                 # PopART's syntheticDataMode (runtime/synthetic_data.py)
    input_group_size: int = 1               # replicas sharing each share of the input (inputReplicaGrouping)
    input_groups_orthogonal: bool = False   # input groups are CommGroupType.Orthogonal, else Consecutive
    key: str = ""
    """Every setting of the options that a compiled program depends on (the ones above and those
    without effect, but not the seed, the cache or the report directory), as text: programs
    compiled with equal keys are interchangeable."""

    def memory(self) -> tuple[IpuSpec, str]:
        """The IPU spec and memory check that apply (see ``ipu_backend.options.in_force``)."""
        staging = self.staging or Staging()
        return (_one_of(self.ipu_spec, staging.ipu_spec, MK2, "ipu_spec", "setIpuSpec"),
                _one_of(self.memory_check, staging.memory_check, DEFAULT_CHECK, "memory_check",
                        "setMemoryCheck"))


def _one_of(from_options, from_strategy, default, name: str, setter: str):
    """A setting made in the options or on the execution strategy: one left at its default gives
    way to the other; set to different values in both, it is an error (which one was meant is
    not knowable)."""
    if from_strategy == default or from_strategy == from_options:
        return from_options
    if from_options == default:
        return from_strategy
    raise Error(f"{name} is set both in Options ({from_options!r}) and in the execution strategy "
                f"({from_strategy!r}): set it in one place only (Options.{setter} applies to every "
                "model, single-IPU ones included)")
