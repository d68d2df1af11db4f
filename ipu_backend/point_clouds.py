"""PopTorch's point-cloud ops from torch_cluster, with PopTorch's argument checks:
``fps`` (farthest point sampling) and ``nearest`` (the nearest point of another set).

Both give torch_cluster's indices (int64, no gradient) in eager torch and compiled. Where
PopTorch raises a ``ValueError`` the error is an ``InvalidArgument`` (an ``Error`` and a
``ValueError``); elsewhere an ``Error``.
"""

import torch

from ipu_backend.compiler import point_clouds
from ipu_backend.compiler.capture import capturing
from ipu_backend.errors import Error
from ipu_backend.option_values import InvalidArgument


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def fps(src: torch.Tensor, ptr: list[int], ratio: float = 0.5,
        random_start: bool = False) -> torch.Tensor:
    """Farthest point sampling (PointNet++) of each segment ``src[ptr[i]:ptr[i + 1]]`` of the
    rows of ``src``: start from its first point, then repeatedly take the point farthest
    (squared Euclidean distance; the first on a tie) from those taken, ``ceil(ratio * size)``
    points in all. Returns their int64 indices into ``src``, segment after segment.
    ``random_start=True`` starts each segment at a random point, drawn from the program's
    random key when compiled (not torch_cluster's draws)."""
    if not isinstance(src, torch.Tensor):
        raise Error(f"`fps` must take a torch.tensor input. {type(src)} is not supported.")
    if not isinstance(ptr, list):
        raise Error("`ptr` must be a list of integers.")
    if len(ptr) < 2:
        raise Error("`ptr` must contain at least 2 elements.")
    if not isinstance(ratio, float):
        raise Error(f"`ratio` must be of float type. {type(ratio)} is not supported.")
    if not isinstance(random_start, bool):
        raise Error(f"`random_start` must be of bool type. {type(random_start)} is not supported.")
    if not 0.0 < ratio <= 1.0:
        raise Error(f"`ratio` ({ratio}) has to be in range (0.0, 1.0>")
    if src.dim() != 2:
        raise Error(f"`src` is supposed to be 2d Tensor, while it has {src.dim()} dims")
    if len(ptr) > src.shape[0] + 1:
        raise Error(f"`ptr` length ({len(ptr)}) is supposed to be at most src.size(0) + 1 "
                    f"({src.shape[0] + 1})")
    if not all(_is_int(p) for p in ptr):
        raise Error(f"`ptr` must be a list of integers, got {ptr}")
    if ptr[0] < 0 or ptr[-1] > src.shape[0] or any(b < a for a, b in zip(ptr, ptr[1:])):
        raise Error(f"`ptr` ({ptr}) must be non-decreasing offsets of rows of `src`, from 0 to "
                    f"src.size(0) ({src.shape[0]})")
    if not src.is_floating_point():
        raise Error(f"`fps` takes floating-point points, got {src.dtype}")
    return point_clouds.fps(src, ptr, ratio, random_start)


def _as_points(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, 1) if x.dim() == 1 else x


def _check_points(x: torch.Tensor, y: torch.Tensor) -> None:
    if x.dim() not in (1, 2) or y.dim() not in (1, 2):
        raise InvalidArgument(f"Inputs `x` and `y` should be 1D or 2D tensors, while `x` has "
                              f"{x.dim()} dims and `y` has {y.dim()} dims.")
    x, y = _as_points(x), _as_points(y)
    if x.shape[1] != y.shape[1]:
        raise InvalidArgument(f"Inputs shapes inconsistent x.shape[1]={x.shape[1]} vs. "
                              f"y.shape[1]={y.shape[1]}")
    if not (x.is_floating_point() and y.is_floating_point()):
        raise Error(f"`nearest` takes floating-point points, got {x.dtype} and {y.dtype}")
    if x.numel() == 0 or y.numel() == 0:
        raise Error(f"`nearest` needs points in `x` and in `y`, got shapes {tuple(x.shape)} and "
                    f"{tuple(y.shape)}")


def _check_sizes(batch_x, batch_y, x_size: int, y_size: int) -> None:
    for name, batch, points, size in (("batch_x", batch_x, "x", x_size), ("batch_y", batch_y, "y", y_size)):
        if len(batch) != size:
            raise InvalidArgument(f"`{name}` has {len(batch)} entries; it needs one for each point "
                                  f"of `{points}` ({size})")


def _check_batches(batch_x: list[int], batch_y: list[int], x_size: int, y_size: int) -> None:
    """torch_cluster's checks of batch vectors (PopTorch makes them on lists)."""
    for name, batch in (("batch_x", batch_x), ("batch_y", batch_y)):
        if any(b < a for a, b in zip(batch, batch[1:])):
            raise InvalidArgument(f"'{name}' is not sorted")
    if _unique_consecutive(batch_x) != _unique_consecutive(batch_y):
        raise InvalidArgument("Some batch indices occur in 'batch_x' that do not occur in 'batch_y'")
    _check_sizes(batch_x, batch_y, x_size, y_size)


def _unique_consecutive(batch: list[int]) -> list[int]:
    return [b for i, b in enumerate(batch) if i == 0 or b != batch[i - 1]]


def _batch_tensors(batch_x, batch_y, x_size: int, y_size: int):
    """The batch vectors as int64 tensors (None, None without batches): a missing one is all
    zeros, as in torch_cluster. Lists, and tensors outside a compiled model, are checked as
    torch_cluster checks them; a compiled model cannot read its tensors' values."""
    batch_x = [] if batch_x is None else batch_x
    batch_y = [] if batch_y is None else batch_y
    kinds = (type(batch_x), type(batch_y))
    if not all(issubclass(kind, (list, torch.Tensor)) for kind in kinds):
        raise Error(f"`batch_x` and `batch_y` must be torch.Tensors or lists while `batch_x` is of "
                    f"type {kinds[0]} and `batch_y` is of type {kinds[1]}.")
    if all(isinstance(b, list) for b in (batch_x, batch_y)):
        if not all(_is_int(b) for b in batch_x + batch_y):
            raise Error("`batch_x` and `batch_y` must be lists of integers")
        if not batch_x and not batch_y:
            return None, None
        batch_x, batch_y = batch_x or [0] * x_size, batch_y or [0] * y_size
        _check_batches(batch_x, batch_y, x_size, y_size)
        return torch.tensor(batch_x), torch.tensor(batch_y)
    batch_x, batch_y = (torch.tensor(b, dtype=torch.long) if isinstance(b, list) else b
                        for b in (batch_x, batch_y))
    for name, batch in (("batch_x", batch_x), ("batch_y", batch_y)):
        if batch.dim() != 1 or batch.is_floating_point() or batch.is_complex() or batch.dtype == torch.bool:
            raise Error(f"`{name}` must be a 1D integer tensor, got {batch.dtype} of shape "
                        f"{tuple(batch.shape)}")
    if batch_x.numel() == 0 and batch_y.numel() == 0:
        return None, None
    batch_x = batch_x if batch_x.numel() else torch.zeros(x_size, dtype=torch.long)
    batch_y = batch_y if batch_y.numel() else torch.zeros(y_size, dtype=torch.long)
    _check_sizes(batch_x, batch_y, x_size, y_size)
    if not capturing():
        _check_batches(batch_x.tolist(), batch_y.tolist(), x_size, y_size)
    return batch_x.long(), batch_y.long()


def nearest(x: torch.Tensor, y: torch.Tensor, batch_x=None, batch_y=None) -> torch.Tensor:
    """For each point of ``x``, the index of the nearest point (Euclidean distance; the first on
    a tie) of ``y`` in the same batch. ``batch_x`` / ``batch_y`` (sorted lists or tensors) give
    each point's batch; a missing one puts all its points in batch 0."""
    if not isinstance(x, torch.Tensor):
        raise Error(f"`nearest` must take a torch.tensor `x` input. {type(x)} is not supported.")
    if not isinstance(y, torch.Tensor):
        raise Error(f"`nearest` must take a torch.tensor `y` input. {type(y)} is not supported.")
    _check_points(x, y)
    x, y = _as_points(x), _as_points(y)
    dtype = torch.promote_types(x.dtype, y.dtype)
    batch_x, batch_y = _batch_tensors(batch_x, batch_y, x.shape[0], y.shape[0])
    return point_clouds.nearest(x.to(dtype), y.to(dtype), batch_x, batch_y)
