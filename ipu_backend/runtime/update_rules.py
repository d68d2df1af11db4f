"""The optimizer update of a training program: the rule that updates its weights (the torch
optimizer as a pure function, ``runtime/algorithms.py``), which of its results is the loss, and
how its weights travel (``runtime/packing.py``)."""

import torch

from ipu_backend.runtime.algorithms import optimizer_rule
from ipu_backend.runtime.loss import find_loss, parameters_without_gradient
from ipu_backend.runtime.packing import Packing, stacks_for_optimizer


def _parameter_names(model: torch.nn.Module) -> dict:
    return {id(p): n for n, p in torch.nn.Module.named_parameters(model)}


def rule_and_loss(program, model: torch.nn.Module, optimizer, step_method: str | None) -> tuple:
    """``(rule, loss index, parameters without gradient)``: the optimizer's update rule over one
    tensor per parameter, the index of the loss among ``program``'s array results and the
    parameters the loss gives no gradient."""
    is_step = step_method is not None
    loss_index = find_loss(program, step_method=is_step)
    without_gradient = parameters_without_gradient(program, loss_index, model, is_step)
    return optimizer_rule(optimizer, _parameter_names(model), without_gradient=without_gradient), loss_index, without_gradient


def packed_rule(program, model: torch.nn.Module, optimizer, without_gradient: frozenset, clipping=None) -> tuple:
    """``(packing, rule)`` of a single-IPU training program: its stacked weights as the optimizer
    updates them, and the update rule over them, clipping the gradients first when ``clipping``
    (a ``runtime.clipping.GradientClipping``) is given."""
    names = _parameter_names(model)
    packing = Packing(stacks_for_optimizer(program.stacks, optimizer, names, without_gradient))
    rule = optimizer_rule(optimizer, names, packing.stacks, without_gradient)
    return packing, rule if clipping is None else clipping.wrap(rule)
