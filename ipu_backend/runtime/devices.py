"""Emulated IPUs and the JAX devices that carry them."""

import os
import warnings

import jax
import numpy as np
from jax.sharding import Mesh

DEFAULT_CPU_DEVICES = 8
REPLICA = "replica"
"""The name of the replica axis of every mesh."""


def reserve_cpu_devices(count: int | None = None) -> None:
    """Ask JAX for ``count`` CPU devices (``IPU_BACKEND_CPU_DEVICES``, else 8): one per emulated IPU.

    JAX accepts this only before its first computation; afterwards the devices it has are used
    and replicas fold onto them with the same numerics.
    """
    count = count or int(os.environ.get("IPU_BACKEND_CPU_DEVICES", DEFAULT_CPU_DEVICES))
    if jax.config.jax_num_cpu_devices >= count:
        return
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        return


def replica_mesh(replicas: int) -> Mesh:
    """A 1-D mesh over as many devices as divide ``replicas``; the rest fold onto them."""
    available = jax.devices()
    count = max(d for d in range(1, min(replicas, len(available)) + 1) if replicas % d == 0)
    if count < replicas:
        warnings.warn(f"{replicas} replicas run on {count} JAX device(s) ({len(available)} available): "
                      f"{replicas // count} replicas share each device, with identical numerics. Set "
                      "IPU_BACKEND_CPU_DEVICES before the first JAX computation for one device each.",
                      stacklevel=3)
    return Mesh(np.array(available[:count]), (REPLICA,))


def memory_in_use() -> list[int]:
    """Bytes of the live arrays on each JAX device (weights, optimizer state and whatever else is
    still alive), in ``jax.devices()`` order."""
    devices = jax.devices()
    used = {d: 0 for d in devices}
    for array in jax.live_arrays():
        for shard in array.addressable_shards:
            if shard.device in used:
                used[shard.device] += shard.data.nbytes
    return [used[d] for d in devices]
