"""The backend a program traced now will run on: some lowerings choose their algorithm by it."""

import jax


def on_cpu() -> bool:
    """Whether programs traced now compile for XLA:CPU (JAX's default backend)."""
    return jax.default_backend() == "cpu"
