"""Resampling against torch: ``F.interpolate``'s nearest and bilinear modes and ``F.grid_sample``,
which core ATen keeps whole and the capture decomposes with torch's own decompositions
(``capture._TORCH_DECOMPOSED``): forward and gradients."""

import pytest
import torch
import torch.nn.functional as F

from tests.compiler.harness import OpCase, case_params, check_case

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def randn(*shape):
    return lambda dtype: (torch.randn(shape).to(dtype),)


def image_and_grid(dtype):
    """An image and sampling points reaching past its edges (padding modes matter there)."""
    return torch.randn(2, 3, 5, 7).to(dtype), (torch.rand(2, 4, 6, 2) * 2.4 - 1.2).to(dtype)


def image_and_boundary_grid(dtype):
    """Sampling points within a float32 rounding of pixel boundaries (a grid that halves the image
    has one at every sample), where torch's decomposition and its CPU kernel round differently."""
    columns = torch.arange(-16, 17, dtype=torch.float32) / 2
    x = torch.cat([(2 * columns + 1) / 7 - 1, 2 * columns / 6 - 1])           # align_corners False, True
    x = (x[:, None] + torch.tensor([-1.2e-7, 0.0, 1.2e-7])).reshape(2, -1, 1)
    grid = torch.stack([x, x.flip(1) * 0.7], -1).expand(2, -1, 3, 2)
    return torch.randn(2, 3, 5, 7).to(dtype), grid.to(dtype)


CASES = [
    OpCase("interpolate_nearest",
           lambda x: (F.interpolate(x, scale_factor=2, mode="nearest"),
                      F.interpolate(x, size=(3, 11), mode="nearest")),
           randn(2, 3, 5, 7), dtypes=FLOATS),
    OpCase("interpolate_bilinear",
           lambda x: (F.interpolate(x, scale_factor=2, mode="bilinear"),
                      F.interpolate(x, size=(3, 11), mode="bilinear", align_corners=True),
                      F.interpolate(x, scale_factor=0.5, mode="bilinear"),
                      F.interpolate(x, scale_factor=1.5, mode="bilinear", antialias=False)),
           randn(2, 3, 5, 7), dtypes=FLOATS),
    OpCase("grid_sample",
           lambda x, grid: tuple(F.grid_sample(x, grid, mode=mode, padding_mode=padding, align_corners=corners)
                                 for mode in ("bilinear", "nearest")
                                 for padding, corners in (("zeros", False), ("border", True), ("reflection", False))),
           image_and_grid),
    OpCase("grid_sample_nearest_at_pixel_boundaries",
           lambda x, grid: tuple(F.grid_sample(x, grid, mode="nearest", padding_mode=padding, align_corners=corners)
                                 for padding in ("zeros", "border") for corners in (False, True)),
           image_and_boundary_grid, dtypes=(torch.float32,)),
]


@pytest.mark.parametrize("case,dtype", case_params(CASES))
def test_resampling(case, dtype):
    check_case(case, dtype)
