"""PopTorch's ``DataLoader`` (:mod:`~ipu_backend.data.loader`) and how it fetches combined
batches: cut from a stream (:mod:`~ipu_backend.data.rebatching`), gathered from a TensorDataset's
tensors (:mod:`~ipu_backend.data.gather`), or ahead of the loop (:mod:`~ipu_backend.data.prefetch`)."""

from ipu_backend.data.loader import DataLoader

__all__ = ["DataLoader"]
