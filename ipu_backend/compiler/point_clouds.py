"""``poptorch.fps`` and ``poptorch.nearest`` (torch_cluster's point-cloud ops) as torch custom
ops: eager kernels that give torch_cluster's results on the CPU, and fake kernels whose output
shape is known at capture (it depends on ``ptr``, a Python list, and on the input shapes only).

Both return int64 indices and have no gradient.
"""

import ml_dtypes
import numpy as np
import torch

_HALF = (torch.float16, torch.bfloat16)
_NUMPY_HALF = {torch.float16: np.float16, torch.bfloat16: ml_dtypes.bfloat16}


def sample_counts(ptr: list[int], ratio: float, dtype: torch.dtype) -> list[int]:
    """How many points ``fps`` takes from each segment of ``ptr``: torch_cluster's
    ``ceil(n * ratio)``, rounded as it computes it (the segment sizes in float32 times ``ratio``
    held in the points' dtype). numpy, not torch: a fake kernel's tensors have no values."""
    held = _NUMPY_HALF.get(dtype, np.float32)(ratio)
    sizes = np.diff(np.asarray(ptr)).astype(np.float32)
    return [int(count) for count in np.ceil(sizes * np.float32(held))]


def _squared_distances(points: torch.Tensor, point: torch.Tensor) -> torch.Tensor:
    return (points - point).pow(2).sum(1)


@torch.library.custom_op("ipu_backend::fps", mutates_args=())
def fps(src: torch.Tensor, ptr: list[int], ratio: float, random_start: bool) -> torch.Tensor:
    chosen = []
    for begin, end, count in zip(ptr, ptr[1:], sample_counts(ptr, ratio, src.dtype)):
        if count == 0:
            continue
        points = src[begin:end]
        index = int(torch.randint(end - begin, ())) if random_start else 0
        picked = [index]
        distance = _squared_distances(points, points[index])
        for _ in range(1, count):
            index = int(distance.argmax())
            picked.append(index)
            distance = torch.minimum(distance, _squared_distances(points, points[index]))
        chosen.append(torch.tensor(picked, dtype=torch.long) + begin)
    return torch.cat(chosen) if chosen else torch.empty(0, dtype=torch.long)


@fps.register_fake
def _(src, ptr, ratio, random_start):
    return src.new_empty(sum(sample_counts(ptr, ratio, src.dtype)), dtype=torch.long)


def _rescaled_with_batches(x, y, batch_x, batch_y):
    """torch_cluster's CPU ``nearest`` preparation of batched points: ``x`` and ``y`` moved and
    scaled together into [0, 1], then each point given one more coordinate, ``2 * D * batch``, so
    that a point of another batch is always farther than every point of its own."""
    low = torch.minimum(x.min(), y.min())
    x, y = x - low, y - low
    high = torch.maximum(x.max(), y.max())
    x, y = x / high, y / high
    scale = 2 * x.shape[1]
    return (torch.cat([x, scale * batch_x.to(x.dtype)[:, None]], 1),
            torch.cat([y, scale * batch_y.to(y.dtype)[:, None]], 1))


@torch.library.custom_op("ipu_backend::nearest", mutates_args=())
def nearest(x: torch.Tensor, y: torch.Tensor, batch_x: torch.Tensor | None,
            batch_y: torch.Tensor | None) -> torch.Tensor:
    if batch_x is not None:
        x, y = _rescaled_with_batches(x, y, batch_x, batch_y)
    wide = torch.float64 if x.dtype in _HALF else x.dtype      # scipy measures half points in float64
    differences = x.to(wide)[:, None, :] - y.to(wide)[None, :, :]
    return differences.pow(2).sum(2).argmin(1)


@nearest.register_fake
def _(x, y, batch_x, batch_y):
    return x.new_empty(x.shape[0], dtype=torch.long)


FPS = torch.ops.ipu_backend.fps.default
NEAREST = torch.ops.ipu_backend.nearest.default

