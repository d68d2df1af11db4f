"""PopTorch's programming model rebuilt on JAX/XLA: ``import ipu_backend as poptorch``."""

from ipu_backend.errors import Error

__all__ = ["Error"]
