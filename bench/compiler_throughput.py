"""Compiler throughput: lowered torch vs hand-written JAX vs torch eager, measured in one run.

Forward and forward+backward of the seed CNN (batch 40) and of a transformer encoder layer
(batch 16, sequence 64, d_model 128, 4 heads), plus the time to compile the seed CNN's training
step. Prints ratios and writes bench/results/compiler_throughput.json. Run by hand: `make bench`.
"""

import json
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
SECONDS = 2.0


def rate(step, samples_per_call, seconds=SECONDS):
    """Samples per second of ``step()`` (which must block until its work is done)."""
    step()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        step()
        calls += 1
    return calls * samples_per_call / (time.perf_counter() - start)


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


def encoder_handwritten(params, x, heads=4):
    def linear(h, name):
        return h @ params[f"{name}.weight"].T + params[f"{name}.bias"]

    def layer_norm(h, name):
        mean = h.mean(-1, keepdims=True)
        var = ((h - mean) ** 2).mean(-1, keepdims=True)
        return (h - mean) * jax.lax.rsqrt(var + 1e-5) * params[f"{name}.weight"] + params[f"{name}.bias"]

    batch, seq, dim = x.shape
    qkv = x @ params["self_attn.in_proj_weight"].T + params["self_attn.in_proj_bias"]
    q, k, v = jnp.split(qkv.reshape(batch, seq, 3, heads, dim // heads), 3, axis=2)
    q, k, v = (t[:, :, 0].transpose(0, 2, 1, 3) for t in (q, k, v))
    scores = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) / jnp.sqrt(dim // heads), axis=-1)
    attended = (scores @ v).transpose(0, 2, 1, 3).reshape(batch, seq, dim)
    h = layer_norm(x + linear(attended, "self_attn.out_proj"), "norm1")
    return layer_norm(h + linear(jax.nn.relu(linear(h, "linear1")), "linear2"), "norm2")


def handwritten_steps(fn, params, inputs, loss_of_outputs):
    args = tuple(to_jax(x) for x in inputs)
    forward = jax.jit(lambda p: fn(p, *args))
    backward = jax.jit(jax.value_and_grad(lambda p: loss_of_outputs(fn(p, *args))))
    return (lambda: jax.block_until_ready(forward(params)),
            lambda: jax.block_until_ready(backward(params)))


def measure(name, module, inputs, handwritten, batch):
    loss = lambda out: (out ** 2).mean()  # noqa: E731  (the same scalar for every implementation)
    params = {n: to_jax(p) for n, p in module.named_parameters()}
    implementations = {
        "compiled": lowered_steps(module, inputs, loss),
        "handwritten_jax": handwritten_steps(handwritten, params, inputs, loss),
        "torch_eager": torch_steps(module, inputs, loss),
    }
    result = {}
    for mode, index in (("forward", 0), ("forward_backward", 1)):
        rates = {impl: rate(steps[index], batch) for impl, steps in implementations.items()}
        result[mode] = {
            "samples_per_s": rates,
            "compiled_vs_handwritten_jax": rates["compiled"] / rates["handwritten_jax"],
            "compiled_vs_torch_eager": rates["compiled"] / rates["torch_eager"],
        }
        print(f"{name:8s} {mode:17s} " + "  ".join(f"{k} {v:9.0f}/s" for k, v in rates.items())
              + f"  | vs JAX {result[mode]['compiled_vs_handwritten_jax']:.3f}"
              + f"  vs torch {result[mode]['compiled_vs_torch_eager']:.3f}")
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
    results["seed_cnn"] = measure("seed_cnn", SeedCNN(), (torch.randn(40, 1, 28, 28),), cnn_handwritten, 40)
    encoder = nn.TransformerEncoderLayer(128, 4, 256, dropout=0.0, batch_first=True).eval()
    results["encoder_layer"] = measure("encoder", encoder, (torch.randn(16, 64, 128),),
                                       encoder_handwritten, 16)
    results["environment"] = {"jax": jax.__version__, "torch": torch.__version__,
                              "devices": str(jax.devices()), "torch_threads": torch.get_num_threads()}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
