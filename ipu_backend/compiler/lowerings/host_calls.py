"""Lowering: ``poptorch.CPU`` calls run their Python function on the host through a callback,
in inference programs (a gradient through one is refused, as in PopTorch)."""

import jax
import numpy as np
import torch

from ipu_backend.compiler.dtypes import jax_dtype, to_torch
from ipu_backend.compiler.host_calls import HOST_CALL, host_function
from ipu_backend.compiler.registry import lowering
from ipu_backend.errors import Error


def _to_numpy(tensor: torch.Tensor, dtype) -> np.ndarray:
    """A host function's result as the program holds it (``dtype``: its JAX dtype)."""
    tensor = tensor.detach()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy().astype(dtype)


@lowering(HOST_CALL)
def host_call(ctx, inputs, key):
    function = host_function(key)
    shapes = [jax.ShapeDtypeStruct(tuple(o.shape), jax_dtype(o.dtype)) for o in ctx.out]
    input_dtypes = [node.meta["val"].dtype for node in ctx.node.args[0]]
    name = key.rsplit("#", 1)[0]

    def on_host(*arrays):
        tensors = [to_torch(a, dtype) for a, dtype in zip(arrays, input_dtypes)]
        return [_to_numpy(o, s.dtype) for o, s in zip(function(*tensors), shapes)]

    @jax.custom_vjp
    def called(*arrays):
        return jax.pure_callback(on_host, shapes, *arrays, vmap_method="sequential")

    def forward(*arrays):
        return called(*arrays), None

    def backward(_, gradients):
        raise Error(f"poptorch.CPU op {name!r} is in the gradient of the loss: CPU ops run in inference "
                    "models only (as in PopTorch); use the op in a poptorch.inferenceModel")

    called.defvjp(forward, backward)
    return list(called(*inputs))
