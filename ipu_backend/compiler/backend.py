"""The backend a program traced now will run on: some lowerings choose their algorithm by it."""

from typing import Literal

import jax
from jax import lax

from ipu_backend.compiler.lowering_options import current_options


def on_cpu() -> bool:
    """Whether programs traced now compile for XLA:CPU (JAX's default backend)."""
    return jax.default_backend() == "cpu"


def on_gpu() -> bool:
    """Whether programs traced now compile for XLA's GPU backend (NVIDIA's or AMD's)."""
    return jax.default_backend() == "gpu"


def float32_precision(kind: Literal["matmul", "convolution"]) -> lax.Precision:
    """The precision of the float32 matrix products (``kind="matmul"``) or convolutions traced
    now: ``HIGHEST``, full float32, on the CPU and where the program follows torch's full
    setting; ``DEFAULT``, which XLA computes in TF32 on NVIDIA GPUs, where it follows TF32."""
    if on_cpu() or getattr(current_options().float32, kind) == "ieee":
        return lax.Precision.HIGHEST
    return lax.Precision.DEFAULT
