"""Device iterations: the executor against torch eager and hand-written JAX, in one run.

1. A host-bound MLP (64→128→10, batch 32, SGD lr 0.01), deviceIterations=100: the executor fed by
   poptorch.DataLoader, vs a torch eager loop over the same tensors, vs a hand-written JAX
   `lax.scan` over the same batches (host→device copies included for both JAX paths).
2. The seed CNN (batch 40, AdamW), deviceIterations=10, vs torch eager.
Targets: MLP ≥ 10× torch eager and ≥ 0.5× hand-written JAX; seed CNN ≥ 1.2× torch eager.
Writes bench/results/device_iterations.json. Run by hand: `make bench`.
"""

import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
from seed_cnn import SeedCNNWithLoss  # noqa: E402

import ipu_backend as poptorch  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results" / "device_iterations.json"
EPOCHS = 3


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(64, 128)
        self.out = nn.Linear(128, 10)

    def forward(self, x, y):
        logits = self.out(torch.relu(self.hidden(x)))
        return logits, F.cross_entropy(logits, y)


def timed(fn, samples):
    fn()  # warm-up (compilation)
    start = time.perf_counter()
    for _ in range(EPOCHS):
        fn()
    return EPOCHS * samples / (time.perf_counter() - start)


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
    rates = {
        "executor": timed(executor(ipu_model, torch.optim.SGD(ipu_model.parameters(), lr=0.01),
                                   dataset, batch, iterations), n),
        "handwritten_jax": timed(mlp_handwritten(x, y, batch, iterations), n),
        "torch_eager": timed(torch_eager(eager_model, torch.optim.SGD(eager_model.parameters(), lr=0.01),
                                         x, y, batch), n),
    }
    steps = {k: v / batch for k, v in rates.items()}
    return {"steps_per_s": steps,
            "executor_vs_torch_eager": rates["executor"] / rates["torch_eager"],
            "executor_vs_handwritten_jax": rates["executor"] / rates["handwritten_jax"]}


def cnn_benchmark():
    torch.manual_seed(0)
    n, batch, iterations = 40 * 10 * 6, 40, 10
    x, y = torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,))
    dataset = torch.utils.data.TensorDataset(x, y)
    eager_model, ipu_model = SeedCNNWithLoss(), SeedCNNWithLoss()
    rates = {
        "executor": timed(executor(ipu_model, torch.optim.AdamW(ipu_model.parameters(), lr=1e-3),
                                   dataset, batch, iterations), n),
        "torch_eager": timed(torch_eager(eager_model, torch.optim.AdamW(eager_model.parameters(), lr=1e-3),
                                         x, y, batch), n),
    }
    return {"images_per_s": rates, "executor_vs_torch_eager": rates["executor"] / rates["torch_eager"]}


def main():
    results = {"mlp": mlp_benchmark()}
    print("MLP  steps/s:", {k: round(v) for k, v in results["mlp"]["steps_per_s"].items()},
          f"| vs torch {results['mlp']['executor_vs_torch_eager']:.1f}x",
          f"| vs JAX {results['mlp']['executor_vs_handwritten_jax']:.2f}x")
    results["seed_cnn"] = cnn_benchmark()
    print("CNN  img/s:", {k: round(v) for k, v in results["seed_cnn"]["images_per_s"].items()},
          f"| vs torch {results['seed_cnn']['executor_vs_torch_eager']:.2f}x")
    results["environment"] = {"jax": jax.__version__, "torch": torch.__version__,
                              "torch_threads": torch.get_num_threads()}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
