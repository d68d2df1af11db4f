"""scikit-learn's handwritten digits upsampled to 28×28: an MNIST stand-in that ships offline."""

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits


def digits_tensors(test_fraction: float = 0.2, seed: int = 0, train_images: int | None = None,
                   test_images: int | None = None):
    """``(train_x, train_y), (test_x, test_y)``: float images (N, 1, 28, 28) normalised, int64 labels.

    ``train_images`` / ``test_images`` keep only the first images of each split (the examples'
    reduced runs in CI); the split itself does not change.
    """
    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False)
    images = (images - 0.1307) / 0.3081
    labels = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    images, labels = images[order], labels[order]
    n_test = int(len(labels) * test_fraction)
    train, test = slice(n_test, n_test + train_images if train_images else None), slice(test_images or n_test)
    return (images[train], labels[train]), (images[test], labels[test])
