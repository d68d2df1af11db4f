"""PopART's synthetic data (``Options.enableSyntheticData``, ``syntheticDataMode``): no host I/O,
the inputs made on the device, to measure a model as if its input pipeline cost nothing.

As in PopART, each input is one micro-batch made once and read by every micro-batch of every
replica, device iteration and call: here it is drawn on the device when an executor first runs an
input signature, from a key made from the executor's seed (``Options.randomSeed``), and broadcast
to the call's ``[D, A, R, m, ...]`` layout; the caller's tensors give only shapes and dtypes. The
outputs are not copied back: the caller gets zeros of their shapes and dtypes (PopTorch hands back
tensors it allocated and the device never wrote), and inputs the model updates in place are left
as they are.

What an input holds in PopART's RandomNormal mode: a floating point input standard normal values in
its dtype; an integer input zeros (PopART rounds the normal values, giving negative and small
numbers that are out of range as class labels or embedding rows: zero is in range for any of them);
a boolean input True (PopART's conversion of a nonzero value). In Zeros mode every input is zero.
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ipu_backend.compiler import jax_dtype
from ipu_backend.compiler.capture import host_known_input
from ipu_backend.errors import Error
from ipu_backend.runtime.devices import REPLICA
from ipu_backend.runtime.outputs import inputs_to_device, output_to_host
from ipu_backend.runtime.random_state import seed_key
from ipu_backend.runtime.schedule import Schedule, split_batch

OFF, ZEROS, RANDOM_NORMAL = 0, 1, 2
"""PopART's ``SyntheticDataMode`` values that are emulated."""

_STREAM = 2**32 - 1
"""Folded into the executor's seed key for synthetic data: a call index never reaches it, so the
data and the calls' random numbers are distinct streams."""


def check_mode(mode: int, processes: int) -> None:
    """Refuse a ``syntheticDataMode`` that is not emulated, or synthetic data over several processes."""
    if mode not in (OFF, ZEROS, RANDOM_NORMAL):
        raise Error(f"Options._Popart syntheticDataMode {mode} is not emulated: use "
                    "Options.enableSyntheticData(True) (RandomNormal, 2), Zeros (1) or Off (0)")
    if mode != OFF and processes > 1:
        raise Error("Options.enableSyntheticData(True) with several processes (Options.Distributed) is not "
                    "emulated: run one process, or remove enableSyntheticData")


def micro_batch(seed: int, index: int, shape: tuple, dtype, mode: int = RANDOM_NORMAL) -> jax.Array:
    """The synthetic micro-batch of a call's data tensor number ``index`` (argument order), of
    ``shape`` and JAX ``dtype``, under an executor with random seed ``seed``: what every
    micro-batch of that input holds on the device."""
    return _value(_input_key(seed, index), tuple(shape), np.dtype(dtype), mode)


def _input_key(seed: int, index: int):
    return jax.random.fold_in(jax.random.fold_in(seed_key(seed), _STREAM), index)


def _value(key, shape: tuple, dtype: np.dtype, mode: int):
    if mode == RANDOM_NORMAL and jnp.issubdtype(dtype, jnp.floating):
        return jax.random.normal(key, shape, jnp.float32).astype(dtype)
    if mode == RANDOM_NORMAL and dtype == np.bool_:
        return jnp.ones(shape, dtype)
    return jnp.zeros(shape, dtype)


class SyntheticInputs:
    """An executor's synthetic inputs, made once per input signature and kept on the device."""

    def __init__(self, mode: int, seed: int):
        self._mode, self._seed = mode, seed
        self._made: dict = {}

    def inputs(self, program, args: tuple, schedule: Schedule, mesh) -> list:
        """The call's tensor inputs ``[D, A, R, m, ...]``: on ``mesh``, sharded on the replica axis,
        or on the default device when ``mesh`` is None (a model split over IPUs sends each input
        to the stages reading it, device to device). What the host knows before a call rather
        than data (a step's host-known argument, Lightning's counters, and the choice of each
        micro-batch's variant) still comes from the host."""
        host = {host_known_input()} | ({len(args) - 1} if len(program.variants) > 1 else set())
        leaves = [(position in host, leaf) for position, arg in enumerate(args)
                  for leaf in torch.utils._pytree.tree_leaves(arg) if isinstance(leaf, torch.Tensor)]
        data = [leaf for from_host, leaf in leaves if not from_host]
        signature = (mesh is None,) + tuple((tuple(x.shape), x.dtype) for x in data)
        if signature not in self._made:
            self._made[signature] = [self._make(index, x, schedule, mesh) for index, x in enumerate(data)]
        made = iter(self._made[signature])
        known = iter(inputs_to_device(tuple(leaf for from_host, leaf in leaves if from_host), schedule, mesh))
        return [next(known) if from_host else next(made) for from_host, _ in leaves]

    def _make(self, index: int, tensor: torch.Tensor, schedule: Schedule, mesh):
        shape = split_batch(np.broadcast_to(np.zeros((), np.int8), tuple(tensor.shape)), schedule).shape
        dtype, mode = np.dtype(jax_dtype(tensor.dtype)), self._mode
        sharding = None if mesh is None else NamedSharding(mesh, P(None, None, REPLICA))
        draw = jax.jit(lambda key: jnp.broadcast_to(_value(key, shape[3:], dtype, mode), shape),
                       out_shardings=sharding)
        return draw(_input_key(self._seed, index))


def for_settings(mode: int, seed: int) -> SyntheticInputs | None:
    """The synthetic inputs of an executor with this mode (checked: :func:`check_mode`) and seed,
    or None (host data)."""
    return None if mode == OFF else SyntheticInputs(mode, seed)


def unwritten_output(array, dtype: torch.dtype) -> torch.Tensor:
    """What the caller gets for an output the device did not send back: zeros of its shape."""
    return output_to_host(np.zeros(array.shape, array.dtype), dtype)
