"""Test session set-up: eight CPU devices (one per emulated IPU of the largest replicated tests)
before JAX's first computation. XLA's optimisation flags stay at their defaults: lowering them
speeds compilation but changes the numbers of log/exp (checked), and tests must see the numbers
users get. Compiled programs are cached on disk in a directory of the session's own, never in
the user's cache directory."""

import os
import shutil
import tempfile

import jax

jax.config.update("jax_num_cpu_devices", 8)

_CACHE_DIR = tempfile.mkdtemp(prefix="ipu_backend-test-cache-")
os.environ["IPU_BACKEND_CACHE_DIR"] = _CACHE_DIR


def pytest_unconfigure(config):
    shutil.rmtree(_CACHE_DIR, ignore_errors=True)
