"""A torch optimizer whose state lives on the device, as its executor keeps it.

Its ``state_dict()`` first brings the state on the host up to date (whatever was read before:
``torch.save({"opt": optimizer.state_dict(), ...})`` saves the device's moments), and its
``load_state_dict()`` makes the loaded state the device's from the next call on (resuming into a
live executor). PopTorch instruments its optimizers' ``state_dict`` the same way; here the
instance's two methods are wrapped, and given back by :func:`release`.
"""

import weakref
from collections.abc import Callable

import torch

_WRAPPED = ("state_dict", "load_state_dict")


def watch(optimizer: torch.optim.Optimizer, owner, to_host: Callable[[object], None],
          loaded: Callable[[object], None]) -> None:
    """Wrap ``optimizer``'s ``state_dict``/``load_state_dict``: ``to_host(owner)`` runs before a
    read, ``loaded(owner)`` after a load, while ``owner`` (held weakly) lives."""
    release(optimizer)
    reference = weakref.ref(owner)
    cls = type(optimizer)

    def state_dict(*args, **kwargs):
        live = reference()
        if live is not None:
            to_host(live)
        return cls.state_dict(optimizer, *args, **kwargs)

    def load_state_dict(*args, **kwargs):
        result = cls.load_state_dict(optimizer, *args, **kwargs)
        live = reference()
        if live is not None:
            loaded(live)
        return result

    optimizer.__dict__.update(state_dict=state_dict, load_state_dict=load_state_dict)


def release(optimizer: torch.optim.Optimizer) -> None:
    """Give ``optimizer`` its own ``state_dict``/``load_state_dict`` back."""
    for name in _WRAPPED:
        optimizer.__dict__.pop(name, None)


def _plain(value):
    """A param-group value as something ``==`` compares by content (tensors as lists)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.tolist())
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    return value


def param_group_values(optimizer, module: torch.nn.Module) -> tuple:
    """Everything an optimizer rule reads from ``optimizer``: its kind, and each param group's
    parameters, with the name ``module`` holds each under (None for a tensor it no longer holds:
    a parameter replaced since), and values. Equal values give equal hyper-parameters and the
    same rule match; a replaced parameter gives another program, never one that trains the new
    tensor in the old one's place."""
    names = {id(p): name for name, p in torch.nn.Module.named_parameters(module)}
    return (type(optimizer),) + tuple(
        (tuple((id(p), p.requires_grad, names.get(id(p))) for p in group["params"]),
         tuple((k, _plain(v)) for k, v in group.items() if k != "params"))
        for group in optimizer.param_groups)
