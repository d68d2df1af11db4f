"""PopTorch's ``DataLoader``: each item is the data of one model run (a *combined batch*).

One run of the model consumes ``device_iterations x replication_factor x gradient_accumulation``
micro-batches of ``batch_size`` samples (``replication_factor / input_group_size`` when groups of
replicas share input data); the loader yields them concatenated along dim 0, in the order the
runtime splits them. ``DataLoaderMode.Async`` fetches the next combined batch on a
background thread while the device computes (:mod:`~ipu_backend.data.prefetch`); a
``TensorDataset``'s are gathered by indexing its tensors (:mod:`~ipu_backend.data.gather`).
"""

import threading
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import IterableDataset, Sampler, default_collate

from ipu_backend.data.combining import combine
from ipu_backend.data.gather import gather, row_selections, tensor_source
from ipu_backend.data.partition import ProcessShard
from ipu_backend.data.prefetch import FetchAhead, PrefetchIterator
from ipu_backend.data.rebatching import rebatch
from ipu_backend.enums import DataLoaderMode
from ipu_backend.option_values import InvalidArgument, WrongArgumentType, _bool, _int_at_least, parse_member
from ipu_backend.options import Options

_ASYNC_OPTIONS = ("buffer_size", "miss_sleep_time_in_ms", "load_indefinitely", "early_preload",
                  "sharing_strategy")


class DataLoader(torch.utils.data.DataLoader):
    """A ``torch.utils.data.DataLoader`` yielding combined batches, as ``poptorch.DataLoader``.

    ``batch_size`` is the micro-batch size; each item holds ``combinedBatchSize`` samples and
    ``len()`` counts combined batches. With ``drop_last`` (the default) samples that do not fill a
    last combined batch are dropped; otherwise the last batch is smaller. Either way a warning
    says so when it happens.

    A ``batch_sampler`` gives micro-batches: consecutive ones are concatenated into combined
    batches (``batch_size`` and ``shuffle`` must then keep their defaults). A ``collate_fn``
    collates each micro-batch on its own (it may pad it), as in PopTorch; their tensors are then
    concatenated (:mod:`~ipu_backend.data.combining`).

    ``mode``: ``DataLoaderMode.Sync`` fetches on the calling thread (a TensorDataset's next
    combined batch while the devices compute the current one, in the model call); ``Async`` and
    ``AsyncRebatched`` fetch on a background thread, ``async_options["buffer_size"]`` (default
    3) combined batches ahead, yielding exactly what ``Sync`` yields. For an ``IterableDataset``,
    ``AsyncRebatched`` has torch load batches of ``rebatched_worker_size`` samples (default: the
    combined batch size) and cuts their concatenation into combined batches, so that each worker's
    leftover samples are not dropped separately; ``Async`` does the same when ``drop_last`` is
    False (PopTorch's rule), so the leftovers make one last, smaller batch. PopTorch's other ``async_options``
    (``miss_sleep_time_in_ms``, ``load_indefinitely``, ``early_preload``, ``sharing_strategy``)
    are accepted and inert.

    When the options have a random seed (``Options.randomSeed``) and no ``generator`` is given,
    shuffling is deterministic: the same seed gives the same epochs.

    With several processes (``Options.Distributed``), ``auto_distributed_partitioning`` (the
    default) gives each process its own block of a map-style dataset, as PopTorch does
    (:mod:`~ipu_backend.data.partition`); shuffling then needs ``Options.randomSeed``, so that
    every process permutes the dataset the same way. With ``False`` each process reads the whole
    dataset (shard it yourself).

    The options are frozen. Other keyword arguments go to ``torch.utils.data.DataLoader``.
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
        micro_batches = (options.device_iterations * options.replication_factor // options.input_group_size
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
        self._prefetchers: weakref.WeakSet[PrefetchIterator] = weakref.WeakSet()
        self._fetch_threads: list[threading.Thread] = []
        """The prefetchers' threads, which outlive an abandoned prefetcher by one fetch at most."""
        self._rebatch_size = None
        self._rebatch_drop_last = drop_last

        is_iterable = isinstance(dataset, IterableDataset)
        self._shard = None
        if options.Distributed.numProcesses > 1 and auto_distributed_partitioning:
            self._shard = _process_shard(options, dataset, combined, drop_last, shuffle,
                                         batch_sampler is not None, is_iterable)
            dataset, shuffle = self._shard.subset, False        # the shard shuffles every process alike
        if options.random_seed is not None and "generator" not in kwargs:
            kwargs["generator"] = torch.Generator().manual_seed(options.random_seed)
        if persistent_workers is None:
            persistent_workers = num_workers > 0
        kwargs.update(num_workers=num_workers, persistent_workers=persistent_workers)

        self._combine = None
        if batch_sampler is not None:
            _warn_micro_batch_remainder(batch_sampler, micro_batches, drop_last)
            if kwargs.get("collate_fn") in (None, default_collate) or micro_batches == 1:
                # torch's collation of the concatenated indices is the concatenation of the
                # micro-batches' collations; loading a combined batch at once is faster
                super().__init__(dataset, batch_sampler=_CombinedBatchSampler(
                    batch_sampler, micro_batches, drop_last), **kwargs)
            else:
                self._combine = (micro_batches, drop_last)
                super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)
        elif is_iterable and combined is not None and (mode is DataLoaderMode.AsyncRebatched or (
                mode is DataLoaderMode.Async and not drop_last and combined > 1)):
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

    @property
    def mode(self) -> DataLoaderMode:
        """How the loader fetches its items (beyond PopTorch): ``Sync``, or ahead of use."""
        return self._mode

    def __len__(self) -> int:
        if self._combine is not None:
            return _combined_count(len(self.batch_sampler), *self._combine)
        if self._rebatch_size is not None:
            whole, rest = divmod(len(self.dataset), self._rebatch_size)
            return whole + (1 if rest and not self._rebatch_drop_last else 0)
        return super().__len__()

    def __iter__(self) -> Iterator[Any]:
        if self.persistent_workers and self.num_workers > 0:
            self.terminate()  # torch restarts its one iterator, which a prefetcher may be reading
        if self._shard is not None:
            self._shard.next_epoch()
        if self._mode is DataLoaderMode.Sync:
            return self._sync_batches(ahead=True)
        batches = self._sync_batches()
        prefetcher = PrefetchIterator(batches, self._buffer_size)
        self._prefetchers.add(prefetcher)
        self._fetch_threads = [t for t in self._fetch_threads if t.is_alive()] + [prefetcher.thread]
        return prefetcher

    def terminate(self) -> None:
        """Stop the background fetching of this loader's iterators (``Async`` modes) and wait
        for it to end, including that of iterators already abandoned (a loop left by ``break``),
        so that nothing else reads torch's (persistent) iterator when it restarts."""
        for prefetcher in list(self._prefetchers):
            prefetcher.close()
        for thread in self._fetch_threads:
            if thread is not threading.current_thread():
                thread.join()
        self._fetch_threads = []

    def _sync_batches(self, ahead: bool = False) -> Iterator[Any]:
        """The combined batches, fetched by the thread that iterates them; with ``ahead``, a
        TensorDataset's are fetched one ahead, while the devices compute
        (:class:`~ipu_backend.data.prefetch.FetchAhead`), unless it holds inference tensors
        (made under ``torch.inference_mode``), whose changes no version counter shows."""
        if self._rebatch_size is not None:
            return rebatch(super().__iter__(), self._rebatch_size, self._rebatch_drop_last)
        if self._combine is not None:
            return combine(super().__iter__(), *self._combine)
        source = tensor_source(self)
        if source is None:
            return super().__iter__()
        # torch's iterators first draw their workers' base seed from the loader's generator; so
        # does this one, for the sampler to shuffle exactly as it does on torch's path.
        torch.empty((), dtype=torch.int64).random_(generator=self.generator)
        tensors, positions = source
        selections = row_selections(positions, self.batch_sampler)
        if ahead and not any(tensor.is_inference() for tensor in tensors):   # no version counters
            return FetchAhead(tensors, selections)
        return (gather(tensors, rows) for rows in selections)


def _process_shard(options: Options, dataset, combined: int | None, drop_last: bool, shuffle: bool,
                   user_batch_sampler: bool, is_iterable: bool) -> ProcessShard:
    """This process's block of ``dataset`` (PopTorch's checks and messages)."""
    if user_batch_sampler:
        raise InvalidArgument("`batch_sampler` option is mutually exclusive with "
                              "auto_distributed_partitioning=True.")
    if is_iterable:
        raise InvalidArgument("auto_distributed_partitioning is not supported for an IterableDataset: give "
                              "each process its own data and pass auto_distributed_partitioning=False")
    if shuffle and options.random_seed is None:
        raise InvalidArgument("When using auto_distributed_partitioning you must set "
                              "poptorch.Options.randomSeed() to ensure that tensors are in the same order "
                              "in all processes.")
    if combined is None:
        raise InvalidArgument("batch_size=None not allowed when using auto_distributed_partitioning.")
    return ProcessShard(dataset, options.Distributed.processId, options.Distributed.numProcesses, combined,
                        drop_last, options.random_seed, shuffle)


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
        f"replication_factor {options.replication_factor}{_per_input_group(options)} x gradient_accumulation "
        f"{options.Training.gradient_accumulation}): {what}.", stacklevel=3)


def _per_input_group(options: Options) -> str:
    """How the replication factor counts in a combined batch when groups of replicas share input."""
    return "" if options.input_group_size == 1 else f" / input_group_size {options.input_group_size}"


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

    @property
    def sampler(self):
        """The batch sampler's own sampler, where frameworks look for ``set_epoch`` (Lightning
        sets a ``DistributedSampler``'s epoch there)."""
        return getattr(self.batch_sampler, "sampler", None)

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
        return _combined_count(len(self.batch_sampler), self.count, self.drop_last)


def _combined_count(micro_batches: int, count: int, drop_last: bool) -> int:
    """How many combined batches of ``count`` micro-batches ``micro_batches`` make."""
    whole, rest = divmod(micro_batches, count)
    return whole + (1 if rest and not drop_last else 0)
