"""Per-replica buffers (``Options.broadcastBuffers(False)``): each replica keeps its own values
of the module's buffers (BatchNorm statistics, counters) from call to call.

The step program takes and returns them stacked, ``[replicas, ...]``, sharded over the replica
mesh. The host (and the weight store shared with other executors of the module) sees replica
0's values, as PopTorch copies them back; buffers the device takes from the host again
(``copyWeightsToDevice``, ``copyNamedBuffersToDevice``, a Lightning step's host writes) start
every replica from the host's values.
"""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ipu_backend.runtime.devices import REPLICA


class ReplicaBuffers:
    """The buffers of each replica, as the last call left them."""

    def __init__(self):
        self._seen = None           # the store's buffers (replica 0's) when the rows were kept
        self._rows = None

    def for_call(self, buffers: dict, replicas: int, mesh) -> dict:
        """Each replica's buffers for the next call, given the store's ``buffers``: the rows the
        last call left when the store still holds their replica 0, else ``buffers`` on every
        replica."""
        if self._rows is not None and buffers is self._seen:
            return self._rows
        stacked = {name: jnp.broadcast_to(value, (replicas, *value.shape)) for name, value in buffers.items()}
        return stacked if mesh is None else jax.device_put(stacked, NamedSharding(mesh, P(REPLICA)))

    def kept(self, rows: dict) -> dict:
        """Keep ``rows`` (a call's new per-replica buffers); replica 0's, for the store."""
        self._rows = rows
        self._seen = {name: value[0] for name, value in rows.items()}
        return self._seen
