"""Choices a lowering makes that change speed but not the numbers, set around a trace.

Lowerings run while JAX traces a program, so the options in force at trace time are the ones
compiled in::

    with lowering_options(conv_algorithm="im2col"):
        jax.jit(step).lower(...)

``conv_algorithm``: ``"xla"`` lowers ``aten.convolution`` to ``lax.conv_general_dilated``;
``"im2col"`` lowers it to static slices and one matrix product; ``"in_loop"``, what programs
use inside loops, is im2col except for an input with a single channel; ``"auto"``, the default
at a program's top level, is im2col. On XLA:CPU im2col is faster than XLA's convolution,
forward and backward, at the top level and, for multi-channel inputs, inside loops (figures in
the performance guide); on other backends (cuDNN's convolutions on GPUs) ``"auto"`` and
``"in_loop"`` are XLA's convolution (see ``lowerings/convolution.py``). All give torch's
numbers.

``attention``: whether a capture keeps ``F.scaled_dot_product_attention`` whole, lowered to
JAX's fused attention (cuDNN's flash attention on GPUs): ``"auto"`` (on a GPU backend, for
half-precision inputs), ``"fused"`` (wherever that form applies) or ``"decomposed"`` (never);
read when a module is captured (see ``lowerings/attention.py``).

``float32``: the precision of float32 matrix products and convolutions where the backend has a
faster mode (TF32 on NVIDIA GPUs), as torch's settings were when the program was captured
(:mod:`ipu_backend.compiler.float32_precision`); on the CPU every product is full float32.
"""

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Literal

from ipu_backend.compiler.float32_precision import Float32Precision

ConvAlgorithm = Literal["auto", "xla", "im2col", "in_loop"]
CONV_ALGORITHMS = ("auto", "xla", "im2col", "in_loop")
Attention = Literal["auto", "fused", "decomposed"]
ATTENTION_CHOICES = ("auto", "fused", "decomposed")


@dataclasses.dataclass(frozen=True)
class LoweringOptions:
    conv_algorithm: ConvAlgorithm = "auto"
    attention: Attention = "auto"
    float32: Float32Precision = Float32Precision()

    def __post_init__(self):
        if self.conv_algorithm not in CONV_ALGORITHMS:
            raise ValueError(f"conv_algorithm must be one of {CONV_ALGORITHMS}, "
                             f"not {self.conv_algorithm!r}")
        if self.attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention must be one of {ATTENTION_CHOICES}, not {self.attention!r}")


_CURRENT = contextvars.ContextVar("lowering_options", default=LoweringOptions())


def current_options() -> LoweringOptions:
    """The options lowerings traced now should follow."""
    return _CURRENT.get()


@contextlib.contextmanager
def lowering_options(**changes) -> Iterator[LoweringOptions]:
    """Trace with the current options changed by ``changes`` (restored on exit)."""
    options = dataclasses.replace(current_options(), **changes)
    token = _CURRENT.set(options)
    try:
        yield options
    finally:
        _CURRENT.reset(token)
