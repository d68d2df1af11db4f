"""JAX's persistent compilation cache behind ``Options.enableExecutableCaching(path)``."""

import os

import jax

ENVIRONMENT_VARIABLE = "IPU_BACKEND_EXECUTABLE_CACHE"


def configure(path: str | None) -> None:
    """Cache compiled programs on disk under ``path`` (or ``$IPU_BACKEND_EXECUTABLE_CACHE``)."""
    path = path or os.environ.get(ENVIRONMENT_VARIABLE)
    if not path:
        return
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
