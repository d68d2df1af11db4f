"""torch -> JAX: capture a module or step with torch.export and lower core ATen to pure JAX."""

from ipu_backend.compiler.capture import LogCall
from ipu_backend.compiler.dtypes import jax_dtype, to_jax, to_torch
from ipu_backend.compiler.program import Program, TensorSpec, compile_module
from ipu_backend.compiler.registry import lowering, registered_ops

__all__ = ["LogCall", "Program", "TensorSpec", "compile_module", "jax_dtype", "lowering",
           "registered_ops", "to_jax", "to_torch"]
