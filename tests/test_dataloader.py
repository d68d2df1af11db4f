"""ipu_backend.data.DataLoader: combined batches, remainders, batch samplers, asynchronous
prefetching, fetching ahead while the model runs, deterministic shuffling, the gathered fast
path, argument checks."""

import gc
import threading
import warnings

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    Dataset,
    IterableDataset,
    SequentialSampler,
    Subset,
    TensorDataset,
)

from ipu_backend import Error, ICustomArgParser, inferenceModel, registerCustomArgParser
from ipu_backend.data import DataLoader
from ipu_backend.data import gather as data
from ipu_backend.enums import DataLoaderMode
from ipu_backend.options import FrozenOptionsError, InvalidArgument, Options, WrongArgumentType
from ipu_backend.runtime import host_idle


def _samples(n):
    """Sample i is (i as a 2x3 float image, label i)."""
    return TensorDataset(torch.arange(n, dtype=torch.float32)[:, None, None].expand(n, 2, 3)
                         .contiguous(), torch.arange(n))


class _PerSample(Dataset):
    """The same samples through __getitem__ only, so torch fetches them one by one."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        return self.dataset[index]


class _Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        return ({"x": torch.tensor([float(i)]), "y": i} for i in range(self.n))


def _labels(loader):
    return [batch[1].tolist() for batch in loader]


def _assert_same_batches(left, right):
    left, right = list(left), list(right)
    assert len(left) == len(right)
    for a, b in zip(left, right):
        assert type(a) is type(b) and len(a) == len(b)
        for ta, tb in zip(a, b):
            assert ta.dtype == tb.dtype and torch.equal(ta, tb)


def _quietly(make):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make()


def test_combined_batches_shape_order_and_length():
    opts = Options(device_iterations=2, replication_factor=3, gradient_accumulation=2)
    loader = DataLoader(opts, _samples(96), batch_size=4)
    assert loader.combinedBatchSize == 48 and loader.options is opts and len(loader) == 2
    batches = list(loader)
    assert len(batches) == 2
    for k, (images, labels) in enumerate(batches):
        assert images.shape == (48, 2, 3) and labels.shape == (48,)
        assert torch.equal(labels, torch.arange(48 * k, 48 * (k + 1)))
        assert torch.equal(images[:, 0, 0], labels.float())
    with pytest.raises(FrozenOptionsError):
        opts.deviceIterations(1)


def test_remainder_is_dropped_with_a_warning():
    opts = Options(device_iterations=4)
    with pytest.warns(UserWarning, match=r"100 samples do not divide into combined batches of 24 "
                                         r"\(batch_size 6 x device_iterations 4 .*the last 4 "
                                         r"samples of each epoch are dropped"):
        loader = DataLoader(opts, _samples(100), batch_size=6)
    assert len(loader) == 4 and _labels(loader)[-1] == list(range(72, 96))

    with pytest.warns(UserWarning, match="the last combined batch has 4 samples"):
        loader = DataLoader(opts.clone(), _samples(100), batch_size=6, drop_last=False)
    assert len(loader) == 5 and _labels(loader)[-1] == [96, 97, 98, 99]

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DataLoader(opts.clone(), _samples(96), batch_size=6)


def test_batch_sampler_micro_batches_are_combined_across_replicas():
    opts = Options(replication_factor=2, device_iterations=2)
    micro_batches = BatchSampler(SequentialSampler(range(30)), batch_size=3, drop_last=False)
    with pytest.warns(UserWarning, match="10 batches do not divide into combined batches of 4 "
                                         "micro-batches: the last 2 are dropped"):
        loader = DataLoader(opts, _samples(30), batch_sampler=micro_batches)
    assert loader.combinedBatchSize == 12 and len(loader) == 2
    assert _labels(loader) == [list(range(12)), list(range(12, 24))]

    loader = _quietly(lambda: DataLoader(opts.clone(), _samples(30), batch_sampler=micro_batches,
                                         drop_last=False))
    assert len(loader) == 3 and _labels(loader)[-1] == list(range(24, 30))

    uneven = [[5], [0, 1], [9, 8, 7], [2], [3, 4], [6]]  # any iterable of index lists
    loader = _quietly(lambda: DataLoader(Options(replication_factor=3), _samples(10),
                                         batch_sampler=uneven))
    assert loader.combinedBatchSize is None
    assert _labels(loader) == [[5, 0, 1, 9, 8, 7], [2, 3, 4, 6]]

    for conflicting in ({"batch_size": 2}, {"shuffle": True}):
        with pytest.raises(InvalidArgument, match="mutually exclusive with batch_size, shuffle"):
            DataLoader(Options(), _samples(8), batch_sampler=micro_batches, **conflicting)


class _Pair:
    """A batch type of the user's own, made a model input by registerCustomArgParser."""

    def __init__(self, data, label):
        self.data, self.label = data, label


class _PairParser(ICustomArgParser):
    def yieldTensors(self, struct):  # noqa: N802
        yield struct.data
        yield struct.label

    def reconstruct(self, original_structure, tensor_iterator):
        return _Pair(*tensor_iterator)


@pytest.fixture
def pair_parser():
    registerCustomArgParser(_Pair, _PairParser())
    yield
    registerCustomArgParser(_Pair, None)


def _padding_collate(size, make):
    """Stacks a micro-batch's samples and pads it with zeros to ``size`` samples."""
    def collate(samples):
        images = torch.stack([image for image, _ in samples])
        labels = torch.stack([label for _, label in samples])
        images = torch.cat([images, images.new_zeros((size - len(samples),) + images.shape[1:])])
        labels = torch.cat([labels, labels.new_zeros(size - len(samples))])
        return make(images, labels)
    return collate


@pytest.mark.parametrize("make", [lambda x, y: (x, y), lambda x, y: {"x": x, "y": y}, _Pair],
                         ids=["tuple", "dict", "custom"])
@pytest.mark.parametrize("drop_last", [True, False])
def test_batch_sampler_with_collate_fn_collates_each_micro_batch(make, drop_last, pair_parser):
    micro_batches = [[0], [1, 2], [3, 4, 5], [6], [7, 8], [9, 10, 11], [12], [13, 14]]
    collate = _padding_collate(3, make)
    dataset = _samples(15)
    # torch collates every micro-batch of the sampler on its own; a call takes 3 of them
    torch_batches = list(torch.utils.data.DataLoader(dataset, batch_sampler=micro_batches,
                                                     collate_fn=collate))
    loader = _quietly(lambda: DataLoader(Options(device_iterations=3), dataset, batch_sampler=micro_batches,
                                         collate_fn=collate, drop_last=drop_last))
    got = list(loader)
    assert len(loader) == len(got) == (2 if drop_last else 3)
    for index, batch in enumerate(got):
        group = torch_batches[3 * index:3 * index + 3]
        leaves = [torch.utils._pytree.tree_leaves(b) for b in group]
        assert type(batch) is type(group[0])
        for position, leaf in enumerate(torch.utils._pytree.tree_leaves(batch)):
            assert torch.equal(leaf, torch.cat([b[position] for b in leaves]))
    assert len(torch.utils._pytree.tree_leaves(got[0])[0]) == 9      # 3 padded micro-batches
    if not drop_last:
        assert len(torch.utils._pytree.tree_leaves(got[-1])[0]) == 6  # the 2 left over


def test_batch_sampler_with_collate_fn_refuses_micro_batches_it_cannot_combine():
    def scalar_collate(samples):
        return torch.tensor(float(len(samples)))

    loader = DataLoader(Options(device_iterations=2), _samples(4), batch_sampler=[[0, 1], [2, 3]],
                        collate_fn=scalar_collate)
    with pytest.raises(WrongArgumentType, match="0-d tensor"):
        list(loader)


@pytest.mark.parametrize("mode", [DataLoaderMode.Async, DataLoaderMode.AsyncRebatched])
def test_async_yields_what_sync_yields(mode):
    def make(dataset, mode, **kwargs):
        return _quietly(lambda: DataLoader(Options(device_iterations=3, random_seed=4), dataset,
                                           batch_size=5, shuffle=True, mode=mode, **kwargs))

    for dataset in (_samples(100), _PerSample(_samples(100))):
        _assert_same_batches(make(dataset, DataLoaderMode.Sync), make(dataset, mode))
    two_epochs_sync = make(_samples(100), DataLoaderMode.Sync, drop_last=False)
    two_epochs_async = make(_samples(100), mode, drop_last=False,
                            async_options={"buffer_size": 1, "early_preload": True})
    for _ in range(2):
        _assert_same_batches(two_epochs_sync, two_epochs_async)


def test_async_rebatches_an_iterable_dataset():
    opts = Options(device_iterations=4)
    sync = _quietly(lambda: DataLoader(opts, _Stream(30), batch_size=2, drop_last=False))
    rebatched = DataLoader(opts.clone(), _Stream(30), batch_size=2, drop_last=False,
                           mode=DataLoaderMode.AsyncRebatched, rebatched_worker_size=3)
    assert len(rebatched) == len(sync) == 4
    expected = [batch["x"].flatten().tolist() for batch in sync]
    got = [batch["x"].flatten().tolist() for batch in rebatched]
    assert got == expected and [len(b) for b in got] == [8, 8, 8, 6]
    assert [batch["y"].tolist() for batch in rebatched][0] == list(range(8))

    dropped = DataLoader(opts.clone(), _Stream(30), batch_size=2,
                         mode=DataLoaderMode.AsyncRebatched, rebatched_worker_size=3)
    assert len(dropped) == 3 and len(list(dropped)) == 3
    with pytest.raises(InvalidArgument, match=r"rebatched_worker_size \(9\) must be <= to the "
                                              r"combined batch size \(8\)"):
        DataLoader(opts.clone(), _Stream(30), batch_size=2, mode=DataLoaderMode.AsyncRebatched,
                   rebatched_worker_size=9)


class _ShardedStream(IterableDataset):
    """Samples 0..n-1, split between the loader's workers."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        worker = torch.utils.data.get_worker_info()
        return iter(torch.arange(self.n, dtype=torch.float32)[worker.id::worker.num_workers][:, None])


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")     # the workers run no JAX
def test_async_without_drop_last_rebatches_the_workers_leftovers_as_poptorch():
    """PopTorch's Async mode with drop_last=False rebatches: the leftover samples of the two
    workers (15 each, in batches of 8) make one last short batch, where Sync would return each
    worker's 7 leftovers as a batch of its own."""
    loader = DataLoader(Options(device_iterations=4), _ShardedStream(30), batch_size=2, drop_last=False,
                        num_workers=2, mode=DataLoaderMode.Async)
    batches = list(loader)
    assert [len(batch) for batch in batches] == [8, 8, 8, 6]
    assert sorted(torch.cat(batches).flatten().tolist()) == list(range(30))


def test_async_thread_stops_when_iteration_ends_or_is_abandoned():
    loader = DataLoader(Options(device_iterations=2), _samples(40), batch_size=2,
                        mode=DataLoaderMode.Async, async_options={"buffer_size": 1})
    iterator = iter(loader)
    thread = iterator._thread
    assert len(list(iterator)) == 10
    assert not thread.is_alive()

    iterator = iter(loader)
    next(iterator)
    thread = iterator._thread
    del iterator  # abandoned with the producer blocked on a full queue
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()

    iterator = iter(loader)
    next(iterator)
    loader.terminate()
    assert not iterator._thread.is_alive()
    assert list(iterator) == []


def test_async_epoch_after_an_abandoned_one_restarts_persistent_workers_cleanly():
    dataset = _PerSample(_samples(10))
    loader = DataLoader(Options(), dataset, batch_size=1, num_workers=1, persistent_workers=True,
                        mode=DataLoaderMode.Async)
    expected = [batch[1].tolist() for batch in torch.utils.data.DataLoader(dataset, batch_size=1)]
    for _ in range(3):
        for index, batch in enumerate(loader):       # left by break: its thread may still fetch
            assert batch[1].tolist() == expected[index]
            if index == 4:
                break
        assert [batch[1].tolist() for batch in loader] == expected


class _Failing(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        if index == 5:
            raise KeyError("sample 5 is missing")
        return torch.tensor(index)


def test_async_raises_the_datasets_error_in_the_loop():
    loader = DataLoader(Options(), _Failing(), batch_size=2, mode="async")
    iterator = iter(loader)
    assert next(iterator).tolist() == [0, 1] and next(iterator).tolist() == [2, 3]
    with pytest.raises(KeyError, match="sample 5 is missing"):
        next(iterator)
    assert not iterator._thread.is_alive()


class _SumModel(torch.nn.Module):
    def forward(self, x, y):
        return x.sum(dim=(1, 2)) + y


def _recording_fetches(monkeypatch, events):
    """Log each tensor the gathered fast path copies, with the thread that copies it (from now
    on: work another test left queued runs first, unlogged)."""
    host_idle.run_queued()
    gather = data._rows

    def rows(tensor, positions):
        events.append(("fetch", threading.current_thread()))
        return gather(tensor, positions)
    monkeypatch.setattr(data, "_rows", rows)


def test_sync_fetches_the_next_tensor_batch_while_the_model_runs(monkeypatch):
    events = []
    _recording_fetches(monkeypatch, events)
    opts = Options().deviceIterations(2)
    model = inferenceModel(_SumModel(), opts)
    dataset = _samples(12)
    outputs = []
    for x, y in DataLoader(opts, dataset, batch_size=2):  # 3 combined batches of 4
        events.append(("call", None))
        outputs.append(model(x, y))
        events.append(("returned", None))
    fetch = ("fetch", threading.current_thread())  # one per dataset tensor, on the loop's thread
    assert events == [fetch, fetch,
                      ("call", None), fetch, fetch, ("returned", None),
                      ("call", None), fetch, fetch, ("returned", None),
                      ("call", None), ("returned", None)]
    x, y = dataset.tensors
    torch.testing.assert_close(torch.cat(outputs), x.sum(dim=(1, 2)) + y)


def test_sync_fetch_ahead_raises_the_datasets_error_at_next_not_in_the_model_call():
    opts = Options()
    loader = DataLoader(opts, Subset(_samples(8), [0, 1, 2, 3, 100, 5, 6, 7]), batch_size=4)
    model = inferenceModel(_SumModel(), opts)
    iterator = iter(loader)
    x, y = next(iterator)
    torch.testing.assert_close(model(x, y), torch.tensor([0.0, 7.0, 14.0, 21.0]))
    with pytest.raises(IndexError):
        next(iterator)


def test_sync_fetch_ahead_sees_the_dataset_changed_in_place_after_the_fetch():
    opts = Options()
    dataset = _samples(8)
    model = inferenceModel(_SumModel(), opts)
    iterator = iter(DataLoader(opts, dataset, batch_size=4))
    x, y = next(iterator)
    model(x, y)                      # fetches the second batch
    dataset.tensors[0].mul_(10)
    x, y = next(iterator)
    torch.testing.assert_close(x, torch.arange(40.0, 80.0, 10.0)[:, None, None].expand(4, 2, 3))
    torch.testing.assert_close(y, torch.arange(4, 8))


def test_a_dataset_of_inference_tensors_is_fetched_on_demand_and_sees_changes():
    """Tensors made under torch.inference_mode (Lightning builds evaluation loaders there) have
    no version counter to tell a change after a fetch ahead: their batches are fetched when taken."""
    opts = Options()
    with torch.inference_mode():
        dataset = _samples(8)
    model = inferenceModel(_SumModel(), opts)
    iterator = iter(DataLoader(opts, dataset, batch_size=4))
    x, y = next(iterator)
    model(x, y)
    with torch.inference_mode():
        dataset.tensors[0].mul_(10)
    x, y = next(iterator)
    torch.testing.assert_close(x, torch.arange(40.0, 80.0, 10.0)[:, None, None].expand(4, 2, 3))


def test_queued_fetches_neither_pile_up_nor_outlive_their_iterator(monkeypatch):
    events = []
    _recording_fetches(monkeypatch, events)
    iterator = iter(DataLoader(Options(), _samples(8), batch_size=2))
    for _ in range(3):      # no model call in between: each next() fetches for itself
        next(iterator)
    assert len(host_idle._QUEUED) == 1
    fetched = len(events)
    del iterator
    gc.collect()
    assert len(host_idle._QUEUED) == 0
    host_idle.run_queued()
    assert len(events) == fetched


def test_async_mode_fetches_only_on_its_own_thread(monkeypatch):
    events = []
    _recording_fetches(monkeypatch, events)
    iterator = iter(DataLoader(Options(), _samples(8), batch_size=2, mode=DataLoaderMode.Async))
    for _ in iterator:
        host_idle.run_queued()
    assert len(events) == 8
    assert all(thread is not threading.main_thread() for _, thread in events)


def test_shuffle_is_deterministic_given_the_random_seed():
    def epochs(seed, count=2):
        loader = DataLoader(Options(device_iterations=2, random_seed=seed), _samples(64),
                            batch_size=4, shuffle=True)
        return [sum(_labels(loader), []) for _ in range(count)]

    first, second = epochs(7)
    assert epochs(7) == [first, second]
    assert first != second and sorted(first) == list(range(64))
    assert epochs(8)[0] != first


def test_tensor_dataset_batches_are_gathered_not_fetched_per_sample(monkeypatch):
    opts = Options(device_iterations=5, replication_factor=2)
    data = _samples(500)

    def plain(dataset, **kwargs):
        return _quietly(lambda: DataLoader(opts.clone(), _PerSample(dataset), batch_size=7,
                                           **kwargs))

    def gathered(dataset, **kwargs):
        return _quietly(lambda: DataLoader(opts.clone(), dataset, batch_size=7, **kwargs))

    expected = [list(plain(data, shuffle=True, generator=torch.Generator().manual_seed(s)))
                for s in range(2)]
    subset = Subset(Subset(data, list(range(400, 0, -2))), torch.arange(150))
    expected_subset = list(plain(subset, drop_last=False))
    expected_sequential = list(plain(data, drop_last=False))

    def per_sample(self, index):
        raise AssertionError("a per-sample fetch")

    monkeypatch.setattr(TensorDataset, "__getitem__", per_sample)
    for seed in range(2):
        _assert_same_batches(
            gathered(data, shuffle=True, generator=torch.Generator().manual_seed(seed)),
            expected[seed])
    _assert_same_batches(gathered(subset, drop_last=False), expected_subset)
    _assert_same_batches(gathered(data, drop_last=False), expected_sequential)
    for batch in gathered(data):
        assert all(t.untyped_storage().data_ptr() != d.untyped_storage().data_ptr()
                   for t, d in zip(batch, data.tensors)), "a batch must not alias the dataset"


def test_gathered_batches_of_tensors_numpy_cannot_hold():
    """bfloat16 and grad-requiring tensors are gathered by torch, as torch's collation would."""
    opts = Options(device_iterations=2)
    x = torch.randn(20, 3).to(torch.bfloat16)
    w = torch.randn(20, 2, requires_grad=True)
    data = TensorDataset(x, w)
    for shuffle in (False, True):
        def load(dataset):
            return _quietly(lambda: DataLoader(opts.clone(), dataset, batch_size=3, shuffle=shuffle,
                                               generator=torch.Generator().manual_seed(0)))
        gathered, plain = list(load(data)), list(load(_PerSample(data)))
        _assert_same_batches(gathered, plain)
        assert all(b[1].requires_grad for b in gathered)


class _Batched(Dataset):
    """A dataset fetching many samples at once through ``__getitems__``."""

    def __init__(self):
        self.calls = []

    def __len__(self):
        return 60

    def __getitem__(self, index):
        raise AssertionError("a per-sample fetch")

    def __getitems__(self, indices):
        self.calls.append(len(indices))
        return [torch.tensor(i) for i in indices]


def test_getitems_is_called_once_per_combined_batch():
    dataset = _Batched()
    loader = DataLoader(Options(device_iterations=4), dataset, batch_size=5)
    assert [b.tolist() for b in loader] == [list(range(i, i + 20)) for i in (0, 20, 40)]
    assert dataset.calls == [20, 20, 20]


def test_batch_size_none_leaves_batching_to_the_dataset():
    loader = DataLoader(Options(device_iterations=4), _samples(3), batch_size=None)
    assert loader.combinedBatchSize is None and len(loader) == 3
    assert [labels.item() for _, labels in loader] == [0, 1, 2]


@pytest.mark.parametrize("kwargs, error, match", [
    ({"batch_size": 0}, InvalidArgument, "batch_size must be >= 1, got 0"),
    ({"batch_size": -2}, InvalidArgument, "batch_size must be >= 1"),
    ({"batch_size": 2.5}, WrongArgumentType, "batch_size must be an int"),
    ({"batch_size": True}, WrongArgumentType, "batch_size must be an int"),
    ({"num_workers": -1}, InvalidArgument, "num_workers must be >= 0"),
    ({"shuffle": 1}, WrongArgumentType, "shuffle must be a bool"),
    ({"drop_last": None}, WrongArgumentType, "drop_last must be a bool"),
    ({"mode": "parallel"}, InvalidArgument, "mode must be one of Sync, Async, AsyncRebatched"),
    ({"async_options": {"bufer_size": 2}}, InvalidArgument, r"Unknown async_options \['bufer"),
    ({"async_options": {"rebatched_size": 2}}, InvalidArgument, "manually specify the rebatch"),
    ({"async_options": {"buffer_size": 0}}, InvalidArgument, "buffer_size'\\] must be >= 1"),
    ({"rebatched_worker_size": 0}, InvalidArgument, "rebatched_worker_size must be >= 1"),
])
def test_bad_arguments_are_refused_clearly(kwargs, error, match):
    with pytest.raises(error, match=match):
        DataLoader(Options(), _samples(8), **kwargs)
    assert issubclass(error, Error)


def test_options_must_be_options():
    with pytest.raises(WrongArgumentType, match="options must be an ipu_backend.Options, got dict"):
        DataLoader({"device_iterations": 2}, _samples(8))
