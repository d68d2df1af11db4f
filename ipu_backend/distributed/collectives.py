"""Host values exchanged between a run's instances over ``jax.distributed`` (what a framework
driving the instances needs besides the compiled program: logged values, a checkpoint path, a
barrier). Each is a collective: every instance calls it, in the same order. With one instance
they return at once."""

import pickle

import jax
import numpy as np
from jax.experimental import multihost_utils


def instances() -> int:
    return jax.process_count()


def all_gather(tree):
    """Every instance's ``tree`` (of host arrays, the same shapes everywhere), stacked on a new
    first axis in instance order."""
    if instances() == 1:
        return jax.tree.map(lambda leaf: np.asarray(leaf)[None], tree)
    return multihost_utils.process_allgather(tree, tiled=False)


def broadcast_object(value, source: int = 0):
    """Instance ``source``'s ``value`` (any picklable object), in every instance."""
    if instances() == 1:
        return value
    is_source = jax.process_index() == source
    payload = np.frombuffer(pickle.dumps(value), dtype=np.uint8) if is_source else np.zeros(0, np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int64(payload.size), is_source=is_source))
    padded = np.zeros(size, np.uint8)
    padded[:payload.size] = payload
    received = multihost_utils.broadcast_one_to_all(padded, is_source=is_source)
    return value if is_source else pickle.loads(np.asarray(received).tobytes())


def barrier(name: str) -> None:
    """Wait until every instance reaches the barrier ``name``."""
    if instances() > 1:
        multihost_utils.sync_global_devices(name)
