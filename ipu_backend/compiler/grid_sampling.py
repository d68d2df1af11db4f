"""``F.grid_sample``'s nearest mode, picking the pixels torch's CPU kernel picks.

torch's decomposition of ``grid_sampler_2d`` maps a grid coordinate ``x`` to a pixel position as
``x * (size / 2) + (size / 2 - 0.5)``; its CPU kernel as ``(x + 1) * (size / 2) - 0.5`` (``(x + 1) *
((size - 1) / 2)`` with ``align_corners``). The two round differently in float32, and the nearest
mode rounds the position to a whole pixel, so a coordinate within a rounding error of a pixel
boundary (as a grid that halves an image has at every sample) takes the neighbouring pixel in one
and not the other. This decomposition computes the kernel's position, and its reflection, for the
nearest mode; the other modes are torch's decomposition, whose interpolation is continuous in the
position. Compiled, zero and border padding pick the kernel's pixels; reflection's arithmetic after
the product, which XLA:CPU fuses into multiply-adds rounded once, can still round the other way
within a rounding error of a boundary.
"""

import torch
from torch._decomp import decompositions as torch_decompositions

_NEAREST, _BORDER, _REFLECTION = 1, 1, 2


def grid_sampler_2d(a: torch.Tensor, grid: torch.Tensor, interpolation_mode: int = 0, padding_mode: int = 0,
                    align_corners: bool = False) -> torch.Tensor:
    if interpolation_mode != _NEAREST:
        return torch_decompositions.grid_sampler_2d(a, grid, interpolation_mode, padding_mode, align_corners)
    batch, _, height, width = a.shape
    x = _pixel(grid[..., 0], width, padding_mode, align_corners)
    y = _pixel(grid[..., 1], height, padding_mode, align_corners)
    inside = (x >= 0) & (x <= width - 1) & (y >= 0) & (y <= height - 1)
    rows = torch.where(inside, y, 0).to(torch.int64)
    columns = torch.where(inside, x, 0).to(torch.int64)
    samples = torch.arange(batch, device=a.device).view(batch, 1, 1)
    picked = a.permute(0, 2, 3, 1)[samples, rows, columns]          # (N, H_out, W_out, C)
    return torch.where(inside.unsqueeze(-1), picked, 0).permute(0, 3, 1, 2)


def _pixel(coordinate: torch.Tensor, size: int, padding_mode: int, align_corners: bool) -> torch.Tensor:
    """The nearest pixel's index (as a float; NaN stays NaN), as torch's CPU kernel computes it."""
    if align_corners:
        position = (coordinate + 1) * ((size - 1) / 2)
    else:
        position = (coordinate + 1) * (size / 2) - 0.5
    if padding_mode == _REFLECTION:
        position = _reflected(position, 0, 2 * (size - 1)) if align_corners else _reflected(position, -1, 2 * size - 1)
    if padding_mode in (_BORDER, _REFLECTION):
        position = position.clamp(0, size - 1)
    return torch.round(position)


def _reflected(position: torch.Tensor, twice_low: int, twice_high: int) -> torch.Tensor:
    """``position`` reflected off ``twice_low / 2`` and ``twice_high / 2`` until it lies between them."""
    if twice_low == twice_high:
        return torch.zeros_like(position)
    low, span = twice_low / 2, (twice_high - twice_low) / 2
    distance = (position - low).abs()
    extra = torch.fmod(distance, span)
    even = torch.remainder(torch.floor(distance / span), 2) == 0
    return torch.where(even, extra + low, span - extra + low)
