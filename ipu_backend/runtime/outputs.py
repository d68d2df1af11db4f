"""Host side of a call: combined-batch inputs onto the replica mesh, outputs back in PopTorch's shapes."""

import numpy as np
import torch
from jax.sharding import PartitionSpec as P

from ipu_backend.compiler import jax_dtype, to_torch
from ipu_backend.compiler.dtypes import check_fits_device, to_jax
from ipu_backend.errors import IndexOutOfRange
from ipu_backend.runtime import processes
from ipu_backend.runtime.devices import REPLICA
from ipu_backend.runtime.schedule import Schedule, split_batch


def host_inputs(args: tuple, schedule: Schedule) -> list:
    """The tensor leaves of ``args`` as host arrays of their device dtype, split to
    ``[D, A, R, m, ...]``. A compiled call takes them as they are and copies each onto the
    replica mesh as its input sharding says, one copy cheaper than placing them first."""
    def split(index, x):
        if x.dtype == torch.bfloat16:
            return split_batch(np.asarray(to_jax(x)), schedule)
        host = x.detach().cpu().numpy()
        check_fits_device(host, f"input tensor {index} of the call (counting tensors in argument order)")
        return split_batch(host.astype(jax_dtype(x.dtype), copy=False), schedule)

    tensors = [x for x in torch.utils._pytree.tree_leaves(tuple(args)) if isinstance(x, torch.Tensor)]
    return [split(index, x) for index, x in enumerate(tensors)]


def check_index_inputs(args: tuple, index_inputs: tuple) -> None:
    """The checks torch makes on indices as it runs (an embedding's rows, a loss's class
    targets, ``x[i]``, ``gather``), made on the host before a call for the inputs that are such
    indices (``Program.index_inputs``)."""
    leaves = torch.utils._pytree.tree_leaves(tuple(args))
    for index_input in index_inputs:
        values = leaves[index_input.position]
        if not values.numel():
            continue
        low, high = _bounds(values)           # one pass; the ignored value only looked for if out
        if (low < index_input.low or high >= index_input.size) and index_input.ignored is not None:
            values = values[values != index_input.ignored]
            if not values.numel():
                continue
            low, high = _bounds(values)
        if low >= index_input.low and high < index_input.size:
            continue
        bad = low if low < index_input.low else high
        where = f"the call's input {index_input.position} (in argument order) holds"
        if index_input.kind == "rows":
            raise IndexOutOfRange(
                f"index out of range in self: {where} the index {bad}, but the embedding at "
                f"{index_input.location} has {index_input.size} rows (indices 0 to {index_input.size - 1})")
        if index_input.kind == "target":
            raise IndexOutOfRange(
                f"Target {bad} is out of bounds: {where} it, for the {index_input.size} classes of the "
                f"loss at {index_input.location} (targets 0 to {index_input.size - 1}, or "
                f"{index_input.ignored}: ignored)")
        raise IndexOutOfRange(
            f"index {bad} is out of bounds for dimension {index_input.dim} with size {index_input.size}: "
            f"{where} it, as an index at {index_input.location}")


def _bounds(values: torch.Tensor) -> tuple[int, int]:
    low, high = torch.aminmax(values)
    return int(low), int(high)


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
