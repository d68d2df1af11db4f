"""Fetching combined batches ahead of the loop that takes them: on the calling thread while the
devices compute (:class:`FetchAhead`, for ``DataLoaderMode.Sync``), or on a background thread
(:class:`PrefetchIterator`, for the ``Async`` modes)."""

import queue
import threading
import traceback
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ipu_backend.data.gather import gather
from ipu_backend.runtime import host_idle


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
        # The error's frames hold the source iterator (this frame too, as their caller), and
        # torch's re-raise of a worker's error makes them a reference cycle: a torch iterator
        # freed later by the garbage collector finds its worker queues closed and waits five
        # seconds for each worker. Emptied of their locals, they hold nothing: the traceback's
        # text is unchanged and the iterator is freed as soon as nothing else holds it.
        traceback.clear_frames(error.__traceback__)
        message = (_ERROR, error)
    if not stop.is_set():
        out.put(message)
    del batches, message


def _stop_producer(out: queue.Queue, stop: threading.Event) -> None:
    """Tell the producer to stop, and empty its queue so that a blocked ``put`` returns."""
    stop.set()
    while True:
        try:
            out.get_nowait()
        except queue.Empty:
            return


class FetchAhead:
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

    def __iter__(self) -> "FetchAhead":
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
            batch = gather(self._tensors, rows)
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
            self._fetched = (_BATCH, (rows, self._versions(), gather(self._tensors, rows)))
        except StopIteration:
            self._fetched = (_END, None)
        except Exception as error:  # re-raised by __next__, in the user's loop
            self._fetched = (_ERROR, error)

    def _versions(self) -> tuple[int, ...]:
        return tuple(tensor._version for tensor in self._tensors)


class PrefetchIterator:
    """Yields ``batches`` as fetched by a background thread, up to ``depth`` batches ahead.

    The thread ends with the iteration, on :meth:`close`, or when this iterator is garbage
    collected (an abandoned loop); it then stops after the fetch under way. An error of the
    source is raised with its traceback's text, its frames emptied of their local variables (see
    ``_produce``).
    """

    def __init__(self, batches: Iterator[Any], depth: int) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        stop = threading.Event()
        self._thread = threading.Thread(target=_produce, args=(batches, self._queue, stop),
                                        name="ipu_backend.DataLoader prefetch", daemon=True)
        self._stop_producer = weakref.finalize(self, _stop_producer, self._queue, stop)
        self._finished = False
        self._thread.start()

    def __iter__(self) -> "PrefetchIterator":
        return self

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        kind, payload = self._queue.get()
        if kind == _BATCH:
            return payload
        self.close()
        if kind == _ERROR:
            try:
                raise payload
            finally:
                payload = None    # the traceback keeps this frame: no cycle through its locals
        raise StopIteration

    @property
    def thread(self) -> threading.Thread:
        """The thread fetching the batches."""
        return self._thread

    def close(self) -> None:
        """Stop fetching and wait for the thread to end."""
        self._finished = True
        self._stop_producer()
        if threading.current_thread() is not self._thread:
            self._thread.join()
