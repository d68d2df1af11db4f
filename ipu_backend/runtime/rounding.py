"""Stochastic rounding to half precision, as IPUs do when ``enableStochasticRounding`` is on."""

import jax
import jax.numpy as jnp


def stochastic_round(x: jax.Array, dtype, key: jax.Array) -> jax.Array:
    """Round float32 ``x`` to ``dtype`` up or down at random, with the probability of each
    neighbour proportional to closeness, so that the rounding is unbiased in expectation."""
    nearest = x.astype(dtype)
    below = nearest.astype(jnp.float32) > x
    other = jnp.nextafter(nearest, jnp.where(below, -jnp.inf, jnp.inf).astype(dtype))
    gap = jnp.abs(other.astype(jnp.float32) - nearest.astype(jnp.float32))
    distance = jnp.abs(x - nearest.astype(jnp.float32))
    take_other = jax.random.uniform(key, x.shape) * gap < distance
    return jnp.where(take_other & jnp.isfinite(other), other, nearest)
