"""Lightning's gradient hooks on IPUs.

``on_after_backward`` and ``on_before_optimizer_step`` (a LightningModule's or a callback's) read
``.grad``, which on IPUs stays on the device: without it, ``grad_norm(self)`` logs nothing and a
hook guarded by ``if p.grad is not None`` skips its work. When a hook is overridden, the training
step keeps its gradients and they appear as ``.grad`` while the hooks run: those of the call's last
optimizer step, as its update took them (averaged over micro-batches and replicas, unscaled,
not yet clipped), what ``on_before_optimizer_step`` sees on the CPU. The update ran on the device
before the hooks, so a hook that changes ``.grad`` is refused rather than ignored.
"""

import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden

HOOKS = ("on_after_backward", "on_before_optimizer_step")


def hooks_read_gradients(module, callbacks) -> list[str]:
    """The overridden gradient hooks, as ``Owner.hook``."""
    found = [f"{type(module).__name__}.{hook}" for hook in HOOKS if is_overridden(hook, module)]
    found += [f"{type(callback).__name__}.{hook}" for callback in callbacks for hook in HOOKS
              if is_overridden(hook, callback, parent=Callback)]
    return found


class ShownGradients:
    """The gradients of the last training call, shown as ``.grad`` from the step's backward (when
    Lightning's ``on_after_backward`` follows) until the optimizer step's hooks are done."""

    def __init__(self, hooks: list[str]):
        self.hooks = hooks
        self._pending: dict[str, torch.Tensor] = {}
        self._shown: list[tuple[str, torch.nn.Parameter, torch.Tensor, int]] = []

    def arrived(self, gradients: dict[str, torch.Tensor]) -> None:
        """A training call's gradients, by parameter name."""
        self._pending = gradients

    def show(self, module: torch.nn.Module) -> None:
        """Set them as the parameters' ``.grad`` (Lightning zeroed the gradients after the step)."""
        self._shown = []
        for name, param in module.named_parameters():
            gradient = self._pending.get(name)
            if gradient is not None:
                param.grad = gradient
                self._shown.append((name, param, gradient, gradient._version))
        self._pending = {}

    def check_unchanged(self) -> None:
        """Refuse a hook's change to a shown ``.grad``: it cannot reach the update, which ran."""
        for name, param, gradient, version in self._shown:
            if param.grad is not gradient or gradient._version != version:
                raise MisconfigurationException(
                    f"the .grad of {name} was changed in a gradient hook ({', '.join(self.hooks)}): on "
                    "IPUs the optimizer update runs inside the compiled training step, before these "
                    "hooks, which may read .grad but not change it. Clip with Trainer(gradient_clip_val=...), "
                    "or change the gradients through the loss in training_step")
        self._shown = []
