"""The short last batch of an evaluation epoch, evaluated whole.

Validation, test and predict see every sample, as on the CPU. A host call takes a whole combined
batch: ``device_iterations x replicas`` micro-batches of the loader's batch size ``b``. The last
batch of an epoch may hold fewer samples, ``k = q·b + r``, which on the CPU are ``q`` batches of
``b`` and one of ``r``. They run here as at most two calls of the step's executor: the ``q`` whole
micro-batches, then the ``r`` samples as a micro-batch of their own (their size is compiled once
more), each call padded to full size with copies of its last real micro-batch. The copies'
results are dropped on the host: outputs, logged values (their mean weighted by micro-batch
size, as Lightning's epoch means weight batches by size) and torchmetrics states, so that the
epoch's metrics equal the CPU's. This needs every micro-batch's results, which inference's
default output mode (``OutputMode.All``) returns.
"""

from dataclasses import dataclass

import torch
import torch.utils._pytree as torch_pytree

from ipu_backend.lightning_seam import TOTAL_SUFFIX


@dataclass
class Piece:
    """One padded call: its inputs, and how many of its micro-batches (of ``size`` samples) are
    real."""

    batch: object
    real: int
    size: int


def pieces(batch, micro_batch_size: int, factor: int) -> list[Piece]:
    """The calls that evaluate ``batch`` (fewer than ``factor`` micro-batches' worth of samples)."""
    count = batch_size(batch)
    whole, rest = divmod(count, micro_batch_size)
    parts = [(0, whole, micro_batch_size)] if whole else []
    if rest:
        parts.append((whole * micro_batch_size, 1, rest))
    return [Piece(torch_pytree.tree_map(lambda x: _padded(x, start, real, size, factor), batch), real, size)
            for start, real, size in parts]


def batch_size(batch) -> int:
    """The samples in ``batch``: the first dimension of its tensors."""
    return next(x.shape[0] for x in torch_pytree.tree_leaves(batch) if isinstance(x, torch.Tensor))


def _padded(x, start: int, real: int, size: int, factor: int):
    """``real`` micro-batches of ``size`` rows of ``x`` from ``start``, then copies of the last of
    them up to ``factor`` micro-batches."""
    if not isinstance(x, torch.Tensor):
        return x
    rows = x[start:start + real * size]
    return torch.cat([rows] + [rows[-size:]] * (factor - real))


def per_sample_leaves(shapes: list, piece: Piece) -> list[bool]:
    """Which result leaves hold one row per sample (``shapes``: each leaf's shape per
    micro-batch, None for a constant), as ``_outputs.combine_outputs`` tells them apart."""
    return [shape is not None and len(shape) > 0 and shape[0] == piece.size for shape in shapes]


def kept_result(result, shapes: list, per_sample: list[bool], piece: Piece, factor: int) -> list:
    """The flattened leaves of a call's ``result`` without the padding: per-sample leaves cut to
    the real samples, any other tensor leaf as the stack of its real micro-batches' values."""
    kept = []
    for value, shape, samples in zip(torch_pytree.tree_leaves(result), shapes, per_sample):
        if shape is None or not isinstance(value, torch.Tensor):
            kept.append(value)
        elif samples:
            kept.append(value[:piece.real * piece.size])
        else:
            kept.append(value.reshape(factor, *shape)[:piece.real])
    return kept


def merged_result(result, kept: list[list], per_sample: list[bool], pieces_run: list[Piece]):
    """The step's result for the whole short batch from each call's :func:`kept_result`: the
    samples in order, and other values averaged over the micro-batches weighted by their size
    when floating point (summed otherwise), as ``_outputs.combine_outputs`` reduces a batch."""
    _, spec = torch_pytree.tree_flatten(result)
    weights = micro_batch_weights(pieces_run)
    leaves = []
    for index, samples in enumerate(per_sample):
        values = [leaves_of_call[index] for leaves_of_call in kept]
        if not isinstance(values[0], torch.Tensor):
            leaves.append(values[0])
        elif samples:
            leaves.append(torch.cat(values))
        elif values[0].is_floating_point():
            joined = torch.cat(values)
            weight = weights.to(joined.dtype).reshape(-1, *([1] * (joined.ndim - 1)))
            leaves.append((joined * weight).sum(0) / weight.sum())
        else:
            leaves.append(torch.cat(values).sum(0))
    return torch_pytree.tree_unflatten(leaves, spec)


def micro_batch_weights(pieces_run: list[Piece]) -> torch.Tensor:
    """The size of each real micro-batch of the calls, in order."""
    return torch.tensor([float(p.size) for p in pieces_run for _ in range(p.real)])


def kept_logs(logs: dict, piece: Piece, factor: int) -> dict:
    """A call's logged values per micro-batch without the padding. A metric state's total over
    the call (``<key>:total``) becomes its real micro-batches' values, which the host reduces."""
    kept = {name: _real_micro_batches(value, piece.real, factor) for name, value in logs.items()
            if not name.endswith(TOTAL_SUFFIX)}
    kept.update({name: kept[name[:-len(TOTAL_SUFFIX)]] for name in logs if name.endswith(TOTAL_SUFFIX)})
    return kept


def _real_micro_batches(value: torch.Tensor, real: int, factor: int) -> torch.Tensor:
    """The first ``real`` of the ``factor`` micro-batches' values concatenated in ``value``."""
    return value.reshape(factor, -1)[:real].reshape(-1, *value.shape[1:])


def merged_logs(kept: list[dict]) -> dict:
    """Each logged value's real micro-batch values over the calls, in order."""
    return {name: torch.cat([logs[name] for logs in kept]) for name in kept[0]}
