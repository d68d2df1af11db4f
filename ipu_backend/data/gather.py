"""Combined batches of a ``TensorDataset`` (or of ``Subset``\\ s of one), gathered by indexing
each tensor once instead of one ``__getitem__`` per sample: a sequential sampler's batches are
row ranges, copied without listing their indices. The batches are what torch's default
collation of the same samples gives."""

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, SequentialSampler, Subset, TensorDataset, default_collate


def tensor_source(loader) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None] | None:
    """The tensors of the TensorDataset behind ``loader.dataset`` and the positions in them of
    the dataset's samples (None: all, in order), when batches can be gathered from them
    directly: torch's default collation in this process, unpinned."""
    if (loader.batch_sampler is None or loader.collate_fn is not default_collate
            or loader.num_workers > 0 or loader.pin_memory):
        return None
    dataset, positions = loader.dataset, None
    while type(dataset) is Subset:
        indices = torch.from_numpy(np.asarray(dataset.indices, dtype=np.int64))
        positions = indices if positions is None else indices[positions]
        dataset = dataset.dataset
    if type(dataset) is not TensorDataset:
        return None
    return dataset.tensors, positions


_NUMPY_DTYPES = frozenset({torch.float16, torch.float32, torch.float64, torch.int8, torch.int16,
                           torch.int32, torch.int64, torch.uint8, torch.bool})


def _rows(tensor: torch.Tensor, rows: slice | np.ndarray) -> torch.Tensor:
    """``tensor[rows]`` as a new tensor. Copied by numpy where it can be: a single-threaded
    memcpy or gather, where torch's ``index_select``/``clone`` of a combined batch go through its
    intra-op thread pool, which costs milliseconds when the host's cores are busy."""
    if (tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.requires_grad
            or tensor.dtype not in _NUMPY_DTYPES):
        if isinstance(rows, slice):
            return tensor[rows].clone()
        return tensor.index_select(0, torch.from_numpy(rows))
    host = tensor.numpy()[rows]
    return torch.from_numpy(host.copy() if isinstance(rows, slice) else host)


def _sequential_ranges(batch_sampler: Any) -> Iterator[slice] | None:
    """The row ranges of torch's ``BatchSampler`` over a ``SequentialSampler`` (None for any
    other sampler), without building its lists of indices."""
    if type(batch_sampler) is not BatchSampler or type(batch_sampler.sampler) is not SequentialSampler:
        return None
    count, size = len(batch_sampler.sampler), batch_sampler.batch_size
    stop = count - count % size if batch_sampler.drop_last else count
    return (slice(start, min(start + size, stop)) for start in range(0, stop, size))


def row_selections(positions: torch.Tensor | None,
                    batch_sampler: Iterable[Sequence[int]]) -> Iterator[slice | np.ndarray]:
    """The rows of the dataset's tensors that each combined batch gathers (``positions``: where
    the dataset's samples are in them, None for all in order)."""
    positions = None if positions is None else positions.numpy()
    ranges = _sequential_ranges(batch_sampler)
    if ranges is not None:
        for rows in ranges:
            yield rows if positions is None else positions[rows]
        return
    for indices in batch_sampler:
        rows = np.asarray(indices, dtype=np.int64)
        yield rows if positions is None else positions[rows]


def gather(tensors: tuple[torch.Tensor, ...], rows: slice | np.ndarray) -> list[torch.Tensor]:
    """What torch's default collation of the samples at ``rows`` gives (a list with one stacked
    tensor per dataset tensor), by one indexing per tensor."""
    return [_rows(tensor, rows) for tensor in tensors]
