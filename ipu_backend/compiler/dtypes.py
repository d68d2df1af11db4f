"""Dtype mapping and host conversion between torch tensors and JAX arrays.

JAX runs in its default 32-bit mode: torch's int64 is carried as int32 and float64 as float32
on the device, and converted back at the host boundary. That keeps programs fast on every
backend and leaves the user's global JAX configuration alone. An int64 value that int32 cannot
hold, or a finite float64 value beyond float32's range, is refused where it crosses to the
device (:func:`check_fits_device`), never wrapped or made infinite.
"""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch

from ipu_backend.errors import Error

_TORCH_TO_JAX = {
    torch.float32: jnp.float32,
    torch.float64: jnp.float32,
    torch.float16: jnp.float16,
    torch.bfloat16: jnp.bfloat16,
    torch.int64: jnp.int32,
    torch.int32: jnp.int32,
    torch.int16: jnp.int16,
    torch.int8: jnp.int8,
    torch.uint8: jnp.uint8,
    torch.bool: jnp.bool_,
}


def jax_dtype(dtype: torch.dtype):
    """The JAX dtype that carries a torch dtype on the device."""
    try:
        return _TORCH_TO_JAX[dtype]
    except KeyError:
        raise Error(f"dtype {dtype} is not supported on emulated IPUs; use one of "
                    f"{sorted(str(d) for d in _TORCH_TO_JAX)}") from None


INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)
_INT64, _FLOAT64 = np.dtype(np.int64), np.dtype(np.float64)


def check_fits_device(values, what: str) -> None:
    """Refuse int64 ``values`` (a tensor or numpy array) that int32, their device dtype, cannot
    hold (converting would wrap them), and finite float64 values beyond float32's range
    (converting would make them infinite). ``what`` names the tensor in the error. (Each input
    of each call is checked: a full pass, as cheap as numpy has, for these two dtypes only.)"""
    if isinstance(values, torch.Tensor):
        if values.dtype not in (torch.int64, torch.float64):
            return
        values = values.detach().cpu().numpy()
    if values.size == 0 or values.dtype not in (_INT64, _FLOAT64):
        return
    if values.dtype == _FLOAT64:
        beyond = values[np.abs(values) > FLOAT32_MAX]
        beyond = beyond[np.isfinite(beyond)]
        if beyond.size:
            raise Error(f"{what} holds the float64 value {float(beyond[0])!r}, beyond the float32 range in "
                        f"which the device carries float64 (±{FLOAT32_MAX:.7g}): it would become infinite. "
                        "Scale the values into that range")
        return
    low, high = np.minimum.reduce(values, axis=None), np.maximum.reduce(values, axis=None)
    if low < INT32_MIN or high > INT32_MAX:
        bad = int(high) if high > INT32_MAX else int(low)
        raise Error(f"{what} holds the int64 value {bad}, outside the int32 range in which the device "
                    f"carries int64 ([{INT32_MIN}, {INT32_MAX}]): it would wrap. Keep integer inputs, "
                    "weights and buffers within that range (re-map large ids to a smaller range)")


def to_jax(tensor: torch.Tensor, what: str = "a tensor"):
    """Copy a torch tensor to a JAX array of its device dtype (``what`` names it in an error)."""
    return jnp.asarray(_numpy(tensor, what), dtype=jax_dtype(tensor.dtype))


def to_host_array(tensor: torch.Tensor, what: str = "a tensor") -> np.ndarray:
    """A torch tensor as a numpy array of its device dtype (host data to stack before a copy)."""
    return np.asarray(_numpy(tensor, what), dtype=jax_dtype(tensor.dtype))


def _numpy(tensor: torch.Tensor, what: str) -> np.ndarray:
    tensor = tensor.detach()
    check_fits_device(tensor, what)
    if tensor.dtype == torch.bfloat16:
        return tensor.cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.cpu().numpy()


def to_torch(array, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Copy a JAX array to a torch tensor, restoring the torch dtype it stands for."""
    host = np.asarray(array)
    if host.dtype == ml_dtypes.bfloat16:
        tensor = torch.from_numpy(host.view(np.int16).copy()).view(torch.bfloat16)
    else:
        tensor = torch.from_numpy(np.array(host, copy=True))
    return tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)
