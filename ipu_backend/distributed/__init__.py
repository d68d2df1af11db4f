"""PopDist's API: this process's place among the instances of a multi-process run.

``ipu-run`` (PopRun's role) starts the instances; each drives its own replicas, and all of them
form one replicated program on ``jax.distributed``'s global device mesh. PopDist's functions
read where this process stands::

    import ipu_backend as poptorch
    import ipu_backend.distributed as popdist

    opts = popdist.poptorch.Options()          # this instance's replicas and index, from ipu-run
    opts.deviceIterations(10)
    loader = poptorch.DataLoader(opts, dataset, batch_size=8)   # this instance's share of the data
    model = poptorch.trainingModel(net, opts, optimizer)
    print(popdist.getInstanceIndex(), popdist.getNumInstances(), popdist.getReplicaIndexOffset())

Without a launcher every function describes a single instance of one replica.
"""

import importlib

from ipu_backend.distributed import environment
from ipu_backend.distributed.connection import init

__all__ = [
    "Options", "getInstanceIndex", "getLocalInstanceIndex", "getNumInstances", "getNumIpusPerReplica",
    "getNumLocalReplicas", "getNumTotalReplicas", "getReplicaIndexOffset", "init", "isPopdistEnvSet",
]


def isPopdistEnvSet() -> bool:  # noqa: N802
    """Whether a PopRun-style launcher (``ipu-run``) started this process."""
    return environment.from_environment().launched


def getInstanceIndex() -> int:  # noqa: N802
    """This instance's index, in ``[0, getNumInstances())``."""
    return environment.from_environment().index


def getNumInstances() -> int:  # noqa: N802
    """The number of instances in the run."""
    return environment.from_environment().count


def getLocalInstanceIndex() -> int:  # noqa: N802
    """This instance's index among the instances on its host."""
    return environment.from_environment().local_index


def getNumLocalReplicas() -> int:  # noqa: N802
    """The replicas this instance drives (1 without a launcher)."""
    return environment.from_environment().local_replicas


def getNumTotalReplicas() -> int:  # noqa: N802
    """The replicas of the whole run, over all instances."""
    return environment.from_environment().total_replicas


def getReplicaIndexOffset() -> int:  # noqa: N802
    """The global index of this instance's first replica."""
    return environment.from_environment().replica_offset


def getNumIpusPerReplica() -> int:  # noqa: N802
    """The IPUs of each replica, as the launcher was told (``--ipus-per-replica``)."""
    return environment.from_environment().ipus_per_replica


def __getattr__(name: str):
    """``Options`` and the ``poptorch`` submodule, imported on first use (they build on
    ``ipu_backend.options``, which reads this package's environment module)."""
    if name in ("Options", "poptorch"):
        module = importlib.import_module("ipu_backend.distributed.poptorch")
        return module if name == "poptorch" else module.Options
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
