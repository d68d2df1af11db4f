"""Weights that travel stacked: the parameters of a loop over repeated layers, one array per
column of the layers' weights (``ipu_backend.compiler.layer_loops.Stack``).

A program handed a stack reads it whole, so its inputs, outputs and optimizer updates are one per
stack rather than one per layer and parameter: what XLA compiles no longer grows with depth. The
weight store keeps the device's weights in the layout of the program that last computed them and
converts (one small compiled program) when another program wants another layout; the host always
sees one tensor per parameter.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import torch

from ipu_backend.compiler import to_torch


@dataclass(frozen=True)
class Packing:
    """Which parameters travel stacked (``stacks``), and under which keys."""

    stacks: tuple = ()

    def pack(self, params: dict) -> dict:
        """One array per parameter -> this layout (computed on the device, one compiled program)."""
        return _convert(Packing(), self, params) if self.stacks else params

    def repack(self, packing: "Packing", params: dict) -> dict:
        """``params`` laid out as ``packing`` says -> this layout."""
        return params if packing == self else _convert(packing, self, params)

    def pack_host(self, params: dict) -> dict:
        """Host arrays, one per parameter -> this layout."""
        members = {name for stack in self.stacks for name in stack.members}
        packed = {name: value for name, value in params.items() if name not in members}
        packed.update((stack.key, np.stack([params[name] for name in stack.members])) for stack in self.stacks)
        return packed

    def unpack_host(self, params: dict) -> dict:
        """Host arrays in this layout -> one per parameter."""
        flat = {name: value for name, value in params.items() if name not in self._keys()}
        for stack in self.stacks:
            stacked = np.asarray(params[stack.key])
            flat.update((name, stacked[index]) for index, name in enumerate(stack.members))
        return flat

    def _keys(self) -> set:
        return {stack.key for stack in self.stacks}


def kept_gradients(grads: dict, packing: Packing, model: torch.nn.Module) -> dict:
    """Gradients a program kept on the device (laid out as ``packing`` says) as torch tensors of
    their parameters' dtypes, by parameter name."""
    params = dict(model.named_parameters())
    return {name: to_torch(value, params[name].dtype)
            for name, value in packing.unpack_host(jax.device_get(grads)).items()}


def stacks_for_optimizer(stacks, optimizer, param_names: dict, without_gradient=frozenset()) -> tuple:
    """The ``stacks`` an optimizer can update whole: those whose members are all in one of its
    param groups, or all outside it (``param_names``: ``id(parameter) -> name``), and all or
    none of them without a gradient (in ``without_gradient``)."""
    group_of = {param_names[id(p)]: index for index, group in enumerate(optimizer.param_groups)
                for p in group["params"] if id(p) in param_names}
    return tuple(stack for stack in stacks if len({group_of.get(name) for name in stack.members}) == 1
                 and len({name in without_gradient for name in stack.members}) == 1)


def _unpacked(packing: Packing, params: dict) -> dict:
    flat = {name: value for name, value in params.items() if name not in packing._keys()}
    for stack in packing.stacks:
        flat.update((name, params[stack.key][index]) for index, name in enumerate(stack.members))
    return flat


def _packed(packing: Packing, params: dict) -> dict:
    members = {name for stack in packing.stacks for name in stack.members}
    packed = {name: value for name, value in params.items() if name not in members}
    packed.update((stack.key, jnp.stack([params[name] for name in stack.members])) for stack in packing.stacks)
    return packed


@jax.jit(static_argnums=(0, 1))
def _convert(source: Packing, target: Packing, params: dict) -> dict:
    return _packed(target, _unpacked(source, params))
