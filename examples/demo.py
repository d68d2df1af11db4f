"""Demo: the seed CNN trained on the handwritten digits through the torch→JAX compiler.

Prints the loss as it trains, throughput and test accuracy.
"""

import time

import jax
import jax.numpy as jnp
import optax
import torch

from digits import digits_tensors
from seed_cnn import SeedCNNWithLoss
from ipu_backend.compiler import compile_module, to_jax

BATCH = 40
EPOCHS = 3


def main():
    torch.manual_seed(0)
    (train_x, train_y), (test_x, test_y) = digits_tensors()
    model = SeedCNNWithLoss()
    start = time.perf_counter()
    program = compile_module(model, (train_x[:BATCH], train_y[:BATCH]))
    params, buffers = program.state(model)
    optimizer = optax.adamw(1e-3, weight_decay=0.01)
    opt_state = optimizer.init(params)

    def loss_of(p, x, y, key):
        (_, loss), _ = program.fn(p, buffers, (x, y), key)
        return loss

    @jax.jit
    def train_step(p, state, x, y, key):
        loss, grads = jax.value_and_grad(loss_of)(p, x, y, key)
        updates, state = optimizer.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss

    key = jax.random.key(0)
    x0, y0 = to_jax(train_x[:BATCH]), to_jax(train_y[:BATCH])
    jax.block_until_ready(train_step.lower(params, opt_state, x0, y0, key).compile())
    print(f"compiled the training step in {time.perf_counter() - start:.2f} s")

    xs, ys = to_jax(train_x), to_jax(train_y)
    steps_per_epoch = len(train_y) // BATCH
    for epoch in range(EPOCHS):
        start = time.perf_counter()
        for step in range(steps_per_epoch):
            batch = slice(step * BATCH, (step + 1) * BATCH)
            params, opt_state, loss = train_step(params, opt_state, xs[batch], ys[batch],
                                                 jax.random.fold_in(key, step))
        loss = float(loss)
        seconds = time.perf_counter() - start
        print(f"epoch {epoch + 1}: loss {loss:.4f}, {steps_per_epoch * BATCH / seconds:,.0f} img/s")

    test_program = compile_module(model, (test_x[:BATCH],))
    logits = jax.jit(lambda p, x: test_program.fn(p, buffers, (x,), key)[0])(params, to_jax(test_x))
    accuracy = float(jnp.mean(jnp.argmax(logits, -1) == to_jax(test_y)))
    print(f"test accuracy {accuracy:.1%} on {len(test_y)} held-out digits")


if __name__ == "__main__":
    main()
