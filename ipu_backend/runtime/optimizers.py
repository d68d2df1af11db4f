"""Optimizer updates as pure JAX functions, driven by a torch optimizer.

``optimizer_rule(torch_optimizer, param_names)`` (``runtime/algorithms.py``, which holds the
algorithms and chooses one for an optimizer) reads the algorithm and its structural options
once (which parameters are in which group, nesterov, amsgrad, accumulator dtypes...). Inside the
jitted training step the executor then runs::

    state = rule.init(params)                               # name -> {slot: array}
    hyper = rule.hyperparameters(torch_optimizer)           # lr, betas, ... as float32 scalars
    new_params, new_state = rule.update(grads, state, params, hyper)

Everything ``setOptimizer`` or an LR scheduler may change is in ``hyper``, a program input, so
changing it never recompiles; a change to a structural option makes ``hyperparameters`` raise
(``rule.matches(optimizer)`` tells beforehand whether a new rule is needed).

PopTorch's loss scaling belongs to the executor: it multiplies the loss by
``rule.loss_scale(hyper)`` and divides the gradients by it, so ``update`` takes the gradients
of the unscaled loss. Updates are computed in float32 whatever the parameter dtype; state slots
keep torch's names and live in the accumulator dtypes the optimizer asks for (float32 by
default), the step count in int32.

The updates are written out in torch's order of operations rather than with optax: optax forms
``1 - decay`` from a float32 decay, which for decays near one (RMSprop's alpha = 0.999, Adam
without bias correction) moves parameters by more than 1e-5 from torch's, whose scalars are
float64. Hyper-parameters entering as ``1 - x`` are passed as complements computed on the host.
"""

import inspect
import logging
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ipu_backend.errors import Error
from ipu_backend.runtime.clipping import clip_by_global_norm

logger = logging.getLogger("ipu_backend")

OPTION_DEFAULTS = {
    "loss_scaling": 1.0,
    "velocity_scaling": 1.0,
    "max_grad_norm": math.inf,
    "use_combined_accum": False,
    "bias_correction": True,
    "use_tf_variant": False,
    "accum_type": torch.float32,
    "velocity_accum_type": torch.float32,
    "first_order_momentum_accum_type": torch.float32,
    "second_order_momentum_accum_type": torch.float32,
}
_STATE_DTYPES = {torch.float32: jnp.float32, torch.float16: jnp.float16}


def _scalar(value) -> np.ndarray:
    """A float32 scalar made on the host: the program's input, with no device computation (a
    ``jnp`` array would compile a small program of its own)."""
    return np.asarray(float(value), np.float32)


def _filled(shape: tuple, value: float, dtype) -> np.ndarray:
    """``np.full``; zeros as ``np.zeros``, whose pages the system gives zeroed instead of being
    written one element at a time (an optimizer's moments of large stacked weights)."""
    return np.zeros(shape, dtype) if value == 0 else np.full(shape, value, dtype)


def optimizer_wide(optimizer: torch.optim.Optimizer, name: str):
    """An option PopTorch keeps optimizer-wide, read from the param groups (where our optimizers
    store it; torch's own have none and get PopTorch's default)."""
    values = [group.get(name, OPTION_DEFAULTS[name]) for group in optimizer.param_groups]
    if any(v != values[0] for v in values):
        raise Error(f"{name} must be the same in every param group (got {values}); set it on the "
                    f"optimizer (optimizer.{name} = ...) rather than in one group")
    return values[0]


def needs_running_mean(optimizer: torch.optim.Optimizer) -> bool:
    """PopTorch's choice of ``MeanReductionStrategy.Running`` for an optimizer: float16 gradient
    accumulators (``accum_type``), except SGD's combined variant."""
    return (optimizer_wide(optimizer, "accum_type") == torch.float16
            and not optimizer_wide(optimizer, "use_combined_accum"))


def state_dtype(optimizer: torch.optim.Optimizer, name: str):
    dtype = optimizer_wide(optimizer, name)
    if dtype not in _STATE_DTYPES:
        raise Error(f"{name}={dtype} is not supported; use torch.float32 or torch.float16")
    return _STATE_DTYPES[dtype]


def moment_dtypes(optimizer: torch.optim.Optimizer) -> dict:
    """PopTorch's first- and second-order accumulator dtypes (of exp_avg and exp_avg_sq...)."""
    return {name: state_dtype(optimizer, name)
            for name in ("first_order_momentum_accum_type", "second_order_momentum_accum_type")}


def _torch_scalar_dtype() -> torch.dtype:
    """The dtype torch gives ``state['step']``."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _to_numpy_float32(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to("cpu", torch.float32).numpy()


def l2_norm(x):
    return jnp.sqrt(jnp.sum(jnp.square(x)))


def one_minus_power(one_minus_beta, step):
    """``1 - beta**step`` without float32 cancellation (torch computes it in float64)."""
    return -jnp.expm1(step.astype(jnp.float32) * jnp.log1p(-one_minus_beta))


def adam_betas(group) -> dict:
    """Adam's betas and, computed in float64 here, their complements: ``1 - beta`` in float32
    loses up to 1e-5 of itself for beta = 0.999, which torch (float64 scalars) does not."""
    beta1, beta2 = (float(beta) for beta in group["betas"])
    return {"beta1": beta1, "beta2": beta2, "one_minus_beta1": 1 - beta1, "one_minus_beta2": 1 - beta2}


def step_gradient(grad, param, hyper, options):
    """The gradient torch's step starts from: negated for ``maximize``, plus ``weight_decay *
    param`` where the decay is not 0 (torch leaves the term out then: ``0 * inf`` would make an
    infinite parameter NaN)."""
    if options["maximize"]:
        grad = -grad
    return jnp.where(hyper["weight_decay"] != 0, grad + hyper["weight_decay"] * param, grad)


def decayed_param_and_gradient(param, grad, hyper, options):
    """``(param, gradient)`` torch's step starts from where the decay may be decoupled
    (``decoupled_weight_decay``, AdamW's): the parameter shrunk by ``1 - lr * weight_decay``, or
    the decay in the gradient (:func:`step_gradient`)."""
    if not options["decoupled_weight_decay"]:
        return param, step_gradient(grad, param, hyper, options)
    return param * (1 - hyper["lr"] * hyper["weight_decay"]), -grad if options["maximize"] else grad


class OptimizerRule:
    """One optimizer's update rule; see the module docstring for the protocol.

    ``param_names`` maps ``id(parameter) -> name`` (``{id(p): n for n, p in
    module.named_parameters()}``): the optimizer's groups are resolved to names once, here.
    Parameters the optimizer does not hold pass through ``update`` unchanged, and so do those
    in ``without_gradient``, which torch's step skips because their ``.grad`` is None (frozen
    with ``requires_grad=False``, or not used by the loss): ``names`` are the others, the
    parameters ``update`` takes gradients for.
    """

    algorithm = ""
    scalar_slots: tuple[str, ...] = ()
    """Slots kept as one number per parameter, as its step count is (NAdam's ``mu_product``)."""
    elementwise = True
    """Whether each element's update reads only that element of the parameter, its gradient and
    moments, and the step: then a stacked parameter is updated whole, its steps broadcast over
    the stacked axis, where otherwise it is updated layer by layer (``jax.vmap``, whose tracing
    costs more)."""

    def __init__(self, optimizer: torch.optim.Optimizer, param_names: Mapping[int, str], stacks=(),
                 without_gradient: frozenset = frozenset()):
        self.member_groups = self._group_names(optimizer, param_names)
        """The parameters of each group by name, as the torch optimizer holds them."""
        self.stacked = {stack.key: stack.members for stack in stacks}
        """Stack key -> its members: parameters updated as one array stacked on a leading axis
        (a loop's layers, see ``ipu_backend.compiler.layer_loops.Stack``), each member with a step
        count of its own. A stack's members all have a gradient, or none has."""
        self._member_of = {name: (stack.key, index) for stack in stacks for index, name in enumerate(stack.members)}
        self.groups = self._stacked_groups(self.member_groups)
        self.without_gradient = frozenset(without_gradient).union(
            key for key, members in self.stacked.items() if without_gradient.issuperset(members))
        self.names = tuple(name for names in self.groups for name in names if name not in self.without_gradient)
        self._param_ids = self._ids(optimizer)
        self._group_params = tuple(tuple(group["params"]) for group in optimizer.param_groups)
        """The parameters of each group, as the optimizer held them."""
        self._options, self._group_options = self._static(optimizer)
        self.accum_dtype = state_dtype(optimizer, "accum_type")
        """dtype for accumulating gradients over micro-batches (PopTorch's ``accum_type``)."""
        self._hyper_values(optimizer)  # reading them validates them, before anything is traced

    # --- the protocol ---------------------------------------------------------------------------
    def init(self, params: Mapping[str, jax.Array]) -> dict:
        """Fresh state (torch's before its first step) for the optimizer's parameters, made on the
        host (numpy: the first call copies it to the device; made with ``jnp``, each shape would
        compile a small program of its own)."""
        self._require(params, "are not among the weights the device holds: parameters registered under new "
                      "names or added to the model after its first call (torch.nn.utils.prune, Lightning's "
                      "ModelPruning callback) are not followed; prune or add them before the first call")
        state = {}
        for options, names in zip(self._group_options, self.groups):
            for name in names:
                steps = (len(self.stacked[name]),) if name in self.stacked else ()
                moments = {slot: _filled(steps if slot in self.scalar_slots else jnp.shape(params[name]),
                                         initial, dtype)
                           for slot, (dtype, initial) in self._slots(options).items()}
                # A parameter that keeps no moments keeps no step count either (plain SGD, whose
                # torch state stays empty): a call then carries nothing in or out for it.
                state[name] = {"step": np.zeros(steps, np.int32), **moments} if moments else {}
        return state

    def hyperparameters(self, optimizer: torch.optim.Optimizer) -> dict:
        """Every value the update reads from ``optimizer`` that may change between steps."""
        changes = self._changes(optimizer)
        if changes:
            raise Error(f"the {self.algorithm} optimizer changed in a way the compiled step cannot "
                        f"follow ({'; '.join(changes)}); a new optimizer rule (recompilation) is "
                        "needed")
        return jax.tree.map(_scalar, self._hyper_values(optimizer))

    def loss_scale(self, hyper: dict) -> jax.Array:
        """PopTorch's ``loss_scaling``: the loss is multiplied by it before the backward pass and
        the gradients divided by it before ``update``."""
        return hyper["loss_scaling"]

    @property
    def structure(self) -> tuple:
        """What a program compiled with this rule bakes in of it: equal for rules that update
        the same parameters (by name) alike, whatever optimizer object they were built from."""
        return (type(self), self.groups, tuple(sorted(self.stacked.items())), tuple(sorted(self.without_gradient)),
                tuple((name, self._options[name]) for name in sorted(self._options)),
                tuple(tuple(sorted(options.items())) for options in self._group_options), self.accum_dtype)

    def matches(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether this rule (and a program compiled with it) can run ``optimizer``."""
        return not self._changes(optimizer)

    def update(self, grads: Mapping, state: Mapping, params: Mapping, hyper: dict) -> tuple[dict, dict]:
        """One optimizer step: ``(new_params, new_state)``. ``grads`` are those of the unscaled
        loss; ``params`` and ``new_params`` may hold parameters outside the optimizer."""
        self._require(grads, "have no gradient among grads")
        grads = {name: grads[name].astype(jnp.float32) for name in self.names}
        if self._options["clip_grad_norm"]:       # clip_grad_norm_ over every parameter it updates
            grads = clip_by_global_norm(grads, self.names, hyper["max_grad_norm"])
        new_params, new_state = dict(params), {}
        for options, names, group_hyper in zip(self._group_options, self.groups, hyper["groups"]):
            def step_one(param, grad, slots, group_hyper=group_hyper, options=options):
                step = slots["step"] + 1 if "step" in slots else None
                spread = lambda value: value.reshape(value.shape + (1,) * (param.ndim - value.ndim))  # noqa: E731
                moments = {slot: spread(value) if slot in self.scalar_slots else value
                           for slot, value in slots.items() if slot != "step"}
                moments = {slot: value.astype(jnp.float32) for slot, value in moments.items()}
                each = None if step is None else spread(step)
                new_param, moments = self._step(param.astype(jnp.float32), grad, moments, each,
                                                group_hyper, options)
                new_slots = {slot: value.astype(slots[slot].dtype).reshape(slots[slot].shape)
                             for slot, value in moments.items()}
                if step is not None:
                    new_slots["step"] = step
                return new_param.astype(param.dtype), new_slots

            for name in names:
                if name in self.without_gradient:
                    new_state[name] = state[name]
                    continue
                update = jax.vmap(step_one) if name in self.stacked and not self.elementwise else step_one
                new_params[name], new_state[name] = update(params[name], grads[name], state[name])
        return new_params, new_state

    def state_to_torch(self, state: Mapping, optimizer: torch.optim.Optimizer) -> None:
        """Write ``state`` into ``optimizer.state`` as torch's own step would have left it, for
        each parameter of this rule's groups that the optimizer still holds, in whichever group
        holds it now (``add_param_group`` may have changed them since the rule was built). Slots
        this rule does not update stay, as torch's step leaves them (SGD's ``momentum_buffer``
        while momentum is 0, taken up again when it returns)."""
        group_of = {id(param): group for group in optimizer.param_groups for param in group["params"]}
        for options, names, params in zip(self._group_options, self.member_groups, self._group_params):
            for name, param in zip(names, params):
                if id(param) not in group_of:
                    continue          # left the optimizer, which no longer updates its state
                slots = {slot: np.asarray(value) for slot, value in self._member_state(state, name).items()}
                torch_state = {**optimizer.state.get(param, {}),
                               **self._to_torch(slots, group_of[id(param)], options)}
                if torch_state:
                    optimizer.state[param] = torch_state

    def state_from_torch(self, optimizer: torch.optim.Optimizer, params: Mapping[str, jax.Array]
                         ) -> dict:
        """The state held in ``optimizer.state`` (e.g. after ``load_state_dict``); parameters
        without torch state start fresh."""
        self._require_same(optimizer)

        def slots_of(group_index: int, position: int, name: str, fresh: dict) -> dict:
            group = optimizer.param_groups[group_index]
            torch_state = optimizer.state.get(group["params"][position])
            if not torch_state:
                return fresh
            return self._from_torch(torch_state, fresh, group, self._group_options[group_index], name)

        return self._placed(params, slots_of)

    def members_state(self, state: Mapping) -> dict:
        """Each parameter's state slots by name, a stack's members apart (for :meth:`carried_over`)."""
        return {name: self._member_state(state, name) for names in self.member_groups for name in names}

    def carried_over(self, members: Mapping[str, dict], params: Mapping[str, jax.Array]) -> dict:
        """State for this rule in which each parameter in ``members`` (another rule's
        :meth:`members_state`, the same optimizer's before its param groups changed) keeps its
        slots and the others start fresh, as torch keeps a parameter's state, keyed by the
        parameter, when ``add_param_group`` or a change of ``requires_grad`` changes the groups."""

        def slots_of(group_index: int, position: int, name: str, fresh: dict) -> dict:
            kept = members.get(name)
            if kept is None:
                return fresh
            if set(kept) != set(fresh):
                raise Error(f"the {self.algorithm} state of parameter {name} does not carry over to its "
                            f"param group's options (slots {sorted(kept)} -> {sorted(fresh)}); torch's "
                            "step would fail on it too: give the parameter a group with the options it "
                            "was trained with, or a new optimizer")
            return kept

        return self._placed(params, slots_of)

    def _placed(self, params: Mapping[str, jax.Array], slots_of) -> dict:
        """Fresh state with each parameter's slots replaced by ``slots_of(group index, position
        in the group, name, fresh slots)``, a stack's members stacked again."""
        state = self.init(params)
        members = {}
        for group_index, names in enumerate(self.member_groups):
            for position, name in enumerate(names):
                slots = slots_of(group_index, position, name, self._member_state(state, name))
                if name in self._member_of:
                    members[name] = slots
                else:
                    state[name] = slots
        for key, stacked in self.stacked.items():
            if key in state:
                state[key] = jax.tree.map(lambda *values: jnp.stack(values), *(members[m] for m in stacked))
        return state

    def _member_state(self, state: Mapping, name: str) -> dict:
        """The state slots of parameter ``name``, taken from its stack's when it is a member."""
        if name not in self._member_of:
            return state[name]
        key, index = self._member_of[name]
        return {slot: value[index] for slot, value in state[key].items()}

    def _stacked_groups(self, member_groups: tuple) -> tuple:
        """``member_groups`` with each stack's members replaced by its key (where the first is)."""
        groups, seen = [], {}
        for index, names in enumerate(member_groups):
            group = []
            for name in names:
                key = self._member_of.get(name, (name,))[0]
                if seen.setdefault(key, index) != index:
                    raise Error(f"the parameters stacked as {key} are in different param groups")
                if key not in group:
                    group.append(key)
            groups.append(tuple(group))
        return tuple(groups)

    # --- per algorithm ----------------------------------------------------------------------
    def _read_options(self, optimizer) -> dict:
        """Structural optimizer-wide options (beyond gradient clipping)."""
        return {}

    def _read_group_options(self, group: dict) -> dict:
        """Structural per-group options."""
        return {}

    def _group_hyper(self, group: dict) -> dict:
        """The group's values that may change between steps."""
        raise NotImplementedError

    def _slots(self, options: dict) -> dict:
        """``slot -> (dtype, initial value)`` of one parameter of a group, in torch's order."""
        raise NotImplementedError

    def _step(self, param, grad, moments, step, hyper, options):
        """float32 ``(new_param, new_moments)``; ``step`` counts this update from 1 (None for a
        parameter that keeps no moments, see :meth:`init`)."""
        raise NotImplementedError

    def _to_torch(self, slots: dict, group: dict, options: dict) -> dict:
        """Torch's state for one parameter, slots in torch's order (pytrees sort dict keys);
        empty before the first step."""
        if int(slots["step"]) == 0:
            return {}
        torch_state = {"step": torch.tensor(float(slots["step"]), dtype=_torch_scalar_dtype())}
        torch_state.update((slot, torch.from_numpy(np.array(slots[slot])))
                           for slot in self._slots(options))
        return torch_state

    def _from_torch(self, torch_state: dict, fresh: dict, group: dict, options: dict, name: str
                    ) -> dict:
        slots = {"step": jnp.asarray(int(torch_state["step"]), jnp.int32)}
        for slot, initial in fresh.items():
            if slot != "step":
                slots[slot] = self._slot_from_torch(torch_state.get(slot), initial, name, slot)
        return slots

    # --- helpers ----------------------------------------------------------------------------
    def _hyper_values(self, optimizer) -> dict:
        """``hyperparameters`` as Python numbers."""
        return {
            "loss_scaling": optimizer_wide(optimizer, "loss_scaling"),
            "max_grad_norm": optimizer_wide(optimizer, "max_grad_norm"),
            "groups": tuple(self._group_hyper(group) for group in optimizer.param_groups),
        }

    @staticmethod
    def _slot_from_torch(tensor, initial, name: str, slot: str):
        if tensor is None:
            return initial
        if tuple(tensor.shape) != initial.shape:
            raise Error(f"optimizer state {slot!r} of {name} has shape {tuple(tensor.shape)}, but the "
                        f"parameter has shape {initial.shape}")
        return jnp.asarray(_to_numpy_float32(tensor), initial.dtype)

    @staticmethod
    def _group_names(optimizer, param_names: Mapping[int, str]) -> tuple:
        groups = []
        for index, group in enumerate(optimizer.param_groups):
            names = []
            for param in group["params"]:
                if id(param) not in param_names:
                    raise Error(f"param group {index} of the optimizer holds a tensor of shape "
                                f"{tuple(param.shape)} that is not a parameter of the model")
                if param.is_complex():
                    raise Error(f"complex parameters are not supported ({param_names[id(param)]})")
                names.append(param_names[id(param)])
            groups.append(tuple(names))
        return tuple(groups)

    @staticmethod
    def _ids(optimizer) -> tuple:
        return tuple(tuple(id(p) for p in group["params"]) for group in optimizer.param_groups)

    def _static(self, optimizer) -> tuple[dict, tuple]:
        options = {"clip_grad_norm": math.isfinite(optimizer_wide(optimizer, "max_grad_norm")),
                   "accum_type": optimizer_wide(optimizer, "accum_type"),
                   **self._read_options(optimizer)}
        return options, tuple(self._read_group_options(group) for group in optimizer.param_groups)

    def _changes(self, optimizer) -> list[str]:
        """How ``optimizer`` differs structurally from the one this rule was built for."""
        if algorithm_of(optimizer) != self.algorithm:
            return [f"the optimizer is a {type(optimizer).__name__}, this rule is {self.algorithm}'s"]
        if self._ids(optimizer) != self._param_ids:
            return ["its param groups hold other parameters"]
        options, group_options = self._static(optimizer)
        changes = [f"{key}: {self._options[key]} -> {value}" for key, value in options.items()
                   if self._options[key] != value]
        for index, (old, new) in enumerate(zip(self._group_options, group_options)):
            changes += [f"param group {index} {key}: {old[key]} -> {value}"
                        for key, value in new.items() if old[key] != value]
        return changes

    def _require(self, arrays: Mapping, why: str) -> None:
        """An error naming the optimizer's parameters ``arrays`` lacks, then ``why``."""
        missing = [name for name in self.names if name not in arrays]
        if missing:
            raise Error(f"the optimizer's parameters {missing} {why}")

    def _require_same(self, optimizer) -> None:
        if self._ids(optimizer) != self._param_ids:
            raise Error(f"this {self.algorithm} rule was built for another optimizer's param groups")


_ALGORITHMS = [
    (torch.optim.SGD, "SGD"), (torch.optim.AdamW, "Adam"), (torch.optim.Adam, "Adam"),
    (torch.optim.RMSprop, "RMSprop"),
]
"""Optimizer classes and the algorithm of their update, most derived first (torch's AdamW, an
Adam, before Adam)."""


def register_algorithm(optimizer_class: type, algorithm: str) -> None:
    """Update ``optimizer_class`` with ``algorithm``, ahead of the classes registered before it
    (see ``algorithms.register_optimizer``)."""
    _ALGORITHMS.insert(0, (optimizer_class, algorithm))


def algorithm_of(optimizer: torch.optim.Optimizer) -> str:
    """The name of the update rule that runs ``optimizer``."""
    for base, algorithm in _ALGORITHMS:
        if isinstance(optimizer, base):
            if inspect.unwrap(type(optimizer).step) is not inspect.unwrap(base.step):
                raise Error(f"{type(optimizer).__qualname__} overrides step() of {base.__module__}."
                            f"{base.__qualname__}: a custom update cannot be compiled; use the "
                            "optimizer it derives from")
            return algorithm
    raise Error(f"optimizer {type(optimizer).__module__}.{type(optimizer).__qualname__} is not "
                "supported; use SGD, Adam, AdamW, RMSprop (torch.optim or poptorch.optim), Adagrad, "
                "Adadelta, Adamax, NAdam, RAdam (torch.optim) or poptorch.optim.LAMB")


def notice_subclass(optimizer: torch.optim.Optimizer) -> None:
    """Warn, as PopTorch does, when ``optimizer`` is a subclass of a supported optimizer: the
    compiled step runs its base's update rule, never the subclass's Python code."""
    cls = type(optimizer)
    base = next((base for base, _ in _ALGORITHMS if isinstance(optimizer, base)), None)
    if base is None or any(cls is known for known, _ in _ALGORITHMS):
        return
    logger.warning("Optimizer `%s` is a subclass of %s.%s: Poptorch does not run Python optimizer code "
                   "directly. The compiled training step applies the update rule of %s with the "
                   "optimizer's param_groups and attributes; Python methods the subclass adds or "
                   "overrides do not run there (an overridden step() is refused when compiling).",
                   cls.__name__, base.__module__, base.__qualname__, base.__qualname__)
