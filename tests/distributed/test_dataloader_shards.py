"""poptorch.DataLoader with several processes gives each process its own block of the dataset,
as PopTorch's does (the process is set with configureProcessId; nothing connects here)."""

import pytest
import torch
from torch.utils.data import TensorDataset

import ipu_backend as poptorch


def options(process: int, processes: int = 2, seed: int | None = None) -> poptorch.Options:
    opts = poptorch.Options().replicationFactor(2)
    opts.Distributed.configureProcessId(process, processes)
    return opts if seed is None else opts.randomSeed(seed)


def dataset(size: int) -> TensorDataset:
    return TensorDataset(torch.arange(size), torch.arange(size) * 10)


def epoch(loader) -> list[int]:
    rows = []
    for x, y in loader:
        assert torch.equal(y, x * 10) and len(x) == loader.combinedBatchSize
        rows += x.tolist()
    return rows


def test_each_process_reads_its_own_block_of_whole_combined_batches():
    data = dataset(42)                          # 4 per combined batch: 2 x 4 x 5 batches, 2 samples left out
    shares = [epoch(poptorch.DataLoader(options(p), data, batch_size=2)) for p in range(2)]
    assert shares == [list(range(20)), list(range(20, 40))]


def test_shuffling_permutes_the_whole_dataset_alike_in_every_process_and_uses_the_left_out_samples():
    """Each epoch one permutation of all 42 samples (from the seed); the 40 read are its samples
    2 to 41 in odd epochs and 0 to 39 in even ones, process 0 the first half."""
    data = dataset(42)
    loaders = [poptorch.DataLoader(options(p, seed=7), data, batch_size=2, shuffle=True) for p in range(2)]
    generator = torch.Generator().manual_seed(7)
    for start in (2, 0, 2):
        order = torch.randperm(42, generator=generator).tolist()
        assert [epoch(loader) for loader in loaders] == [order[start:start + 20], order[start + 20:start + 40]]


def test_shuffled_shards_reach_persistent_workers_each_epoch():
    """Workers hold a copy of the dataset made when they start; each epoch's order still reaches
    them (in shared memory), so they read what a loader without workers reads."""
    data = dataset(42)
    in_process = poptorch.DataLoader(options(1, seed=7), data, batch_size=2, shuffle=True)
    workers = poptorch.DataLoader(options(1, seed=7), data, batch_size=2, shuffle=True, num_workers=1,
                                  persistent_workers=True)
    epochs = [epoch(in_process) for _ in range(3)]
    assert epochs[0] != epochs[1] != epochs[2]
    assert [epoch(workers) for _ in range(3)] == epochs


def test_without_drop_last_the_samples_are_spread_evenly():
    data = dataset(11)

    def rows(process):
        loader = poptorch.DataLoader(options(process, processes=3), data, batch_size=1, drop_last=False)
        return [x for batch in loader for x in batch[0].tolist()]

    assert [rows(0), rows(1)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.warns(UserWarning, match="3 samples do not divide into combined batches of 2"):
        assert rows(2) == [8, 9, 10]


def test_without_partitioning_every_process_reads_everything():
    assert epoch(poptorch.DataLoader(options(1), dataset(8), batch_size=2,
                                     auto_distributed_partitioning=False)) == list(range(8))


@pytest.mark.parametrize("make, message", [
    (lambda: poptorch.DataLoader(options(0), dataset(40), batch_size=2, shuffle=True), "randomSeed"),
    (lambda: poptorch.DataLoader(options(0), dataset(40), batch_sampler=torch.utils.data.BatchSampler(
        range(40), 2, False)), "mutually exclusive with auto_distributed_partitioning"),
    (lambda: poptorch.DataLoader(options(0), dataset(6), batch_size=2), "one combined batch of 4 for each"),
])
def test_what_cannot_be_partitioned_says_why(make, message):
    with pytest.raises(poptorch.Error, match=message):
        make()
