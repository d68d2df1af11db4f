"""The executors' random numbers: one key per executor, made from PopTorch's 64-bit seed, which
each call folds with its index. The seed and the number of calls made are the whole random state."""

import jax
import numpy as np

from ipu_backend.errors import Error

SEED_LIMIT = 2**64
"""PopTorch's seeds are unsigned 64-bit integers."""


def seed_key(seed: int) -> jax.Array:
    """A threefry key holding all 64 bits of ``seed`` (its high and low words, as JAX's own
    ``key`` does for 64-bit seeds): seeds that differ in any bit give distinct streams, and a
    seed below 2**31 gives ``jax.random.key(seed)``."""
    if not 0 <= seed < SEED_LIMIT:
        raise Error(f"random seed {seed} is outside PopTorch's range [0, 2**64)")
    words = np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)
    return jax.random.wrap_key_data(words, impl="threefry2x32")


def restore_random_state(state) -> tuple[int, int]:
    """``(seed, calls made)`` from an executor's ``rng_state`` (``[seed, calls made]``)."""
    if (not isinstance(state, (list, tuple)) or len(state) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in state)):
        raise Error(f"rng_state must be [seed, calls made] as rng_state returns it, got {state!r}")
    seed_key(state[0])
    return int(state[0]), int(state[1])
