"""Replicas over several host processes: one global replica mesh, each process holding its own.

With ``jax.distributed`` connected, the mesh spans every process's devices, ordered by process:
process ``p`` holds replicas ``[p*r, (p+1)*r)`` of ``r`` local replicas each. A compiled step runs
on all of them as one program (its gradient sum crosses processes). What the host hands in and
gets back stays local: each process places its own replicas' share of the combined batch and reads
back its own replicas' outputs; replicated state (weights, optimizer state, keys) is the same
value in every process. With one process every function here is the plain single-process form.
"""

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def process_count() -> int:
    """The processes JAX connects (1 unless ``jax.distributed`` was initialized)."""
    return jax.process_count()


def devices_for(local_replicas: int, processes: int) -> tuple[list, int]:
    """The devices of a replica mesh: in each process, as many of its devices as divide
    ``local_replicas`` (the rest fold onto them), and that number."""
    local = jax.local_devices()
    count = max(d for d in range(1, min(local_replicas, len(local)) + 1) if local_replicas % d == 0)
    if processes == 1:
        return local[:count], count
    by_process: dict[int, list] = {}
    for device in jax.devices():
        by_process.setdefault(device.process_index, []).append(device)
    return [d for p in sorted(by_process) for d in sorted(by_process[p], key=lambda d: d.id)[:count]], count


def replicated(tree, mesh: Mesh, first_process: bool = False):
    """``tree`` on every device of ``mesh``. Across processes each process places its own copy
    (a host array, or a single-device one) on its devices, of a value the same everywhere, or made
    so with ``first_process``: process 0's is taken (one collective). Leaves already on the mesh
    are passed through."""
    sharding = NamedSharding(mesh, P())
    if not mesh.is_multi_process:
        return jax.device_put(tree, sharding)
    leaves, structure = jax.tree.flatten(tree)
    placed = [isinstance(leaf, jax.Array) and leaf.sharding == sharding for leaf in leaves]
    host = [np.asarray(leaf) for leaf, done in zip(leaves, placed) if not done]
    if first_process and host:
        host = [np.asarray(leaf) for leaf in multihost_utils.broadcast_one_to_all(host)]
    host = iter(host)

    def place(value):
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    return structure.unflatten([leaf if done else place(next(host)) for leaf, done in zip(leaves, placed)])


def batch_on_mesh(arrays: list, mesh: Mesh, spec: P) -> list:
    """This process's share of the combined batch (host arrays ``[D, A, r, m, ...]`` of its own
    ``r`` replicas) as global arrays sharded by ``spec`` (replicas on the mesh's axis)."""
    sharding = NamedSharding(mesh, spec)
    if not mesh.is_multi_process:
        return jax.device_put(arrays, sharding)
    axis = list(spec).index(mesh.axis_names[0])
    processes = len({d.process_index for d in mesh.devices.flat})

    def place(local):
        shape = list(local.shape)
        shape[axis] *= processes
        return jax.make_array_from_process_local_data(sharding, local, tuple(shape))

    return [place(a) for a in arrays]


def local_rows(array) -> np.ndarray:
    """The host value of ``array`` (a host array as it is), or across processes this process's rows
    of it: a replicated array whole, an array sharded on its first axis (``[R, ...]``) its own
    replicas' rows."""
    if not isinstance(array, jax.Array) or array.is_fully_addressable or array.is_fully_replicated:
        return np.asarray(array)
    shards = {}
    for shard in array.addressable_shards:
        shards.setdefault(shard.index[0].start or 0, shard)
    return np.concatenate([np.asarray(shards[start].data) for start in sorted(shards)], axis=0)


def from_first_process(value):
    """``value`` (host arrays) as process 0 has it, in every process (a collective)."""
    return multihost_utils.broadcast_one_to_all(value)
