"""The device's copy of a module's weights, shared by every executor of that module.

As in PopTorch, after a training call the user's module shows the device's weights the moment it
is touched (parameters, buffers, ``state_dict``, a forward call): the module's class is swapped
for a subclass whose accessors copy the weights back first, and only when they changed.

A host write (seen by a tensor's version counter and identity: ``load_state_dict``, in-place
updates under ``torch.no_grad()``, a new tensor assigned; a write through ``.data``, which no
version counter sees, is assumed of any parameter whose ``.data`` was read: ``held_parameters.py``)
is never overwritten by device state computed before it: copying
the device's weights back skips the tensors written since the device's last update. A new
executor starts from the host's weights and buffers (:meth:`WeightStore.load_from_host` at its
first call); an existing one takes the host writes made since its last call at its next one
(:meth:`WeightStore.load_host_writes`), as torch would compute with them: PopTorch would run
from the device's weights until ``copyWeightsToDevice``, a result no torch program gives.

Calls and copies of one module's weights hold its store's lock, so executors sharing them may be
called from several threads: one call at a time, every update kept.
"""

import contextlib
import weakref

import jax
import torch

from ipu_backend.compiler import to_jax, to_torch
from ipu_backend.compiler.dtypes import to_host_array
from ipu_backend.errors import Error
from ipu_backend.runtime.held_parameters import QuietLock, hold, let_go, quiet
from ipu_backend.runtime.packing import Packing

_STORES: "weakref.WeakKeyDictionary[torch.nn.Module, WeightStore]" = weakref.WeakKeyDictionary()


def _host_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*torch.nn.Module.named_parameters(module), *torch.nn.Module.named_buffers(module)]


_RUNNING_STATISTICS = ("running_mean", "running_var")


def _running_statistics_updated(written: set[str], tensors: list) -> set[str]:
    """The running statistics a batch norm's forward on the host updated: torch's batch-norm
    kernels write them without a version-counter bump, but the forward that does so counts
    ``num_batches_tracked`` up beside them, in place, which is seen."""
    prefixes = [name[:-len("num_batches_tracked")] for name in written if name.split(".")[-1] == "num_batches_tracked"]
    if not prefixes:
        return set()
    return {prefix + statistic for prefix in prefixes for statistic in _RUNNING_STATISTICS} & {n for n, _ in tensors}


def _unversioned_statistics(module: torch.nn.Module) -> set[str]:
    """The running statistics of the module's instance norms that track them: some torch versions'
    kernels update them in a forward on the host without a version-counter bump, and no counter
    beside them moves."""
    return {f"{prefix}{'.' if prefix else ''}{statistic}"
            for prefix, sub in torch.nn.Module.named_modules(module)
            if isinstance(sub, torch.nn.modules.instancenorm._InstanceNorm) and sub.track_running_stats
            for statistic in _RUNNING_STATISTICS}


class WeightStore:
    """Parameters and buffers of one module as JAX arrays, with the direction of staleness. The
    parameters are laid out as ``packing`` says (some stacked, see ``runtime/packing.py``): as the
    program that computed them last wants them."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.params: dict | None = None
        self.packing = Packing()
        self.buffers: dict | None = None
        self.host_stale = False        # the device has weights the module does not show yet
        self._writer = None
        """A weak reference to the executor whose call computed the device's weights last."""
        self.on_host_sync = []         # callbacks run after weights reach the host (optimizer state)
        self.executors = weakref.WeakSet()   # the executors using these weights (``module.destroy()``)
        self.training_wrapper = None
        """A weak reference to the executor ``trainingModel`` made of the module (one at a time)."""
        self.on_host_load = []         # callbacks run with the names of the host writes loaded
        self.lock = QuietLock()
        """Held by every call and copy of these weights: one at a time, from any thread."""
        self.reads_refused: str | None = None
        """Why a read of the weights is refused now (:func:`weight_reads_refused`), if it is."""
        self._agreed: dict[str, tuple] = {}
        """name -> (tensor, version, data pointer) as of the device's last update, for each
        host tensor that then held the device's value."""
        self._data_read: set[int] = set()
        """The ids of the parameters whose ``.data`` was read since they were last loaded."""
        self._statistics = dict.fromkeys(_unversioned_statistics(module))
        """name -> the value last agreed, of each :func:`_unversioned_statistics` (compared)."""

    def device_state(self, packing: Packing = Packing()) -> tuple[dict, dict]:
        """The weights for the next device call, parameters laid out as ``packing`` says, read
        from the module when the device has none."""
        if self.params is None:
            self.load_from_host(packing)
        if packing != self.packing:
            self.params, self.packing = packing.repack(self.packing, self.params), packing
        return self.params, self.buffers

    def load_from_host(self, packing: Packing = Packing()) -> None:
        """The module's current values become the device's (``copyWeightsToDevice``), parameters
        laid out as ``packing`` says (stacked on the host, before the copy). Tensors the host did
        not write are first brought up to date, so nothing the device computed is lost."""
        with self.lock:
            self.sync_to_host()
            written = self.host_writes()
            tensors = _host_tensors(self.module)
            params = {n for n, _ in torch.nn.Module.named_parameters(self.module)}
            host = {n: to_host_array(t, f"parameter {n}") for n, t in tensors if n in params}
            self.params = jax.device_put(packing.pack_host(host))
            self.packing = packing
            self.buffers = {n: to_jax(t, f"buffer {n}") for n, t in tensors if n not in params}
            self._agree(tensors)
            for callback in self.on_host_load:
                callback(written)

    def check_buffer_names(self, names) -> None:
        """Refuse ``Options.updatableNamedBuffers`` naming a buffer the module does not have."""
        if not names:
            return
        host = dict(torch.nn.Module.named_buffers(self.module))
        unknown = [name for name in names if name not in host]
        if unknown:
            raise Error(f"updatableNamedBuffers names buffers the model does not have: {unknown}; the "
                        f"model's buffers are {sorted(host) or 'none'}")

    def load_buffers_from_host(self, names) -> None:
        """The module's current values of the buffers ``names`` become the device's
        (``copyNamedBuffersToDevice``); the device keeps its other weights."""
        with self.lock:
            self.device_state(self.packing)
            self.check_buffer_names(names)
            host = dict(torch.nn.Module.named_buffers(self.module))
            self.buffers = {**self.buffers, **{name: to_jax(host[name], f"buffer {name}") for name in names}}
            self._agree((name, host[name]) for name in names)

    def update(self, params: dict, buffers: dict, packing: Packing = Packing(), writer=None,
               changed: bool = True) -> None:
        """New weights computed on the device (parameters laid out as ``packing`` says) by the
        call of the executor ``writer``; the host copy is refreshed lazily. Host writes made
        before this call, which ran without them, count as seen: copying back overwrites them.
        ``changed=False``: the call returned the weights it took (an inference call that updates
        no buffer): the host copy stays as fresh as it was, and host writes not yet loaded still
        reach the device at the next call."""
        self.params, self.buffers, self.packing = params, buffers, packing
        if not changed:
            return
        self.host_stale = True
        self._writer = None if writer is None else weakref.ref(writer)
        self._data_read.clear()
        self._agreed = {name: (tensor, tensor._version, tensor.data_ptr())
                        for name, (tensor, _, _) in self._agreed.items()}
        self._statistics.update((name, tensor.detach().clone()) for name, (tensor, _, _) in self._agreed.items()
                                if name in self._statistics)

    def load_host_writes(self) -> None:
        """Only the tensors the host wrote since the device's last update become the device's
        (the device keeps the rest, which may be newer than the host's copy); a member of a
        stack is written into its row. The callbacks get the keys written, in the store's layout
        (a stack's key for its members)."""
        with self.lock:
            if self.params is None:
                return
            written = self.host_writes()
            if not written:
                return
            tensors = [(n, t) for n, t in _host_tensors(self.module) if n in written]
            rows = {name: (stack.key, row) for stack in self.packing.stacks for row, name in enumerate(stack.members)}
            params, buffers, keys = dict(self.params), dict(self.buffers), set()
            for name, tensor in tensors:
                if name in rows:
                    key, row = rows[name]
                    params[key] = params[key].at[row].set(to_jax(tensor, f"parameter {name}"))
                elif name in params:
                    key, params[name] = name, to_jax(tensor, f"parameter {name}")
                elif name in buffers:
                    key, buffers[name] = name, to_jax(tensor, f"buffer {name}")
                else:
                    continue
                keys.add(key)
            self.params, self.buffers = params, buffers
            self._agree(tensors)
            for callback in self.on_host_load:
                callback(keys)

    def forget(self, executor) -> bool:
        """The device's weights reach the host and ``executor`` leaves them (its callbacks too);
        whether other executors still use them."""
        with self.lock:
            self.sync_to_host()
            self.executors.discard(executor)
            self.on_host_sync = [c for c in self.on_host_sync if getattr(c, "__self__", None) is not executor]
            self.on_host_load = [c for c in self.on_host_load if getattr(c, "__self__", None) is not executor]
            if self.last_writer() is executor:
                self._writer = None
            return bool(self.executors)

    def last_writer(self):
        """The executor whose call computed the device's weights last (None: none alive)."""
        return None if self._writer is None else self._writer()

    def implicit_copy(self) -> None:
        """The copy a host access makes when the device is ahead: as in PopTorch, the
        ``copyWeightsToHost`` of the executor whose call computed the weights (a wrapper the
        user put on it sees each implicit copy), else the copy itself."""
        writer = self.last_writer()
        if writer is None:
            self.sync_to_host()
        else:
            writer.copyWeightsToHost()

    def host_writes(self) -> set[str]:
        """The host tensors written since the device's last update (or never loaded)."""
        tensors = _host_tensors(self.module)
        written = {name for name, tensor in tensors
                   if not self._agrees(name, tensor) or id(tensor) in self._data_read
                   or (name in self._statistics and not torch.equal(tensor, self._statistics[name]))}
        return written | _running_statistics_updated(written, tensors)

    def sync_to_host(self) -> None:
        """Write the device's weights into the module's tensors, in place (``copyWeightsToHost``),
        except those the host wrote since the device's last update."""
        with self.lock:
            if not self.host_stale:
                return
            self.host_stale = False
            host = jax.device_get((self.params, self.buffers))
            host = (self.packing.unpack_host(host[0]), host[1])
            copied = []
            with torch.no_grad():
                for source, named in ((host[0], torch.nn.Module.named_parameters(self.module)),
                                      (host[1], torch.nn.Module.named_buffers(self.module))):
                    for name, tensor in named:
                        if name in source and self._agrees(name, tensor):
                            tensor.copy_(to_torch(source[name], tensor.dtype))
                            copied.append((name, tensor))
            self._agree(copied)
            for callback in self.on_host_sync:
                callback()

    def _agrees(self, name: str, tensor: torch.Tensor) -> bool:
        agreed = self._agreed.get(name)
        return (agreed is not None and agreed[0] is tensor and agreed[1] == tensor._version
                and agreed[2] == tensor.data_ptr())

    def _agree(self, tensors) -> None:
        """``tensors`` hold the device's values now; parameters among them show them from now
        on wherever they are held (one assigned since the module's first executor too)."""
        tensors = list(tensors)
        hold([tensor for _, tensor in tensors if isinstance(tensor, torch.nn.Parameter)], self)
        self._agreed.update((name, (tensor, tensor._version, tensor.data_ptr())) for name, tensor in tensors)
        self._data_read.difference_update(id(tensor) for _, tensor in tensors)
        self._statistics.update((name, tensor.detach().clone()) for name, tensor in tensors
                                if name in self._statistics)

    def parameter_read(self, parameter: torch.nn.Parameter, attribute: str) -> None:
        """A parameter of the module, wherever held, is read (``held_parameters.py``): the
        device's weights reach the host first; a read of ``.data`` counts as a host write."""
        with quiet():
            if self.reads_refused is not None:
                name = next((n for n, p in self.module.named_parameters() if p is parameter), "a parameter")
                raise Error(f"{name} was read {self.reads_refused}")
            if self.host_stale:
                self.implicit_copy()
            if attribute == "data":
                self._data_read.add(id(parameter))


def weight_store(module: torch.nn.Module) -> WeightStore:
    """The one store of ``module``, created (and the module made host-syncing) on first use."""
    store = _STORES.get(module)
    if store is None:
        store = _STORES[module] = WeightStore(module)
        _make_host_syncing(module)
    return store


@contextlib.contextmanager
def weight_reads_refused(module: torch.nn.Module, why: str):
    """Within the block, a read of a parameter of ``module`` (its values: metadata and ``.grad``
    stay readable) raises an error saying it was read ``why``: where what the host would show
    is not what torch shows there."""
    store = weight_store(module)
    store.reads_refused = why
    try:
        yield
    finally:
        store.reads_refused = None


def refuse_second_training_wrapper(module: torch.nn.Module) -> None:
    """PopTorch's rule: a module has one ``trainingModel`` wrapper at a time, so that no two
    optimizer states train its weights. A wrapper holds the module once it has compiled, until it
    is destroyed (which clears its compiled programs)."""
    store = _STORES.get(module)
    wrapper = None if store is None or store.training_wrapper is None else store.training_wrapper()
    if wrapper is not None and wrapper.isCompiled():
        raise Error("Model has already been wrapped in 'poptorch.trainingModel'. Call model.destroy() on "
                    "the model to unwrap before wrapping again. (Or call destroy() on the executor "
                    "trainingModel returned; an inferenceModel of the same module needs neither.)")


def claim_for_training(module: torch.nn.Module, executor) -> None:
    """Record ``executor`` as the module's ``trainingModel`` wrapper."""
    weight_store(module).training_wrapper = weakref.ref(executor)


def release(module: torch.nn.Module, executor) -> None:
    """``executor`` no longer uses the module's device weights, which reach the host first. Once
    no other executor uses them, the module forgets them and gets its own class back; until then
    the others keep them, and the host keeps showing their updates."""
    store = _STORES.get(module)
    if store is not None:
        if store.forget(executor):
            return
        del _STORES[module]
        let_go(torch.nn.Module.parameters(module))
    cls = type(module)
    if getattr(cls, "_ipu_original_class", None) is not None:
        module.__class__ = cls._ipu_original_class


def _sync(module) -> None:
    store = _STORES.get(module)
    if store is not None and store.host_stale:
        with quiet():
            store.implicit_copy()


class _HostSyncing:
    """Accessors that show the device's weights; mixed in front of the user's module class."""

    _ipu_original_class = None

    def __getattr__(self, name):
        _sync(self)
        return super().__getattr__(name)

    def __call__(self, *args, **kwargs):
        _sync(self)
        return super().__call__(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        _sync(self)
        return super().state_dict(*args, **kwargs)

    def named_parameters(self, *args, **kwargs):
        _sync(self)
        return super().named_parameters(*args, **kwargs)

    def parameters(self, *args, **kwargs):
        _sync(self)
        return super().parameters(*args, **kwargs)

    def named_buffers(self, *args, **kwargs):
        _sync(self)
        return super().named_buffers(*args, **kwargs)

    def buffers(self, *args, **kwargs):
        _sync(self)
        return super().buffers(*args, **kwargs)

    def __reduce_ex__(self, protocol):
        """Pickled and copied (``torch.save``, ``copy.deepcopy``) as the user's own class, with
        the device's weights: the subclass exists only in this process."""
        _sync(self)
        _, args, *rest = super().__reduce_ex__(protocol)
        return (_new_instance, (self._ipu_original_class, *args[1:]), *rest)


def _destroy(self) -> None:
    """Destroy every executor of this module (PopTorch's ``model.destroy()``)."""
    store = _STORES.get(self)
    for executor in list(store.executors if store is not None else ()):
        executor.destroy()


def _copy_weights_to_host_if_needed(self) -> bool:
    """Copy the device's weights into the module if they changed; whether they did."""
    store = _STORES.get(self)
    stale = store is not None and store.host_stale
    _sync(self)
    return stale


_MODEL_METHODS = {"destroy": _destroy, "copyWeightsToHostIfNeeded": _copy_weights_to_host_if_needed}
"""What PopTorch adds to a wrapped model's class, added where the class has no such name."""


def _new_instance(cls, *args):
    """Unpickling a module pickled by ``_HostSyncing.__reduce_ex__``: a bare instance of ``cls``."""
    return cls.__new__(cls, *args)


def _make_host_syncing(module: torch.nn.Module) -> None:
    cls = type(module)
    if issubclass(cls, _HostSyncing):
        return
    methods = {name: method for name, method in _MODEL_METHODS.items() if not hasattr(cls, name)}
    module.__class__ = type(cls.__name__, (_HostSyncing, cls),
                            {"_ipu_original_class": cls, "__qualname__": cls.__qualname__,
                             "__module__": cls.__module__, **methods})
