"""Repeated layers captured once: while the model is captured, each layer of a run (see
``repeated_layers``) stands in as one call of the custom op ``ipu_backend::repeated_layer``,
taking the layer's tensor inputs and its own parameters and buffers (none, and which layer it
is, where the layer's weights are held out of the export: ``layer_weights``), so that capturing
a model costs the same whatever its depth. Each distinct call (a run's layers with inputs of one
shape) is then captured once on its own, as the *template* every call of it is lowered with
(``lowerings/layers.py``; ``layer_loops`` turns a chain of calls into one loop).

The op's shapes come from running one layer's forward on fake tensors, once per distinct call.
Buffers the layer updates (batch-norm statistics) are outputs of the op, copied into the
buffers after it, so the model's graph updates them as an unrolled capture does. A layer whose
template shows what a stand-in cannot carry (it updates its inputs or parameters in place, opens
pipeline blocks, marks a loss, or disagrees with its fake run) is captured inline instead: the
model is captured again without its run.
"""

import contextlib
import contextvars
import inspect
from dataclasses import dataclass

import torch
import torch.utils._pytree as torch_pytree
from torch._guards import detect_fake_mode
from torch.export.graph_signature import InputKind, OutputKind
from torch.nn.utils import stateless

from ipu_backend.compiler import capture, layer_weights
from ipu_backend.compiler.custom_ops import IDENTITY_LOSS
from ipu_backend.errors import Error

TEMPLATE_KEY = "ipu_layer_template"
"""``node.meta[TEMPLATE_KEY]``: the :class:`Template` a ``repeated_layer`` node is lowered with."""


@torch.library.custom_op("ipu_backend::repeated_layer", mutates_args=())
def _repeated_layer(inputs: list[torch.Tensor], state: list[torch.Tensor], call: int, held: int) -> list[torch.Tensor]:
    raise Error("ipu_backend::repeated_layer stands in for a layer only while a model is captured")


REPEATED_LAYER = torch.ops.ipu_backend.repeated_layer.default


@dataclass(frozen=True)
class _Place:
    """A marker with a stable description (``identity.describe``), compared by ``is``."""

    name: str


TENSOR = _Place("tensor")
"""Marks where a tensor goes among the leaves of a layer's inputs or outputs."""


class NotRepeatable(Exception):
    """A run whose layers cannot stand in as calls: the model is captured again without it."""

    def __init__(self, run: int, reason: str):
        super().__init__(reason)
        self.run = run


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorMeta":
        return cls(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device)

    def empty(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)


@dataclass
class LayerCall:
    """One distinct call of a run's layers: the layer that stands for them all, the names of the
    state it takes (parameters, then buffers, duplicates kept), how its inputs are laid out, and,
    once a fake run gave them, its outputs: their layout, the metadata of their tensors and the
    buffers whose new values follow the outputs' tensors (all of them)."""

    index: int
    run: int
    module: torch.nn.Module
    param_names: tuple[str, ...]
    buffer_names: tuple[str, ...]
    in_spec: torch_pytree.TreeSpec
    in_leaves: tuple                    # non-tensor leaves; TENSOR where a tensor goes
    in_metas: tuple[TensorMeta, ...]
    out_spec: torch_pytree.TreeSpec | None = None
    out_leaves: tuple = ()
    out_metas: tuple[TensorMeta, ...] = ()
    mutated: tuple[str, ...] = ()
    evaluated: bool = False

    @property
    def state_names(self) -> tuple[str, ...]:
        return self.param_names + self.buffer_names

    def arguments(self, tensors) -> tuple:
        """The positional arguments of the layer's forward, ``tensors`` put in place."""
        tensors = iter(tensors)
        leaves = [next(tensors) if leaf is TENSOR else leaf for leaf in self.in_leaves]
        return torch_pytree.tree_unflatten(leaves, self.in_spec)

    def fake_run(self, inputs, state) -> None:
        """The layer's forward on fake ``inputs`` and ``state``: what its outputs look like. Every
        buffer's value after the forward is an output too (fake tensors cannot tell which ones
        changed): the model's graph then updates each, most to the value it had."""
        params = dict(zip(self.param_names, state))
        buffers = {name: value.clone() for name, value in zip(self.buffer_names, state[len(self.param_names):])}
        annotations = capture.annotations()
        with stateless._reparametrize_module(self.module, {**params, **buffers}):
            outputs = _original_forward(self.module)(*self.arguments(inputs))
            after = {name: getattr_path(self.module, name) for name in self.buffer_names}
        if capture.annotations() != annotations:
            raise NotRepeatable(self.run, "the layer opens pipeline blocks")
        self.mutated = tuple(dict.fromkeys(self.buffer_names))
        leaves, self.out_spec = torch_pytree.tree_flatten(outputs)
        self.out_leaves = tuple(TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves)
        self.out_metas = tuple(TensorMeta.of(leaf) for leaf in leaves if isinstance(leaf, torch.Tensor))
        self.out_metas += tuple(TensorMeta.of(after[name]) for name in self.mutated)
        self.evaluated = True

    def results(self, tensors) -> object:
        """The layer's outputs from the op's tensors (the updated buffers' values left out)."""
        tensors = iter(tensors)
        leaves = [next(tensors) if leaf is TENSOR else leaf for leaf in self.out_leaves]
        return torch_pytree.tree_unflatten(leaves, self.out_spec)


def getattr_path(module: torch.nn.Module, name: str):
    for part in name.split("."):
        module = getattr(module, part)
    return module


def _original_forward(module: torch.nn.Module):
    """The layer's own forward (its class's), not the stand-in installed on the instance."""
    return type(module).forward.__get__(module)


_CAPTURE: contextvars.ContextVar["StandIns | None"] = contextvars.ContextVar("layer_stand_ins", default=None)


@_repeated_layer.register_fake
def _(inputs, state, call, held):
    stand_ins = _CAPTURE.get()
    if stand_ins is None:
        raise Error("ipu_backend::repeated_layer was traced outside the capture that made it")
    layer_call = stand_ins.calls[call]
    if not layer_call.evaluated:
        layer_call.fake_run(inputs, state if held < 0 or state else stand_ins.fake_state(held, layer_call, inputs))
    return [meta.empty() for meta in layer_call.out_metas]


def _key_of(leaf):
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), leaf.dtype, leaf.device)
    try:
        hash(leaf)
    except TypeError:
        return ("object", id(leaf))
    return (type(leaf), leaf)


class StandIns:
    """The layers of ``runs`` standing in as op calls while installed (see :meth:`installed`).
    Given the exported ``root``, the weights of the layers of each run but those in ``in_place``
    are held out of the export while installed (``layer_weights``), and put back by
    :meth:`complete`."""

    def __init__(self, runs: list[tuple[torch.nn.Module, ...]], root: torch.nn.Module | None = None,
                 in_place: frozenset[int] = frozenset()):
        self.runs = runs
        self.calls: list[LayerCall] = []
        self._by_key: dict = {}
        self._held = None if root is None else layer_weights.Held(root)
        self._in_place = in_place

    @contextlib.contextmanager
    def installed(self):
        token = _CAPTURE.set(self)
        patched = []
        try:
            for run_index, run in enumerate(self.runs):
                hold = (self._held is not None and run_index not in self._in_place
                        and layer_weights.holdable(self._held.root, run))
                for position, layer in enumerate(run):
                    if "forward" not in vars(layer):
                        held = self._held.hold(run_index, layer) if hold and position else None
                        layer.forward = self._stand_in(run_index, run[0], layer, held)
                        patched.append(layer)
            yield self
        finally:
            if self._held is not None:
                self._held.release()
            for layer in patched:
                del layer.forward
            _CAPTURE.reset(token)

    def refused_holding(self) -> int | None:
        """A run whose held weights the model's code read while installed (exported again with
        its weights in place), else None."""
        return self._held.refused[0] if self._held is not None and self._held.refused else None

    def complete(self, exported: torch.export.ExportedProgram) -> None:
        """Put the held weights back into ``exported`` (see ``layer_weights``): raises
        :class:`~ipu_backend.compiler.layer_weights.NotHeld` where a held layer's call is inside
        a nested graph (a ``torch.no_grad()`` block), whose inputs the weights would miss."""
        if self._held is None or not self._held.layers:
            return
        if self._held.refused:       # the model's code caught the refusal
            raise layer_weights.NotHeld(self._held.refused[0], "the model's code reads held weights")
        calls = _held_calls(exported.graph_module)
        nested = [node for module in exported.graph_module.modules()
                  if isinstance(module, torch.fx.GraphModule) and module is not exported.graph_module
                  for node in _held_calls(module)]
        if nested:
            self._held.refuse(self.calls[nested[0].args[2]].run, "a layer is called in a nested graph")
        self._held.put_back(exported, calls, lambda node: self.calls[node.args[2]].state_names)

    def fake_state(self, held: int, call: LayerCall, inputs) -> list[torch.Tensor]:
        """A held layer's weights as fake tensors of the export's, for a fake run of ``call``."""
        fake_mode = detect_fake_mode(inputs)
        if fake_mode is None:
            self._held.refuse(call.run, "the layer takes no tensors")
        tensors = self._held.layers[held]
        return [fake_mode.from_tensor(tensors[name], static_shapes=True) for name in call.state_names]

    def _stand_in(self, run_index: int, first: torch.nn.Module, layer: torch.nn.Module, held: int | None):
        parameters = inspect.signature(_original_forward(first))

        def forward(*args, **kwargs):
            if torch.compiler.is_dynamo_compiling():      # a torch.cond branch, traced by torch's compiler
                return _original_forward(layer)(*args, **kwargs)
            bound = parameters.bind(*args, **kwargs)
            bound.apply_defaults()
            if bound.kwargs:         # keyword-only parameters: capture the layer inline
                raise NotRepeatable(run_index, "the layer's forward takes keyword-only arguments")
            call = self._call(run_index, first, tuple(bound.args))
            tensors = [leaf for leaf in torch_pytree.tree_leaves(tuple(bound.args)) if isinstance(leaf, torch.Tensor)]
            if held is not None:     # no buffers: nothing to update after the call
                return call.results(REPEATED_LAYER(tensors, [], call.index, held))
            named = dict(layer.named_parameters(remove_duplicate=False))
            named.update(layer.named_buffers(remove_duplicate=False))
            outputs = REPEATED_LAYER(tensors, [named[name] for name in call.state_names], call.index, -1)
            produced = len(outputs) - len(call.mutated)
            for name, value in zip(call.mutated, outputs[produced:]):
                named[name].copy_(value)
            return call.results(outputs[:produced])

        return forward

    def _call(self, run_index: int, first: torch.nn.Module, args: tuple) -> LayerCall:
        leaves, spec = torch_pytree.tree_flatten(args)
        key = (run_index, spec, tuple(_key_of(leaf) for leaf in leaves))
        call = self._by_key.get(key)
        if call is None:
            call = LayerCall(
                index=len(self.calls), run=run_index, module=first,
                param_names=tuple(n for n, _ in first.named_parameters(remove_duplicate=False)),
                buffer_names=tuple(n for n, _ in first.named_buffers(remove_duplicate=False)),
                in_spec=spec,
                in_leaves=tuple(TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves),
                in_metas=tuple(TensorMeta.of(leaf) for leaf in leaves if isinstance(leaf, torch.Tensor)))
            self.calls.append(call)
            self._by_key[key] = call
        return call


def _held_calls(graph_module: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The ``repeated_layer`` calls of held layers in ``graph_module``'s own graph."""
    return [node for node in graph_module.graph.nodes if node.target is REPEATED_LAYER and node.args[3] >= 0]


class _LayerForward(torch.nn.Module):
    """Exports a layer's own forward, without the hooks its ``__call__`` would run."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, *args):
        return _original_forward(self.layer)(*args)


@dataclass(frozen=True)
class Template:
    """A layer call captured once: ``program`` computes one layer from its inputs (laid out as
    ``call`` says) and its own weights."""

    call: LayerCall
    program: object                    # compiler.program.Program (imported lazily: no cycle)

    @property
    def output_count(self) -> int:
        return len(self.call.out_metas)


def capture_template(call: LayerCall, build, decompose=None) -> Template:
    """Capture ``call``'s layer on its own (decomposed by ``decompose``, see ``capture.export``);
    ``build(module, exported, prefix)`` makes the Program. Raises :class:`NotRepeatable` when the
    template shows what a stand-in cannot carry."""
    example = call.arguments(torch.zeros(m.shape, dtype=m.dtype, device=m.device) for m in call.in_metas)
    exported = capture.export(_LayerForward(call.module), example, decompose=decompose)
    signature = exported.graph_signature
    kinds = {spec.kind for spec in signature.output_specs}
    if kinds - {OutputKind.USER_OUTPUT, OutputKind.BUFFER_MUTATION}:
        raise NotRepeatable(call.run, "the layer updates its inputs or parameters in place")
    if any(spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.USER_INPUT, InputKind.CONSTANT_TENSOR)
           for spec in signature.input_specs):
        raise NotRepeatable(call.run, "the layer's capture has inputs of another kind")
    mutated = [spec for spec in signature.output_specs if spec.kind == OutputKind.BUFFER_MUTATION]
    nodes = list(exported.graph_module.graph.nodes)
    if any(node.target is IDENTITY_LOSS or capture.annotations(node) for node in nodes):
        raise NotRepeatable(call.run, "the layer marks a loss or annotates its operations (pipeline blocks)")
    output = nodes[-1].args[0][len(mutated):]
    metas = [node.meta.get("val") if isinstance(node, torch.fx.Node) else None for node in output]
    tensors = [m for m in metas if isinstance(m, torch.Tensor)]
    if [(tuple(t.shape), t.dtype) for t in tensors] != [(m.shape, m.dtype) for m in call.out_metas[:len(tensors)]] \
            or len(tensors) + len(call.mutated) != len(call.out_metas):
        raise NotRepeatable(call.run, "the layer's outputs differ between captures")
    return Template(call, build(call.module, exported, "layer."))
