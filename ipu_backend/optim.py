"""PopTorch's optimizers (``poptorch.optim``): the ``torch.optim`` classes plus IPU options.

Each class takes its torch parent's arguments, then PopTorch's extra ones with PopTorch's
defaults: ``loss_scaling``, the accumulation dtypes, ``max_grad_norm`` and, per optimizer,
``velocity_scaling``/``use_combined_accum`` (SGD), ``bias_correction`` (AdamW, LAMB),
``use_tf_variant`` (RMSprop) and ``max_weight_norm`` (LAMB).

Every option is stored in ``defaults`` and in each param group, so ``state_dict()`` and
``load_state_dict()`` carry it. PopTorch makes all of them optimizer-wide except
``velocity_scaling`` and ``max_weight_norm``; those optimizer-wide ones are also attributes
(``optimizer.loss_scaling = 128.0`` sets every group) and must agree across groups. As in
PopTorch, ``None`` for any argument means its default (``accum_type=None`` is float32).

The compiled training step runs its own update rule (``ipu_backend.runtime.optimizers``)
that applies all of them. ``step()`` of SGD, Adam, AdamW and RMSprop is torch's eager step, which
(as in PopTorch) applies none of the IPU options, but for ``AdamW(bias_correction=False)``, whose
eager step leaves out the bias correction as the compiled one does; LAMB's eager step follows
PopTorch's formula. :class:`Optimizer` is their common base, as in PopTorch.

Each optimizer has PopTorch's ``variable_attrs`` (:class:`VariableAttributes`): the attributes
given to the constructor are variable, the others constant. On emulated IPUs every
hyper-parameter is an input of the compiled program, so a change takes effect without
recompiling whichever way an attribute is marked; the marks are kept for scripts that read them.
"""

import functools
import inspect
import math
import warnings
import weakref
from collections.abc import Mapping

import torch

from ipu_backend.errors import Error
from ipu_backend.runtime.algorithms import register_optimizer

FP16_MAX = 65500.0
"""LAMB's default ``max_weight_norm``: the largest float16, as in PopTorch."""

_ACCUM_DTYPES = (torch.float16, torch.float32)


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _finite_positive(name: str, value) -> float:
    value = _number(name, value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return value


def _positive_or_inf(name: str, value) -> float:
    value = _number(name, value)
    if not value > 0:  # also rejects NaN
        raise ValueError(f"{name} must be > 0 (float('inf') disables it), got {value!r}")
    return value


def _max_weight_norm(name: str, value) -> float:
    """PopTorch replaces ``None`` by the float16 maximum."""
    return FP16_MAX if value is None else _positive_or_inf(name, value)


def _accum_dtype(name: str, value) -> torch.dtype:
    if value not in _ACCUM_DTYPES:
        raise ValueError(f"{name} must be torch.float32 or torch.float16, got {value!r}")
    return value


def _flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


_CHECKS = {
    "loss_scaling": _finite_positive,
    "velocity_scaling": _finite_positive,
    "max_grad_norm": _positive_or_inf,
    "max_weight_norm": _max_weight_norm,
    "use_combined_accum": _flag,
    "bias_correction": _flag,
    "use_tf_variant": _flag,
    "accum_type": _accum_dtype,
    "velocity_accum_type": _accum_dtype,
    "first_order_momentum_accum_type": _accum_dtype,
    "second_order_momentum_accum_type": _accum_dtype,
}


def _optimizer_wide_attribute(name: str) -> property:
    """An attribute that reads param group 0 and writes ``defaults`` and every group."""

    def get(self):
        return self.param_groups[0][name]

    def set(self, value):
        value = _CHECKS[name](name, value)
        self.defaults[name] = value
        for group in self.param_groups:
            group[name] = value

    return property(get, set, doc=f"PopTorch's optimizer-wide ``{name}``, kept in every param group.")


class VariableAttributes:
    """Which optimizer attributes are variable and which constant (``optimizer.variable_attrs``):
    ``isConstant(attr)``, ``markAsConstant(attr)``, ``markAsVariable(attr)``. The attributes an
    optimizer's constructor was given are variable, as in PopTorch."""

    def __init__(self, variable_attributes: list[str], allowed_attributes: list[str]) -> None:
        self._variable_attributes = list(variable_attributes)
        self._allowed_attributes = list(allowed_attributes)

    def isConstant(self, attr: str) -> bool:  # noqa: N802
        """Whether ``attr`` is marked as constant."""
        return attr not in self._variable_attributes

    def _check(self, attr: str) -> None:
        if attr not in self._allowed_attributes:
            raise AssertionError(f"Unknown attribute {attr}, allowed values: {self._allowed_attributes}")

    def markAsConstant(self, attr: str) -> None:  # noqa: N802
        """Mark ``attr`` as constant."""
        self._check(attr)
        self._variable_attributes = [a for a in self._variable_attributes if a != attr]

    def markAsVariable(self, attr: str) -> None:  # noqa: N802
        """Mark ``attr`` as variable."""
        self._check(attr)
        self._variable_attributes.append(attr)

    def __repr__(self) -> str:
        return f"VariableAttributes(variable={self._variable_attributes})"


def _records_given_arguments(init):
    """Wrap an optimizer's ``__init__`` so that the arguments its caller gave become the variable
    attributes of ``variable_attrs``."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        given = signature.bind(self, *args, **kwargs).arguments
        allowed = list(self.defaults)
        self.variable_attrs = VariableAttributes(      # None is the default, so not given (PopTorch)
            [name for name, value in given.items() if name in allowed and value is not None], allowed)

    return recording_init


def _none_means_default(init):
    """PopTorch's optimizers take ``None`` for any argument after ``params`` to mean its default
    (``accum_type=None`` is float32, ``momentum=None`` torch's 0, ...): so do these."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def with_defaults(self, params, *args, **kwargs):
        bound = signature.bind(self, params, *args, **kwargs)
        for name, value in bound.arguments.items():
            if value is None and name not in ("self", "params"):
                bound.arguments[name] = signature.parameters[name].default
        return init(*bound.args, **bound.kwargs)

    return with_defaults


_IPU_ENTRIES = ("ipu_state", "ipu_param")
_SEPARATOR = "___"
_param_names: "weakref.WeakKeyDictionary[torch.optim.Optimizer, dict[int, str]]" = weakref.WeakKeyDictionary()


def _hyper_parameter(value) -> bool:
    numbers = value if isinstance(value, tuple) else (value,)
    return bool(numbers) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers)


def _eager_step(optimizer, closure, update):
    """torch's ``step(closure)`` protocol: the closure's loss (computed with gradients), after
    ``update(param, group)`` of every parameter that has a gradient."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None:
                update(param, group)
    return loss


class Optimizer:
    """PopTorch's base of its optimizers (``isinstance(opt, poptorch.optim.Optimizer)``): stores
    PopTorch's extra options in ``defaults`` and every param group; adds PopTorch's
    ``ipu_state`` and ``ipu_param`` entries to ``state_dict()``.

    ``ipu_state`` maps ``"<slot>___<parameter name>"`` (torch's slot names: ``exp_avg``,
    ``momentum_buffer``, ``step``...) to the very tensors of torch's ``state`` entry, and
    ``ipu_param`` maps ``"<hyper-parameter>___<parameter name>"`` (``lr``, ``weight_decay``,
    ``betas``...) to tensors of the param groups' values. Both are None until a training model
    has been compiled with the optimizer, as in PopTorch. ``load_state_dict`` applies them after
    torch's entries (so they win), or, for an optimizer no training program has used yet, when the
    first one is built; a torch-only state dict (a CPU checkpoint) loads as well.
    """

    _optimizer_wide: tuple[str, ...] = ()

    def _record_param_names(self, param_names: Mapping[int, str]) -> None:
        """Called by the runtime when it builds a training program for this optimizer: the
        parameters' names in the model (``id(parameter) -> name``), which name the entries of
        ``ipu_state``/``ipu_param``. Entries loaded before the names were known apply now."""
        _param_names[self] = dict(param_names)
        pending = self.__dict__.pop("_pending_ipu_entries", None)
        if pending is not None:
            self._apply_ipu_entries(*pending)

    def __getstate__(self) -> dict:
        """torch's state, and ``variable_attrs`` (copies and pickles keep the marks)."""
        return {**super().__getstate__(), "variable_attrs": self.variable_attrs}

    def state_dict(self) -> dict:
        state = super().state_dict()
        names = _param_names.get(self)
        if names is None:
            ipu_state, ipu_param = self.__dict__.get("_pending_ipu_entries", (None, None))
            return {**state, "ipu_state": ipu_state, "ipu_param": ipu_param}
        ipu_state, ipu_param = {}, {}
        for group, saved in zip(self.param_groups, state["param_groups"]):
            for param, index in zip(group["params"], saved["params"]):
                name = names.get(id(param), str(index))
                for slot, value in state["state"].get(index, {}).items():
                    if isinstance(value, torch.Tensor):
                        ipu_state[f"{slot}{_SEPARATOR}{name}"] = value
                for key, value in group.items():
                    if key != "params" and _hyper_parameter(value):
                        ipu_param[f"{key}{_SEPARATOR}{name}"] = torch.tensor(value, dtype=torch.float32)
        return {**state, "ipu_state": ipu_state, "ipu_param": ipu_param}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict({k: v for k, v in state_dict.items() if k not in _IPU_ENTRIES})
        ipu_state, ipu_param = state_dict.get("ipu_state"), state_dict.get("ipu_param")
        if not ipu_state and not ipu_param:
            return
        if self not in _param_names:      # names come with the first training program (as PopTorch
            self._pending_ipu_entries = (ipu_state, ipu_param)  # uploads a loaded state on first use)
            return
        self._apply_ipu_entries(ipu_state, ipu_param)

    def _apply_ipu_entries(self, ipu_state: dict | None, ipu_param: dict | None) -> None:
        names = _param_names[self]
        params = [(param, group, index) for index, group in enumerate(self.param_groups)
                  for param in group["params"]]
        by_name = {names.get(id(entry[0]), str(position)): entry for position, entry in enumerate(params)}

        def target(key: str, entry: str):
            slot, _, name = key.rpartition(_SEPARATOR)
            if not slot or name not in by_name:
                raise Error(f"{entry} entry {key!r} names no parameter of this optimizer: keys are "
                            f"'<name>{_SEPARATOR}<parameter>' with parameters {sorted(by_name)}")
            return slot, by_name[name]

        values = {}
        for key, value in (ipu_param or {}).items():
            hyper, (_, group, index) = target(key, "ipu_param")
            current = group.get(hyper)
            if not _hyper_parameter(current):
                raise Error(f"ipu_param entry {key!r}: param group {index} has no hyper-parameter {hyper!r}")
            new = (tuple(float(v) for v in value.tolist()) if isinstance(current, tuple)
                   else type(current)(value.item()))
            if hyper in _CHECKS:
                new = _CHECKS[hyper](hyper, new)
            if values.setdefault((index, hyper), new) != new:
                raise Error(f"ipu_param gives param group {index} several values of {hyper!r}: the "
                            "parameters of a group share its hyper-parameters")
        for (index, hyper), new in values.items():
            self.param_groups[index][hyper] = new
        for hyper in self._optimizer_wide:
            if len({group[hyper] for group in self.param_groups}) > 1:
                raise Error(f"ipu_param gives the param groups different values of {hyper!r}, which "
                            "is optimizer-wide in PopTorch")
        for key, value in (ipu_state or {}).items():
            slot, (param, _, _) = target(key, "ipu_state")
            self.state[param][slot] = value.detach().clone()

    def _add_options(self, options: dict) -> None:
        """Validate ``options`` (values a param group already holds win, as for torch's own
        options) and check the optimizer-wide ones agree across groups."""
        for name, value in options.items():
            self.defaults[name] = _CHECKS[name](name, value)
            for index, group in enumerate(self.param_groups):
                group[name] = _CHECKS[name](f"param group {index} {name}", group.get(name, value))
        for name in self._optimizer_wide:
            values = [group[name] for group in self.param_groups]
            if any(v != values[0] for v in values):
                raise ValueError(f"{name} is optimizer-wide in PopTorch: every param group needs the "
                                 f"same value, got {values}; pass it to the constructor only")


class SGD(Optimizer, torch.optim.SGD):
    """``torch.optim.SGD`` with PopTorch's loss scaling, velocity scaling and accumulator types.

    ``use_combined_accum=True`` is PopTorch's combined variant: the velocity is stored multiplied
    by the (per-group) ``velocity_scaling`` and the learning rate divided by it. The separate
    variant (default) ignores ``velocity_scaling``, with a warning when one is given.
    """

    _optimizer_wide = ("loss_scaling", "use_combined_accum", "accum_type", "velocity_accum_type",
                       "max_grad_norm")

    @_none_means_default
    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False, *,
                 maximize=False, foreach=None, differentiable=False, fused=None, loss_scaling=1.0,
                 velocity_scaling=None, use_combined_accum=False, accum_type=torch.float32,
                 velocity_accum_type=torch.float32, max_grad_norm=math.inf):
        super().__init__(params, lr, momentum, dampening, weight_decay, nesterov, maximize=maximize,
                         foreach=foreach, differentiable=differentiable, fused=fused)
        if velocity_scaling is not None and not use_combined_accum:
            warnings.warn("velocity_scaling is ignored by the separate variant of SGD "
                          "(use_combined_accum=False)", stacklevel=2)
        self._add_options({
            "loss_scaling": loss_scaling,
            "velocity_scaling": 1.0 if velocity_scaling is None else velocity_scaling,
            "use_combined_accum": use_combined_accum, "accum_type": accum_type,
            "velocity_accum_type": velocity_accum_type, "max_grad_norm": max_grad_norm})


class Adam(Optimizer, torch.optim.Adam):
    """``torch.optim.Adam`` with PopTorch's loss scaling, accumulator types and gradient clipping."""

    _optimizer_wide = ("loss_scaling", "accum_type", "first_order_momentum_accum_type",
                       "second_order_momentum_accum_type", "max_grad_norm")

    @_none_means_default
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, *,
                 foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay=False, loss_scaling=1.0, accum_type=torch.float32,
                 first_order_momentum_accum_type=torch.float32,
                 second_order_momentum_accum_type=torch.float32, max_grad_norm=math.inf):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
                         maximize=maximize, capturable=capturable, differentiable=differentiable,
                         fused=fused, decoupled_weight_decay=decoupled_weight_decay)
        self._add_options({
            "loss_scaling": loss_scaling, "accum_type": accum_type,
            "first_order_momentum_accum_type": first_order_momentum_accum_type,
            "second_order_momentum_accum_type": second_order_momentum_accum_type,
            "max_grad_norm": max_grad_norm})


class AdamW(Optimizer, torch.optim.AdamW):
    """``torch.optim.AdamW`` with PopTorch's loss scaling, accumulator types, gradient clipping and
    ``bias_correction`` (``False``: the moments are used without Adam's bias correction)."""

    _optimizer_wide = ("loss_scaling", "bias_correction", "accum_type",
                       "first_order_momentum_accum_type", "second_order_momentum_accum_type",
                       "max_grad_norm")

    @_none_means_default
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 *, maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 loss_scaling=1.0, bias_correction=True, accum_type=torch.float32,
                 first_order_momentum_accum_type=torch.float32,
                 second_order_momentum_accum_type=torch.float32, max_grad_norm=math.inf):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         foreach=foreach, capturable=capturable, differentiable=differentiable,
                         fused=fused)
        self._add_options({
            "loss_scaling": loss_scaling, "bias_correction": bias_correction,
            "accum_type": accum_type,
            "first_order_momentum_accum_type": first_order_momentum_accum_type,
            "second_order_momentum_accum_type": second_order_momentum_accum_type,
            "max_grad_norm": max_grad_norm})

    @torch.no_grad()
    def step(self, closure=None):
        """torch's step; without bias correction an eager step of the compiled rule's formula
        (computed in float32, moments kept in their accumulator types), which torch's lacks."""
        if self.bias_correction:
            return super().step(closure)
        return _eager_step(self, closure, self._update_without_bias_correction)

    def _update_without_bias_correction(self, param, group) -> None:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, dtype=group["first_order_momentum_accum_type"])
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=group["second_order_momentum_accum_type"])
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(state["exp_avg_sq"])
        state["step"] += 1
        beta1, beta2 = group["betas"]
        grad = -param.grad.float() if group["maximize"] else param.grad.float()
        exp_avg = state["exp_avg"].float().lerp_(grad, 1 - beta1)
        exp_avg_sq = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        state["exp_avg"].copy_(exp_avg)
        state["exp_avg_sq"].copy_(exp_avg_sq)
        if group["amsgrad"]:
            exp_avg_sq = torch.maximum(state["max_exp_avg_sq"].float(), exp_avg_sq)
            state["max_exp_avg_sq"].copy_(exp_avg_sq)
        weight = param.float().mul_(1 - group["lr"] * group["weight_decay"])
        param.copy_(weight.addcdiv_(exp_avg, exp_avg_sq.sqrt().add_(group["eps"]), value=-group["lr"]))


class RMSprop(Optimizer, torch.optim.RMSprop):
    """``torch.optim.RMSprop`` with PopTorch's loss scaling, accumulator types and
    ``use_tf_variant``: TensorFlow's RMSprop, whose mean square starts at one, whose ``eps`` is
    added inside the square root and whose momentum buffer accumulates ``lr`` times the step."""

    _optimizer_wide = ("loss_scaling", "accum_type", "first_order_momentum_accum_type",
                       "second_order_momentum_accum_type", "use_tf_variant")

    @_none_means_default
    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0,
                 centered=False, capturable=False, foreach=None, maximize=False,
                 differentiable=False, *,
                 loss_scaling=1.0, accum_type=torch.float32,
                 first_order_momentum_accum_type=torch.float32,
                 second_order_momentum_accum_type=torch.float32, use_tf_variant=False):
        super().__init__(params, lr, alpha, eps, weight_decay, momentum, centered, capturable, foreach,
                         maximize, differentiable)
        self._add_options({
            "loss_scaling": loss_scaling, "accum_type": accum_type,
            "first_order_momentum_accum_type": first_order_momentum_accum_type,
            "second_order_momentum_accum_type": second_order_momentum_accum_type,
            "use_tf_variant": use_tf_variant})


class LAMB(Optimizer, torch.optim.Optimizer):
    """Layer-wise Adaptive Moments (You et al., 2019) as PopTorch defines it.

    Per parameter tensor ``w`` with gradient ``g`` and step ``t``::

        m = b1 m + (1 - b1) g            v = b2 v + (1 - b2) g²
        u = (m / bc1) / (sqrt(v) / sqrt(bc2) + eps) + weight_decay · w
        w -= lr · (min(|w|, max_weight_norm) / |u|) · u

    with ``bci = 1 - bi^t`` (1 when ``bias_correction=False``), ``|·|`` the L2 norm over the
    whole tensor, and a trust ratio of 1 where either norm is zero.
    """

    _optimizer_wide = ("loss_scaling", "bias_correction", "accum_type",
                       "first_order_momentum_accum_type", "second_order_momentum_accum_type")

    @_none_means_default
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 bias_correction=True, loss_scaling=1.0, max_weight_norm=FP16_MAX,
                 accum_type=torch.float32, first_order_momentum_accum_type=torch.float32,
                 second_order_momentum_accum_type=torch.float32):
        if not lr >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not eps >= 0.0:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not all(0.0 <= beta < 1.0 for beta in betas) or len(betas) != 2:
            raise ValueError(f"Invalid betas: {betas} (two values in [0, 1) expected)")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps,
                                  "weight_decay": weight_decay})
        self._add_options({
            "max_weight_norm": max_weight_norm, "bias_correction": bias_correction,
            "loss_scaling": loss_scaling, "accum_type": accum_type,
            "first_order_momentum_accum_type": first_order_momentum_accum_type,
            "second_order_momentum_accum_type": second_order_momentum_accum_type})

    @torch.no_grad()
    def step(self, closure=None):
        """One eager LAMB step (computed in float32; moments kept in their accumulator types)."""
        return _eager_step(self, closure, self._update)

    def _update(self, param, group) -> None:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(
                param, dtype=group["first_order_momentum_accum_type"])
            state["exp_avg_sq"] = torch.zeros_like(
                param, dtype=group["second_order_momentum_accum_type"])
        state["step"] += 1
        step = state["step"].item()
        beta1, beta2 = group["betas"]
        grad = param.grad.float()
        exp_avg = state["exp_avg"].float().mul(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq = state["exp_avg_sq"].float().mul(beta2).addcmul_(grad, grad, value=1 - beta2)
        state["exp_avg"].copy_(exp_avg)
        state["exp_avg_sq"].copy_(exp_avg_sq)
        bc1, bc2 = (1 - beta1**step, 1 - beta2**step) if group["bias_correction"] else (1.0, 1.0)
        weight = param.float()
        update = (exp_avg / bc1) / (exp_avg_sq.sqrt() / math.sqrt(bc2) + group["eps"])
        update.add_(weight, alpha=group["weight_decay"])
        weight_norm = weight.norm().clamp(max=group["max_weight_norm"])
        update_norm = update.norm()
        both_nonzero = (weight_norm > 0) & (update_norm > 0)
        trust = torch.where(both_nonzero, weight_norm / update_norm, torch.ones(()))
        param.copy_(weight - (group["lr"] * trust) * update)


for _cls in (SGD, Adam, AdamW, RMSprop, LAMB):
    _cls.__init__ = _records_given_arguments(_cls.__init__)
    for _name in _cls._optimizer_wide:
        setattr(_cls, _name, _optimizer_wide_attribute(_name))
del _cls, _name


# The compiled training step runs these with the runtime's update rules, ahead of torch's classes.
for _optimizer, _algorithm in ((RMSprop, "RMSprop"), (Adam, "Adam"), (AdamW, "Adam"), (SGD, "SGD"), (LAMB, "LAMB")):
    register_optimizer(_optimizer, _algorithm)
