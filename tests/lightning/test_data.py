"""Lightning's dataloaders as combined-batch IPU loaders (lightning_ipu/_data.py)."""

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

import ipu_backend
from lightning_ipu._data import to_ipu_dataloader
from tests.lightning.helpers import dataset


def batches(loader, seed=0):
    torch.manual_seed(seed)
    return [tuple(t.clone() for t in batch) for batch in loader]


def assert_same_batches(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_four_replicas_of_batch_b_get_exactly_the_shuffled_batches_of_4b():
    data = dataset(70)
    options = ipu_backend.Options(replication_factor=4)
    ipu = to_ipu_dataloader(DataLoader(data, batch_size=4, shuffle=True), options, "train")
    assert isinstance(ipu, ipu_backend.DataLoader) and len(ipu) == 4
    assert_same_batches(batches(ipu), batches(DataLoader(data, batch_size=16, shuffle=True, drop_last=True)))


def test_device_iterations_and_accumulation_multiply_the_combined_batch():
    data = dataset(64)
    options = ipu_backend.Options(replication_factor=2, device_iterations=2, gradient_accumulation=2)
    got = batches(to_ipu_dataloader(DataLoader(data, batch_size=2), options, "train"))
    assert_same_batches(got, batches(DataLoader(data, batch_size=16)))


class Buckets(BatchSampler):
    """A user batch sampler: batches of the even, then the odd indices."""

    def __init__(self, n, batch_size):
        self.n, self.batch_size = n, batch_size

    def __iter__(self):
        for parity in (0, 1):
            indices = list(range(parity, self.n, 2))
            yield from (indices[i:i + self.batch_size] for i in range(0, len(indices), self.batch_size))

    def __len__(self):
        return self.n // self.batch_size


def test_a_user_batch_sampler_works_with_replicas():
    data = dataset(32)
    ipu = to_ipu_dataloader(DataLoader(data, batch_sampler=Buckets(32, 4)), ipu_backend.Options(replication_factor=2), "train")
    got = batches(ipu)
    assert len(got) == 4
    torch.testing.assert_close(got[0][0], data.tensors[0][[0, 2, 4, 6, 8, 10, 12, 14]])
    torch.testing.assert_close(got[2][0], data.tensors[0][[1, 3, 5, 7, 9, 11, 13, 15]])


def test_a_short_last_batch_is_dropped_in_training_when_batches_are_combined():
    data = dataset(18)
    with pytest.warns(UserWarning, match="last batch is short"):
        ipu = to_ipu_dataloader(DataLoader(data, batch_size=4), ipu_backend.Options(replication_factor=2), "train")
    assert [b[0].shape[0] for b in ipu] == [8, 8]
    single = to_ipu_dataloader(DataLoader(data, batch_size=4), ipu_backend.Options(), "train")
    assert [b[0].shape[0] for b in single] == [4, 4, 4, 4, 2]


def test_evaluation_keeps_the_short_last_batch():
    """Validation, test and predict evaluate it whole (tests/lightning/test_short_batches.py)."""
    data = dataset(18)
    ipu = to_ipu_dataloader(DataLoader(data, batch_size=4), ipu_backend.Options(replication_factor=2), "val")
    assert [b[0].shape[0] for b in ipu] == [8, 8, 2]
    torch.testing.assert_close(torch.cat([b[0] for b in ipu]), data.tensors[0])


class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(20, dtype=torch.float32).reshape(10, 2))


def test_an_iterable_dataset_is_batched_by_the_combined_batch_size():
    options = ipu_backend.Options(replication_factor=2)
    assert [b.shape for b in to_ipu_dataloader(DataLoader(Stream(), batch_size=2), options, "train")] == [(4, 2)] * 2
    assert [b.shape for b in to_ipu_dataloader(DataLoader(Stream(), batch_size=2), options, "predict")] == \
        [(4, 2), (4, 2), (2, 2)]


def test_an_ipu_dataloader_with_the_right_options_is_kept():
    options = ipu_backend.Options(replication_factor=2)
    given = ipu_backend.DataLoader(options, dataset(16), batch_size=2)
    assert to_ipu_dataloader(given, options, "train") is given
    sampler = BatchSampler(SequentialSampler(range(8)), 2, drop_last=False)
    assert to_ipu_dataloader(DataLoader(dataset(8), batch_sampler=sampler), options, "test").batch_sampler.batch_sampler is sampler
