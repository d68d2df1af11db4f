"""The device-iteration loop's outputs per OutputMode, against the same reductions done by numpy
on every iteration's outputs: Final and Sum keep only the last outputs (or their running sum) in
the loop, the metric totals are running sums, maxima and minima."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ipu_backend.compiler.metric_states import TOTAL_SUFFIX
from ipu_backend.runtime import step as step_module
from ipu_backend.runtime.step import Schedule, device_loop

D, A, R = 6, 2, 1
TOTALS = {"hits": "sum", "worst": "max", "best": "min"}


def iteration(count, x):
    """A step whose outputs differ per iteration and micro-batch: ``[A, r, ...]`` arrays of three
    dtypes, and logs that the call totals."""
    scaled = x * (count + 1)
    arrays = [scaled, scaled.astype(jnp.float16), jnp.round(scaled).astype(jnp.int32)]
    logs = {"loss": scaled.sum(-1), "hits": (scaled > 0).sum(-1), "worst": scaled.max(-1),
            "best": jnp.round(scaled.min(-1)).astype(jnp.int32)}
    return count + 1, (arrays, logs)


def stacked(xs):
    """Every iteration's outputs ``[D, A, r, ...]``, computed step by step in numpy."""
    steps = [jax.tree.map(np.asarray, iteration(jnp.float32(d), jnp.asarray(xs[d]))[1]) for d in range(D)]
    return jax.tree.map(lambda *ys: np.stack(ys), *steps)


def expected(xs, mode):
    arrays, logs = stacked(xs)
    select = {"all": lambda y: y, "final": lambda y: y[-1:, -1:], "every_n": lambda y: y[2::3],
              "sum": lambda y: y.sum(axis=(0, 1), keepdims=True, dtype=np.float32 if y.dtype.kind == "f"
                                     else None).astype(jnp.sum(y).dtype)}[mode]
    totals = {n + TOTAL_SUFFIX: getattr(np, how)(logs[n], axis=(0, 1), keepdims=True)
              .astype(getattr(jnp, how)(logs[n]).dtype) for n, how in TOTALS.items()}
    arrays, logs = jax.tree.map(select, (arrays, logs))
    return jax.tree.map(lambda y: np.moveaxis(y, 2, 0), (arrays, {**logs, **totals}))


@pytest.mark.parametrize("mode", ["all", "final", "sum", "every_n", "final_unpeeled"])
def test_outputs_and_metric_totals_follow_the_output_mode(mode, monkeypatch):
    if mode == "final_unpeeled":       # a step too big to peel the last iteration off the loop
        monkeypatch.setattr(step_module, "PEEL_MAX_EQUATIONS", 0)
        mode = "final"
    schedule = Schedule(device_iterations=D, accumulation=A, replicas=R, output_mode=mode, output_period=3)
    xs = np.random.default_rng(0).normal(size=(D, A, R, 3)).astype(np.float32)
    count, outputs = jax.jit(lambda xs: device_loop(iteration, jnp.float32(0), xs, schedule, TOTALS))(xs)
    assert count == D
    want = expected(xs, mode)
    assert jax.tree.structure(outputs) == jax.tree.structure(want)
    for got, value in zip(jax.tree.leaves(outputs), jax.tree.leaves(want)):
        assert got.dtype == value.dtype and got.shape == value.shape
        np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(value, np.float64),
                                   rtol=1e-3 if got.dtype == jnp.float16 else 1e-6)


@pytest.mark.parametrize("peeled", [True, False])
def test_final_mode_of_a_small_step_computes_outputs_of_the_last_iteration_only(peeled, monkeypatch):
    """Final mode runs the first D - 1 iterations of a small step in a loop that reads none of
    their outputs, so what computes only outputs (here a host callback that counts its calls)
    runs once a call; a step above ``PEEL_MAX_EQUATIONS`` computes them in every iteration. The
    outputs returned are the last iteration's either way."""
    if not peeled:
        monkeypatch.setattr(step_module, "PEEL_MAX_EQUATIONS", 0)
    calls = []

    def counted(x):
        calls.append(x.copy())
        return x

    def step(count, x):
        scaled = x * (count + 1)
        out = jax.pure_callback(counted, jax.ShapeDtypeStruct(scaled.shape, scaled.dtype), scaled)
        return count + 1, ([out], {})

    schedule = Schedule(device_iterations=D, accumulation=A, replicas=R, output_mode="final")
    xs = np.random.default_rng(1).normal(size=(D, A, R, 3)).astype(np.float32)
    count, (arrays, logs) = jax.jit(lambda xs: device_loop(step, jnp.float32(0), xs, schedule, {}))(xs)
    assert count == D and logs == {}
    assert len(calls) == (1 if peeled else D)
    np.testing.assert_allclose(np.asarray(arrays[0]), np.moveaxis(xs[-1:, -1:] * D, 2, 0), rtol=1e-6)


def test_equation_count_includes_the_jaxprs_inside_equations():
    def inner(c, x):
        return c + jnp.sin(x) * 2, None

    def nested(xs):
        return jax.lax.scan(inner, 0.0, xs)[0] + 1

    jaxpr = jax.make_jaxpr(nested)(np.zeros(3, np.float32)).jaxpr
    body = jaxpr.eqns[0].params["jaxpr"].jaxpr            # the scan's
    assert len(jaxpr.eqns) == 2 and len(body.eqns) >= 3
    assert step_module._equation_count(jaxpr) == len(jaxpr.eqns) + len(body.eqns)
