"""What one host call of a compiled step gives back, in the form Lightning expects.

One Lightning batch is one host call: a combined batch of ``device_iterations x
gradient_accumulation x replicas`` micro-batches. The executor returns each step output per
micro-batch (those the output mode keeps), concatenated; Lightning wants what the step would have
returned on the CPU for the whole combined batch:

* an output whose first dimension is the micro-batch size (per-sample predictions, per-sample
  losses) stays concatenated: it is exactly the CPU output for the combined batch;
* any other output (a mean loss, a fixed-size statistic) is averaged over the returned
  micro-batches when it is floating point, as a mean-reduced statistic of the combined batch is
  on the CPU, and summed otherwise (counts);
* a ``self.log`` value is reduced with the call's ``reduce_fx`` (``"mean"`` by default, the
  value ``sync_dist=True`` gives with DDP) over the replicas, and in evaluation over the
  returned micro-batches too (training logs each micro-batch in turn: see the strategy).

Which micro-batches are returned is the output mode's choice: the last one per replica for
training's default (``OutputMode.Final``), every one for inference's (``OutputMode.All``).
"""

from collections.abc import Mapping

import torch
import torch.utils._pytree as torch_pytree

from ipu_backend import Error

_REDUCTIONS: dict = {"mean": torch.mean, "sum": torch.sum, "max": torch.max, "min": torch.min}


def _combine(value, shape, micro_batch_size: int):
    if shape is None or not isinstance(value, torch.Tensor):
        return value
    if len(shape) > 0 and shape[0] == micro_batch_size:
        return value
    per_micro = value.reshape(-1, *shape)
    if per_micro.is_floating_point():
        return per_micro.mean(0)
    return per_micro.sum(0)


def combine_outputs(result, program, micro_batch_size: int):
    """The step's result for the whole combined batch (see the module docstring)."""
    leaves, spec = torch_pytree.tree_flatten(result)
    shapes = program.result_shapes()          # per micro-batch; None for a constant leaf
    combined = [_combine(value, shape, micro_batch_size) for value, shape in zip(leaves, shapes)]
    return torch_pytree.tree_unflatten(combined, spec)


def reduce_logged(name: str, value: torch.Tensor, reduce_fx, weights: torch.Tensor | None = None) -> torch.Tensor:
    """One logged value from its per-micro-batch values, with ``self.log``'s ``reduce_fx``; a
    mean is weighted by the micro-batches' sizes (``weights``) when they differ."""
    if isinstance(reduce_fx, str):
        if reduce_fx not in _REDUCTIONS:
            raise Error(f"self.log({name!r}, ..., reduce_fx={reduce_fx!r}): use one of "
                        f"{', '.join(_REDUCTIONS)} or a function of a tensor")
        reduce_fx = _REDUCTIONS[reduce_fx]
    flat = value.reshape(-1)
    if reduce_fx is torch.mean and not flat.is_floating_point():
        flat = flat.float()
    if reduce_fx is torch.mean and weights is not None:
        weights = weights.to(flat.dtype)
        return (flat * weights).sum() / weights.sum()
    return reduce_fx(flat)


def per_micro_batch(value: torch.Tensor, processes: int, replicas: int) -> torch.Tensor:
    """``[micro-batches, processes x replicas]``: a logged value's rows as the processes gathered
    them, each process's in input order (micro-batch, replica)."""
    return value.reshape(processes, -1, replicas).transpose(0, 1).reshape(-1, processes * replicas)


def divided_loss(result, accumulation: int):
    """A training step's result with its loss divided by the micro-batches accumulated, as
    Lightning's automatic optimization divides it by ``accumulate_grad_batches`` before handing
    it to ``on_train_batch_end`` (the Trainer's count is 1 on IPUs, which accumulate inside a call)."""
    if accumulation == 1:
        return result
    if isinstance(result, torch.Tensor):
        return result / accumulation
    if isinstance(result, Mapping) and isinstance(result.get("loss"), torch.Tensor):
        return {**result, "loss": result["loss"] / accumulation}
    return result
