"""Test session set-up: eight CPU devices (one per emulated IPU of the largest replicated tests)
before JAX's first computation. XLA's optimisation flags stay at their defaults: lowering them
speeds compilation but changes the numbers of log/exp (checked), and tests must see the numbers
users get."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
