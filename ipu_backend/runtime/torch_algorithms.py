"""The update rules of torch's optimizers that PopTorch has none of: Adagrad, Adadelta, Adamax,
NAdam and RAdam (each an :class:`~ipu_backend.runtime.optimizers.OptimizerRule`), in the order
of operations of torch's CPU step (its single-tensor loop). Their state is torch's: the same
slots, NAdam's ``mu_product`` one number per parameter.

torch computes their step-dependent scalars in float64 on the host; here they are float32 on the
device, written so that none cancels: bias corrections through ``expm1``, and RAdam's rectifier
length ``rho_t``, whose direct formula subtracts two numbers near ``2 / (1 - beta2)`` in its
first steps, through a series (see :func:`_radam_length`).
"""

import math

import jax.numpy as jnp
import torch

from ipu_backend.runtime.optimizers import (
    OptimizerRule,
    adam_betas,
    decayed_param_and_gradient,
    one_minus_power,
    step_gradient,
)


class _AdagradRule(OptimizerRule):
    algorithm = "Adagrad"

    def _read_group_options(self, group):
        return {"maximize": bool(group["maximize"]),
                "initial_accumulator_value": float(group["initial_accumulator_value"])}

    def _group_hyper(self, group):
        return {"lr": group["lr"], "lr_decay": group["lr_decay"], "eps": group["eps"],
                "weight_decay": group["weight_decay"]}

    def _slots(self, options):
        return {"sum": (jnp.float32, options["initial_accumulator_value"])}

    def _step(self, param, grad, moments, step, hyper, options):
        grad = step_gradient(grad, param, hyper, options)
        clr = hyper["lr"] / (1 + (step - 1).astype(jnp.float32) * hyper["lr_decay"])
        total = moments["sum"] + grad * grad
        return param + (-clr) * (grad / (jnp.sqrt(total) + hyper["eps"])), {"sum": total}

    def _to_torch(self, slots, group, options):
        """torch's Adagrad makes its state when it is built, before any step."""
        return {"step": torch.tensor(float(slots["step"])), "sum": torch.from_numpy(slots["sum"].copy())}


class _AdadeltaRule(OptimizerRule):
    algorithm = "Adadelta"

    def _read_group_options(self, group):
        return {"maximize": bool(group["maximize"])}

    def _group_hyper(self, group):
        return {"lr": group["lr"], "rho": group["rho"], "one_minus_rho": 1 - float(group["rho"]),
                "eps": group["eps"], "weight_decay": group["weight_decay"]}

    def _slots(self, options):
        return {"square_avg": (jnp.float32, 0.0), "acc_delta": (jnp.float32, 0.0)}

    def _step(self, param, grad, moments, step, hyper, options):
        grad = step_gradient(grad, param, hyper, options)
        square_avg = moments["square_avg"] * hyper["rho"] + hyper["one_minus_rho"] * grad * grad
        std = jnp.sqrt(square_avg + hyper["eps"])
        delta = jnp.sqrt(moments["acc_delta"] + hyper["eps"]) / std * grad
        acc_delta = moments["acc_delta"] * hyper["rho"] + hyper["one_minus_rho"] * delta * delta
        return param + (-hyper["lr"]) * delta, {"square_avg": square_avg, "acc_delta": acc_delta}


class _AdamaxRule(OptimizerRule):
    algorithm = "Adamax"

    def _read_group_options(self, group):
        return {"maximize": bool(group["maximize"])}

    def _group_hyper(self, group):
        return {"lr": group["lr"], **adam_betas(group), "eps": group["eps"], "weight_decay": group["weight_decay"]}

    def _slots(self, options):
        return {"exp_avg": (jnp.float32, 0.0), "exp_inf": (jnp.float32, 0.0)}

    def _step(self, param, grad, moments, step, hyper, options):
        grad = step_gradient(grad, param, hyper, options)
        exp_avg = moments["exp_avg"] + hyper["one_minus_beta1"] * (grad - moments["exp_avg"])
        exp_inf = jnp.maximum(moments["exp_inf"] * hyper["beta2"], jnp.abs(grad) + hyper["eps"])
        clr = hyper["lr"] / one_minus_power(hyper["one_minus_beta1"], step)
        return param + (-clr) * (exp_avg / exp_inf), {"exp_avg": exp_avg, "exp_inf": exp_inf}


class _DecoupledRule(OptimizerRule):
    """NAdam's and RAdam's options: ``maximize`` and ``decoupled_weight_decay`` (AdamW's)."""

    def _read_group_options(self, group):
        return {"maximize": bool(group["maximize"]), "decoupled_weight_decay": bool(group["decoupled_weight_decay"])}


class _NAdamRule(_DecoupledRule):
    algorithm = "NAdam"
    scalar_slots = ("mu_product",)

    def _group_hyper(self, group):
        return {"lr": group["lr"], **adam_betas(group), "eps": group["eps"], "weight_decay": group["weight_decay"],
                "momentum_decay": group["momentum_decay"]}

    def _slots(self, options):
        return {"mu_product": (jnp.float32, 1.0), "exp_avg": (jnp.float32, 0.0), "exp_avg_sq": (jnp.float32, 0.0)}

    def _step(self, param, grad, moments, step, hyper, options):
        param, grad = decayed_param_and_gradient(param, grad, hyper, options)
        steps = step.astype(jnp.float32)
        mu = hyper["beta1"] * (1 - 0.5 * jnp.power(0.96, steps * hyper["momentum_decay"]))
        mu_next = hyper["beta1"] * (1 - 0.5 * jnp.power(0.96, (steps + 1) * hyper["momentum_decay"]))
        mu_product = moments["mu_product"] * mu
        exp_avg = moments["exp_avg"] + hyper["one_minus_beta1"] * (grad - moments["exp_avg"])
        exp_avg_sq = moments["exp_avg_sq"] * hyper["beta2"] + hyper["one_minus_beta2"] * grad * grad
        denom = jnp.sqrt(exp_avg_sq / one_minus_power(hyper["one_minus_beta2"], step)) + hyper["eps"]
        param = param + (-hyper["lr"] * (1 - mu) / (1 - mu_product)) * (grad / denom)
        param = param + (-hyper["lr"] * mu_next / (1 - mu_product * mu_next)) * (exp_avg / denom)
        return param, {"mu_product": mu_product, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def _radam_length(steps, hyper):
    """RAdam's ``rho_t = rho_inf - 2 t beta2^t / (1 - beta2^t)``, ``rho_inf = 2 / (1 - beta2) - 1``.
    In its first steps (``x = -t log(beta2)`` under 0.5) the two terms nearly cancel: there it is
    ``2t - 1 + 2 (c - g(x) / l)`` with ``l = -log(beta2)``, ``c = 1 / (1 - beta2) - 1 / l`` (from
    the host, in float64) and ``g(x) = x / (1 - e^-x) - 1`` as its series."""
    x = steps * hyper["minus_log_beta2"]
    g = x / 2 + x ** 2 / 12 - x ** 4 / 720 + x ** 6 / 30240 - x ** 8 / 1209600
    early = 2 * steps - 1 + 2 * (hyper["rho_offset"] - g / hyper["minus_log_beta2"])
    large = jnp.maximum(x, 0.5)
    later = hyper["rho_inf"] - 2 * steps * jnp.exp(-large) / -jnp.expm1(-large)
    return jnp.where(x < 0.5, early, later)


class _RAdamRule(_DecoupledRule):
    algorithm = "RAdam"

    def _group_hyper(self, group):
        betas = adam_betas(group)
        minus_log_beta2 = -math.log1p(-betas["one_minus_beta2"])
        rho_inf = 2 / betas["one_minus_beta2"] - 1
        return {"lr": group["lr"], **betas, "eps": group["eps"], "weight_decay": group["weight_decay"],
                "minus_log_beta2": minus_log_beta2, "rho_offset": 1 / betas["one_minus_beta2"] - 1 / minus_log_beta2,
                "rho_inf": rho_inf, "rect_scale": rho_inf / ((rho_inf - 4) * (rho_inf - 2))}

    def _slots(self, options):
        return {"exp_avg": (jnp.float32, 0.0), "exp_avg_sq": (jnp.float32, 0.0)}

    def _step(self, param, grad, moments, step, hyper, options):
        param, grad = decayed_param_and_gradient(param, grad, hyper, options)
        exp_avg = moments["exp_avg"] + hyper["one_minus_beta1"] * (grad - moments["exp_avg"])
        exp_avg_sq = moments["exp_avg_sq"] * hyper["beta2"] + hyper["one_minus_beta2"] * grad * grad
        corrected = exp_avg / one_minus_power(hyper["one_minus_beta1"], step)
        rho = _radam_length(step.astype(jnp.float32), hyper)
        rect = jnp.sqrt(jnp.maximum((rho - 4) * (rho - 2) / rho * hyper["rect_scale"], 0))
        adaptive = jnp.sqrt(one_minus_power(hyper["one_minus_beta2"], step)) / (jnp.sqrt(exp_avg_sq) + hyper["eps"])
        rectified = corrected * hyper["lr"] * adaptive * rect
        return param - jnp.where(rho > 5, rectified, corrected * hyper["lr"]), {"exp_avg": exp_avg,
                                                                                 "exp_avg_sq": exp_avg_sq}


TORCH_RULES = {"Adagrad": _AdagradRule, "Adadelta": _AdadeltaRule, "Adamax": _AdamaxRule, "NAdam": _NAdamRule,
               "RAdam": _RAdamRule}
"""The update rules by algorithm name."""

TORCH_OPTIMIZERS = [(torch.optim.Adagrad, "Adagrad"), (torch.optim.Adadelta, "Adadelta"),
                    (torch.optim.Adamax, "Adamax"), (torch.optim.NAdam, "NAdam"), (torch.optim.RAdam, "RAdam")]
"""Their optimizer classes."""
