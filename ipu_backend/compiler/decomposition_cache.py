"""Decompositions kept between processes: a capture whose exported graph equals one decomposed
before, in a store the runtime provides (the executable cache's directory), takes that
decomposition instead of running it again.

Decomposing to core ATen traces the exported graph once more, about half of a capture's time,
and a second process running the same script exports the same graph: without this its warm start
would be mostly that trace. The key is everything the decomposition reads: the exported graph
(every node's operation, arguments and metadata, source lines and tensors' strides included), its
signature, constants and weights, and the lowering options that choose how attention decomposes;
the store adds the versions, package source and backend (``executable_cache.environment``).

An entry holds the decomposed graph written plainly (operation names, arguments, tensor
metadata, the metadata lowerings read, source lines) and its digest. A rebuilt graph whose digest
(``identity.graph_digest``, everything a lowering reads) differs from the one written is dropped
and the graph decomposed again, so an entry can only stand in for an equal graph. Graphs with
nested graphs (``torch.cond`` branches), symbolic shapes or operations that are not named ops are
not kept.
"""

import contextlib
import contextvars
import importlib
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import jax
import torch
import torch.fx
from torch._export.verifier import SpecViolationError
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from ipu_backend.compiler import identity
from ipu_backend.compiler.lowering_options import current_options

FORMAT = 1

_PYTHON_MODULES = ("operator", "_operator", "builtins", "math")
"""Modules whose functions a decomposed graph may call besides ops (``operator.getitem``)."""


class Store(Protocol):
    """Where entries live, by key: the runtime's executable cache."""

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, data: bytes) -> None: ...


_STORE: contextvars.ContextVar[Store | None] = contextvars.ContextVar("decomposition_store", default=None)


@contextlib.contextmanager
def kept_in(store: Store | None) -> Iterator[None]:
    """Within the block, captures take and keep their decompositions in ``store`` (None: not kept)."""
    token = _STORE.set(store)
    try:
        yield
    finally:
        _STORE.reset(token)


def decomposed(exported: torch.export.ExportedProgram,
               decompose: Callable[[torch.export.ExportedProgram], torch.export.ExportedProgram]):
    """``decompose(exported)``, taken from the store when it holds an equal graph's, else run
    and kept there."""
    store = _STORE.get()
    key = None if store is None else key_of(exported)
    if key is None:
        return decompose(exported)
    data = store.get(key)
    if data is not None:
        rebuilt = read(data, exported)
        if rebuilt is not None:
            return rebuilt
    result = decompose(exported)
    data = written(result)
    if data is not None:
        store.put(key, data)
    return result


def key_of(exported: torch.export.ExportedProgram) -> str | None:
    """The digest of what decomposing ``exported`` reads; None when some value in it has no
    stable description."""
    graphs = [module for module in exported.graph_module.modules() if isinstance(module, torch.fx.GraphModule)]
    try:
        return identity.digest((
            FORMAT,
            identity.graph_digest(exported.graph_module),          # nested graphs included
            [[(node.name, node.meta.get("stack_trace"), _layout(node.meta.get("val"))) for node in graph.graph.nodes]
             for graph in graphs],
            list(exported.graph_signature.input_specs), list(exported.graph_signature.output_specs),
            exported.call_spec.in_spec, exported.call_spec.out_spec,
            sorted((name, identity.describe(value)) for name, value in exported.constants.items()),
            sorted((name, _layout(value)) for name, value in exported.state_dict.items()),
            current_options(), jax.default_backend()))
    except identity.Unidentifiable:
        return None


def _layout(value) -> object:
    """What the digest leaves out of the tensors in a node's value (it has shapes and dtypes)."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.stride()), value.storage_offset(), value.device.type, value.requires_grad)
    if isinstance(value, (tuple, list)):
        return tuple(_layout(v) for v in value)
    return None


class _Unwritable(Exception):
    """A part of the graph this module does not write down."""


@dataclass(frozen=True)
class _Ref:
    """A node among another node's arguments, by name."""

    name: str


@dataclass(frozen=True)
class _TensorRecord:
    """A fake tensor's metadata, made again as a fake tensor when read."""

    shape: tuple
    stride: tuple
    storage_offset: int
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool


def written(exported: torch.export.ExportedProgram) -> bytes | None:
    """``exported`` (decomposed) as an entry, or None when it holds what is not written down."""
    graph_module = exported.graph_module
    try:
        nodes = [_written_node(node) for node in graph_module.graph.nodes]
        entry = {"format": FORMAT, "nodes": nodes, "signature": exported.graph_signature,
                 "module_call_graph": exported.module_call_graph, "constants": dict(exported.constants),
                 "graph_meta": dict(graph_module.meta), "verifiers": list(exported.verifiers),
                 "digest": identity.graph_digest(graph_module)}
        return pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL)
    except (_Unwritable, identity.Unidentifiable, pickle.PicklingError, TypeError, AttributeError):
        return None


def _written_node(node: torch.fx.Node) -> tuple:
    if node.op not in ("placeholder", "call_function", "output"):
        raise _Unwritable(node.op)
    args = torch.fx.node.map_arg((node.args, node.kwargs), lambda source: _Ref(source.name))
    meta = [(key, _written_value(value) if key == "val" else value) for key, value in node.meta.items()
            if key == "stack_trace" or key not in identity.DEBUG_META]
    return node.op, node.name, _target_name(node.target), args, meta


def _target_name(target) -> tuple:
    if isinstance(target, str):
        return ("str", target)
    if isinstance(target, torch._ops.OpOverload):
        return ("op", target._schema.name, target._overloadname)
    module = getattr(target, "__module__", None)
    if module in _PYTHON_MODULES and callable(target):
        return ("python", module, target.__name__)
    raise _Unwritable(f"call of {target}")


def _written_value(value):
    if isinstance(value, FakeTensor):
        return _TensorRecord(tuple(value.shape), tuple(value.stride()), value.storage_offset(), value.dtype,
                             value.device, value.requires_grad)
    if isinstance(value, (tuple, list)):
        return type(value)(_written_value(v) for v in value)
    if value is None or type(value) in (bool, int, float):
        return value
    raise _Unwritable(f"a value of type {type(value).__name__}")


def read(data: bytes, exported: torch.export.ExportedProgram) -> torch.export.ExportedProgram | None:
    """The decomposition an entry holds, over ``exported``'s weights; None when the entry cannot be
    read or its graph does not come back equal to the one written."""
    try:
        entry = pickle.loads(data)
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError, TypeError, IndexError):
        return None
    if not isinstance(entry, dict) or entry.get("format") != FORMAT:
        return None
    graph = torch.fx.Graph()
    made: dict[str, torch.fx.Node] = {}
    mode = FakeTensorMode()
    try:
        for op, name, target, args, meta in entry["nodes"]:
            args, kwargs = torch.fx.node.map_aggregate(args, lambda a: made[a.name] if isinstance(a, _Ref) else a)
            node = graph.create_node(op, _resolved(target), tuple(args), dict(kwargs), name=name)
            node.name = name        # as torch.export names it (fx renames Python's builtins: input)
            node.meta.update((key, _fake(value, mode) if key == "val" else value) for key, value in meta)
            made[name] = node
    except (_Unwritable, AttributeError, KeyError):
        return None
    graph_module = torch.fx.GraphModule(torch.nn.Module(), graph)
    graph_module.meta.update(entry["graph_meta"])
    try:
        rebuilt = torch.export.ExportedProgram(
            root=graph_module, graph=graph_module.graph, graph_signature=entry["signature"],
            state_dict=exported.state_dict, range_constraints={}, module_call_graph=entry["module_call_graph"],
            example_inputs=exported.example_inputs, constants=entry["constants"], verifiers=entry["verifiers"])
        same = identity.graph_digest(rebuilt.graph_module) == entry["digest"]
    except (SpecViolationError, identity.Unidentifiable):
        return None
    return rebuilt if same else None


def _resolved(name: tuple):
    kind, *parts = name
    if kind == "str":
        return parts[0]
    if kind == "op":
        namespace, _, op = parts[0].partition("::")
        return getattr(getattr(getattr(torch.ops, namespace), op), parts[1] or "default")
    if kind == "python" and parts[0] in _PYTHON_MODULES:
        return getattr(importlib.import_module(parts[0]), parts[1])
    raise _Unwritable(f"target {name}")


def _fake(value, mode: FakeTensorMode):
    """A node's ``val`` again: fake tensors made from meta tensors directly (a fake mode's own
    dispatch for each would be most of the time reading takes)."""
    if isinstance(value, _TensorRecord):
        meta = torch.empty_strided(value.shape, value.stride, dtype=value.dtype, device="meta")
        if value.storage_offset:
            meta = meta.as_strided(value.shape, value.stride, value.storage_offset)
        tensor = mode.fake_tensor_converter.from_meta_and_device(mode, meta, torch.device(value.device))
        return tensor.requires_grad_(value.requires_grad) if value.requires_grad else tensor
    if isinstance(value, (tuple, list)):
        return type(value)(_fake(v, mode) for v in value)
    return value
