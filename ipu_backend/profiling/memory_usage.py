"""Per-IPU memory of a compiled program, as :mod:`ipu_backend.runtime.memory` estimates it.

A model split over IPUs carries its estimate (the one its out-of-memory check used). A
single-IPU step is one fused program: its weights, buffers and optimizer state are the arrays it
is called with, and its temporaries (activations and gradients of the micro-batch being run,
gradient sums included) come from XLA's memory analysis; nothing is stashed between programs.
"""

import math

import jax
import numpy as np

from ipu_backend.runtime import memory


def tree_bytes(tree) -> int:
    """Bytes of the arrays of ``tree`` (random keys excluded: they are not model state)."""
    return sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree)
               if not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key))


def single_ipu_usage(executable, state: dict, replicas_per_device: int,
                     optimizer_offloaded: bool = False) -> list[memory.IpuMemory]:
    """The estimate of one replica of a single-IPU program called with ``state``."""
    analysis = executable.memory_analysis()
    temporaries = 0 if analysis is None else int(analysis.temp_size_in_bytes) // replicas_per_device
    stage = memory.StageMemory(
        stage=0, ipu=0, weights=tree_bytes(state["params"]) + tree_bytes(state["buffers"]),
        optimizer=tree_bytes(state.get("opt")), accumulators=0, stash_per_micro_batch=0,
        stashed_micro_batches=0, temporaries=temporaries, optimizer_offloaded=optimizer_offloaded)
    return memory.estimate([stage])
