"""PopTorch's ``AsynchronousDataAccessor``: iterate any iterable (a dataset, a DataLoader) with
its items fetched ahead on a background thread, ``buffer_size`` at most.

PopTorch fetches in a worker process into shared memory that the next item overwrites (users
must clone what they keep); a thread needs neither, so the items are the iterable's own and stay
valid. ``sharing_strategy`` and ``miss_sleep_time_in_ms`` are accepted and have no effect.
"""

import logging
import traceback
from typing import Any

from ipu_backend.data import DataLoader
from ipu_backend.data.prefetch import PrefetchIterator
from ipu_backend.data.rebatching import rebatch
from ipu_backend.enums import DataLoaderMode, SharingStrategy
from ipu_backend.errors import Error

logger = logging.getLogger("ipu_backend")


class AsynchronousDataAccessor:
    """Items of ``dataset`` (any iterable), fetched ahead on a background thread.

    As in PopTorch, the first item is fetched when the accessor is made, so that a dataset that
    fails does so there. ``load_indefinitely``: once an epoch ends, the next one starts loading
    at once. ``early_preload``: the buffer fills when the accessor is made rather than at its
    first ``iter()``. ``rebatched_size``: items are cut into batches of that many samples (the
    iterable's items batched by 1; the incomplete last batch is dropped).
    """

    def __init__(self, dataset, buffer_size: int = 3, miss_sleep_time_in_ms: float = 0.1,
                 load_indefinitely: bool = True, early_preload: bool = False,
                 sharing_strategy: SharingStrategy = SharingStrategy.ForkServer,
                 rebatched_size: int | None = None):
        self._iterator = None
        if isinstance(dataset, DataLoader) and dataset.mode is not DataLoaderMode.Sync:
            raise Error("The DataLoader already uses an AsynchronousDataAccessor internally. Either "
                        "use the existing one or set mode='poptorch.DataLoaderMode.Sync' in the "
                        "DataLoader.")
        if (isinstance(dataset, DataLoader) and not dataset.drop_last and rebatched_size is None
                and dataset.combinedBatchSize not in (None, 1)):
            raise AssertionError("The 'drop_last=False' option from the DataLoader only works if "
                                 "'rebatched_size' is specified too.")
        if rebatched_size is not None and rebatched_size <= 1:
            raise AssertionError("rebatched_size must be None or greater than 1")
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
            raise Error(f"buffer_size must be an int >= 1, got {buffer_size!r}")
        self._dataset = dataset
        self._buffer_size = buffer_size
        self._load_indefinitely = load_indefinitely
        self.rebatched_size = rebatched_size
        self._terminated = False
        self._fresh = False                # the current iterator has handed out nothing yet
        self._first = None                 # the item fetched to check the dataset, not handed out yet
        self._restart(depth=buffer_size if early_preload else 1)
        try:
            self._first = (next(self._iterator),)
        except StopIteration:
            self._iterator = None
        except Exception as error:          # whatever the dataset raised, reported as PopTorch does
            self.terminate()
            # PopTorch's worker logs the failure itself: the console shows it even where the Error is
            # caught. The record holds the traceback's text, not its frames (which hold the dataset
            # and its worker processes), however long a handler keeps records.
            logger.error("AsynchronousDataAccessor worker thread failed to start\n%s",
                         "".join(traceback.format_exception(error)).rstrip())
            raise Error(f"AsynchronousDataAccessor worker thread failed to start: the first item "
                        f"could not be loaded ({type(error).__name__}: {error})") from error

    def _restart(self, depth: int | None = None) -> None:
        if self._iterator is not None:
            self._iterator.close()
        items = iter(self._dataset)
        if self.rebatched_size is not None:
            items = rebatch(items, self.rebatched_size, drop_last=True)
        self._iterator = PrefetchIterator(items, depth or self._buffer_size)
        self._fresh, self._first = True, None

    def terminate(self) -> None:
        """Stop the background loading."""
        self._terminated = True
        if self._iterator is not None:
            self._iterator.close()
            self._iterator = None

    def __del__(self) -> None:
        if getattr(self, "_iterator", None) is not None:
            self._iterator.close()

    def __len__(self) -> int:
        length = len(self._dataset)
        if self.rebatched_size:
            length = length * getattr(self._dataset, "batch_size", 1) // self.rebatched_size
        return length

    def __iter__(self) -> "AsynchronousDataAccessor":
        if self._terminated:
            raise AssertionError("this AsynchronousDataAccessor was terminated")
        if self._iterator is None or not self._fresh:
            self._restart()
        return self

    def __next__(self) -> Any:
        if self._first is not None:
            (item,), self._first = self._first, None
            self._fresh = False
            return item
        if self._iterator is None:
            raise StopIteration
        try:
            item = next(self._iterator)
        except StopIteration:
            self._iterator = None
            if self._load_indefinitely and not self._terminated:
                self._restart()            # the next epoch loads while this one is used
            raise
        self._fresh = False
        return item
