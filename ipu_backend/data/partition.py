"""Each process's share of a dataset when the replicas are spread over several processes, as
PopTorch's ``DataLoader`` partitions it (``auto_distributed_partitioning``).

Process ``p`` of ``P`` reads one contiguous block of the dataset: with ``drop_last`` the blocks
hold the same whole number of combined batches, ``step * (n // (step * P))`` samples each;
without it the samples are spread as evenly as they go. Shuffling permutes the whole dataset
the same way in every process (from ``Options.randomSeed``, one permutation per epoch) before
the blocks are taken, and every other epoch shifts the blocks by the samples they leave out, so
that all of them are read.
"""

from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from ipu_backend.option_values import InvalidArgument


class ProcessShard:
    """The block of ``dataset`` that process ``process`` of ``processes`` reads, as ``subset``."""

    def __init__(self, dataset: Dataset, process: int, processes: int, step: int, drop_last: bool,
                 seed: int | None, shuffle: bool) -> None:
        size = len(dataset)
        if drop_last:
            length = step * (size // (step * processes))
            if length == 0:
                raise InvalidArgument(
                    f"The dataset's {size} samples do not make one combined batch of {step} for each "
                    f"of the {processes} processes (drop_last=True)")
            offset, self.leftovers = process * length, size % length
        else:
            lengths = [size // processes + (size % processes > p) for p in range(processes)]
            offset, length, self.leftovers = sum(lengths[:process]), lengths[process], 0
        self.size, self.offset, self.length = size, offset, length
        self.generator = torch.Generator().manual_seed(seed) if shuffle else None
        self.shifted = False
        self.order = None if self.generator is None else _SharedOrder(length)
        self.subset = Subset(dataset, range(offset, offset + length) if self.order is None else self.order)

    def next_epoch(self) -> None:
        """Before each epoch: with shuffling, a new permutation of the whole dataset, and the block
        shifted by the left-out samples every other epoch."""
        if self.generator is None:
            return
        order = torch.randperm(self.size, generator=self.generator)
        self.shifted = not self.shifted
        start = self.offset + (self.leftovers if self.shifted else 0)
        self.order.tensor.copy_(order[start:start + self.length])


class _SharedOrder(Sequence):
    """A shuffled shard's sample indices, in shared memory and rewritten in place each epoch, so
    that persistent DataLoader workers, which hold a copy of the dataset made when they started,
    read each epoch's order (as PopTorch's shared index tensor)."""

    def __init__(self, length: int) -> None:
        self.tensor = torch.zeros(length, dtype=torch.long).share_memory_()

    def __len__(self) -> int:
        return len(self.tensor)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.tensor[index].tolist()
        return int(self.tensor[index])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return self.tensor.numpy().astype(dtype or np.int64, copy=bool(copy))
