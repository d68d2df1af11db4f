"""Host side of a call: combined-batch inputs onto the replica mesh, outputs back in PopTorch's shapes."""

import numpy as np
import torch
from jax.sharding import PartitionSpec as P

from ipu_backend.compiler import jax_dtype, to_torch
from ipu_backend.compiler.dtypes import to_jax
from ipu_backend.runtime import processes
from ipu_backend.runtime.devices import REPLICA
from ipu_backend.runtime.schedule import Schedule, split_batch


def host_inputs(args: tuple, schedule: Schedule) -> list:
    """The tensor leaves of ``args`` as host arrays of their device dtype, split to
    ``[D, A, R, m, ...]``. A compiled call takes them as they are and copies each onto the
    replica mesh as its input sharding says, one copy cheaper than placing them first."""
    def split(x):
        host = np.asarray(to_jax(x)) if x.dtype == torch.bfloat16 else \
            x.detach().cpu().numpy().astype(jax_dtype(x.dtype), copy=False)
        return split_batch(host, schedule)

    return [split(x) for x in torch.utils._pytree.tree_leaves(tuple(args)) if isinstance(x, torch.Tensor)]


def inputs_to_device(args: tuple, schedule: Schedule, mesh) -> list:
    """:func:`host_inputs` sharded on the replica axis of ``mesh`` (across processes, this
    process's share of the global batch); left on the host when ``mesh`` is None (a multi-IPU
    program sends each to the stages reading it)."""
    arrays = host_inputs(args, schedule)
    if mesh is None:
        return arrays
    return processes.batch_on_mesh(arrays, mesh, P(None, None, REPLICA))   # one batched copy


def output_to_host(array, dtype: torch.dtype) -> torch.Tensor:
    """``[R, D', A', *s]`` → PopTorch's shape: micro-batch outputs concatenated in input order
    (iteration, micro-batch, replica); scalars stacked, and a single scalar stays 0-d. Across
    processes, this process's replicas' outputs, as PopDist returns them."""
    host = processes.local_rows(array)
    if host.shape[0] > 1:
        host = np.moveaxis(host, 0, 2)             # [D', A', R, *s]; one replica: already so
    count = host.shape[0] * host.shape[1] * host.shape[2]
    if host.ndim == 3:
        host = host.reshape(()) if count == 1 else host.reshape(count)
    else:
        host = host.reshape(count * host.shape[3], *host.shape[4:])
    return to_torch(host, dtype)
