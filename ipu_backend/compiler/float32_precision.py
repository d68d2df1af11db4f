"""torch's float32 precision settings for matrix products and convolutions, as a captured program
follows them.

torch on an NVIDIA GPU computes float32 matrix products in TF32 when
``torch.set_float32_matmul_precision("high")`` (or ``"medium"``),
``torch.backends.cuda.matmul.allow_tf32 = True`` or ``fp32_precision = "tf32"`` say so, and
float32 convolutions in TF32 unless ``torch.backends.cudnn.allow_tf32 = False`` (on by default).
A program reads these settings when it is captured and traces its products with them: on a GPU
its numbers are those of torch CUDA with the same settings; on the CPU, where torch computes in
full float32 whatever they say, every product stays full float32.
"""

import warnings
from dataclasses import dataclass
from typing import Literal

import jax
import torch

Float32Mode = Literal["ieee", "tf32"]


@dataclass(frozen=True)
class Float32Precision:
    """How float32 matrix products and convolutions are computed where the backend has a choice:
    ``"ieee"`` (full float32) or ``"tf32"`` (inputs rounded to TF32, float32 accumulation)."""

    matmul: Float32Mode = "ieee"
    convolution: Float32Mode = "ieee"


def _resolved(*settings) -> Float32Mode:
    """The first setting that is not ``"none"`` (torch's ``fp32_precision`` settings go from the
    op to its backend to the generic one, each ``"none"`` deferring to the next), else full."""
    for setting in settings:
        if setting != "none":
            return "tf32" if setting == "tf32" else "ieee"
    return "ieee"


def torch_setting() -> Float32Precision:
    """The precision torch CUDA uses now for float32 matrix products and convolutions.

    Read through torch's ``fp32_precision`` attributes, which the legacy switches
    (``set_float32_matmul_precision``, ``allow_tf32``) also set, and which, unlike the legacy
    getters, answer whichever way the user set them."""
    backends = torch.backends
    return Float32Precision(
        matmul=_resolved(backends.cuda.matmul.fp32_precision, backends.fp32_precision),
        convolution=_resolved(backends.cudnn.conv.fp32_precision, backends.cudnn.fp32_precision,
                              backends.fp32_precision))


def program_key() -> Float32Precision | None:
    """What of torch's settings a program compiled now bakes in, for the caches of compiled
    programs: nothing on the CPU, where every product is full float32 whatever they say (and
    reading them would cost each call more than the rest of its key), else
    :func:`torch_setting`."""
    return None if jax.default_backend() == "cpu" else torch_setting()


_CONVOLUTIONS_COMPILED: set[str] = set()
"""The convolution precisions of the programs compiled in this process (GPU backends)."""


def note_compiled(settings: tuple | None) -> None:
    """Record that a program compiles now with ``settings`` (the runtime's program settings:
    None on the CPU, else :func:`program_key`'s value and whether its convolutions are tuned
    while compiling), and warn when its convolutions are full float32 and tuned after a program
    with TF32 convolutions in this process: XLA's GPU autotuner keeps the algorithms it picked
    per convolution shape without telling the two apart, so this program may run TF32
    convolutions (docs/limitations.md)."""
    if settings is None:
        return
    precision, convolutions_tuned = settings
    if precision.convolution == "ieee" and convolutions_tuned and "tf32" in _CONVOLUTIONS_COMPILED:
        warnings.warn("a program with float32 convolutions tuned while compiling (torch.backends.cudnn."
                      "benchmark or Options.autotuneMatmuls) compiles after one with TF32 convolutions "
                      "in this process: XLA's GPU autotuner may give it the TF32 algorithms it chose "
                      "for convolutions of the same shape, and its numbers can then differ from torch's "
                      "float32 ones by about 1e-3. Keep one torch.backends.cudnn.allow_tf32 setting per "
                      "process, or leave convolutions untuned",
                      stacklevel=4)
    _CONVOLUTIONS_COMPILED.add(precision.convolution)
