"""A torch optimizer whose state lives on the device, as its executor keeps it.

Its ``state_dict()`` first brings the state on the host up to date (whatever was read before:
``torch.save({"opt": optimizer.state_dict(), ...})`` saves the device's moments), and its
``load_state_dict()`` makes the loaded state the device's from the next call on (resuming into a
live executor). PopTorch instruments its optimizers' ``state_dict`` the same way; here the
instance's two methods are wrapped, and given back by :func:`release`.

Its ``state`` is a :class:`DeviceState`: reading it (``optimizer.state[p]["exp_avg"]``, as torch
keeps it current after each step) first brings it up to date too, and what the host writes into
it (a moment reset in place, a step count replaced) is the device's from the next call on.
"""

import collections
import contextlib
import weakref
from collections.abc import Callable

import torch

_WRAPPED = ("state_dict", "load_state_dict")


class DeviceState(collections.defaultdict):
    """``optimizer.state`` while a device holds it: every use first brings the device's state
    here; :func:`take_host_writes` tells the owner, before its next call, of what the host
    wrote since the state was last brought here (tensors replaced or changed in place:
    ``Tensor._version``; entries added, replaced or removed)."""

    def __init__(self, contents, to_host: Callable[[], None], loaded: Callable[[], None]):
        super().__init__(dict, contents)
        self._to_host = to_host
        self.loaded = loaded
        """Makes what the host holds the device's state at the next call."""
        self._syncing = False
        self.used = False
        """Whether the state was used since it was last marked: unused, it cannot have changed."""
        self._marked = self._fingerprint()

    def _use(self) -> None:
        if not self._syncing:
            self._syncing = True
            try:
                self._to_host()
            finally:
                self._syncing = False
        self.used = True

    def mark(self) -> None:
        """The host's state is the device's now: count writes from here."""
        self._marked, self.used = self._fingerprint(), False

    def written(self) -> bool:
        return self.used and self._fingerprint() != self._marked

    def _fingerprint(self) -> dict:
        return {id(param): {key: _marker(value) for key, value in dict.items(state)}
                for param, state in dict.items(self)}

    def copy(self) -> collections.defaultdict:
        self._use()
        return collections.defaultdict(dict, dict.items(self))

    __copy__ = copy

    def __reduce__(self):
        return collections.defaultdict, (dict,), None, None, iter(list(self.items()))


def _marker(value):
    """``value`` as a fingerprint compares it: a tensor by identity and in-place changes."""
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value._version)
    if isinstance(value, (tuple, list)):
        return tuple(_marker(item) for item in value)
    return value


def _using(name: str):
    method = getattr(collections.defaultdict, name)

    def used(self, *args, **kwargs):
        self._use()
        return method(self, *args, **kwargs)
    used.__name__ = name
    return used


for _name in ("__getitem__", "__setitem__", "__delitem__", "__contains__", "__iter__", "__len__",
              "__repr__", "__eq__", "get", "items", "keys", "values", "setdefault", "pop", "popitem",
              "update", "clear"):
    setattr(DeviceState, _name, _using(_name))


def take_host_writes(optimizer: torch.optim.Optimizer) -> None:
    """Before a call: what the host wrote into ``optimizer.state`` since the device's state was
    last brought there becomes the device's (as ``load_state_dict`` does)."""
    state = getattr(optimizer, "state", None)
    if isinstance(state, DeviceState) and state.used:
        if state.written():
            state.loaded()
        state.mark()


@contextlib.contextmanager
def writing_device_state(optimizer: torch.optim.Optimizer):
    """While the block writes the device's state into ``optimizer.state``, its uses do not fetch
    that state again; after it, the host's writes count from there."""
    state = optimizer.state
    if not isinstance(state, DeviceState):
        yield
        return
    syncing, state._syncing = state._syncing, True
    try:
        yield
    finally:
        state._syncing = syncing
    state.mark()


def watch(optimizer: torch.optim.Optimizer, owner, to_host: Callable[[object], None],
          loaded: Callable[[object], None]) -> None:
    """Wrap ``optimizer``'s ``state_dict``/``load_state_dict``: ``to_host(owner)`` runs before a
    read, ``loaded(owner)`` after a load, while ``owner`` (held weakly) lives."""
    release(optimizer)
    reference = weakref.ref(owner)
    cls = type(optimizer)

    def to_host_now():
        live = reference()
        if live is not None:
            to_host(live)

    def loaded_now():
        live = reference()
        if live is not None:
            loaded(live)

    def watch_state():
        optimizer.state = DeviceState(dict.items(optimizer.state), to_host_now, loaded_now)

    def state_dict(*args, **kwargs):
        to_host_now()
        return cls.state_dict(optimizer, *args, **kwargs)

    def load_state_dict(*args, **kwargs):
        result = cls.load_state_dict(optimizer, *args, **kwargs)
        watch_state()
        loaded_now()
        return result

    optimizer.__dict__.update(state_dict=state_dict, load_state_dict=load_state_dict)
    watch_state()


def release(optimizer: torch.optim.Optimizer) -> None:
    """Give ``optimizer`` its own ``state_dict``/``load_state_dict`` and a plain ``state`` back."""
    for name in _WRAPPED:
        optimizer.__dict__.pop(name, None)
    if isinstance(getattr(optimizer, "state", None), DeviceState):
        optimizer.state = collections.defaultdict(dict, dict.items(optimizer.state))


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
