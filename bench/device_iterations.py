"""Device iterations: the executor against torch eager and hand-written JAX, in one run.

1. A host-bound MLP (64→128→10, batch 32, SGD lr 0.01), deviceIterations=100: the executor fed by
   poptorch.DataLoader, vs a torch eager loop over the same tensors, vs a hand-written JAX
   `lax.scan` over the same batches (host→device copies included for both JAX paths).
2. The seed CNN (batch 40, AdamW), deviceIterations=10, vs torch eager, and vs the same LeNet
   hand-written in JAX as a `lax.scan` with im2col convolutions for both layers (channels-last,
   AdamW from optax); the executor uses im2col for the second layer only (its first reads a
   single channel, which XLA's convolution handles well inside a loop).
3. The same with deviceIterations=1 (PopTorch's default: one optimizer step per host call).
Targets: MLP ≥ 10× torch eager and ≥ 0.5× hand-written JAX; seed CNN ≥ 1.2× torch eager (with
deviceIterations=10).
Each path's epochs are timed in alternation, ROUNDS times (the order rotating each round, each
timed epoch right after an untimed one of the same path), and the fastest of each kept; the
median over rounds of the same-round ratio is reported too, with the share of CPU time stolen
by the hypervisor during the run (bench/cpu_steal.py).
Writes bench/results/device_iterations.json. Run by hand: `make bench`.
"""

import json
import os
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
from seed_cnn import SeedCNNWithLoss  # noqa: E402

from cpu_steal import StealMeter  # noqa: E402

import ipu_backend as poptorch  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results" / "device_iterations.json"
ROUNDS = 5


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(64, 128)
        self.out = nn.Linear(128, 10)

    def forward(self, x, y):
        logits = self.out(torch.relu(self.hidden(x)))
        return logits, F.cross_entropy(logits, y)


def timed_rounds(epochs: dict) -> dict:
    """Seconds of each epoch function per round: after a warm-up (compilation), ROUNDS rounds,
    the functions taking turns in an order that rotates each round. Each timed epoch follows an
    untimed epoch of the same function, so that no path pays for the state another left behind:
    torch's OpenMP workers spin for milliseconds after its loop ends, competing for the cores
    with whatever runs next (figures in docs/performance.md, "Device iterations")."""
    for epoch in epochs.values():
        epoch()
    times = {name: [] for name in epochs}
    order = list(epochs)
    for _ in range(ROUNDS):
        for name in order:
            epochs[name]()
            start = time.perf_counter()
            epochs[name]()
            times[name].append(time.perf_counter() - start)
        order = order[1:] + order[:1]
    return times


def rates_and_ratios(times: dict, samples: int, of: str, to: list) -> tuple[dict, dict]:
    """Samples per second of each path's fastest epoch; and ``of`` against each path in ``to``:
    the ratio of fastest epochs, and the median over rounds of the same-round ratio."""
    rates = {name: samples / min(seconds) for name, seconds in times.items()}
    ratios = {}
    for other in to:
        ratios[f"{of}_vs_{other}"] = rates[of] / rates[other]
        ratios[f"{of}_vs_{other}_median_of_rounds"] = statistics.median(
            theirs / ours for ours, theirs in zip(times[of], times[other]))
    return rates, ratios


def torch_eager(model, optimizer, x, y, batch):
    def epoch():
        for i in range(0, len(y) - batch + 1, batch):
            optimizer.zero_grad()
            _, loss = model(x[i:i + batch], y[i:i + batch])
            loss.backward()
            optimizer.step()
    return epoch


def executor(model, optimizer, dataset, batch, iterations):
    opts = poptorch.Options().deviceIterations(iterations)
    loader = poptorch.DataLoader(opts, dataset, batch_size=batch, shuffle=False)
    training = poptorch.trainingModel(model, opts, optimizer)

    def epoch():
        for xb, yb in loader:
            training(xb, yb)
        training.copyWeightsToHost()
    return epoch


def mlp_handwritten(x, y, batch, iterations, lr=0.01):
    """The same MLP in JAX: one jitted lax.scan per chunk of `iterations` SGD steps."""
    keys = jax.random.split(jax.random.key(0), 2)
    params = {"w1": jax.random.normal(keys[0], (64, 128)) * 0.1, "b1": jnp.zeros(128),
              "w2": jax.random.normal(keys[1], (128, 10)) * 0.1, "b2": jnp.zeros(10)}

    def loss(p, xb, yb):
        logits = jax.nn.relu(xb @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), yb[:, None], 1).mean()

    @jax.jit
    def chunk(p, xs, ys):
        def step(p, xy):
            value, grads = jax.value_and_grad(loss)(p, *xy)
            return jax.tree.map(lambda w, g: w - lr * g, p, grads), value
        return jax.lax.scan(step, p, (xs, ys))

    xn, yn = x.numpy(), y.numpy().astype("int32")
    per_call = batch * iterations
    state = {"p": params}

    def epoch():
        for i in range(0, len(yn) - per_call + 1, per_call):
            xs = xn[i:i + per_call].reshape(iterations, batch, 64)
            ys = yn[i:i + per_call].reshape(iterations, batch)
            state["p"], _ = chunk(state["p"], xs, ys)
        jax.block_until_ready(state["p"])
    return epoch


def mlp_benchmark():
    torch.manual_seed(0)
    n, batch, iterations = 32 * 100 * 20, 32, 100
    x, y = torch.randn(n, 64), torch.randint(0, 10, (n,))
    dataset = torch.utils.data.TensorDataset(x, y)
    eager_model, ipu_model = MLP(), MLP()
    times = timed_rounds({
        "executor": executor(ipu_model, torch.optim.SGD(ipu_model.parameters(), lr=0.01),
                             dataset, batch, iterations),
        "handwritten_jax": mlp_handwritten(x, y, batch, iterations),
        "torch_eager": torch_eager(eager_model, torch.optim.SGD(eager_model.parameters(), lr=0.01),
                                   x, y, batch),
    })
    rates, ratios = rates_and_ratios(times, n, "executor", ["torch_eager", "handwritten_jax"])
    return {"steps_per_s": {k: v / batch for k, v in rates.items()}, **ratios}


def _im2col_conv(x, w, b):
    """Valid k×k convolution of NHWC ``x`` with HWIO ``w``: one static slice per kernel offset,
    concatenated on the channels, and one matrix product."""
    k = w.shape[0]
    out_h, out_w = x.shape[1] - k + 1, x.shape[2] - k + 1
    columns = jnp.concatenate([x[:, i:i + out_h, j:j + out_w, :] for i in range(k) for j in range(k)],
                              axis=-1)
    return columns @ w.reshape(-1, w.shape[-1]) + b


def _max_pool2(x):
    n, h, w, c = x.shape
    return x.reshape(n, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


def cnn_handwritten(x, y, batch, iterations):
    """The seed CNN in JAX, channels-last with im2col convolutions, trained by optax's AdamW
    (torch's defaults) in one jitted lax.scan per chunk of `iterations` steps."""
    keys = jax.random.split(jax.random.key(0), 4)
    params = {"c1": jax.random.normal(keys[0], (5, 5, 1, 10)) * 0.2, "c1b": jnp.zeros(10),
              "c2": jax.random.normal(keys[1], (5, 5, 10, 20)) * 0.06, "c2b": jnp.zeros(20),
              "f1": jax.random.normal(keys[2], (320, 256)) * 0.05, "f1b": jnp.zeros(256),
              "f2": jax.random.normal(keys[3], (256, 10)) * 0.06, "f2b": jnp.zeros(10)}
    optimizer = optax.adamw(1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)

    def loss(p, xb, yb):
        h = jax.nn.relu(_max_pool2(_im2col_conv(jnp.moveaxis(xb, 1, -1), p["c1"], p["c1b"])))
        h = jax.nn.relu(_max_pool2(_im2col_conv(h, p["c2"], p["c2b"])))
        h = jax.nn.relu(h.reshape(h.shape[0], -1) @ p["f1"] + p["f1b"])
        logits = h @ p["f2"] + p["f2b"]
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), yb[:, None], 1).mean()

    @jax.jit
    def chunk(p, opt_state, xs, ys):
        def step(carry, xy):
            p, opt_state = carry
            value, grads = jax.value_and_grad(loss)(p, *xy)
            updates, opt_state = optimizer.update(grads, opt_state, p)
            return (optax.apply_updates(p, updates), opt_state), value
        return jax.lax.scan(step, (p, opt_state), (xs, ys))

    xn, yn = x.numpy(), y.numpy().astype("int32")
    per_call = batch * iterations
    state = {"p": params, "opt": optimizer.init(params)}

    def epoch():
        for i in range(0, len(yn) - per_call + 1, per_call):
            xs = xn[i:i + per_call].reshape(iterations, batch, *xn.shape[1:])
            ys = yn[i:i + per_call].reshape(iterations, batch)
            (state["p"], state["opt"]), _ = chunk(state["p"], state["opt"], xs, ys)
        jax.block_until_ready(state["p"])
    return epoch


def cnn_benchmark(iterations: int = 10):
    torch.manual_seed(0)
    n, batch = 40 * 10 * 6, 40
    x, y = torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,))
    dataset = torch.utils.data.TensorDataset(x, y)
    eager_model, ipu_model = SeedCNNWithLoss(), SeedCNNWithLoss()
    times = timed_rounds({
        "executor": executor(ipu_model, torch.optim.AdamW(ipu_model.parameters(), lr=1e-3),
                             dataset, batch, iterations),
        "handwritten_jax_im2col": cnn_handwritten(x, y, batch, iterations),
        "torch_eager": torch_eager(eager_model, torch.optim.AdamW(eager_model.parameters(), lr=1e-3),
                                   x, y, batch),
    })
    rates, ratios = rates_and_ratios(times, n, "executor", ["torch_eager", "handwritten_jax_im2col"])
    return {"images_per_s": rates, **ratios}


def _report(name: str, result: dict, unit: str, others: list) -> str:
    rates = result[unit]
    parts = [f"{name} {unit}: " + str({k: round(v) for k, v in rates.items()})]
    for other in others:
        parts.append(f"vs {other} {result['executor_vs_' + other]:.2f}x "
                     f"(median of rounds {result['executor_vs_' + other + '_median_of_rounds']:.2f}x)")
    return " | ".join(parts)


def main():
    with StealMeter() as mlp_steal:
        results = {"mlp": mlp_benchmark()}
    results["mlp"]["cpu_steal_share"] = mlp_steal.share
    print(_report("MLP", results["mlp"], "steps_per_s", ["torch_eager", "handwritten_jax"]))
    with StealMeter() as cnn_steal:
        results["seed_cnn"] = cnn_benchmark()
    results["seed_cnn"]["cpu_steal_share"] = cnn_steal.share
    print(_report("CNN", results["seed_cnn"], "images_per_s", ["torch_eager", "handwritten_jax_im2col"]))
    results["seed_cnn_one_iteration"] = cnn_benchmark(iterations=1)
    print(_report("CNN, deviceIterations=1", results["seed_cnn_one_iteration"], "images_per_s",
                  ["torch_eager", "handwritten_jax_im2col"]))
    print(f"CPU time stolen by the hypervisor: MLP {mlp_steal.share:.1%}, CNN {cnn_steal.share:.1%}"
          if mlp_steal.share is not None else "CPU steal time: not reported by this system")
    results["environment"] = {"jax": jax.__version__, "torch": torch.__version__,
                              "torch_threads": torch.get_num_threads(), "rounds": ROUNDS,
                              "load_average_1min": os.getloadavg()[0]}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
