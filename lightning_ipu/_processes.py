"""Several processes under one Trainer (``num_nodes``): one per node, each driving ``devices``
replicas, all of them one replicated program on ``jax.distributed``.

The strategy takes each process's rank from ``ipu-run`` or from Lightning's cluster environment
and connects the processes here. What a call logs (per replica) is gathered from every process
before it is reduced, so a logged value, and a torchmetrics state, is the one a single process
with all the replicas would log; Lightning's own collectives (``reduce``, ``broadcast``,
``barrier``, ``all_gather``) go over the same connection.
"""

import numpy as np
import torch

from ipu_backend import lightning_seam as seam

_REDUCTIONS = {"sum": np.sum, "mean": np.mean, "avg": np.mean, "max": np.max, "min": np.min}


launched_by_ipu_run = seam.ipu_run_instance


def coordinator(main_address: str, main_port: int) -> str:
    """Where JAX's coordination service listens: ``IPU_BACKEND_COORDINATOR``, else Lightning's
    main address on the port after its main port (which torchrun's own store may hold)."""
    return seam.coordinator_from_environment() or f"{main_address}:{main_port + 1}"


def connect(rank: int, processes: int, main_address: str, main_port: int) -> None:
    """Join the other processes (nothing to do for one, or when ``ipu-run`` already did)."""
    if processes > 1:
        seam.join_processes(coordinator(main_address, main_port), num_instances=processes, instance_index=rank)


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).detach().cpu().numpy()


def gathered(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each value's per-replica (or per-sample) rows from every process, concatenated in process
    order (a single value becomes one row per process)."""
    if not values:
        return values
    names = sorted(values)
    stacked = seam.all_gather([_to_numpy(values[name]) for name in names])
    result = {}
    for name, every in zip(names, stacked):
        rows = np.asarray(every).reshape(-1, *values[name].shape[1:])
        result[name] = torch.from_numpy(np.array(rows)).to(values[name].dtype)
    return result


def reduce_op_name(reduce_op) -> str:
    """Lightning's ``reduce_op`` (a name, or torch's ``ReduceOp``) as a name of ``_REDUCTIONS``."""
    name = str(getattr(reduce_op, "name", reduce_op) or "mean").lower().rsplit(".", 1)[-1]
    if name not in _REDUCTIONS:
        raise ValueError(f"reduce_op {reduce_op!r} is not one of {', '.join(_REDUCTIONS)}")
    return name


def reduce(tensor, reduce_op) -> torch.Tensor:
    """``tensor`` reduced over the processes element-wise."""
    value = torch.as_tensor(tensor)
    name = reduce_op_name(reduce_op)
    every = np.asarray(seam.all_gather(_to_numpy(value)))
    result = torch.as_tensor(_REDUCTIONS[name](every, axis=0))
    return result if name in ("mean", "avg") and not value.is_floating_point() else result.to(value.dtype)


def all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` from every process, stacked on a new first axis."""
    return torch.from_numpy(np.array(seam.all_gather(_to_numpy(tensor)))).to(tensor.dtype)


barrier = seam.barrier
broadcast = seam.broadcast_object
