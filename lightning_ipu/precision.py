"""``IPUPrecision``: Lightning's ``precision`` flag on emulated IPUs.

==============  ================================================================================
``32-true``     float32 weights and compute.
``16-mixed``    float32 weights; the step is compiled under ``torch.autocast(float16)`` and, with
                default options, trains with dynamic loss scaling (``auto_loss_scaling``).
``bf16-mixed``  float32 weights; the step is compiled under ``torch.autocast(bfloat16)``.
``16-true``     float16 weights and compute; float inputs are cast on the host.
``bf16-true``   bfloat16 weights and compute; float inputs are cast on the host.
==============  ================================================================================

The backward pass, the optimizer update and gradient clipping all happen inside the compiled
training step, so this plugin's ``backward`` does nothing and its ``optimizer_step`` only runs the
closure (which runs the step on the IPUs).
"""

import contextlib
from collections.abc import Callable, Generator
from typing import Any, Literal, get_args

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from ipu_backend import lightning_seam as seam

_PRECISION_INPUT = Literal["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"]
SUPPORTED_PRECISIONS: tuple[str, ...] = get_args(_PRECISION_INPUT)
_HALF = {"16": torch.float16, "bf16": torch.bfloat16}
_READ_BEFORE_THE_UPDATE = (
    "in a hook that runs between the training step and the optimizer step (on_before_zero_grad, "
    "on_before_backward, on_after_backward, on_before_optimizer_step): on IPUs the compiled training step "
    "has updated the weights already there, where on the CPU these hooks see the weights before the "
    "update. Read the weights in on_train_batch_start (before the step) or on_train_batch_end (after it); "
    "these hooks may read .grad")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class IPUPrecision(Precision):
    """Precision of the compiled steps (see the module docstring for each value)."""

    def __init__(self, precision: _PRECISION_INPUT = "32-true") -> None:
        if precision not in SUPPORTED_PRECISIONS:
            raise ValueError(f"`Trainer(accelerator='ipu', precision={precision!r})` is not supported: "
                             f"precision must be one of {', '.join(map(repr, SUPPORTED_PRECISIONS))}")
        self.precision = precision
        bits, _, kind = precision.partition("-")
        self.half_dtype: torch.dtype | None = _HALF.get(bits)
        """float16/bfloat16 for the half modes, None for ``32-true``."""
        self.mixed = kind == "mixed"
        self.gradient_clipping: tuple[float, str] | None = None
        """``(value, algorithm)`` compiled into the training step, set by the strategy."""
        self.shown_gradients = None
        """The strategy's ``_gradient_hooks.ShownGradients`` when gradient hooks are overridden."""

    @property
    def loss_scaling(self) -> bool:
        """Whether default options train with dynamic loss scaling (float16 mixed precision)."""
        return self.precision == "16-mixed"

    @override
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if self.half_dtype is not None and not self.mixed:
            return module.to(dtype=self.half_dtype)
        return module

    @override
    def convert_input(self, data: Any) -> Any:
        """Float tensors of a batch in the half dtype (``-true`` modes), cast on the host."""
        if self.half_dtype is None or self.mixed:
            return data
        return apply_to_collection(data, torch.Tensor, lambda t: t.to(self.half_dtype) if t.is_floating_point() else t)

    @override
    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        if self.half_dtype is not None and not self.mixed:
            return _default_dtype(self.half_dtype)
        return contextlib.nullcontext()

    @override
    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self.tensor_init_context()

    @override
    def forward_context(self) -> contextlib.AbstractContextManager:
        """Where the steps are traced: under autocast (``-mixed``), with the half default dtype
        (``-true``)."""
        if self.half_dtype is None:
            return contextlib.nullcontext()
        if self.mixed:
            return torch.autocast("cpu", dtype=self.half_dtype)
        return _default_dtype(self.half_dtype)

    @override
    def backward(self, tensor: torch.Tensor, model, optimizer, *args: Any, **kwargs: Any) -> None:
        """The compiled step differentiated the loss already; gradient hooks see its gradients
        from here (``_gradient_hooks.py``)."""
        if self.shown_gradients is not None:
            self.shown_gradients.show(model)

    @override
    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Run the closure: its training step runs forward, backward and the update on the IPUs.
        The hooks between the step and the update (``on_before_zero_grad``, ``on_after_backward``,
        ``on_before_optimizer_step``...) would see the updated weights where the CPU shows those
        the step used, so their reads of the weights are refused."""
        # The update happens on the IPUs, in the closure: tell torch's LR schedulers, which otherwise
        # warn that they step before the optimizer does (also those stepped inside the call).
        optimizer._opt_called = True
        with seam.weight_reads_refused(model, _READ_BEFORE_THE_UPDATE):
            closure_result = closure()
            self._after_closure(model, optimizer)
        if self.shown_gradients is not None:
            self.shown_gradients.check_unchanged()
        return closure_result

    def host_optimizer_step(self, optimizer, model, closure: Callable[[], Any]) -> Any:
        """Lightning's own optimizer step, on the host: the closure, the hooks, the clipping the
        Trainer asked for, torch's step (the step of an epoch without backward,
        ``_skipped_backward.py``)."""
        closure_result = closure()
        self._after_closure(model, optimizer)
        self.clip_on_host(optimizer)
        optimizer.step()
        return closure_result

    def clip_on_host(self, optimizer) -> None:
        """Clip the ``.grad`` the host holds as the Trainer asked, with Lightning's clipping."""
        if self.gradient_clipping is not None:
            value, algorithm = self.gradient_clipping
            super().clip_gradients(optimizer, value, GradClipAlgorithmType(algorithm))

    @override
    def clip_gradients(self, optimizer, clip_val: int | float = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM) -> None:
        """Gradients were clipped inside the compiled step, as ``Trainer(gradient_clip_val,
        gradient_clip_algorithm)`` asked; other values (from ``configure_gradient_clipping``)
        cannot reach a compiled step."""
        requested = None if clip_val <= 0 else (float(clip_val), GradClipAlgorithmType(gradient_clip_algorithm).value)
        if requested != self.gradient_clipping:
            raise MisconfigurationException(
                f"clip_gradients(gradient_clip_val={clip_val}, gradient_clip_algorithm="
                f"{GradClipAlgorithmType(gradient_clip_algorithm).value!r}) differs from what the IPU "
                f"training step was compiled with ({self._describe(self.gradient_clipping)}): on IPUs "
                "gradients are clipped inside the compiled step, so set the clipping with "
                "Trainer(gradient_clip_val=..., gradient_clip_algorithm=...) rather than in "
                "configure_gradient_clipping")

    @staticmethod
    def _describe(clipping: tuple[float, str] | None) -> str:
        return "no clipping" if clipping is None else f"{clipping[1]} clipping at {clipping[0]}"
