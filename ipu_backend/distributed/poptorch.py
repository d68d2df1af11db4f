"""``popdist.poptorch.Options``: options set up for this instance from its launcher's environment."""

from typing import Any

import ipu_backend
from ipu_backend.distributed import environment
from ipu_backend.errors import Error
from ipu_backend.options import _DistributedOptions


def _refused(name: str):
    def refuse(self, *args, **kwargs):
        raise Error(f"Cannot call `{name}` with popdist.poptorch.Options (ipu_backend.distributed.Options): "
                    "the launcher sets it. Replicas per instance are ipu-run's --num-replicas divided by "
                    "--num-instances")
    refuse.__name__ = name.rsplit(".", 1)[-1]
    return refuse


class _LaunchedDistributedOptions(_DistributedOptions):
    """``opts.Distributed`` of launcher-configured options: set by the launcher, not by hand."""

    disable = _refused("Distributed.disable")
    setEnvVarNames = _refused("Distributed.setEnvVarNames")
    configureProcessId = _refused("Distributed.configureProcessId")


class Options(ipu_backend.Options):
    """``ipu_backend.Options`` for this instance, as PopDist's ``popdist.poptorch.Options``:
    ``replicationFactor`` is the instance's share of the run's replicas and
    ``Distributed.configureProcessId`` its index among the instances; both are the launcher's to
    set, so calling them (or ``useIpuId``) raises. Other settings work as usual.

    ``ipus_per_replica``, when given, must match the launcher's ``--ipus-per-replica``.
    """

    def __init__(self, ipus_per_replica: int | None = None, **kwargs: Any) -> None:
        if "replication_factor" in kwargs:
            _refused("replicationFactor")(self)
        instance = environment.from_environment()
        if ipus_per_replica is not None and ipus_per_replica != instance.ipus_per_replica:
            raise Error(f"popdist.poptorch.Options(ipus_per_replica={ipus_per_replica}) but the launcher "
                        f"gives each replica {instance.ipus_per_replica} IPU(s) (--ipus-per-replica)")
        super().__init__(replication_factor=instance.local_replicas, **kwargs)
        self.Distributed.configureProcessId(instance.index, instance.count)
        self.Distributed.__class__ = _LaunchedDistributedOptions
        self._launched = True

    def replicationFactor(self, replication_factor: int):  # noqa: N802
        """Refused once built: the launcher sets it."""
        if getattr(self, "_launched", False):
            _refused("replicationFactor")(self)
        return super().replicationFactor(replication_factor)

    useIpuId = _refused("useIpuId")
