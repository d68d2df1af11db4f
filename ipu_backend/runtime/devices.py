"""Emulated IPUs and the JAX devices that carry them."""

import os
import warnings

import jax
import numpy as np
from jax.sharding import Mesh

from ipu_backend.errors import Error
from ipu_backend.runtime.processes import devices_for

DEFAULT_CPU_DEVICES = 8
MAX_IPUS_PER_PROCESS = 64
"""The most IPUs one host process drives (an IPU-POD64), as PopTorch checks."""


def check_ipus_per_process(num_ipus: int) -> None:
    """PopTorch's limit on the IPUs one process asks for (replicas × IPUs per replica)."""
    if num_ipus > MAX_IPUS_PER_PROCESS:
        raise Error(f"Too many IPUs requested ({num_ipus}). Experiments that need more than "
                    f"{MAX_IPUS_PER_PROCESS} IPUs require distributed execution. (A process drives at most "
                    f"{MAX_IPUS_PER_PROCESS}: replicas × IPUs per replica.)")


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


def _backend() -> str:
    """The kind of JAX device in use, as a user names it: CPU, GPU, TPU."""
    return jax.default_backend().upper()


def _one_each(what: str, count: int) -> str:
    """How to give each of ``count`` ``what`` a JAX device of its own on the backend in use."""
    if jax.default_backend() == "cpu":
        return (f" Set IPU_BACKEND_CPU_DEVICES={count} (or more) before the first JAX computation "
                f"for one device per {what}.")
    return ""


def replica_mesh(replicas: int, processes: int = 1) -> Mesh:
    """A 1-D mesh over as many devices as divide ``replicas``; the rest fold onto them. Spread over
    several host processes, each gives as many of its own devices as divide its share, and the
    mesh lists them by process (:func:`~ipu_backend.runtime.processes.devices_for`)."""
    local = replicas // processes
    check_ipus_per_process(local)
    devices, count = devices_for(local, processes)
    if count < local:
        where = " in each process" if processes > 1 else ""
        warnings.warn(f"{local} replicas run on {count} JAX {_backend()} device(s) ({len(jax.local_devices())} "
                      f"available{where}): {local // count} replicas share each device, with identical "
                      f"numerics.{_one_each('replica', local)}", stacklevel=3)
    return Mesh(np.array(devices), (REPLICA,))


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


def ipu_devices(num_ipus: int, replicas: int) -> list[list]:
    """The JAX device of each emulated IPU of a model split over ``num_ipus`` IPUs, as
    ``[ipu][replica]``. With enough devices, replica ``r`` of IPU ``i`` is device
    ``r · num_ipus + i``. With fewer (one GPU, one CPU device), each replica's IPUs share the
    devices left to it — IPU ``i`` on its ``i mod p``-th of ``p`` — as replicas fold onto
    devices: one program runs at a time on a device, with identical numerics. Each replica
    needs a device of its own."""
    check_ipus_per_process(num_ipus * replicas)
    available = jax.devices()
    per_replica = min(num_ipus, len(available) // replicas)
    if per_replica == 0:
        raise Error(f"a model split over IPUs runs each replica on JAX devices of its own (its IPUs "
                    f"may share one): {replicas} replicas need {replicas} devices, but JAX has "
                    f"{len(available)} {_backend()} device(s). Use at most {len(available)} "
                    f"replicas here.{_one_each('emulated IPU', num_ipus * replicas)}")
    if per_replica < num_ipus:
        warnings.warn(f"{num_ipus} IPUs × {replicas} replicas run on {per_replica * replicas} JAX "
                      f"{_backend()} device(s) ({len(available)} available): each device carries "
                      f"{-(-num_ipus // per_replica)} emulated IPUs' programs, one at a time, with "
                      f"identical numerics.{_one_each('emulated IPU', num_ipus * replicas)}",
                      stacklevel=4)
    return [[available[r * per_replica + i % per_replica] for r in range(replicas)]
            for i in range(num_ipus)]
