"""Compiler throughput: lowered torch vs hand-written JAX vs torch eager, measured in one run.

Forward and forward+backward of the seed CNN (batch 40) and of a transformer encoder layer
(batch 16, sequence 64, d_model 128, 4 heads), plus the time to compile the seed CNN's training
step. Each implementation is timed in short windows taken in turn, several rounds, and keeps
its best window, so a load that comes and goes on a shared machine weighs on all alike. Prints
ratios and writes bench/results/compiler_throughput.json. Run by hand: `make bench`.

The hand-written encoder does torch's math: attention scales q and k by ``head_dim ** -0.25``
each and a row whose every score is -inf gives zeros (torch's ``_safe_softmax``), as the
compiled program must. ``handwritten_jax_plain_softmax`` drops that row rule (NaN there, the
usual ``jax.nn.softmax``) and scales the scores once: a looser baseline, reported beside it.
The hand-written seed CNN uses ``lax.conv_general_dilated``, as a JAX user writes it; the
compiled program lowers its convolutions as im2col on the CPU (``conv_algorithm="auto"``).
"""

import json
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
from seed_cnn import SeedCNN  # noqa: E402

from ipu_backend.compiler import compile_module, to_jax  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results" / "compiler_throughput.json"
SECONDS = 0.3
ROUNDS = 10


def rate(step, samples_per_call, seconds=SECONDS):
    """Samples per second of ``step()`` (which must block until its work is done)."""
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        step()
        calls += 1
    return calls * samples_per_call / (time.perf_counter() - start)


def best_rates(steps: dict, samples_per_call) -> dict:
    """Each step's best rate over ``ROUNDS`` rounds of one window per step, steps in turn. The
    order rotates every round: a window right after torch eager's runs measurably slower (by
    5-10 % on a loaded 2-core machine), so no implementation may always be the one after it."""
    for step in steps.values():
        step()
    best = dict.fromkeys(steps, 0.0)
    names = list(steps)
    for round_ in range(ROUNDS):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            best[name] = max(best[name], rate(steps[name], samples_per_call))
    return best


def lowered_steps(module, inputs, loss_of_outputs):
    """Jitted forward and forward+backward of the compiled module."""
    program = compile_module(module, inputs)
    params, buffers = program.state(module)
    args = tuple(to_jax(x) for x in inputs)
    key = jax.random.key(0)

    def loss(p):
        return loss_of_outputs(program.fn(p, buffers, args, key)[0])

    forward = jax.jit(lambda p: program.fn(p, buffers, args, key)[0])
    backward = jax.jit(jax.value_and_grad(loss))
    return (lambda: jax.block_until_ready(forward(params)),
            lambda: jax.block_until_ready(backward(params)))


def torch_steps(module, inputs, loss_of_outputs):
    def forward():
        with torch.no_grad():
            module(*inputs)

    def backward():
        module.zero_grad()
        loss_of_outputs(module(*inputs)).backward()

    return forward, backward


def cnn_handwritten(params, x):
    def conv(x, w, b):
        y = jax.lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=("NCHW", "OIHW", "NCHW"))
        return y + b[None, :, None, None]

    def pool(x):
        return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")

    h = jax.nn.relu(pool(conv(x, params["conv1.0.weight"], params["conv1.0.bias"])))
    h = jax.nn.relu(pool(conv(h, params["conv2.0.weight"], params["conv2.0.bias"])))
    h = h.reshape(h.shape[0], -1)
    h = jax.nn.relu(h @ params["fc1.0.weight"].T + params["fc1.0.bias"])
    return h @ params["fc2.weight"].T + params["fc2.bias"]


def encoder_handwritten(params, x, heads=4, torch_softmax=True):
    def linear(h, name):
        return h @ params[f"{name}.weight"].T + params[f"{name}.bias"]

    def layer_norm(h, name):
        mean = h.mean(-1, keepdims=True)
        var = ((h - mean) ** 2).mean(-1, keepdims=True)
        return (h - mean) * jax.lax.rsqrt(var + 1e-5) * params[f"{name}.weight"] + params[f"{name}.bias"]

    def softmax_all_minus_inf_rows_zero(scores):
        peak = jax.lax.stop_gradient(scores.max(-1, keepdims=True))
        exps = jnp.exp(scores - jnp.where(peak == -jnp.inf, 0.0, peak))
        total = exps.sum(-1, keepdims=True)
        return exps / jnp.where(total == 0, 1.0, total)

    batch, seq, dim = x.shape
    head_dim = dim // heads
    qkv = x @ params["self_attn.in_proj_weight"].T + params["self_attn.in_proj_bias"]
    q, k, v = jnp.split(qkv.reshape(batch, seq, 3, heads, head_dim), 3, axis=2)
    q, k, v = (t[:, :, 0].transpose(0, 2, 1, 3) for t in (q, k, v))
    if torch_softmax:
        scale = head_dim ** -0.25
        scores = softmax_all_minus_inf_rows_zero((q * scale) @ (k.transpose(0, 1, 3, 2) * scale))
    else:
        scores = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) / jnp.sqrt(head_dim), axis=-1)
    attended = (scores @ v).transpose(0, 2, 1, 3).reshape(batch, seq, dim)
    h = layer_norm(x + linear(attended, "self_attn.out_proj"), "norm1")
    return layer_norm(h + linear(jax.nn.relu(linear(h, "linear1")), "linear2"), "norm2")


def encoder_handwritten_plain_softmax(params, x):
    return encoder_handwritten(params, x, torch_softmax=False)


def handwritten_steps(fn, params, inputs, loss_of_outputs):
    args = tuple(to_jax(x) for x in inputs)
    forward = jax.jit(lambda p: fn(p, *args))
    backward = jax.jit(jax.value_and_grad(lambda p: loss_of_outputs(fn(p, *args))))
    return (lambda: jax.block_until_ready(forward(params)),
            lambda: jax.block_until_ready(backward(params)))


def measure(name, module, inputs, handwritten: dict, batch):
    """``handwritten`` maps a name (``handwritten_jax...``) to a JAX function of the same network."""
    loss = lambda out: (out ** 2).mean()  # noqa: E731  (the same scalar for every implementation)
    params = {n: to_jax(p) for n, p in module.named_parameters()}
    implementations = {"compiled": lowered_steps(module, inputs, loss)}
    implementations.update((label, handwritten_steps(fn, params, inputs, loss))
                           for label, fn in handwritten.items())
    implementations["torch_eager"] = torch_steps(module, inputs, loss)
    result = {}
    for mode, index in (("forward", 0), ("forward_backward", 1)):
        rates = best_rates({impl: steps[index] for impl, steps in implementations.items()}, batch)
        result[mode] = {"samples_per_s": rates}
        result[mode].update((f"compiled_vs_{other}", rates["compiled"] / rates[other])
                            for other in rates if other != "compiled")
        print(f"{name:8s} {mode:17s} " + "  ".join(f"{k} {v:9.0f}/s" for k, v in rates.items())
              + "  |" + "".join(f"  vs {other.removeprefix('compiled_vs_')} {ratio:.3f}"
                               for other, ratio in result[mode].items() if other != "samples_per_s"))
    return result


def training_step_compile_seconds():
    """Capture + lowering + XLA compilation of the seed CNN's full training step (fresh process cache)."""
    module = SeedCNN()
    x, y = torch.randn(40, 1, 28, 28), torch.randint(0, 10, (40,))
    start = time.perf_counter()
    program = compile_module(module, (x,))
    params, buffers = program.state(module)

    def loss(p):
        logits = program.fn(p, buffers, (to_jax(x),), jax.random.key(0))[0]
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), to_jax(y)[:, None], 1).mean()

    jax.jit(jax.value_and_grad(loss)).lower(params).compile()
    return time.perf_counter() - start


def main():
    torch.manual_seed(0)
    torch.set_num_threads(torch.get_num_threads())
    results = {"compile_seconds_seed_cnn_training_step": training_step_compile_seconds()}
    print(f"seed CNN training step compiled in {results['compile_seconds_seed_cnn_training_step']:.2f} s")
    results["seed_cnn"] = measure("seed_cnn", SeedCNN(), (torch.randn(40, 1, 28, 28),),
                                  {"handwritten_jax": cnn_handwritten}, 40)
    encoder = nn.TransformerEncoderLayer(128, 4, 256, dropout=0.0, batch_first=True).eval()
    results["encoder_layer"] = measure(
        "encoder", encoder, (torch.randn(16, 64, 128),),
        {"handwritten_jax": encoder_handwritten,
         "handwritten_jax_plain_softmax": encoder_handwritten_plain_softmax}, 16)
    results["environment"] = {"jax": jax.__version__, "torch": torch.__version__,
                              "devices": str(jax.devices()), "torch_threads": torch.get_num_threads(),
                              "load_average_1_5_15_min": os.getloadavg(), "cpus": os.cpu_count()}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
