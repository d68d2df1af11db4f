"""The update rules of torch's SGD, Adam, AdamW and RMSprop and of PopTorch's LAMB (each an
:class:`~ipu_backend.runtime.optimizers.OptimizerRule`), and the registry that gives an
optimizer its rule (torch's other optimizers: ``runtime/torch_algorithms.py``)."""

from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np
import torch

from ipu_backend.errors import Error
from ipu_backend.runtime.optimizers import (
    OPTION_DEFAULTS,
    OptimizerRule,
    adam_betas,
    algorithm_of,
    one_minus_power,
    l2_norm,
    moment_dtypes,
    optimizer_wide,
    register_algorithm,
    state_dtype,
    decayed_param_and_gradient,
    step_gradient,
)
from ipu_backend.runtime.torch_algorithms import TORCH_OPTIMIZERS, TORCH_RULES


def _adam_direction(grad, moments, step, hyper, *, bias_correction: bool, amsgrad: bool):
    """Adam's ``m̂ / (sqrt(v̂) + eps)`` and the new moments, in torch's order of operations;
    AMSGrad keeps the maximum of the raw second moment, PopTorch's no-bias variant uses m, v."""
    exp_avg = moments["exp_avg"] + hyper["one_minus_beta1"] * (grad - moments["exp_avg"])
    exp_avg_sq = moments["exp_avg_sq"] * hyper["beta2"] + hyper["one_minus_beta2"] * grad * grad
    new = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    second = exp_avg_sq
    if amsgrad:
        second = new["max_exp_avg_sq"] = jnp.maximum(moments["max_exp_avg_sq"], exp_avg_sq)
    if not bias_correction:
        return exp_avg / (jnp.sqrt(second) + hyper["eps"]), new
    bias1 = one_minus_power(hyper["one_minus_beta1"], step)
    bias2 = one_minus_power(hyper["one_minus_beta2"], step)
    return (exp_avg / bias1) / (jnp.sqrt(second) / jnp.sqrt(bias2) + hyper["eps"]), new


class _SGDRule(OptimizerRule):
    """torch's SGD (first step: the buffer is the gradient, undampened) with PopTorch's combined
    variant, whose buffer holds ``velocity_scaling`` × the velocity and whose learning rate is
    divided by it (so lowering the scaling mid-run over-estimates the velocity for a while)."""

    algorithm = "SGD"

    def _read_options(self, optimizer):
        return {"use_combined_accum": optimizer_wide(optimizer, "use_combined_accum"),
                "velocity_accum_type": state_dtype(optimizer, "velocity_accum_type")}

    def _read_group_options(self, group):
        return {"momentum": group["momentum"] != 0, "nesterov": bool(group["nesterov"]),
                "maximize": bool(group.get("maximize", False))}

    def _group_hyper(self, group):
        return {"lr": group["lr"], "momentum": group["momentum"],
                "one_minus_dampening": 1 - float(group["dampening"]),
                "weight_decay": group["weight_decay"],
                "velocity_scaling": group.get("velocity_scaling", OPTION_DEFAULTS["velocity_scaling"])}

    def _slots(self, options):
        if not options["momentum"]:
            return {}
        return {"momentum_buffer": (self._options["velocity_accum_type"], 0.0)}

    def _step(self, param, grad, moments, step, hyper, options):
        grad = step_gradient(grad, param, hyper, options)
        if not options["momentum"]:
            return param - hyper["lr"] * grad, {}
        lr = hyper["lr"]
        if self._options["use_combined_accum"]:
            grad = hyper["velocity_scaling"] * grad
            lr = lr / hyper["velocity_scaling"]
        later = hyper["momentum"] * moments["momentum_buffer"] + hyper["one_minus_dampening"] * grad
        buffer = jnp.where(step == 1, grad, later)
        direction = grad + hyper["momentum"] * buffer if options["nesterov"] else buffer
        return param - lr * direction, {"momentum_buffer": buffer}

    def _velocity_scale(self, group) -> float:
        if not self._options["use_combined_accum"]:
            return 1.0
        return group.get("velocity_scaling", OPTION_DEFAULTS["velocity_scaling"])

    def _to_torch(self, slots, group, options):
        """torch keeps only the (unscaled) buffer, once a step has made one."""
        if not options["momentum"] or int(slots["step"]) == 0:
            return {}
        scaled = slots["momentum_buffer"]
        buffer = np.array(scaled.astype(np.float32) / self._velocity_scale(group), scaled.dtype)
        return {"momentum_buffer": torch.from_numpy(buffer)}

    def _from_torch(self, torch_state, fresh, group, options, name):
        buffer = torch_state.get("momentum_buffer")
        if not options["momentum"] or buffer is None:
            return fresh
        buffer = self._slot_from_torch(buffer, fresh["momentum_buffer"], name, "momentum_buffer")
        scaled = buffer.astype(jnp.float32) * self._velocity_scale(group)
        return {"step": jnp.asarray(1, jnp.int32), "momentum_buffer": scaled.astype(buffer.dtype)}


class _AdamRule(OptimizerRule):
    """torch's Adam and AdamW (``decoupled_weight_decay``), AMSGrad and maximize included, and
    PopTorch's AdamW without bias correction."""

    algorithm = "Adam"

    def _read_options(self, optimizer):
        return {"bias_correction": optimizer_wide(optimizer, "bias_correction"),
                **moment_dtypes(optimizer)}

    def _read_group_options(self, group):
        return {"amsgrad": bool(group["amsgrad"]), "maximize": bool(group.get("maximize", False)),
                "decoupled_weight_decay": bool(group.get("decoupled_weight_decay", False))}

    def _group_hyper(self, group):
        return {"lr": group["lr"], **adam_betas(group), "eps": group["eps"],
                "weight_decay": group["weight_decay"]}

    def _slots(self, options):
        first = self._options["first_order_momentum_accum_type"]
        second = self._options["second_order_momentum_accum_type"]
        slots = {"exp_avg": (first, 0.0), "exp_avg_sq": (second, 0.0)}
        if options["amsgrad"]:
            slots["max_exp_avg_sq"] = (second, 0.0)
        return slots

    def _step(self, param, grad, moments, step, hyper, options):
        param, grad = decayed_param_and_gradient(param, grad, hyper, options)
        direction, moments = _adam_direction(grad, moments, step, hyper, amsgrad=options["amsgrad"],
                                             bias_correction=self._options["bias_correction"])
        return param - hyper["lr"] * direction, moments


class _RMSpropRule(OptimizerRule):
    """torch's RMSprop (centered, momentum, maximize) and PopTorch's TensorFlow variant: mean
    square starting at one, ``eps`` inside the square root, ``lr`` folded into the momentum
    buffer."""

    algorithm = "RMSprop"

    def _read_options(self, optimizer):
        return {"use_tf_variant": optimizer_wide(optimizer, "use_tf_variant"),
                **moment_dtypes(optimizer)}

    def _read_group_options(self, group):
        return {"momentum": group["momentum"] > 0, "centered": bool(group["centered"]),
                "maximize": bool(group.get("maximize", False))}

    def _group_hyper(self, group):
        return {"lr": group["lr"], "alpha": group["alpha"],
                "one_minus_alpha": 1 - float(group["alpha"]), "eps": group["eps"],
                "weight_decay": group["weight_decay"], "momentum": group["momentum"]}

    def _slots(self, options):
        first = self._options["first_order_momentum_accum_type"]
        second = self._options["second_order_momentum_accum_type"]
        slots = {"square_avg": (second, 1.0 if self._options["use_tf_variant"] else 0.0)}
        if options["momentum"]:
            slots["momentum_buffer"] = (first, 0.0)
        if options["centered"]:
            slots["grad_avg"] = (first, 0.0)
        return slots

    def _step(self, param, grad, moments, step, hyper, options):
        grad = step_gradient(grad, param, hyper, options)
        square_avg = moments["square_avg"] * hyper["alpha"] + hyper["one_minus_alpha"] * grad * grad
        new = {"square_avg": square_avg}
        variance = square_avg
        if options["centered"]:
            grad_avg = moments["grad_avg"] + hyper["one_minus_alpha"] * (grad - moments["grad_avg"])
            new["grad_avg"] = grad_avg
            variance = square_avg - grad_avg * grad_avg
        if self._options["use_tf_variant"]:
            direction = grad / jnp.sqrt(variance + hyper["eps"])
        else:
            direction = grad / (jnp.sqrt(variance) + hyper["eps"])
        if not options["momentum"]:
            return param - hyper["lr"] * direction, new
        if self._options["use_tf_variant"]:
            buffer = moments["momentum_buffer"] * hyper["momentum"] + hyper["lr"] * direction
            new["momentum_buffer"] = buffer
            return param - buffer, new
        buffer = new["momentum_buffer"] = moments["momentum_buffer"] * hyper["momentum"] + direction
        return param - hyper["lr"] * buffer, new


class _LAMBRule(OptimizerRule):
    """PopTorch's LAMB (see ``ipu_backend.optim.LAMB``): Adam's direction plus decoupled weight
    decay, scaled per tensor by the trust ratio ``min(|w|, max_weight_norm) / |update|``."""

    algorithm = "LAMB"
    elementwise = False

    def _read_options(self, optimizer):
        return {"bias_correction": optimizer_wide(optimizer, "bias_correction"),
                **moment_dtypes(optimizer)}

    def _group_hyper(self, group):
        return {"lr": group["lr"], **adam_betas(group), "eps": group["eps"],
                "weight_decay": group["weight_decay"], "max_weight_norm": group["max_weight_norm"]}

    def _slots(self, options):
        return {"exp_avg": (self._options["first_order_momentum_accum_type"], 0.0),
                "exp_avg_sq": (self._options["second_order_momentum_accum_type"], 0.0)}

    def _step(self, param, grad, moments, step, hyper, options):
        direction, moments = _adam_direction(grad, moments, step, hyper, amsgrad=False,
                                             bias_correction=self._options["bias_correction"])
        update = direction + hyper["weight_decay"] * param
        weight_norm = jnp.minimum(l2_norm(param), hyper["max_weight_norm"])
        update_norm = l2_norm(update)
        trust = jnp.where((weight_norm > 0) & (update_norm > 0), weight_norm / update_norm, 1.0)
        return param - (hyper["lr"] * trust) * update, moments


UPDATE_RULES = {"SGD": _SGDRule, "Adam": _AdamRule, "RMSprop": _RMSpropRule, "LAMB": _LAMBRule, **TORCH_RULES}
"""The update rules by algorithm name."""


for _optimizer_class, _algorithm in TORCH_OPTIMIZERS:
    register_algorithm(_optimizer_class, _algorithm)


def register_optimizer(optimizer_class: type, algorithm: str) -> None:
    """Run ``optimizer_class`` (and its subclasses that keep its ``step``) with the update rule of
    ``algorithm`` (a key of :data:`UPDATE_RULES`), ahead of the classes registered before it:
    ``ipu_backend.optim`` registers PopTorch's optimizers this way."""
    if algorithm not in UPDATE_RULES:
        raise Error(f"no update rule named {algorithm!r}; the rules are {sorted(UPDATE_RULES)}")
    register_algorithm(optimizer_class, algorithm)


def optimizer_rule(optimizer: torch.optim.Optimizer, param_names: Mapping[int, str], stacks=(),
                   without_gradient: frozenset = frozenset()) -> OptimizerRule:
    """The update rule of ``optimizer`` (torch's SGD, Adam, AdamW, RMSprop or ours, LAMB too),
    ``param_names`` mapping ``id(parameter) -> name``; the members of each of ``stacks`` are
    updated as one stacked array under its key (each within one param group); the parameters
    ``without_gradient`` are left as they are (see :class:`OptimizerRule`). An optimizer that
    keeps the names (PopTorch's ``ipu_state``/``ipu_param`` entries name parameters) is told them
    through ``_record_param_names``."""
    rule = UPDATE_RULES[algorithm_of(optimizer)](optimizer, param_names, stacks, without_gradient)
    record = getattr(optimizer, "_record_param_names", None)
    if record is not None:
        record(param_names)
    return rule
