"""Combined batches from a user's ``batch_sampler`` and ``collate_fn``: each micro-batch is
collated on its own (a ``collate_fn`` may pad or reshape it), then the tensors of consecutive
micro-batches are concatenated along dim 0, as PopTorch does. Structures are walked as torch
pytrees, so tuples, lists, dicts, named tuples and types registered with
``registerCustomArgParser`` keep their shape."""

from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as torch_pytree

from ipu_backend.option_values import WrongArgumentType


def _concat_leaves(leaves: list[Any], position: int) -> Any:
    first = leaves[0]
    if not isinstance(first, torch.Tensor):
        if any(leaf != first for leaf in leaves[1:]):
            raise WrongArgumentType(
                f"the collate_fn's micro-batches differ in a non-tensor value (item {position}: "
                f"{first!r} vs {leaves[-1]!r}); micro-batches are combined by concatenating their "
                "tensors, so their other values must be equal")
        return first
    if first.dim() == 0:
        raise WrongArgumentType(
            f"the collate_fn returned a 0-d tensor (item {position}); micro-batches are combined "
            "along dim 0, so each tensor needs a batch dimension")
    return torch.cat(leaves)


def concat_batches(batches: list[Any]) -> Any:
    """One batch whose tensors are those of ``batches`` concatenated along dim 0."""
    flat = [torch_pytree.tree_flatten(batch) for batch in batches]
    spec = flat[0][1]
    for leaves, other in flat[1:]:
        if other != spec:
            raise WrongArgumentType(
                "the collate_fn's micro-batches have different structures and cannot be combined "
                f"into one batch: {spec} vs {other}")
    columns = zip(*(leaves for leaves, _ in flat))
    return torch_pytree.tree_unflatten(
        [_concat_leaves(list(column), i) for i, column in enumerate(columns)], spec)


def combine(batches: Iterator[Any], count: int, drop_last: bool) -> Iterator[Any]:
    """Each ``count`` consecutive ``batches`` as one; a last, smaller group unless ``drop_last``."""
    pending: list[Any] = []
    for batch in batches:
        pending.append(batch)
        if len(pending) == count:
            yield concat_batches(pending)
            pending = []
    if pending and not drop_last:
        yield concat_batches(pending)
