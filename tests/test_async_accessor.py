"""AsynchronousDataAccessor: the iterable's items in order, epoch after epoch, rebatched, with
PopTorch's errors; the hardware queries (the emulated IPUs stand for the hardware), log levels,
profiling channels and PopTorch's error classes."""

import gc
import multiprocessing

import pytest
import torch

import ipu_backend as poptorch


def rows(n):
    return torch.utils.data.TensorDataset(torch.arange(float(n)).reshape(n, 1))


def test_items_in_order_for_every_epoch_and_after_early_preload():
    accessor = poptorch.AsynchronousDataAccessor(rows(7), buffer_size=2, early_preload=True)
    assert len(accessor) == 7
    for _ in range(2):
        assert [item[0].item() for item in accessor] == list(range(7))
    accessor.terminate()


def test_a_sync_data_loader_and_rebatching():
    loader = poptorch.DataLoader(poptorch.Options().deviceIterations(2), rows(8), batch_size=2)
    accessor = poptorch.AsynchronousDataAccessor(loader)
    assert len(accessor) == 2
    assert [b[0].flatten().tolist() for b in accessor] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    single = poptorch.DataLoader(poptorch.Options(), rows(10), batch_size=1)
    rebatched = poptorch.AsynchronousDataAccessor(single, rebatched_size=4, load_indefinitely=False)
    assert len(rebatched) == 2
    assert [b[0].flatten().tolist() for b in rebatched] == [[0, 1, 2, 3], [4, 5, 6, 7]]


class Broken(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        raise ValueError("Broken dataset")


def test_poptorch_errors(capfd):
    with pytest.raises(poptorch.Error, match="worker thread failed to start.*Broken dataset"):
        poptorch.AsynchronousDataAccessor(Broken())
    assert "ValueError: Broken dataset" in capfd.readouterr().err, "the failure is logged, as PopTorch's worker does"
    loader = poptorch.DataLoader(poptorch.Options(), rows(4), batch_size=2, mode=poptorch.DataLoaderMode.Async)
    with pytest.raises(poptorch.Error, match="The DataLoader already uses an AsynchronousDataAccessor"):
        poptorch.AsynchronousDataAccessor(loader)
    with pytest.raises(AssertionError, match="rebatched_size must be None or greater than 1"):
        poptorch.AsynchronousDataAccessor(rows(4), rebatched_size=1)


def test_a_failing_worker_dataset_keeps_no_worker_process_alive():
    """Neither the logged failure nor a reference cycle through torch's re-raised worker error
    keeps the loader: dropped, its workers stop at once, not when the garbage collector runs
    (where torch finds their queues closed and waits five seconds for each)."""
    before = set(multiprocessing.active_children())
    gc.disable()
    try:
        loader = poptorch.DataLoader(poptorch.Options(), Broken(), batch_size=1, num_workers=2)
        with pytest.raises(poptorch.Error, match="worker thread failed to start"):
            poptorch.AsynchronousDataAccessor(loader)
        del loader
        assert set(multiprocessing.active_children()) <= before
    finally:
        gc.enable()


def test_no_ipu_hardware_and_log_levels():
    assert poptorch.ipuHardwareIsAvailable() and poptorch.ipuHardwareIsAvailable(8)   # 8 test devices
    assert not poptorch.ipuHardwareIsAvailable(1024)
    assert poptorch.ipuHardwareVersion() == 2
    import logging
    poptorch.setLogLevel("ERR")
    assert logging.getLogger("ipu_backend").level == logging.ERROR
    poptorch.setLogLevel(3)
    assert logging.getLogger("ipu_backend").level == logging.WARNING
    with pytest.raises(ValueError, match="Unknown log level: LOUD"):
        poptorch.setLogLevel("LOUD")
    logging.getLogger("ipu_backend").setLevel(logging.NOTSET)


def test_profiling_channels_are_inert_and_error_classes_exist():
    channel = poptorch.profiling.Channel("app")
    with channel.tracepoint("step"):
        value = 3
    obj = object()
    assert channel.instrument(obj, "method") is obj and value == 3
    assert issubclass(poptorch.RecoverableError, poptorch.Error)
    assert issubclass(poptorch.UnrecoverableError, poptorch.Error)
