"""Runs of repeated layers: structurally identical children of an ``nn.Sequential`` or an
``nn.ModuleList`` (a transformer's blocks, ``nn.TransformerEncoder``'s layers).

Two layers are structurally identical when they and every module inside them have the same
class, the same parameter and buffer names, shapes, dtypes and ``requires_grad``, the same mode
(``training``) and equal other attributes (numbers, strings, dtypes, tensors of equal values;
any other object must be the very same one), but for plain scalars (numbers, strings, booleans,
``None``, enum members, dtypes), which may differ (a block's index, as Hugging Face's and
litgpt's blocks keep it): :func:`differing_attributes` names them, and the capture checks that
the layers' forward does not read them. Such layers compute the same function of their inputs
and their own weights, so one capture of one of them describes them all. A module with hooks
inside a layer, or a global module hook, makes nothing repeatable: a hook could tell the layers
apart.
"""

import enum

import torch
from torch.nn.modules import module as torch_module

_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
_PLAIN = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device, enum.Enum)
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList)


def _value_key(value):
    """A hashable stand-in for an attribute's value: equal keys for equal values."""
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu()
        return ("tensor", tuple(data.shape), data.dtype, data.contiguous().view(-1).view(torch.uint8)
                .numpy().tobytes() if data.numel() else b"")
    if isinstance(value, (tuple, list)):
        return (type(value),) + tuple(_value_key(v) for v in value)
    if isinstance(value, dict):
        return (dict,) + tuple((_value_key(k), _value_key(v)) for k, v in value.items())
    if isinstance(value, (set, frozenset)):
        return (type(value), frozenset(_value_key(v) for v in value))
    if isinstance(value, _PLAIN):
        return (type(value), value)
    return ("object", id(value))


_SCALAR = "a plain scalar"
"""What a plain scalar attribute counts as in a layer's signature: layers may differ in them."""


def _scalar(value) -> bool:
    """A value whose reads the capture notes as guards (``python_reads``): layers may differ in
    it where their forward does not read it."""
    return type(value) in (bool, int, float, str, type(None)) or isinstance(value, (enum.Enum, torch.dtype))


def differing_attributes(run: tuple[torch.nn.Module, ...]) -> set[tuple[str, str]]:
    """``(module path inside a layer, attribute)`` of each plain scalar that differs between the
    layers of ``run``."""
    values = [{(path, name): _value_key(value) for path, module in layer.named_modules()
               for name, value in vars(module).items() if name not in _MODULE_INTERNALS and _scalar(value)}
              for layer in run]
    return {key for key in values[0] if any(other[key] != values[0][key] for other in values[1:])}


def _has_hooks(module: torch.nn.Module) -> bool:
    return any(getattr(module, name, None) for name in _HOOKS)


def _global_hooks() -> bool:
    return any(getattr(torch_module, name, None) for name in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
        "_global_backward_pre_hooks", "_global_forward_hooks_always_called"))


def signature(module: torch.nn.Module, memo: dict, inner: bool = False):
    """What makes ``module`` compute what it computes (see the module docstring), hashable; None
    when it cannot be repeated. ``inner``: a module inside a layer, whose hooks would run inside
    the layer's capture."""
    key = (id(module), inner)
    if key not in memo:
        memo[key] = _signature(module, memo, inner)
    return memo[key]


def _signature(module, memo, inner):
    if inner and _has_hooks(module):
        return None
    children = []
    for name, child in module._modules.items():
        child_signature = None if child is None else signature(child, memo, inner=True)
        if child is not None and child_signature is None:
            return None
        children.append((name, child_signature))
    params = tuple((name, None) if p is None else (name, tuple(p.shape), p.dtype, p.requires_grad)
                   for name, p in module._parameters.items())
    buffers = tuple((name, None) if b is None else
                    (name, tuple(b.shape), b.dtype, name in module._non_persistent_buffers_set)
                    for name, b in module._buffers.items())
    attributes = tuple(sorted(((name, _SCALAR if _scalar(value) else _value_key(value))
                               for name, value in vars(module).items()
                               if name not in _MODULE_INTERNALS), key=lambda item: item[0]))
    return (type(module), module.training, params, buffers, attributes, tuple(children))


def _has_parameters(module: torch.nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def repeated_runs(root: torch.nn.Module) -> list[tuple[torch.nn.Module, ...]]:
    """Each run of two or more consecutive structurally identical children, holding parameters,
    of an ``nn.Sequential`` or ``nn.ModuleList`` inside ``root``; the layers of a run are not
    searched for runs of their own."""
    if _global_hooks():
        return []
    runs, memo, seen = [], {}, set()

    def search(module):
        if id(module) in seen:
            return
        seen.add(id(module))
        children = [c for c in module._modules.values() if c is not None]
        if not isinstance(module, _CONTAINERS):
            for child in children:
                search(child)
            return
        start = 0
        while start < len(children):
            first = signature(children[start], memo)
            end = start + 1
            while end < len(children) and first is not None and signature(children[end], memo) == first:
                end += 1
            if end - start >= 2 and _has_parameters(children[start]):
                runs.append(tuple(children[start:end]))
                seen.update(id(c) for c in children[start:end])
            else:
                search(children[start])
                end = start + 1
            start = end

    search(root)
    return runs
