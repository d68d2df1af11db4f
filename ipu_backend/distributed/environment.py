"""Where this process stands among a run's instances, as its launcher's environment says.

``ipu-run`` sets PopRun's variables (``POPDIST_*``: total and local replicas, this instance's
first replica) and the address of JAX's coordination service; an instance's index and the
number of instances follow from them as in PopDist (replicas are spread uniformly). Without
them, Open MPI's rank variables give the index and count, as PopTorch's ``Options.Distributed``
reads them by default. This module reads the environment only: it imports no JAX.
"""

import os
from dataclasses import dataclass

from ipu_backend.errors import Error

TOTAL_REPLICAS = "POPDIST_NUM_TOTAL_REPLICAS"
LOCAL_REPLICAS = "POPDIST_NUM_LOCAL_REPLICAS"
REPLICA_OFFSET = "POPDIST_REPLICA_INDEX_OFFSET"
IPUS_PER_REPLICA = "POPDIST_NUM_IPUS_PER_REPLICA"
UNIFORM_REPLICAS = "POPDIST_UNIFORM_REPLICAS_PER_INSTANCE"
LOCAL_INSTANCE = "POPDIST_LOCAL_INSTANCE_INDEX"
"""PopRun's names for what it tells each instance."""

COORDINATOR = "IPU_BACKEND_COORDINATOR"
"""``host:port`` of JAX's coordination service, which instance 0 serves."""
HEARTBEAT_TIMEOUT = "IPU_BACKEND_HEARTBEAT_TIMEOUT"
"""Seconds without a heartbeat after which the coordination service declares an instance dead."""
INIT_TIMEOUT = "IPU_BACKEND_INIT_TIMEOUT"
"""Seconds an instance waits for all the others to connect."""

DEFAULT_HEARTBEAT_TIMEOUT = 30
DEFAULT_INIT_TIMEOUT = 120

MPI_RANK, MPI_SIZE = "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"


def _integer(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise Error(f"the environment variable {name}={value!r} must be an integer") from None


@dataclass(frozen=True)
class Instance:
    """One process of a run: its index among ``count`` instances and its share of the replicas."""

    index: int = 0
    count: int = 1
    local_replicas: int = 1
    total_replicas: int = 1
    ipus_per_replica: int = 1
    local_index: int = 0
    """Its index among the instances on its host."""
    launched: bool = False
    """Whether a PopRun-style launcher (``ipu-run``) set the environment."""

    @property
    def replica_offset(self) -> int:
        """The global index of its first replica."""
        return self.index * self.local_replicas


def from_environment() -> Instance:
    """This process's :class:`Instance` (one instance of one replica when nothing is set)."""
    if TOTAL_REPLICAS in os.environ:
        local = _integer(LOCAL_REPLICAS, 1)
        total = _integer(TOTAL_REPLICAS, local)
        offset = _integer(REPLICA_OFFSET, 0)
        if local < 1 or total % local or offset % local or not 0 <= offset < total:
            raise Error(f"inconsistent PopRun environment: {TOTAL_REPLICAS}={total}, {LOCAL_REPLICAS}="
                             f"{local}, {REPLICA_OFFSET}={offset} (replicas must be spread uniformly "
                             "over the instances)")
        return Instance(index=offset // local, count=total // local, local_replicas=local, total_replicas=total,
                        ipus_per_replica=_integer(IPUS_PER_REPLICA, 1), local_index=_integer(LOCAL_INSTANCE, 0),
                        launched=True)
    count = _integer(MPI_SIZE, 1)
    return Instance(index=_integer(MPI_RANK, 0), count=count, total_replicas=count)


def coordinator() -> str | None:
    """The coordination service's ``host:port`` the launcher chose, if any."""
    return os.environ.get(COORDINATOR) or None


def timeouts() -> tuple[int, int]:
    """(heartbeat, initialization) timeouts in seconds."""
    return (_integer(HEARTBEAT_TIMEOUT, DEFAULT_HEARTBEAT_TIMEOUT), _integer(INIT_TIMEOUT, DEFAULT_INIT_TIMEOUT))
