"""Lightning's dataloaders as ``ipu_backend.DataLoader``\\ s: one item is one host call.

A map-style loader keeps its own batch sampler (its sampler, shuffling, generator and any user
``BatchSampler``): the IPU loader concatenates ``device_iterations x replicas x
gradient_accumulation`` of its consecutive batches into one combined batch. So with 4 replicas
and ``batch_size=b`` each combined batch holds exactly the samples the same loader with
``batch_size=4b`` would give, in the same order. An iterable dataset is batched by the combined
batch size directly. Training uses only whole combined batches (the IPU loader warns about what
it drops); validation, test and predict also get the short last batch, which the strategy
evaluates whole (``_short_batches.py``). With several processes (``num_nodes``) Lightning's
``DistributedSampler`` gives each process its shard first, as with DDP; the replicas of one process
share its batches.
"""

import warnings

from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

import ipu_backend
from ipu_backend import Error

_PASSED_THROUGH = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
                   "multiprocessing_context", "generator", "persistent_workers")


def micro_batches_per_call(options: ipu_backend.Options) -> int:
    """Micro-batches in one call's combined batch (one per group of replicas sharing input data)."""
    return (options.device_iterations * options.replication_factor // options.input_group_size
            * options.Training.gradient_accumulation)


def to_ipu_dataloader(dataloader: object, options: ipu_backend.Options, stage: str) -> object:
    """``dataloader`` yielding combined batches for ``options`` (an IPU loader is kept as it is)."""
    factor = micro_batches_per_call(options)
    if isinstance(dataloader, ipu_backend.DataLoader):
        given = micro_batches_per_call(dataloader.options)
        if given != factor:
            raise Error(
                f"the {stage} ipu_backend.DataLoader combines {given} micro-batches per item, but "
                f"the {stage} options run {factor} per call (device_iterations "
                f"{options.device_iterations} x replication_factor {options.replication_factor} x "
                f"gradient_accumulation {options.Training.gradient_accumulation}): build it with "
                f"the strategy's options (trainer.strategy.{'training' if stage == 'train' else 'inference'}"
                "_opts) or pass a torch DataLoader")
        return dataloader
    if not isinstance(dataloader, DataLoader):
        raise Error(f"the {stage} dataloader is a {type(dataloader).__name__}; on IPUs it must be a "
                    "torch.utils.data.DataLoader (or an ipu_backend.DataLoader), whose batches are "
                    "combined for each host call")
    kwargs = {name: getattr(dataloader, name) for name in _PASSED_THROUGH}
    if dataloader.num_workers > 0:
        kwargs["prefetch_factor"] = dataloader.prefetch_factor
    training = stage == "train"
    if isinstance(dataloader.dataset, IterableDataset):
        if dataloader.batch_size is None:
            raise _unbatched(stage)
        return ipu_backend.DataLoader(options, dataloader.dataset, batch_size=dataloader.batch_size,
                                      drop_last=training or dataloader.drop_last, auto_distributed_partitioning=False,
                                      **kwargs)
    batch_sampler = dataloader.batch_sampler
    if batch_sampler is None:
        raise _unbatched(stage)
    if not training:                 # the short last batch is evaluated whole (_short_batches.py)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The batch sampler's .* do not divide")
            loader = ipu_backend.DataLoader(options, dataloader.dataset, drop_last=False,
                                            auto_distributed_partitioning=False, batch_sampler=batch_sampler, **kwargs)
        if isinstance(batch_sampler, _IndexBatchSamplerWrapper):
            # set past torch's guard: the loader keeps iterating the same batches
            object.__setattr__(loader, "batch_sampler", _CallIndices(loader.batch_sampler, batch_sampler, factor))
        return loader
    return ipu_backend.DataLoader(options, dataloader.dataset, drop_last=True, auto_distributed_partitioning=False,
                                  batch_sampler=_whole_micro_batches(batch_sampler, factor, stage),
                                  **kwargs)


class _CallIndices(_IndexBatchSamplerWrapper):
    """The dataset indices of each host call, where Lightning's prediction loop looks for each
    batch's (``BasePredictionWriter``'s ``batch_indices``): the indices its wrapper of the user's
    batch sampler saw, ``factor`` batches to a call. It iterates as ``batch_sampler``, the
    loader's own, does."""

    def __init__(self, batch_sampler, recorded: _IndexBatchSamplerWrapper, factor: int):
        # not _IndexBatchSamplerWrapper's __init__: that would record the combined batches as one
        self._batch_sampler, self._recorded, self._factor = batch_sampler, recorded, factor

    @property
    def seen_batch_indices(self) -> list[list[int]]:
        seen, factor = self._recorded.seen_batch_indices, self._factor
        return [[index for batch in seen[start:start + factor] for index in batch]
                for start in range(0, len(seen), factor)]

    @property
    def sampler(self):
        return getattr(self._batch_sampler, "sampler", None)

    def __iter__(self):
        return iter(self._batch_sampler)

    def __len__(self) -> int:
        return len(self._batch_sampler)


def _whole_micro_batches(batch_sampler, factor: int, stage: str):
    """``batch_sampler`` without its short last batch when several batches make a call (a call's
    micro-batches must all have the same size)."""
    if factor == 1 or type(batch_sampler) is not BatchSampler or batch_sampler.drop_last \
            or len(batch_sampler.sampler) % batch_sampler.batch_size == 0:
        return batch_sampler
    warnings.warn(f"the {stage} dataloader's last batch is short ({len(batch_sampler.sampler)} "
                  f"samples in batches of {batch_sampler.batch_size}); it is dropped, since each "
                  f"host call combines {factor} batches of the same size", stacklevel=4)
    return BatchSampler(batch_sampler.sampler, batch_sampler.batch_size, drop_last=True)


def _unbatched(stage: str) -> Error:
    return Error(f"the {stage} dataloader has batch_size=None (no automatic batching); IPU calls "
                 "need the micro-batch size to combine batches: give the DataLoader a batch_size")
