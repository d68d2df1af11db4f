"""Test session set-up, before JAX's first computation: eight CPU devices (one per emulated IPU
of the largest replicated tests) and a cheaper XLA compiler. Test programs are tiny, so
compilation is most of the suite's time; these flags change how long XLA optimises, not the
numbers it computes."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
