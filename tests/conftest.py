"""Test session set-up: eight emulated IPUs' worth of CPU devices before JAX's first computation."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
