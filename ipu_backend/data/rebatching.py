"""``DataLoaderMode.AsyncRebatched`` for an ``IterableDataset``: the batches torch loads, cut
into combined batches, so that each worker's leftover samples are not dropped separately."""

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from ipu_backend.option_values import WrongArgumentType


def _unsupported_batch(batch: Any) -> WrongArgumentType:
    return WrongArgumentType(
        "AsyncRebatched needs batches of tensors, or of lists, tuples or dicts of tensors; got "
        f"a {type(batch).__name__}")


def _length(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return len(batch)
    items = list(batch.values()) if isinstance(batch, Mapping) else batch
    if isinstance(items, (list, tuple)) and items:
        return _length(items[0])
    raise _unsupported_batch(batch)


def _rebuild(like: list | tuple, parts: Iterable[Any]) -> list | tuple:
    parts = list(parts)
    return type(like)(*parts) if hasattr(like, "_fields") else type(like)(parts)


def _concat(batches: list[Any]) -> Any:
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(batches)
    if isinstance(first, Mapping):
        return type(first)({key: _concat([b[key] for b in batches]) for key in first})
    if isinstance(first, (list, tuple)):
        return _rebuild(first, (_concat(list(items)) for items in zip(*batches)))
    raise _unsupported_batch(first)


def _slice(batch: Any, start: int, stop: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, Mapping):
        return type(batch)({key: _slice(value, start, stop) for key, value in batch.items()})
    if isinstance(batch, (list, tuple)):
        return _rebuild(batch, (_slice(item, start, stop) for item in batch))
    raise _unsupported_batch(batch)


def rebatch(batches: Iterator[Any], size: int, drop_last: bool) -> Iterator[Any]:
    """Cut the concatenation of ``batches`` into batches of ``size`` samples."""
    pending: list[Any] = []
    count = 0
    for batch in batches:
        pending.append(batch)
        count += _length(batch)
        while count >= size:
            merged = _concat(pending)
            yield _slice(merged, 0, size)
            count -= size
            pending = [_slice(merged, size, size + count)] if count else []
    if pending and not drop_last:
        yield _concat(pending)
