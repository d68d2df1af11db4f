"""Gradient clipping inside the compiled training step.

Lightning's ``Trainer(gradient_clip_val=v, gradient_clip_algorithm="norm" | "value")`` clips the
gradients of the optimizer's parameters between the backward pass and the optimizer step, as
``torch.nn.utils.clip_grad_norm_(params, v)`` (norm 2) or ``clip_grad_value_(params, v)`` would.
Here the same happens on the device: :meth:`GradientClipping.wrap` gives an optimizer rule whose
``update`` clips the (already averaged, unscaled) gradients first.
"""

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import jax.numpy as jnp

from ipu_backend.errors import Error

_NORM_EPS = 1e-6
"""Added to the total norm by ``torch.nn.utils.clip_grad_norm_``."""

ALGORITHMS = ("norm", "value")


def norm_coefficient(max_norm, total_norm):
    """What ``clip_grad_norm_`` multiplies every gradient by, given their global 2-norm."""
    return jnp.minimum(max_norm / (total_norm + _NORM_EPS), 1.0)


def clip_by_global_norm(grads: Mapping, names: Iterable[str], max_norm) -> dict:
    """``grads`` with those of ``names`` clipped as ``torch.nn.utils.clip_grad_norm_(max_norm)``
    clips them: by their global 2-norm (computed in float32); the others unchanged."""
    names = tuple(names)
    total = jnp.sqrt(sum(jnp.sum(jnp.square(grads[name].astype(jnp.float32))) for name in names))
    coefficient = norm_coefficient(max_norm, total)
    clipped = dict(grads)
    for name in names:
        clipped[name] = (grads[name] * coefficient).astype(grads[name].dtype)
    return clipped


@dataclass(frozen=True)
class GradientClipping:
    """Clip the optimizer's gradients to ``value``: by their global 2-norm, or element-wise."""

    value: float
    algorithm: str = "norm"

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise Error(f"gradient clipping algorithm must be one of {', '.join(ALGORITHMS)}; "
                        f"got {self.algorithm!r}")
        if isinstance(self.value, bool) or not isinstance(self.value, (int, float)) \
                or not math.isfinite(self.value) or self.value <= 0:
            raise Error(f"the gradient clipping value must be a positive finite number; got {self.value!r}")

    def __call__(self, grads: Mapping, names: Iterable[str]) -> dict:
        """``grads`` with those of ``names`` clipped; the others unchanged."""
        if self.algorithm == "norm":
            return clip_by_global_norm(grads, names, self.value)
        clipped = dict(grads)
        for name in names:
            clipped[name] = jnp.clip(grads[name], -self.value, self.value)
        return clipped

    def wrap(self, rule) -> "ClippedRule":
        return ClippedRule(rule, self)


class ClippedRule:
    """An optimizer rule (see ``runtime/optimizers.py``) that clips the gradients of its
    parameters before each update; everything else is the wrapped rule's."""

    def __init__(self, rule, clipping: GradientClipping):
        self._rule = rule
        self._clipping = clipping

    def update(self, grads: Mapping, state: Mapping, params: Mapping, hyper: dict) -> tuple[dict, dict]:
        return self._rule.update(self._clipping(grads, self._rule.names), state, params, hyper)

    def __getattr__(self, name):
        return getattr(self._rule, name)
