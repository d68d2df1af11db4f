"""Host side of a call: combined-batch inputs onto the replica mesh, outputs back in PopTorch's shapes."""

import jax
import numpy as np
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ipu_backend.compiler import jax_dtype, to_torch
from ipu_backend.compiler.dtypes import to_jax
from ipu_backend.runtime.step import REPLICA, Schedule, split_batch


def inputs_to_device(args: tuple, schedule: Schedule, mesh) -> list:
    """The tensor leaves of ``args``, split to ``[D, A, R, m, ...]`` and sharded on the replica
    axis of ``mesh``; left on the host when ``mesh`` is None (a multi-IPU program sends each to
    the stages reading it)."""
    sharding = None if mesh is None else NamedSharding(mesh, P(None, None, REPLICA))

    def split(x):
        host = np.asarray(to_jax(x)) if x.dtype == torch.bfloat16 else \
            x.detach().cpu().numpy().astype(jax_dtype(x.dtype), copy=False)
        return split_batch(host, schedule)

    arrays = [split(x) for x in torch.utils._pytree.tree_leaves(tuple(args)) if isinstance(x, torch.Tensor)]
    return arrays if sharding is None else jax.device_put(arrays, sharding)   # one batched copy


def output_to_host(array, dtype: torch.dtype) -> torch.Tensor:
    """``[R, D', A', *s]`` → PopTorch's shape: micro-batch outputs concatenated in input order
    (iteration, micro-batch, replica); scalars stacked, and a single scalar stays 0-d."""
    host = np.asarray(jax.device_get(array))
    host = np.moveaxis(host, 0, 2)                  # [D', A', R, *s]
    count = host.shape[0] * host.shape[1] * host.shape[2]
    if host.ndim == 3:
        host = host.reshape(()) if count == 1 else host.reshape(count)
    else:
        host = host.reshape(count * host.shape[3], *host.shape[4:])
    return to_torch(host, dtype)
