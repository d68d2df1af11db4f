"""poptorch.optim and the JAX update rules against torch.optim run eagerly (and, for PopTorch's own
options and LAMB, against references written here from PopTorch's documented formulas).

Each rule runs under ``jax.jit`` as the executor runs it; every compile costs about a second, so
cases combine options where they do not interact.
"""

import copy
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from ipu_backend import optim
from ipu_backend.errors import Error
from ipu_backend.runtime.algorithms import optimizer_rule

STEPS = 6
FP32 = {"rtol": 1e-5, "atol": 1e-6}


class Net(torch.nn.Module):
    """Parameters of a small model, a 0-d one included (no forward: see ``gradient``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(3, 2)
        self.scale = torch.nn.Parameter(torch.tensor(0.7))


def gradient(param: torch.Tensor, step: int) -> torch.Tensor:
    """A fixed function of the parameter and the step, standing in for backward."""
    return torch.sin(3 * param + step) + 0.5 * param


def clip_to_option(optimizer) -> float:
    """The optimizer's own max_grad_norm, which its eager step (torch's) does not apply."""
    return optimizer.param_groups[0].get("max_grad_norm", math.inf)


def torch_run(make_optimizer, steps=STEPS, before_step=None, model=None, start=0):
    """Eager steps of ``make_optimizer(model)`` (gradients clipped to the optimizer's
    max_grad_norm first, as the compiled step does); returns (model, optimizer)."""
    model = model or Net()
    optimizer = make_optimizer(model)
    torch_steps(model, optimizer, range(start, start + steps), before_step)
    return model, optimizer


def torch_steps(model, optimizer, steps, before_step=None):
    for step in steps:
        for param in model.parameters():
            param.grad = gradient(param.detach(), step)
        if before_step:
            before_step(optimizer, step)
        if math.isfinite(clip_to_option(optimizer)):
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_to_option(optimizer))
        optimizer.step()


class RuleRun:
    """The same model and optimizer, stepped by the JAX rule under ``jax.jit``."""

    def __init__(self, make_optimizer, dtype=None):
        self.model = Net()
        self.optimizer = make_optimizer(self.model)
        named = dict(self.model.named_parameters())
        self.rule = optimizer_rule(self.optimizer, {id(p): n for n, p in named.items()})
        self.params = {n: jnp.asarray(p.detach().numpy(), dtype) for n, p in named.items()}
        self.state = self.rule.init(self.params)
        self.traces = 0

        def update(*args):
            self.traces += 1
            return self.rule.update(*args)

        self.update = jax.jit(update)

    def run(self, steps=STEPS, start=0, before_step=None):
        for step in range(start, start + steps):
            if before_step:
                before_step(self.optimizer, step)
            grads = {n: jnp.asarray(gradient(as_float_tensor(p), step).numpy(), p.dtype)
                     for n, p in self.params.items()}
            hyper = self.rule.hyperparameters(self.optimizer)
            self.params, self.state = self.update(grads, self.state, self.params, hyper)
        return self


def reference_run(update, steps=STEPS):
    """Parameters after ``steps`` of ``update(param, grad, state, t)`` (t from 1), in float64."""
    params = {n: p.detach().double() for n, p in Net().named_parameters()}
    states = {n: {} for n in params}
    for step in range(steps):
        for name, param in params.items():
            params[name] = update(param, gradient(param, step), states[name], step + 1)
    return params


def as_float_tensor(value) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().float()
    return torch.from_numpy(np.array(value, np.float32))


def assert_params(actual: dict, expected: dict, **tolerance):
    for name, value in expected.items():
        torch.testing.assert_close(as_float_tensor(actual[name]), as_float_tensor(value),
                                   **(tolerance or FP32),
                                   msg=lambda message, name=name: f"{name}: {message}")


def model_params(model) -> dict:
    return dict(model.named_parameters())


# --- each optimizer and option against torch.optim ------------------------------------------

TORCH_CASES = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
    "sgd_momentum_dampening_wd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9,
                                                           dampening=0.3, weight_decay=0.05),
    "sgd_nesterov_maximize": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.8,
                                                       nesterov=True, weight_decay=0.01, maximize=True),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
    "adam_wd_amsgrad_maximize": lambda m: torch.optim.Adam(m.parameters(), lr=0.01, betas=(0.8, 0.95),
                                                           eps=1e-6, weight_decay=0.1, amsgrad=True,
                                                           maximize=True),
    "adam_decoupled": lambda m: torch.optim.Adam(m.parameters(), lr=0.01, weight_decay=0.1,
                                                 decoupled_weight_decay=True),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=0.01),
    "rmsprop": lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01),
    "rmsprop_momentum_wd_maximize": lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01, alpha=0.9,
                                                                  momentum=0.7, weight_decay=0.1,
                                                                  maximize=True),
    "rmsprop_centered": lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01, centered=True,
                                                      momentum=0.5),
    # torch's optimizers PopTorch has none of
    "adagrad": lambda m: torch.optim.Adagrad(m.parameters(), lr=0.1),
    "adagrad_decays_maximize": lambda m: torch.optim.Adagrad(m.parameters(), lr=0.1, lr_decay=0.05, weight_decay=0.1,
                                                             initial_accumulator_value=0.2, eps=1e-6, maximize=True),
    "adadelta": lambda m: torch.optim.Adadelta(m.parameters()),
    "adadelta_wd_maximize": lambda m: torch.optim.Adadelta(m.parameters(), lr=0.5, rho=0.8, eps=1e-4,
                                                           weight_decay=0.1, maximize=True),
    "adamax": lambda m: torch.optim.Adamax(m.parameters(), lr=0.01),
    "adamax_wd_maximize": lambda m: torch.optim.Adamax(m.parameters(), lr=0.02, betas=(0.8, 0.99), eps=1e-4,
                                                       weight_decay=0.1, maximize=True),
    "nadam": lambda m: torch.optim.NAdam(m.parameters(), lr=0.01),
    "nadam_decoupled_maximize": lambda m: torch.optim.NAdam(m.parameters(), lr=0.01, betas=(0.8, 0.99),
                                                            weight_decay=0.1, momentum_decay=0.01,
                                                            decoupled_weight_decay=True, maximize=True),
    "nadam_coupled": lambda m: torch.optim.NAdam(m.parameters(), lr=0.01, weight_decay=0.1),
    "radam": lambda m: torch.optim.RAdam(m.parameters(), lr=0.01),
    "radam_decoupled_maximize": lambda m: torch.optim.RAdam(m.parameters(), lr=0.01, betas=(0.8, 0.9),
                                                            weight_decay=0.1, decoupled_weight_decay=True,
                                                            maximize=True),
    "radam_coupled": lambda m: torch.optim.RAdam(m.parameters(), lr=0.01, betas=(0.9, 0.99), weight_decay=0.1),
    # PopTorch's classes, whose extra options leave torch's numbers unchanged
    "ipu_sgd_combined": lambda m: optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True,
                                            use_combined_accum=True, velocity_scaling=3.0,
                                            loss_scaling=64.0),
    "ipu_sgd_separate": lambda m: optim.SGD(m.parameters(), lr=0.1, momentum=0.9, dampening=0.1,
                                            loss_scaling=8.0),
    "ipu_adamw_amsgrad": lambda m: optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.2, amsgrad=True,
                                               loss_scaling=1024.0),
}


@pytest.mark.parametrize("case", TORCH_CASES)
def test_update_matches_torch(case):
    model, _ = torch_run(TORCH_CASES[case])
    assert_params(RuleRun(TORCH_CASES[case]).run().params, model_params(model))


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    lambda p: torch.optim.Adam(p, lr=0.01),
    lambda p: torch.optim.RMSprop(p, lr=0.01),
    lambda p: torch.optim.Adagrad(p, lr=0.1),
], ids=["sgd", "adam", "rmsprop", "adagrad"])
def test_an_infinite_weight_without_weight_decay_stays_infinite_as_in_torch(make):
    """torch leaves out the weight-decay term when the decay is 0: 0 * inf would be NaN."""
    weight = torch.nn.Parameter(torch.tensor([math.inf, 1.0]))
    optimizer = make([weight])
    rule = optimizer_rule(optimizer, {id(weight): "w"})
    params = {"w": jnp.asarray(weight.detach().numpy())}
    grads = {"w": jnp.asarray([0.5, 0.5], jnp.float32)}
    new, _ = jax.jit(rule.update)(grads, rule.init(params), params, rule.hyperparameters(optimizer))
    weight.grad = torch.tensor([0.5, 0.5])
    optimizer.step()
    torch.testing.assert_close(torch.from_numpy(np.asarray(new["w"])), weight.detach(), **FP32)
    assert math.isinf(weight[0])


@pytest.mark.parametrize("make", [
    lambda m: optim.SGD(m.parameters(), lr=0.1, momentum=0.9, max_grad_norm=0.5),
    lambda m: optim.Adam(m.parameters(), lr=0.01, max_grad_norm=0.5),
    lambda m: optim.AdamW(m.parameters(), lr=0.01, max_grad_norm=100.0),
], ids=["sgd", "adam", "adamw_not_reached"])
def test_max_grad_norm_is_torch_clip_grad_norm(make):
    model, _ = torch_run(make)
    assert_params(RuleRun(make).run().params, model_params(model))


# --- PopTorch-only options and LAMB, against PopTorch's formulas ------------------------------

def lamb_reference(lr, betas, eps, weight_decay, bias_correction=True, max_weight_norm=65500.0):
    beta1, beta2 = betas

    def update(param, grad, state, t):
        m = state["m"] = beta1 * state.get("m", 0.0) + (1 - beta1) * grad
        v = state["v"] = beta2 * state.get("v", 0.0) + (1 - beta2) * grad * grad
        bc1, bc2 = (1 - beta1**t, 1 - beta2**t) if bias_correction else (1.0, 1.0)
        u = (m / bc1) / (v.sqrt() / math.sqrt(bc2) + eps) + weight_decay * param
        r1 = min(float(param.norm()), max_weight_norm)
        r2 = float(u.norm())
        trust = r1 / r2 if r1 > 0 and r2 > 0 else 1.0
        return param - lr * trust * u

    return update


LAMB_CASES = {
    "default": {},
    "no_bias_correction": {"bias_correction": False, "weight_decay": 0.1},
    "max_weight_norm": {"max_weight_norm": 0.5, "betas": (0.8, 0.99)},
}


@pytest.mark.parametrize("case", LAMB_CASES)
def test_lamb_matches_poptorch_formula(case):
    """The compiled rule and the eager ``LAMB.step`` both follow PopTorch's formula."""
    options = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, **LAMB_CASES[case]}
    expected = reference_run(lamb_reference(**options))
    assert_params(RuleRun(lambda m: optim.LAMB(m.parameters(), **options)).run().params, expected)
    eager, _ = torch_run(lambda m: optim.LAMB(m.parameters(), **options))
    assert_params(model_params(eager), expected)


def test_adamw_without_bias_correction():
    lr, (beta1, beta2), eps, wd = 0.01, (0.9, 0.999), 1e-8, 0.05

    def update(param, grad, state, t):
        m = state["m"] = beta1 * state.get("m", 0.0) + (1 - beta1) * grad
        v = state["v"] = beta2 * state.get("v", 0.0) + (1 - beta2) * grad * grad
        return param - lr * (m / (v.sqrt() + eps) + wd * param)

    make = lambda m: optim.AdamW(m.parameters(), lr=lr, weight_decay=wd, bias_correction=False)  # noqa: E731
    expected = reference_run(update)
    assert_params(RuleRun(make).run().params, expected)
    eager, _ = torch_run(make)                              # its step() on the host too
    assert_params(model_params(eager), expected)


@pytest.mark.parametrize("momentum, centered", [(0.0, False), (0.6, True)])
def test_rmsprop_tf_variant(momentum, centered):
    """PopART's TensorFlow RMSprop: mean square from one, eps inside the square root, lr inside
    the momentum buffer."""
    lr, alpha, eps, wd = 0.01, 0.9, 1e-3, 0.05

    def update(param, grad, state, t):
        grad = grad + wd * param
        ms = state["ms"] = alpha * state.get("ms", 1.0) + (1 - alpha) * grad * grad
        if centered:
            mg = state["mg"] = alpha * state.get("mg", 0.0) + (1 - alpha) * grad
            ms = ms - mg * mg
        step = grad / (ms + eps).sqrt()
        if not momentum:
            return param - lr * step
        buf = state["buf"] = momentum * state.get("buf", 0.0) + lr * step
        return param - buf

    run = RuleRun(lambda m: optim.RMSprop(m.parameters(), lr=lr, alpha=alpha, eps=eps, weight_decay=wd,
                                          momentum=momentum, centered=centered, use_tf_variant=True))
    assert_params(run.run().params, reference_run(update))


def test_sgd_velocity_scaling_change_follows_poptorch():
    """The combined variant stores velocity × velocity_scaling: lowering the scaling mid-run
    over-estimates the velocity, as PopTorch warns (constant scaling gives torch's numbers)."""
    lr, momentum, wd = 0.1, 0.9, 0.01

    def scaling(t):
        return 4.0 if t <= 3 else 1.0

    def update(param, grad, state, t):
        scaled = scaling(t) * (grad + wd * param)
        v = state["v"] = scaled if t == 1 else momentum * state["v"] + scaled
        return param - lr / scaling(t) * v

    def set_scaling(optimizer, step):
        optimizer.param_groups[0]["velocity_scaling"] = scaling(step + 1)

    run = RuleRun(lambda m: optim.SGD(m.parameters(), lr=lr, momentum=momentum, weight_decay=wd,
                                      use_combined_accum=True, velocity_scaling=4.0))
    assert_params(run.run(before_step=set_scaling).params, reference_run(update))
    assert run.traces == 1
    torch_model, _ = torch_run(lambda m: torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum,
                                                         weight_decay=wd))
    assert not torch.allclose(as_float_tensor(run.params["fc.weight"]), torch_model.fc.weight.detach())


def test_loss_scaling_is_for_the_executor():
    """update takes unscaled gradients: scaling the loss and dividing the gradients by
    loss_scale(hyper) (the executor's part) gives torch's numbers."""
    run = RuleRun(lambda m: optim.SGD(m.parameters(), lr=0.1, momentum=0.9, loss_scaling=512.0))
    hyper = run.rule.hyperparameters(run.optimizer)
    scale = run.rule.loss_scale(hyper)
    assert float(scale) == 512.0

    def scaled_loss(params):
        return scale * sum(jnp.sum(jnp.cos(x)) for x in params.values())

    scaled_grads = jax.jit(jax.grad(scaled_loss))(run.params)
    grads = jax.tree.map(lambda g: g / scale, scaled_grads)
    params, _ = run.update(grads, run.state, run.params, hyper)
    model = Net()
    torch_optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sum(p.cos().sum() for p in model.parameters()).backward()
    torch_optimizer.step()
    assert_params(params, model_params(model))


# --- param groups and hyper-parameters as inputs -------------------------------------------

GROUP_CASES = {
    "sgd": lambda m: torch.optim.SGD([
        {"params": [m.fc.weight], "lr": 0.05, "momentum": 0.5, "weight_decay": 0.1},
        {"params": [m.scale], "nesterov": True, "momentum": 0.9}], lr=0.1),
    "adam": lambda m: torch.optim.Adam([
        {"params": [m.fc.weight], "betas": (0.5, 0.9), "weight_decay": 0.1, "amsgrad": True},
        {"params": [m.scale], "lr": 0.03}], lr=0.01),
    "ipu_rmsprop": lambda m: optim.RMSprop([
        {"params": [m.fc.weight], "centered": True, "alpha": 0.8},
        {"params": [m.scale], "momentum": 0.9, "lr": 0.02}], lr=0.01),
    "ipu_lamb": lambda m: optim.LAMB([
        {"params": [m.fc.weight], "max_weight_norm": 0.3, "lr": 0.05},
        {"params": [m.scale], "weight_decay": 0.0}]),
}


@pytest.mark.parametrize("case", GROUP_CASES)
def test_param_groups(case):
    """Each group's own hyper-parameters; a parameter in no group (fc.bias) stays unchanged."""
    model, _ = torch_run(GROUP_CASES[case])
    run = RuleRun(GROUP_CASES[case]).run()
    assert run.rule.groups == (("fc.weight",), ("scale",))
    assert_params(run.params, model_params(model))
    np.testing.assert_array_equal(np.asarray(run.params["fc.bias"]), Net().fc.bias.detach().numpy())


def change_hyperparameters(optimizer, step):
    if step == 2:
        group = optimizer.param_groups[0]
        group["lr"] *= 0.3
        group["weight_decay"] = 0.2
        for key, value in {"momentum": 0.4, "betas": (0.7, 0.99), "eps": 1e-4}.items():
            if key in group:
                group[key] = value
        if "max_grad_norm" in group:
            optimizer.max_grad_norm = 0.3
            optimizer.loss_scaling = 16.0


@pytest.mark.parametrize("make", [
    lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    lambda m: optim.AdamW(m.parameters(), lr=0.01, max_grad_norm=1.0, loss_scaling=4.0),
], ids=["sgd", "ipu_adamw_clipped"])
def test_changing_hyperparameters_never_recompiles(make):
    model, _ = torch_run(make, before_step=change_hyperparameters)
    run = RuleRun(make).run(before_step=change_hyperparameters)
    assert run.traces == 1
    assert_params(run.params, model_params(model))
    if isinstance(run.optimizer, optim.AdamW):
        assert float(run.rule.loss_scale(run.rule.hyperparameters(run.optimizer))) == 16.0


def test_matches_tells_when_a_new_rule_is_needed():
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rule = optimizer_rule(optimizer, {id(p): n for n, p in model.named_parameters()})
    assert rule.matches(torch.optim.SGD(model.parameters(), lr=0.5, weight_decay=0.1))
    assert not rule.matches(torch.optim.SGD([model.fc.weight], lr=0.1))
    assert not rule.matches(torch.optim.Adam(model.parameters()))
    optimizer.param_groups[0]["momentum"] = 0.9
    assert not rule.matches(optimizer)
    with pytest.raises(Error, match="param group 0 momentum: False -> True"):
        rule.hyperparameters(optimizer)


# --- state round trip ----------------------------------------------------------------------

ROUND_TRIP_CASES = {
    "sgd_nesterov": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True),
    "adam_amsgrad": lambda m: torch.optim.Adam(m.parameters(), lr=0.01, amsgrad=True),
    "rmsprop_centered": lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01, momentum=0.5,
                                                      centered=True),
    "ipu_sgd_combined": lambda m: optim.SGD(m.parameters(), lr=0.1, momentum=0.9,
                                            use_combined_accum=True, velocity_scaling=8.0),
    "ipu_lamb": lambda m: optim.LAMB(m.parameters(), lr=0.01, max_weight_norm=0.5),
}


@pytest.mark.parametrize("case", ROUND_TRIP_CASES)
def test_state_round_trip(case):
    """To torch: after 3 compiled steps ``state_dict()`` is torch's after 3 eager steps, and
    torch's ``step()`` continues from it. From torch: after ``load_state_dict`` of torch's
    state, the compiled steps continue it."""
    make = ROUND_TRIP_CASES[case]
    half_model, half_optimizer = torch_run(make, steps=3)
    full_model, _ = torch_run(make)

    run = RuleRun(make).run(steps=3)
    run.rule.state_to_torch(jax.device_get(run.state), run.optimizer)
    ours, theirs = run.optimizer.state_dict(), half_optimizer.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys()
    for index, slots in theirs["state"].items():
        assert list(ours["state"][index]) == list(slots)
        for slot, value in slots.items():
            assert ours["state"][index][slot].dtype == value.dtype
            torch.testing.assert_close(ours["state"][index][slot], value, **FP32)
    with torch.no_grad():
        for name, param in run.model.named_parameters():
            param.copy_(as_float_tensor(run.params[name]))
    torch_steps(run.model, run.optimizer, range(3, STEPS))
    assert_params(model_params(run.model), model_params(full_model))

    run.optimizer.load_state_dict(half_optimizer.state_dict())
    run.params = {n: jnp.asarray(p.detach().numpy()) for n, p in half_model.named_parameters()}
    run.state = run.rule.state_from_torch(run.optimizer, run.params)
    assert_params(run.run(steps=3, start=3).params, model_params(full_model))
    assert run.traces == 1


def test_plain_sgd_keeps_no_state_as_torch():
    """SGD without momentum holds nothing between steps (torch's ``state`` stays empty), so a
    compiled call carries no per-parameter arrays for it; with momentum each parameter keeps its
    step count and buffer."""
    plain = RuleRun(lambda m: torch.optim.SGD(m.parameters(), lr=0.1)).run(steps=2)
    assert jax.tree.leaves(plain.state) == []
    plain.rule.state_to_torch(plain.state, plain.optimizer)
    assert plain.optimizer.state_dict()["state"] == {}
    momentum = RuleRun(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)).run(steps=2)
    assert all(set(slots) == {"step", "momentum_buffer"} and int(slots["step"]) == 2
               for slots in momentum.state.values())


def test_fresh_state_writes_no_torch_state():
    run = RuleRun(lambda m: torch.optim.Adam(m.parameters()))
    run.rule.state_to_torch(run.state, run.optimizer)
    assert run.optimizer.state_dict()["state"] == {}


# --- accumulation dtypes --------------------------------------------------------------------

def test_half_accumulators_keep_their_dtype():
    run = RuleRun(lambda m: optim.Adam(m.parameters(), lr=0.01, accum_type=torch.float16,
                                       first_order_momentum_accum_type=torch.float16,
                                       second_order_momentum_accum_type=torch.float16)).run()
    assert run.rule.accum_dtype == jnp.float16
    for slots in run.state.values():
        assert slots["exp_avg"].dtype == jnp.float16 and slots["exp_avg_sq"].dtype == jnp.float16
    model, _ = torch_run(lambda m: torch.optim.Adam(m.parameters(), lr=0.01))
    # float16 moments carry ~1e-3 relative error into each step of size ~lr = 1e-2
    assert_params(run.params, model_params(model), rtol=0.0, atol=1e-4)
    run.rule.state_to_torch(run.state, run.optimizer)
    assert run.optimizer.state_dict()["state"][0]["exp_avg"].dtype == torch.float16


def test_half_params_keep_float32_state_by_default():
    make = lambda m: optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    run = RuleRun(make, dtype=jnp.float16).run()
    assert all(p.dtype == jnp.float16 for p in run.params.values())
    assert all(s["momentum_buffer"].dtype == jnp.float32 for s in run.state.values())
    model, _ = torch_run(make)
    # float16 parameters: each step is computed in float32 and rounded to float16 (2^-11)
    assert_params(run.params, model_params(model), rtol=2e-3, atol=2e-3)
    half = RuleRun(lambda m: optim.SGD(m.parameters(), lr=0.1, momentum=0.9,
                                       velocity_accum_type=torch.float16))
    assert all(s["momentum_buffer"].dtype == jnp.float16 for s in half.state.values())


# --- the user-facing classes ---------------------------------------------------------------

def test_poptorch_defaults_and_options_survive_state_dict():
    params = list(Net().parameters())
    assert optim.AdamW(params).param_groups[0]["weight_decay"] == 0.01
    lamb = optim.LAMB(params)
    assert (lamb.defaults["lr"], lamb.defaults["weight_decay"], lamb.defaults["max_weight_norm"]) == \
        (1e-3, 1e-2, 65500.0)
    assert lamb.bias_correction and lamb.loss_scaling == 1.0
    assert optim.LAMB(params, max_weight_norm=None).param_groups[0]["max_weight_norm"] == 65500.0
    sgd = optim.SGD(params, lr=0.1)
    assert (sgd.loss_scaling, sgd.use_combined_accum, sgd.max_grad_norm) == (1.0, False, math.inf)
    assert sgd.accum_type == sgd.velocity_accum_type == torch.float32

    saved = optim.RMSprop(params, loss_scaling=4.0, use_tf_variant=True,
                          second_order_momentum_accum_type=torch.float16)
    saved.loss_scaling = 32.0
    restored = optim.RMSprop(params)
    restored.load_state_dict(copy.deepcopy(saved.state_dict()))
    assert restored.loss_scaling == 32.0 and restored.use_tf_variant
    assert restored.param_groups[0]["second_order_momentum_accum_type"] == torch.float16


@pytest.mark.parametrize("cls", [optim.SGD, optim.Adam, optim.AdamW, optim.RMSprop, optim.LAMB])
def test_none_means_the_default_for_every_argument_as_in_poptorch(cls):
    params = list(Net().parameters())
    names = [name for name in inspect.signature(cls.__init__).parameters if name not in ("self", "params")]
    with_none = cls(params, lr=0.1, **{name: None for name in names if name != "lr"})
    omitted = cls(params, lr=0.1)
    assert with_none.defaults == omitted.defaults and "accum_type" in omitted.defaults
    assert with_none.state_dict()["param_groups"] == omitted.state_dict()["param_groups"]


def test_velocity_scaling_ignored_by_separate_variant_warns():
    with pytest.warns(UserWarning, match="velocity_scaling is ignored"):
        optim.SGD(Net().parameters(), lr=0.1, velocity_scaling=2.0)


@pytest.mark.parametrize("make, message", [
    (lambda p: optim.SGD(p, loss_scaling=0.0), "loss_scaling must be a finite number > 0"),
    (lambda p: optim.Adam(p, accum_type=torch.bfloat16),
     "accum_type must be torch.float32 or torch.float16"),
    (lambda p: optim.AdamW(p, max_grad_norm=float("nan")), "max_grad_norm must be > 0"),
    (lambda p: optim.LAMB(p, bias_correction=1), "bias_correction must be True or False"),
    (lambda p: optim.LAMB(p, betas=(0.9, 1.0)), "Invalid betas"),
    (lambda p: optim.SGD([{"params": p[:1], "loss_scaling": 2.0}, {"params": p[1:]}], lr=0.1),
     "loss_scaling is optimizer-wide"),
])
def test_invalid_options(make, message):
    with pytest.raises(ValueError, match=message):
        make(list(Net().parameters()))


def test_unsupported_optimizers_and_parameters():
    model = Net()
    names = {id(p): n for n, p in model.named_parameters()}
    with pytest.raises(Error, match="torch.optim.asgd.ASGD is not supported; use SGD, .*Adagrad, .*RAdam"):
        optimizer_rule(torch.optim.ASGD(model.parameters()), names)

    class Custom(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    with pytest.raises(Error, match="Custom overrides step"):
        optimizer_rule(Custom(model.parameters(), lr=0.1), names)
    with pytest.raises(Error, match="not a parameter of the model"):
        optimizer_rule(torch.optim.SGD([torch.nn.Parameter(torch.zeros(5))], lr=0.1), names)
    split = optim.SGD(model.parameters(), lr=0.1)
    extra = torch.nn.Parameter(torch.zeros(1))
    split.add_param_group({"params": [extra], "loss_scaling": 2.0})
    with pytest.raises(Error, match="loss_scaling must be the same in every param group"):
        optimizer_rule(split, names | {id(extra): "extra"})


@pytest.mark.parametrize("base", [torch.optim.SGD, torch.optim.Adam, optim.AdamW, optim.RMSprop, optim.LAMB])
def test_a_subclassed_optimizer_is_noticed_on_stderr(capfd, base):
    """PopTorch logs that it does not run a subclass's Python code (on the console, whatever
    handlers the root logger has: pytest's log capture is one); the plain classes are not noticed."""
    import ipu_backend as poptorch

    class Subclassed(base):
        pass

    model = torch.nn.Linear(3, 2)
    poptorch.trainingModel(model, optimizer=base(model.parameters(), lr=0.01))
    assert "Python optimizer code" not in capfd.readouterr().err
    executor = poptorch.trainingModel(model, optimizer=Subclassed(model.parameters(), lr=0.01))
    err = capfd.readouterr().err
    assert "Optimizer `Subclassed` is a subclass of" in err and \
        "Poptorch does not run Python optimizer code directly" in err, err
    executor.setOptimizer(Subclassed(model.parameters(), lr=0.02))
    assert "Poptorch does not run Python optimizer code directly" in capfd.readouterr().err


def test_variable_attrs_mark_the_given_arguments_as_poptorch():
    params = [torch.nn.Parameter(torch.ones(2))]
    sgd = optim.SGD(params, lr=0.1, momentum=0.9)
    assert not sgd.variable_attrs.isConstant("lr") and not sgd.variable_attrs.isConstant("momentum")
    assert sgd.variable_attrs.isConstant("loss_scaling") and sgd.variable_attrs.isConstant("dampening")
    sgd.variable_attrs.markAsVariable("loss_scaling")
    sgd.variable_attrs.markAsConstant("momentum")
    copied = copy.deepcopy(sgd)
    assert not copied.variable_attrs.isConstant("loss_scaling") and copied.variable_attrs.isConstant("momentum")
    with pytest.raises(AssertionError, match="Unknown attribute foo, allowed values"):
        sgd.variable_attrs.markAsConstant("foo")

    class LambNoBias(optim.LAMB):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, bias_correction=False, **kwargs)

    lamb = LambNoBias(params, lr=0.1)
    assert not lamb.variable_attrs.isConstant("bias_correction")
    assert lamb.variable_attrs.isConstant("eps")


def test_half_accumulators_choose_the_running_mean_strategy_as_poptorch():
    import ipu_backend as poptorch

    class Summed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def forward(self, x):
            return self.layer(x).sum()

    Strategy = poptorch.MeanReductionStrategy
    model = Summed()
    x = torch.ones(2, 2)
    opts = poptorch.Options()
    executor = poptorch.trainingModel(model, opts, optim.Adam(model.parameters(), accum_type=torch.half))
    assert executor.options.Training.meanAccumulationAndReplicationReductionStrategy == Strategy.Running
    assert opts.Training.meanAccumulationAndReplicationReductionStrategy == Strategy.Post    # the user's copy
    combined = poptorch.trainingModel(torch.nn.Linear(2, 1), optimizer=optim.SGD(
        model.parameters(), lr=0.1, accum_type=torch.half, use_combined_accum=True))
    assert combined.options.Training.mean_reduction_strategy == Strategy.Post
    plain = poptorch.trainingModel(model, optimizer=optim.Adam(model.parameters()))
    plain.compile(x)
    with pytest.raises(ValueError, match="the new optimizer would require changing options.Training."
                                         "meanAccumulationAndReplicationReductionStrategy"):
        plain.setOptimizer(optim.Adam(model.parameters(), accum_type=torch.half))


def test_a_warning_reaches_the_console_once_when_the_root_logger_writes_there(capfd):
    import logging
    import sys

    root = logging.getLogger()
    console = logging.StreamHandler(sys.stderr)
    root.addHandler(console)
    try:
        logging.getLogger("ipu_backend").warning("one notice")
    finally:
        root.removeHandler(console)
    assert capfd.readouterr().err.count("one notice") == 1
