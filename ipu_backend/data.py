"""PopTorch's ``DataLoader``: each item is the data of one model run (a *combined batch*).

One run of the model consumes ``device_iterations x replication_factor x gradient_accumulation``
micro-batches of ``batch_size`` samples; the loader yields them concatenated along dim 0, in the
order the runtime splits them. ``DataLoaderMode.Async`` fetches the next combined batch on a
background thread while the device computes.

Combined batches of a ``TensorDataset`` (or of ``Subset``\\ s of one) are gathered by indexing
each tensor once instead of one ``__getitem__`` per sample (a sequential sampler's batches are
row ranges, copied without listing their indices); a dataset with ``__getitems__`` gets one call
per combined batch (as torch's own fetcher does).
"""

import queue
import threading
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import (
    BatchSampler,
    IterableDataset,
    Sampler,
    SequentialSampler,
    Subset,
    TensorDataset,
    default_collate,
)

from ipu_backend.enums import DataLoaderMode
from ipu_backend.options import (
    InvalidArgument,
    Options,
    WrongArgumentType,
    _bool,
    _int_at_least,
    parse_member,
)
from ipu_backend.runtime import host_idle

_ASYNC_OPTIONS = ("buffer_size", "miss_sleep_time_in_ms", "load_indefinitely", "early_preload",
                  "sharing_strategy")


class DataLoader(torch.utils.data.DataLoader):
    """A ``torch.utils.data.DataLoader`` yielding combined batches, as ``poptorch.DataLoader``.

    ``batch_size`` is the micro-batch size; each item holds ``combinedBatchSize`` samples and
    ``len()`` counts combined batches. With ``drop_last`` (the default) samples that do not fill a
    last combined batch are dropped; otherwise the last batch is smaller. Either way a warning
    says so when it happens.

    A ``batch_sampler`` gives micro-batches: consecutive ones are concatenated into combined
    batches (``batch_size`` and ``shuffle`` must then keep their defaults).

    ``mode``: ``DataLoaderMode.Sync`` fetches on the calling thread (a TensorDataset's next
    combined batch while the devices compute the current one, in the model call); ``Async`` and
    ``AsyncRebatched`` fetch on a background thread, ``async_options["buffer_size"]`` (default
    3) combined batches ahead, yielding exactly what ``Sync`` yields. For an ``IterableDataset``,
    ``AsyncRebatched`` has torch load batches of ``rebatched_worker_size`` samples (default: the
    combined batch size) and cuts their concatenation into combined batches, so that each worker's
    leftover samples are not dropped separately. PopTorch's other ``async_options``
    (``miss_sleep_time_in_ms``, ``load_indefinitely``, ``early_preload``, ``sharing_strategy``)
    are accepted and inert.

    When the options have a random seed (``Options.randomSeed``) and no ``generator`` is given,
    shuffling is deterministic: the same seed gives the same epochs.

    The options are frozen. ``auto_distributed_partitioning`` is inert (a single process is
    emulated). Other keyword arguments go to ``torch.utils.data.DataLoader``.
    """

    def __init__(self, options: Options, dataset: torch.utils.data.Dataset,
                 batch_size: int | None = 1, shuffle: bool | None = False, num_workers: int = 0,
                 drop_last: bool = True, persistent_workers: bool | None = None,
                 auto_distributed_partitioning: bool = True,
                 mode: DataLoaderMode | str = DataLoaderMode.Sync,
                 async_options: Mapping[str, Any] | None = None,
                 rebatched_worker_size: int | None = None,
                 batch_sampler: Sampler[Sequence[int]] | Iterable[Sequence[int]] | None = None,
                 **kwargs: Any) -> None:
        if not isinstance(options, Options):
            raise WrongArgumentType(
                f"options must be an ipu_backend.Options, got {type(options).__name__}")
        if batch_size is not None:
            _int_at_least(batch_size, "batch_size", 1)
        shuffle = False if shuffle is None else _bool(shuffle, "shuffle")  # PopTorch's default
        _int_at_least(num_workers, "num_workers", 0)
        _bool(drop_last, "drop_last")
        _bool(auto_distributed_partitioning, "auto_distributed_partitioning")
        mode = parse_member(DataLoaderMode, mode, "mode")
        buffer_size = _buffer_size(async_options)
        if batch_sampler is not None and (batch_size != 1 or shuffle):
            raise InvalidArgument(
                "`batch_sampler` option is mutually exclusive with batch_size, shuffle.")

        options._freeze()
        micro_batches = (options.device_iterations * options.replication_factor
                         * options.Training.gradient_accumulation)
        if batch_sampler is not None:
            sampler_batch_size = getattr(batch_sampler, "batch_size", None)
            combined = None if sampler_batch_size is None else sampler_batch_size * micro_batches
        else:
            combined = None if batch_size is None else batch_size * micro_batches
        if rebatched_worker_size is not None:
            _int_at_least(rebatched_worker_size, "rebatched_worker_size", 1)
            if combined is None or rebatched_worker_size > combined:
                raise InvalidArgument(
                    f"The rebatched_worker_size ({rebatched_worker_size}) must be <= to the "
                    f"combined batch size ({combined})")

        self._options = options
        self._combined_batch_size = combined
        self._mode = mode
        self._buffer_size = buffer_size
        self._prefetchers: weakref.WeakSet[_PrefetchIterator] = weakref.WeakSet()
        self._rebatch_size = None
        self._rebatch_drop_last = drop_last

        is_iterable = isinstance(dataset, IterableDataset)
        if options.random_seed is not None and "generator" not in kwargs:
            kwargs["generator"] = torch.Generator().manual_seed(options.random_seed)
        if persistent_workers is None:
            persistent_workers = num_workers > 0
        kwargs.update(num_workers=num_workers, persistent_workers=persistent_workers)

        if batch_sampler is not None:
            _warn_micro_batch_remainder(batch_sampler, micro_batches, drop_last)
            super().__init__(dataset, batch_sampler=_CombinedBatchSampler(
                batch_sampler, micro_batches, drop_last), **kwargs)
        elif is_iterable and mode is DataLoaderMode.AsyncRebatched and combined is not None:
            self._rebatch_size = combined
            super().__init__(dataset, batch_size=rebatched_worker_size or combined,
                             drop_last=False, **kwargs)
        else:
            if not is_iterable and combined is not None:
                _warn_sample_remainder(len(dataset), combined, batch_size, options, drop_last)
            super().__init__(dataset, batch_size=combined, shuffle=shuffle,
                             drop_last=drop_last and combined is not None, **kwargs)

    @property
    def combinedBatchSize(self) -> int | None:
        """Samples per item: the micro-batch size times the micro-batches of one model run
        (None when unknown: ``batch_size=None``, or a batch sampler without ``batch_size``)."""
        return self._combined_batch_size

    @property
    def options(self) -> Options:
        """The (frozen) options this loader was built with."""
        return self._options

    def __len__(self) -> int:
        if self._rebatch_size is not None:
            whole, rest = divmod(len(self.dataset), self._rebatch_size)
            return whole + (1 if rest and not self._rebatch_drop_last else 0)
        return super().__len__()

    def __iter__(self) -> Iterator[Any]:
        if self.persistent_workers and self.num_workers > 0:
            self.terminate()  # torch restarts its one iterator, which a prefetcher may be reading
        if self._mode is DataLoaderMode.Sync:
            return self._sync_batches(ahead=True)
        batches = self._sync_batches()
        prefetcher = _PrefetchIterator(batches, self._buffer_size)
        self._prefetchers.add(prefetcher)
        return prefetcher

    def terminate(self) -> None:
        """Stop the background fetching of this loader's iterators (``Async`` modes)."""
        for prefetcher in list(self._prefetchers):
            prefetcher.close()

    def _sync_batches(self, ahead: bool = False) -> Iterator[Any]:
        """The combined batches, fetched by the thread that iterates them; with ``ahead``, a
        TensorDataset's are fetched one ahead, while the devices compute (:class:`_FetchAhead`)."""
        if self._rebatch_size is not None:
            return _rebatch(super().__iter__(), self._rebatch_size, self._rebatch_drop_last)
        source = self._tensor_source()
        if source is None:
            return super().__iter__()
        # torch's iterators first draw their workers' base seed from the loader's generator; so
        # does this one, for the sampler to shuffle exactly as it does on torch's path.
        torch.empty((), dtype=torch.int64).random_(generator=self.generator)
        tensors, positions = source
        selections = _row_selections(positions, self.batch_sampler)
        if ahead:
            return _FetchAhead(tensors, selections)
        return (_gather(tensors, rows) for rows in selections)

    def _tensor_source(self) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None] | None:
        """The tensors of the TensorDataset behind ``self.dataset`` and the positions in them of
        the dataset's samples (None: all, in order), when batches can be gathered from them
        directly: torch's default collation in this process, unpinned."""
        if (self.batch_sampler is None or self.collate_fn is not default_collate
                or self.num_workers > 0 or self.pin_memory):
            return None
        dataset, positions = self.dataset, None
        while type(dataset) is Subset:
            indices = torch.as_tensor(dataset.indices, dtype=torch.long)
            positions = indices if positions is None else indices[positions]
            dataset = dataset.dataset
        if type(dataset) is not TensorDataset:
            return None
        return dataset.tensors, positions


def _buffer_size(async_options: Mapping[str, Any] | None) -> int:
    async_options = dict(async_options or {})
    if "rebatched_size" in async_options:
        raise InvalidArgument("You cannot use DataLoaderMode.AsyncRebatched and manually specify "
                              "the rebatched_size in async_options")
    unknown = sorted(set(async_options) - set(_ASYNC_OPTIONS))
    if unknown:
        raise InvalidArgument(f"Unknown async_options {unknown}; they are "
                              f"{', '.join(_ASYNC_OPTIONS)}")
    return _int_at_least(async_options.get("buffer_size", 3), "async_options['buffer_size']", 1)


def _warn_sample_remainder(num_samples: int, combined: int, batch_size: int, options: Options,
                           drop_last: bool) -> None:
    rest = num_samples % combined
    if not rest:
        return
    what = (f"the last {rest} samples of each epoch are dropped (drop_last=True)" if drop_last
            else f"the last combined batch has {rest} samples (drop_last=False)")
    warnings.warn(
        f"The dataset's {num_samples} samples do not divide into combined batches of {combined} "
        f"(batch_size {batch_size} x device_iterations {options.device_iterations} x "
        f"replication_factor {options.replication_factor} x gradient_accumulation "
        f"{options.Training.gradient_accumulation}): {what}.", stacklevel=3)


def _warn_micro_batch_remainder(batch_sampler: Any, micro_batches: int, drop_last: bool) -> None:
    if not hasattr(batch_sampler, "__len__"):
        return
    rest = len(batch_sampler) % micro_batches
    if not rest:
        return
    what = (f"the last {rest} are dropped (drop_last=True)" if drop_last
            else f"the last combined batch holds only {rest} (drop_last=False)")
    warnings.warn(
        f"The batch sampler's {len(batch_sampler)} batches do not divide into combined batches "
        f"of {micro_batches} micro-batches: {what}.", stacklevel=3)


class _CombinedBatchSampler(Sampler[list[int]]):
    """The indices of ``count`` consecutive batches of ``batch_sampler``, concatenated."""

    def __init__(self, batch_sampler: Iterable[Sequence[int]], count: int,
                 drop_last: bool) -> None:
        self.batch_sampler = batch_sampler
        self.count = count
        self.drop_last = drop_last

    def __iter__(self) -> Iterator[list[int]]:
        combined: list[int] = []
        taken = 0
        for micro_batch in self.batch_sampler:
            combined.extend(micro_batch)
            taken += 1
            if taken == self.count:
                yield combined
                combined, taken = [], 0
        if taken and not self.drop_last:
            yield combined

    def __len__(self) -> int:
        whole, rest = divmod(len(self.batch_sampler), self.count)
        return whole + (1 if rest and not self.drop_last else 0)


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


def _row_selections(positions: torch.Tensor | None,
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


def _gather(tensors: tuple[torch.Tensor, ...], rows: slice | np.ndarray) -> list[torch.Tensor]:
    """What torch's default collation of the samples at ``rows`` gives (a list with one stacked
    tensor per dataset tensor), by one indexing per tensor."""
    return [_rows(tensor, rows) for tensor in tensors]


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


def _rebatch(batches: Iterator[Any], size: int, drop_last: bool) -> Iterator[Any]:
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


_BATCH, _END, _ERROR = "batch", "end", "error"


def _produce(batches: Iterator[Any], out: queue.Queue, stop: threading.Event) -> None:
    """Background thread: put each batch in ``out``, then the end or the error that stopped it;
    return as soon as ``stop`` is set."""
    try:
        for batch in batches:
            if stop.is_set():
                return
            out.put((_BATCH, batch))
            if stop.is_set():
                return
        message = (_END, None)
    except Exception as error:  # re-raised by the consuming thread, in the user's loop
        message = (_ERROR, error)
    if not stop.is_set():
        out.put(message)


def _stop_producer(out: queue.Queue, stop: threading.Event) -> None:
    """Tell the producer to stop, and empty its queue so that a blocked ``put`` returns."""
    stop.set()
    while True:
        try:
            out.get_nowait()
        except queue.Empty:
            return


class _FetchAhead:
    """Yields the batches of a TensorDataset's ``tensors`` at each of ``selections``; handing one
    out queues the fetch of the next to run while the devices compute
    (:mod:`ipu_backend.runtime.host_idle`), where a training loop's thread would otherwise wait,
    so that its next ``next()`` finds the batch ready. Fetching runs no user code, and a batch
    whose tensors were changed in place since its fetch (their version counters moved) is
    fetched again, so the batches are those a fetch on demand gives."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], selections: Iterator[slice | np.ndarray]):
        self._tensors = tensors
        self._selections = selections
        self._fetched: tuple[str, Any] | None = None
        self._lock = threading.Lock()     # the queued fetch runs on whichever thread calls a model

    def __iter__(self) -> "_FetchAhead":
        return self

    def __next__(self) -> Any:
        with self._lock:
            self._fetch_locked()
            kind, payload = self._fetched
            if kind != _END:
                self._fetched = None
        if kind == _ERROR:
            raise payload
        if kind == _END:
            raise StopIteration
        rows, versions, batch = payload
        if versions != self._versions():
            batch = _gather(self._tensors, rows)
        host_idle.queue(self)
        return batch

    def run_idle(self) -> None:
        """Fetch the next batch now (the devices are computing)."""
        with self._lock:
            self._fetch_locked()

    def _fetch_locked(self) -> None:
        if self._fetched is not None:
            return
        try:
            rows = next(self._selections)
            self._fetched = (_BATCH, (rows, self._versions(), _gather(self._tensors, rows)))
        except StopIteration:
            self._fetched = (_END, None)
        except Exception as error:  # re-raised by __next__, in the user's loop
            self._fetched = (_ERROR, error)

    def _versions(self) -> tuple[int, ...]:
        return tuple(tensor._version for tensor in self._tensors)


class _PrefetchIterator:
    """Yields ``batches`` as fetched by a background thread, up to ``depth`` batches ahead.

    The thread ends with the iteration, on :meth:`close`, or when this iterator is garbage
    collected (an abandoned loop); it then stops after the fetch under way.
    """

    def __init__(self, batches: Iterator[Any], depth: int) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        stop = threading.Event()
        self._thread = threading.Thread(target=_produce, args=(batches, self._queue, stop),
                                        name="ipu_backend.DataLoader prefetch", daemon=True)
        self._stop_producer = weakref.finalize(self, _stop_producer, self._queue, stop)
        self._finished = False
        self._thread.start()

    def __iter__(self) -> "_PrefetchIterator":
        return self

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        kind, payload = self._queue.get()
        if kind == _BATCH:
            return payload
        self.close()
        if kind == _ERROR:
            raise payload
        raise StopIteration

    def close(self) -> None:
        """Stop fetching and wait for the thread to end."""
        self._finished = True
        self._stop_producer()
        if threading.current_thread() is not self._thread:
            self._thread.join()
