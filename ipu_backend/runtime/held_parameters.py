"""Parameters that show the device's weights wherever the user holds them.

The module's class swap (``weights.py``) covers access through the module; a parameter held
elsewhere (a list taken before training, an optimizer's ``param_groups``) is reached without
it. As in PopTorch, each parameter's class is swapped too, for a subclass whose attribute reads
first bring the device's weights to the host. torch's operators look up their operands'
``__torch_function__`` attribute, so a torch operation on a held parameter reads it too.

``.data`` hands out a tensor whose in-place writes no version counter records (weight clipping
as ``p.data.clamp_(-c, c)``), so a parameter whose ``.data`` was read is taken from the host at
the next call, as a written one is.

The package's own reads of the weights are :func:`quiet` (a weight store's lock, a :class:`QuietLock`,
is quiet within): they neither copy nor mark.
"""

import contextlib
import contextvars
import functools
import threading
import weakref

import torch

_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}
"""id of a held parameter -> (the parameter, the weight store it shows), both weakly: kept out
of the parameter's ``__dict__``, which pickling a parameter writes out."""
_QUIET = contextvars.ContextVar("ipu_backend_quiet_parameters", default=False)


@contextlib.contextmanager
def quiet():
    """Within the block, reading a held parameter neither copies the device's weights to the
    host nor marks it read through ``.data``."""
    token = _QUIET.set(True)
    try:
        yield
    finally:
        _QUIET.reset(token)


_METADATA = frozenset({
    "__class__", "__dict__", "shape", "dtype", "device", "layout", "size", "dim", "ndim", "numel",
    "nelement", "element_size", "stride", "is_contiguous", "is_floating_point", "is_complex",
    "requires_grad", "requires_grad_", "is_leaf", "grad", "grad_fn", "retains_grad", "register_hook",
    "register_post_accumulate_grad_hook", "_backward_hooks", "_post_accumulate_grad_hooks"})
"""Attributes that read no weight value (a parameter's gradient is not a weight): an optimizer's
``zero_grad`` between calls copies nothing."""


class _DeviceBacked:
    """Mixed in front of a parameter's class: reads first ask the owning store for the
    device's weights (``WeightStore.parameter_read``)."""

    _ipu_original_class = None

    def __getattribute__(self, name):
        if name in _METADATA:
            token = _QUIET.set(True)       # torch's getters look ``__torch_function__`` up
            try:
                return super().__getattribute__(name)
            finally:
                _QUIET.reset(token)
        if not _QUIET.get():
            store = _owner(self)
            if store is not None and (store.host_stale or name == "data" or store.reads_refused is not None):
                store.parameter_read(self, name)
        return super().__getattribute__(name)

    def __repr__(self, *args, **kwargs):
        """torch's own, which names a subclass of a parameter's class in it."""
        if type(self)._ipu_original_class is not torch.nn.Parameter:
            return super().__repr__(*args, **kwargs)
        plain = self.detach().requires_grad_(self.requires_grad)
        return "Parameter containing:\n" + plain.__repr__(*args, **kwargs)

    def __deepcopy__(self, memo):
        """A copy is the user's own class: it is not the device's weights."""
        copy = super().__deepcopy__(memo)
        copy.__class__ = type(self)._ipu_original_class
        return copy


def _owner(parameter):
    entry = _OWNERS.get(id(parameter))
    return None if entry is None or entry[0]() is not parameter else entry[1]()


@functools.cache
def _device_backed_class(cls: type) -> type:
    return type(cls.__name__, (_DeviceBacked, cls),
                {"_ipu_original_class": cls, "__module__": cls.__module__, "__qualname__": cls.__qualname__})


def hold(parameters, store) -> None:
    """``parameters`` show ``store``'s device weights from now on, wherever they are held."""
    with quiet():
        for parameter in parameters:
            if _owner(parameter) is store:
                continue
            key = id(parameter)
            _OWNERS[key] = (weakref.ref(parameter, lambda _, key=key: _OWNERS.pop(key, None)),
                            weakref.ref(store))
            if not isinstance(parameter, _DeviceBacked):
                parameter.__class__ = _device_backed_class(type(parameter))


def let_go(parameters) -> None:
    """``parameters`` are the user's plain parameters again."""
    with quiet():
        for parameter in parameters:
            _OWNERS.pop(id(parameter), None)
            if isinstance(parameter, _DeviceBacked):
                parameter.__class__ = type(parameter)._ipu_original_class


class QuietLock:
    """A reentrant lock within which the package's own reads of held parameters are quiet: a
    weight store's lock, held by every call and copy of its weights."""

    def __init__(self):
        self._lock = threading.RLock()
        self._tokens = []          # touched only by the thread holding the lock

    def __enter__(self):
        self._lock.acquire()
        self._tokens.append(_QUIET.set(True))
        return self

    def __exit__(self, *exc_info):
        _QUIET.reset(self._tokens.pop())
        self._lock.release()
