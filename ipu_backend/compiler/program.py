"""A compiled program: a pure JAX step function plus what a runtime needs to drive it."""

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import jax
import torch
import torch.utils._pytree as torch_pytree
from torch._dynamo.exc import InternalTorchDynamoError, UncapturedHigherOrderOpError
from torch.export.graph_signature import InputKind, OutputKind

from ipu_backend.compiler import (
    attribute_writes,
    capture,
    decomposition_cache,
    global_reads,
    host_random,
    identity,
    index_bounds,
    interpreter,
    layer_calls,
    layer_loops,
    layer_weights,
    list_appends,
    metric_states,
    python_reads,
    repeated_layers,
)
from ipu_backend.compiler.dtypes import to_jax
from ipu_backend.compiler.global_reads import NameRead
from ipu_backend.compiler.python_reads import HookGuard, Read, ValueRead
from ipu_backend.compiler.sources import user_location
from ipu_backend.errors import Error


CAPTURE_EVENT = "/ipu_backend/compiler/capture"
"""The ``jax.monitoring`` event (a duration and a time span) that :func:`compile_module` records
for each capture: torch.export and the decomposition to core ATen. JAX records its own phases
(``/jax/core/compile/...``: tracing, MLIR lowering, XLA compilation) alike."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple
    dtype: torch.dtype


@dataclass(frozen=True)
class IndexInput:
    """A user input that is, through views only, the indices an operation reads or writes at
    (``index_bounds``): torch checks them as it runs; the host checks this input before each
    call."""

    position: int
    """The input's position among the call's flattened inputs (tensors and constants)."""
    size: int
    """The size of the dimension indexed: values must lie in ``[low, size)``."""
    location: str
    low: int = 0
    dim: int = 0
    ignored: int | None = None
    """A value a loss's target may hold to be ignored (``cross_entropy``'s ``ignore_index``)."""
    kind: str = "index"
    """``"rows"`` (an embedding's), ``"target"`` (a loss's class) or ``"index"``."""


def _index_inputs(graph_module: torch.fx.GraphModule, user_inputs: dict) -> tuple[IndexInput, ...]:
    """The index arguments whose values come straight from a user input (``user_inputs``:
    placeholder node -> its position among the inputs); each such argument's number is kept in
    its node's ``meta[index_bounds.HOST_CHECKED]``."""
    found = []
    for node in graph_module.graph.nodes:
        checked = set()
        for number, use in enumerate(index_bounds.index_uses(node)):
            source, ignored = index_bounds.input_source(use.index)
            if source not in user_inputs:
                continue
            checked.add(number)
            kind = ("rows" if node.target in index_bounds.ROWS else "target" if ignored is not None
                    else "index")
            found.append(IndexInput(user_inputs[source], use.size,
                                    user_location(node.meta.get("stack_trace")) or "unknown source line",
                                    use.low, use.dim, ignored, kind))
        if checked:
            node.meta[index_bounds.HOST_CHECKED] = frozenset(checked)
    return tuple(found)


def _carries_gradient(node: torch.fx.Node) -> bool:
    """Whether ``node``'s value can carry a gradient: floating point (or holding some)."""
    value = node.meta.get("val")
    values = value if isinstance(value, (tuple, list)) else [value]
    return node.op == "get_attr" or any(
        isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) for v in values)


@dataclass(frozen=True)
class Program:
    """``fn(params, buffers, inputs, rng_key) -> (outputs, new_buffers)``, pure and jittable.

    ``params``/``buffers`` map state_dict names to JAX arrays; ``inputs`` is the tuple of
    positional arguments (JAX arrays where torch had tensors); ``new_buffers`` holds every
    buffer, mutated ones updated. ``logged_fn`` also returns the ``self.log`` values by name.
    When the program updates some of its inputs in place (``mutated_inputs``: their indices among
    the flattened inputs), ``outputs`` is ``(outputs, new values of those inputs)``. ``params``
    may hold the members of each of ``stacks`` as one stacked array under its key.
    """

    logged_fn: Callable
    params: tuple[TensorSpec, ...]
    buffers: tuple[TensorSpec, ...]
    mutated_buffers: tuple[str, ...]
    output_spec: torch_pytree.TreeSpec
    logs: tuple[capture.LogCall, ...]
    source_locations: dict
    graph_module: torch.fx.GraphModule
    mutated_inputs: tuple[int, ...] = ()
    stacks: tuple[layer_loops.Stack, ...] = ()
    """Parameters that ``params`` may hold stacked, one array per stack (see ``layer_loops.Stack``)."""
    index_inputs: tuple[IndexInput, ...] = ()
    param_placeholders: dict = field(default_factory=dict)
    """Placeholder node name -> the parameter it reads."""
    aliases: dict = field(default_factory=dict)
    """Other names of tied parameters and buffers -> the name the program reads them under."""
    keywords: tuple[str, ...] = ()
    """The names under which the last inputs are passed by keyword."""
    python_reads: tuple[Read | NameRead | HookGuard | ValueRead, ...] = ()
    """The plain Python attributes of the module that the capture read, the globals and closure
    variables its code can read (``global_reads``), the values a step read through its caller's
    adapter (``capture.step_arguments``), its tensor constants and its hooks, and the optimizer
    hyper-parameters a step read from param groups or schedulers (``optimizer_reads``,
    added by the executor that owns the optimizers), with their values: the program is what the
    module computes only while they keep them (``python_reads.changed``)."""
    identity: str | None = None
    """What the program computes, as a digest (:mod:`~ipu_backend.compiler.identity`): equal for
    captures that lower to the same function, None when some value in it has no stable
    description (the program is then never shared)."""
    host_input: int | None = None
    """The position of the input known on the host per micro-batch, when the capture branched
    on it in Python (``guards``)."""
    guards: tuple = ()
    """The Python values the capture took from tensors of ``host_input``, in order
    (:class:`~ipu_backend.compiler.host_branches.Guard`): the branches this capture follows."""
    assignments: tuple = ()
    """What the captured code (a forward or a step method) assigned on its module's tree, made on
    the host after each call (:class:`~ipu_backend.compiler.attribute_writes.Assignment`)."""
    variants: tuple = ()
    """The captures (:class:`~ipu_backend.compiler.host_branches.Variant`) of a step that
    branches on ``host_input``: each micro-batch runs the one whose guards hold for it. With
    several, ``logged_fn`` takes each micro-batch's variant as one more input, last
    (:func:`~ipu_backend.compiler.host_branches.combined`)."""

    def parameters_with_gradient(self, node: torch.fx.Node) -> frozenset[str]:
        """The parameters whose values reach ``node`` through floating-point values and no
        ``detach``: those to which autograd gives a gradient of ``node`` (torch leaves the
        others' ``.grad`` None, and its optimizers skip them)."""
        reached = capture.placeholders_reached(node, _carries_gradient)
        return frozenset(self.param_placeholders[p.name] for p in reached if p.name in self.param_placeholders)

    @property
    def num_mutations(self) -> int:
        """How many of the graph's first outputs are new values of buffers and inputs."""
        return len(self.mutated_buffers) + len(self.mutated_inputs)

    def refuse_mutated_inputs(self, where: str) -> None:
        """An error naming the inputs the model updates in place, where that is not emulated."""
        if self.mutated_inputs:
            raise Error(f"the model updates its input(s) {list(self.mutated_inputs)} in place, which "
                        f"{where} cannot copy back to your tensors: return the new values instead")

    def fn(self, params, buffers, inputs, rng_key):
        outputs, new_buffers, _ = self.logged_fn(params, buffers, inputs, rng_key)
        return outputs, new_buffers

    def output_leaves(self) -> list:
        """The user outputs, flattened in pytree order: graph nodes, or constants the program
        returns as they are."""
        output = next(n for n in self.graph_module.graph.nodes if n.op == "output")
        return list(output.args[0][self.num_mutations:])

    def array_outputs(self) -> list[torch.fx.Node]:
        """The graph nodes among :meth:`output_leaves` (the program's array results), the
        ``self.log`` values of a step method last."""
        return [n for n in self.output_leaves() if isinstance(n, torch.fx.Node)]

    def result_arrays(self) -> list[torch.fx.Node]:
        """:meth:`array_outputs` without the ``self.log`` values a step method adds at the end."""
        arrays = self.array_outputs()
        logged = sum(call.is_tensor for call in self.logs)
        return arrays[:len(arrays) - logged]

    def logged_dtypes(self) -> dict[str, torch.dtype]:
        """The dtype of each tensor a step method logs (``self.log``), by name, and of each
        metric state's total over a call (``<name>:total``)."""
        names = [call.name for call in self.logs if call.is_tensor]
        nodes = self.array_outputs()[len(self.result_arrays()):]
        dtypes = {name: node.meta["val"].dtype for name, node in zip(names, nodes)}
        return {**dtypes, **{name + metric_states.TOTAL_SUFFIX: dtypes[name]
                             for name in metric_states.totals_of(self.logs)}}

    def call_totals(self) -> dict[str, str]:
        """Logged name -> what a call returns of it over all its micro-batches, whatever the
        output mode keeps: a metric state reduced ("sum" | "max" | "min"), an appended tensor or
        a value aggregated over the epoch for every micro-batch (``list_appends.EVERY_MICRO_BATCH``)."""
        every = {call.name: list_appends.EVERY_MICRO_BATCH for call in self.logs if call.aggregated_over_epoch}
        return {**metric_states.totals_of(self.logs), **every, **list_appends.every_micro_batch(self.logs)}

    def result_shapes(self) -> list:
        """Per leaf of a step method's result, its shape (None for a constant leaf)."""
        count = self.output_spec.child(0).num_leaves
        return [leaf.meta["val"].shape if isinstance(leaf, torch.fx.Node) else None
                for leaf in self.output_leaves()[:count]]

    def state(self, module: torch.nn.Module) -> tuple[dict, dict]:
        """The module's current parameters and buffers as JAX arrays, keyed as the program wants."""
        tensors = dict(module.named_parameters())
        tensors.update(module.named_buffers())
        return ({s.name: to_jax(tensors[s.name]) for s in self.params},
                {s.name: to_jax(tensors[s.name]) for s in self.buffers})


def compile_module(module: torch.nn.Module, example_args: tuple, method: str | None = None,
                   loop_repeated_layers: bool = True, keywords: tuple[str, ...] = (),
                   host_input: int | None = None) -> Program:
    """Capture ``module(*example_args)`` (or ``module.<method>(*example_args)``) as a Program.
    The last ``len(keywords)`` arguments are passed by keyword, under those names.

    ``host_input``: the position of a step method's argument whose values the host knows per
    micro-batch: the step may branch in Python on it (the Program's ``guards``).

    ``loop_repeated_layers``: runs of structurally identical layers (``repeated_layers``) are
    captured once and lowered as one loop over their stacked weights, so that capture, tracing
    and XLA compilation do not grow with depth; False captures and lowers every layer inline.
    """
    host_known = None if host_input is None or method is None else (host_input, example_args[host_input])
    target = module if method is None else capture.StepCall(module, method, host_known)
    runs = repeated_layers.repeated_runs(module) if loop_repeated_layers else []
    start = time.time()
    args, kwargs = split_keywords(tuple(example_args), keywords)
    names = global_reads.reads(module, method)
    with host_random.refused(module, method or "model's forward"):
        try:
            with python_reads.recorded(module) as reads:
                exported, templates, looped, assignments = _capture_forward(module, target, args, kwargs, runs,
                                                                            method)
        except UncapturedHigherOrderOpError:
            # torch.cond's branches are traced by torch's compiler, which cannot run the classes
            # that note reads: capture again unnoted, guarded by every plain attribute.
            exported, templates, looped, assignments = _capture_forward(module, target, args, kwargs, runs, method)
            reads = python_reads.every_attribute(module)
    end = time.time()
    jax.monitoring.record_event_duration_secs(CAPTURE_EVENT, end - start)
    jax.monitoring.record_event_time_span(CAPTURE_EVENT, start, end)
    _check_lowerable(exported.graph_module)
    graph_module = exported.graph_module
    for node in graph_module.graph.nodes:
        if node.target is layer_calls.REPEATED_LAYER:
            node.meta[layer_calls.TEMPLATE_KEY] = templates[node.args[2]]
    layer_loops.loop_layer_chains(graph_module)
    if method is None:
        program = _build(module, exported, "", None, keywords)
    else:
        program = _build(module, exported, "module.", tuple(target.recorder.calls), keywords)
    guards = () if method is None else tuple(target.taken.guards)
    adapter_reads = () if method is None else tuple(target.taken.reads)
    reads = _without_appended_lists(reads, program.logs)
    reads = (reads + python_reads.across_runs(reads, module, looped) + names + adapter_reads
             + python_reads.tensor_attributes(module) + (python_reads.HookGuard(module),))
    return replace(program, python_reads=reads, guards=guards, host_input=host_input if guards else None,
                   assignments=assignments)


def split_keywords(inputs: tuple, keywords: tuple[str, ...]) -> tuple[tuple, dict]:
    """``inputs`` whose last ``len(keywords)`` values go by keyword -> ``(args, kwargs)``."""
    count = len(inputs) - len(keywords)
    return tuple(inputs[:count]), dict(zip(keywords, inputs[count:]))


def _capture_forward(module: torch.nn.Module, target: torch.nn.Module, args: tuple, kwargs: dict, runs: list,
                     method: str | None) -> tuple:
    """:func:`_capture` and the assignments the captured code made on the module
    (``attribute_writes``), refusing a model's forward that appends to lists the module holds (a
    step method's appends are its outputs: ``capture.StepCall``)."""
    if method is not None:
        return *_capture(target, args, kwargs, runs), tuple(target.taken.assignments)
    with list_appends.watching(module) as watch, attribute_writes.noted_in_forward(module) as assigned:
        captured = _capture(target, args, kwargs, runs)
    watch.refuse_appends("the model's forward")
    return *captured, tuple(assigned)


def _without_appended_lists(reads, logs) -> tuple:
    """``reads`` but those of the lists the step appended to: their items are the step's outputs,
    which the host appends after each call, not values baked into the program."""
    appended = {(call.appended.module, call.appended.attribute) for call in logs if call.appended is not None}
    return tuple(read for read in reads if not (isinstance(read, Read) and (read.path, read.name) in appended))


def _capture(target: torch.nn.Module, args: tuple, kwargs: dict, runs: list) -> tuple:
    """The export of ``target(*args, **kwargs)`` with the layers of ``runs`` standing in as calls,
    the template of each distinct call, and the runs that stood in; a run whose layers cannot
    stand in is captured inline, one whose weights the model's code reads with its weights in
    place (``layer_weights``)."""
    in_place = frozenset()
    while True:
        stand_ins = layer_calls.StandIns(runs, target, in_place)
        try:
            with stand_ins.installed():
                exported = capture.export(target, args, kwargs, _decompose, stand_ins.complete)
            templates = [layer_calls.capture_template(call, _template_program, _decompose) for call in stand_ins.calls]
            _refuse_differences_read(runs)
        except layer_calls.NotRepeatable as refusal:
            runs = [run for index, run in enumerate(runs) if index != refusal.run]
            continue
        except (layer_weights.NotHeld, InternalTorchDynamoError):
            refused = stand_ins.refused_holding()      # torch's compiler wraps a refusal in its error
            if refused is None:
                raise
            in_place |= {refused}
            continue
        return exported, templates, runs


def _refuse_differences_read(runs: list) -> None:
    """Raise :class:`~ipu_backend.compiler.layer_calls.NotRepeatable` for a run whose layers
    differ in a plain attribute (``repeated_layers.differing_attributes``) that the capture read
    of its first layer, or may have read (its reads are not noted: ``torch.cond``)."""
    for index, run in enumerate(runs):
        for path, name in sorted(repeated_layers.differing_attributes(run)):
            notes = python_reads.noted(run[0].get_submodule(path))
            if notes is None or name in notes:
                raise layer_calls.NotRepeatable(index, f"the layers differ in {name}, which their forward reads")


def _decompose(exported):
    """The capture's decomposition to core ATen, kept where ``decomposition_cache.kept_in`` says."""
    return decomposition_cache.decomposed(exported, capture.decompose_to_core_aten)


def _template_program(layer: torch.nn.Module, exported, prefix: str) -> "Program":
    _check_lowerable(exported.graph_module)
    return _build(layer, exported, prefix, None, host_inputs=False)


_DATA_DEPENDENT_SIZES = frozenset({"aten.nonzero.default", "aten._unique2.default", "aten.unique_dim.default",
                                   "aten.unique_consecutive.default", "aten.masked_select.default"})


def _why_unlowered(op: str) -> str:
    """Why ``op`` has no lowering, where there is a reason beyond a missing rule."""
    if op in _DATA_DEPENDENT_SIZES:
        return (" (its size depends on the data, which a compiled IPU program cannot hold: keep the shape "
                "fixed with torch.where, masked_fill or torch.topk, then reduce)")
    if op == "aten._local_scalar_dense.default":
        return (" (x.item(), float(x) or int(x) reads a tensor's value into Python, which a program traced "
                "once cannot: keep the value a tensor)")
    return ""


def _check_lowerable(graph_module: torch.fx.GraphModule) -> None:
    """Raise, naming each operation and its source line, where the graph has no lowering."""
    missing = interpreter.unsupported_ops(graph_module)
    if missing:
        listing = "\n".join(f"  {op} at {where}{_why_unlowered(op)}" for op, where in missing)
        raise Error("these operations have no lowering to JAX:\n" + listing +
                    "\nRewrite those lines with supported torch operations, or register a "
                    "lowering with ipu_backend.compiler.lowering(<op overload>).")
    interpreter.reject_boolean_mask_indexing(graph_module)


def _ordered_specs(module, names: set[str], kind: str) -> tuple[TensorSpec, ...]:
    """Specs in state_dict() order, then any non-persistent buffers."""
    tensors = dict(module.named_parameters())
    tensors.update(module.named_buffers())
    removed = sorted(names - set(tensors))
    if removed:
        raise Error(f"{kind} {removed[0]} is removed from the model when calling the forward method. "
                    f"(Capturing the model ran forward, which deleted it.) Keep the {kind.lower()} "
                    "and leave it unused, or remove it before wrapping the model.")
    order = [n for n in module.state_dict(keep_vars=True) if n in names]
    order += sorted(names - set(order))
    return tuple(TensorSpec(n, tuple(tensors[n].shape), tensors[n].dtype) for n in order)


def _check_reassigned_buffers(exported, prefix: str) -> None:
    """A buffer the forward replaces (``self.y = x``) is updated as torch does, if the new value
    keeps its dtype and shape; otherwise PopTorch's error."""
    signature = exported.graph_signature
    nodes = {node.name: node for node in exported.graph_module.graph.nodes}
    before = {spec.target: nodes[spec.arg.name].meta.get("val") for spec in signature.input_specs
              if spec.kind == InputKind.BUFFER}
    results = next(n for n in reversed(exported.graph_module.graph.nodes) if n.op == "output").args[0]
    for spec, result in zip(signature.output_specs, results):
        if spec.kind != OutputKind.BUFFER_MUTATION or not isinstance(result, torch.fx.Node):
            continue
        old, new = before.get(spec.target), result.meta.get("val")
        if old is None or new is None or (old.dtype, old.shape) == (new.dtype, new.shape):
            continue
        name = spec.target[len(prefix):]
        raise Error(f"Buffer {name} is reassigned within the model when calling the forward method. "
                    f"This is not supported. Consider using self.{name}.copy_(src) to copy data from "
                    "a source tensor, where src is the name of the source tensor. (Here the new "
                    f"value is {new.dtype} {list(new.shape)} and the buffer {old.dtype} "
                    f"{list(old.shape)}; a new value of the buffer's dtype and shape is accepted.)")


def canonical_names(module: torch.nn.Module) -> dict[str, str]:
    """Each parameter and buffer name of ``module`` -> the name ``named_parameters()`` /
    ``named_buffers()`` give its tensor. Tied weights (``head.weight = emb.weight``) have several
    names and one tensor: the program reads it under the one name, so its gradients add up."""
    first, names = {}, {}
    for name, tensor in [*module.named_parameters(remove_duplicate=False),
                         *module.named_buffers(remove_duplicate=False)]:
        names[name] = first.setdefault(id(tensor), name)
    return names


def _refuse_parameter_change(exported, spec, name: str) -> None:
    """A parameter that forward changes in place (``with torch.no_grad(): self.w.clamp_(...)``):
    a compiled step changes parameters through its optimizer update only."""
    written = next((node for node in exported.graph.nodes if node.name == spec.arg.name), None)
    where = user_location(written.meta.get("stack_trace") if written is not None else None)
    raise Error(f"forward changes the parameter {name} in place{f' at {where}' if where else ''}: a compiled "
                "program changes parameters only through the optimizer's update. Make the change on the "
                "host before each call (with torch.no_grad(): ...clamp_(...) in a callback or the training "
                "loop; the next call computes with it), or compute with a changed copy in forward "
                f"(w = {name.rpartition('.')[2]}.clamp(...)), whose gradient differs from torch's")


def _build(module, exported, prefix: str, logs: tuple | None, keywords: tuple[str, ...] = (),
           host_inputs: bool = True) -> Program:
    """The Program of ``exported`` (a capture of ``module``, its weights named with ``prefix``);
    ``logs``: the ``self.log`` calls of a step method, whose outputs are ``(result, logged
    values)``, or None for a forward. ``host_inputs``: its inputs are the call's, which the host
    can check (not a repeated layer's template, whose inputs the program computes)."""
    signature = exported.graph_signature
    canonical = canonical_names(module)
    strip = lambda target: canonical.get(target[len(prefix):], target[len(prefix):])  # noqa: E731
    inputs = []
    placeholders = [node for node in exported.graph_module.graph.nodes if node.op == "placeholder"]
    user_inputs = {}
    param_placeholders = {}
    for spec, node in zip(signature.input_specs, placeholders):
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            inputs.append((spec.kind, strip(spec.target)))
            if spec.kind == InputKind.PARAMETER:
                param_placeholders[node.name] = strip(spec.target)
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            inputs.append((spec.kind, to_jax(exported.constants[spec.target], f"the constant tensor {spec.target}")))
        elif spec.kind == InputKind.USER_INPUT:
            user_inputs[node] = len(user_inputs)
            inputs.append((spec.kind, None))
        else:
            raise Error(f"graph input {spec.arg.name} of kind {spec.kind.name} is not supported")
    user_names = [spec.arg.name for spec in signature.input_specs if spec.kind == InputKind.USER_INPUT]
    mutated, mutated_inputs, mutation_kinds = [], [], []
    for spec in signature.output_specs:
        if spec.kind == OutputKind.BUFFER_MUTATION:
            mutated.append(strip(spec.target))
            mutation_kinds.append(OutputKind.BUFFER_MUTATION)
        elif spec.kind == OutputKind.USER_INPUT_MUTATION:
            mutated_inputs.append(user_names.index(spec.target))
            mutation_kinds.append(OutputKind.USER_INPUT_MUTATION)
        elif spec.kind == OutputKind.PARAMETER_MUTATION:
            _refuse_parameter_change(exported, spec, strip(spec.target))
        elif spec.kind != OutputKind.USER_OUTPUT:
            raise Error(f"the program updates {spec.target} in place ({spec.kind.name}); only buffers "
                        "and inputs may be updated in place: return the new value instead")
    _check_reassigned_buffers(exported, prefix)
    param_names = {name for kind, name in inputs if kind == InputKind.PARAMETER}
    buffer_names = {name for kind, name in inputs if kind == InputKind.BUFFER}
    graph_module = exported.graph_module
    placeholders = [node for node in graph_module.graph.nodes if node.op == "placeholder"]
    stacks = layer_loops.parameter_stacks(graph_module, {node: name for node, (kind, name) in zip(placeholders, inputs)
                                                         if kind == InputKind.PARAMETER})
    member_of = {name: (stack.key, index) for stack in stacks for index, name in enumerate(stack.members)}
    in_spec = exported.call_spec.in_spec
    out_spec = exported.call_spec.out_spec
    n_mutated = len(mutation_kinds)
    with_logs = logs is not None
    log_names = [call.name for call in logs or () if call.is_tensor]

    def logged_fn(params, buffers, user_inputs, rng_key):
        leaves, spec = torch_pytree.tree_flatten(split_keywords(tuple(user_inputs), keywords))
        if spec != in_spec:
            raise Error(f"inputs have structure {spec}, the program was compiled for {in_spec}")
        leaves = iter(leaves)
        graph_inputs = []
        for kind, value in inputs:
            if kind == InputKind.PARAMETER:
                graph_inputs.append(params[value] if value in params or value not in member_of
                                    else layer_loops.StackedMember(params[member_of[value][0]], member_of[value][1]))
            elif kind == InputKind.BUFFER:
                graph_inputs.append(buffers[value])
            elif kind == InputKind.CONSTANT_TENSOR:
                graph_inputs.append(value)
            else:
                graph_inputs.append(next(leaves))
        results = interpreter.run_graph(graph_module, graph_inputs, rng_key)
        new_buffers = dict(buffers)
        new_buffers.update(zip(mutated, [value for value, kind in zip(results, mutation_kinds)
                                         if kind == OutputKind.BUFFER_MUTATION]))
        outputs = torch_pytree.tree_unflatten(list(results[n_mutated:]), out_spec)
        logged = {}
        if with_logs:
            outputs, values = outputs
            logged = dict(zip(log_names, values))
        if mutated_inputs:
            outputs = (outputs, tuple(value for value, kind in zip(results, mutation_kinds)
                                      if kind == OutputKind.USER_INPUT_MUTATION))
        return outputs, new_buffers, logged

    locations = {node.name: user_location(node.meta.get("stack_trace"))
                 for node in graph_module.graph.nodes if node.op == "call_function"}
    params = _ordered_specs(module, param_names, "Parameter")
    buffers = _ordered_specs(module, buffer_names, "Buffer")
    index_inputs = _index_inputs(graph_module, user_inputs) if host_inputs else ()
    aliases = {alias: name for alias, name in canonical.items() if alias != name}
    return Program(
        logged_fn=logged_fn,
        params=params,
        buffers=buffers,
        mutated_buffers=tuple(mutated),
        output_spec=out_spec,
        logs=logs or (),
        source_locations=locations,
        graph_module=graph_module,
        mutated_inputs=tuple(mutated_inputs),
        stacks=stacks,
        index_inputs=index_inputs,
        param_placeholders=param_placeholders,
        keywords=tuple(keywords),
        aliases=aliases,
        identity=_identity(module, exported, params, buffers, mutated, mutated_inputs, logs,
                           (stacks, index_inputs, tuple(keywords), aliases)),
    )


def _identity(module, exported, params, buffers, mutated, mutated_inputs, logs, boundary) -> str | None:
    """The digest of what the program computes (see :mod:`~ipu_backend.compiler.identity`);
    ``boundary``: how its weights and inputs are passed (stacks, checked indices, keywords, tied
    names)."""
    trained = {name: p.requires_grad for name, p in module.named_parameters(remove_duplicate=False)}
    try:
        return identity.digest((
            identity.graph_digest(exported.graph_module),
            tuple((s.name, s.shape, s.dtype, trained.get(s.name)) for s in params),
            tuple((s.name, s.shape, s.dtype) for s in buffers),
            tuple(mutated), tuple(mutated_inputs), exported.call_spec.in_spec, exported.call_spec.out_spec,
            logs, tuple(spec.target for spec in exported.graph_signature.input_specs),
            tuple(sorted((name, identity.describe(value)) for name, value in exported.constants.items())),
            boundary))
    except identity.Unidentifiable:
        return None
