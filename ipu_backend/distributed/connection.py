"""Joining a run's other instances through ``jax.distributed``: one coordination service (served
by instance 0) and collectives between all instances' devices (gloo between CPU devices, NCCL
between GPUs), so that each instance's replicas are part of one global device mesh."""

import jax

from ipu_backend.distributed import environment
from ipu_backend.errors import Error


def connected() -> bool:
    """Whether this process has joined other instances."""
    return jax.distributed.is_initialized()


def init(coordinator_address: str | None = None, num_instances: int | None = None,
         instance_index: int | None = None) -> None:
    """Connect this process to the run's other instances (nothing to do for one instance).

    The arguments default to what the launcher's environment says (``ipu-run`` sets them all).
    It must come before JAX's first computation in the process; a second call with the same
    instance is a no-op.
    """
    instance = environment.from_environment()
    count = instance.count if num_instances is None else num_instances
    index = instance.index if instance_index is None else instance_index
    if not 0 <= index < count:
        raise Error(f"instance index {index} is not among the {count} instances (0 to {count - 1})")
    if connected():
        if (jax.process_count(), jax.process_index()) != (count, index):
            raise Error(f"this process is already instance {jax.process_index()} of {jax.process_count()}, "
                        f"not instance {index} of {count}")
        return
    if count == 1:
        return
    address = coordinator_address or environment.coordinator()
    if address is None:
        raise Error(f"instance {index} of {count} does not know where to find the others: launch the "
                    f"instances with ipu-run, or set {environment.COORDINATOR}=host:port (a free port on "
                    "instance 0's host) in every instance's environment")
    heartbeat, wait = environment.timeouts()
    if jax.config.jax_cpu_collectives_implementation != "mpi":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption service would catch SIGTERM, which must stop an instance (ipu-run, SLURM).
    jax.config.update("jax_enable_preemption_service", False)
    try:
        jax.distributed.initialize(address, count, index, initialization_timeout=wait,
                                   heartbeat_timeout_seconds=heartbeat)
    except RuntimeError as error:
        if "before any JAX" not in str(error):
            raise
        raise Error(f"instance {index} of {count} cannot join the others: this process already ran JAX "
                    "computations. Connect first: call ipu_backend.distributed.init() at the start of the "
                    "script (ipu-run does it when ipu_backend is imported)") from error


def join_launched_run() -> None:
    """Connect at once when ``ipu-run`` started this process (``import ipu_backend`` does it, before
    any JAX computation), so that PopTorch scripts run under it unchanged."""
    instance = environment.from_environment()
    if instance.launched and instance.count > 1 and environment.coordinator() is not None:
        init()
