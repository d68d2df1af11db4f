"""Capture a module, or one of its step methods, as a core-ATen graph with torch.export."""

import contextlib
import contextvars
import functools
import inspect
import operator
import os
import types
import warnings
from dataclasses import dataclass, field

import torch
import torch._decomp
import torch.fx.traceback
import torch.utils._pytree as torch_pytree
from torch._export import utils as _export_utils
from torch.export import exported_program as _exported_program
from torch.nn.modules import module as _module_hooks
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from ipu_backend.compiler import (
    attention_choice,
    attribute_writes,
    containers,
    cumulative_batch_norm,
    distribution_checks,
    float32_precision,
    fused_losses,
    grid_sampling,
    hints,
    host_branches,
    list_appends,
    logged_items,
    loops,
    loss_checks,
    metric_states,
    product_dtypes,
    refused_calls,
    region_blocks,
    transformer_modules,
)
from ipu_backend.compiler.custom_ops import NO_GRAD_UPDATE
from ipu_backend.compiler.sources import calling_user_location, traceback_location, user_location
from ipu_backend.errors import Error

_TREESPEC_DEPRECATION = {"message": r"`isinstance\(treespec, LeafSpec\)` is deprecated", "category": FutureWarning}
warnings.filterwarnings("ignore", **_TREESPEC_DEPRECATION)
"""torch's own copies of its tree specs (``run_decompositions`` deep-copies the module call graph;
a cached program's output layout holds one) warn of a deprecation inside torch, on every compile."""


@contextlib.contextmanager
def without_treespec_deprecation():
    """The filter above, also where the warning filters were reset since this module was imported
    (pytest resets them for each test, and a test may assert that compiling warns of nothing):
    around the capture's decomposition and the executable cache's (un)pickling of tree specs."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", **_TREESPEC_DEPRECATION)
        yield


@dataclass(frozen=True)
class LogCall:
    """One ``self.log`` made by a step: its name, keyword arguments and, for a torchmetrics
    object, its path in the module (tensor values become outputs of the program, Python numbers
    too, and a number's value at capture is kept as ``constant``: captures that log different
    numbers are different programs). A torchmetrics state the step updated is logged as a tensor
    with its ``state`` (see ``metric_states``), a tensor it appended to a list the module holds
    with its ``appended`` (see ``list_appends``)."""

    name: str
    kwargs: dict = field(default_factory=dict)
    constant: int | float | bool | None = None
    metric: str | None = None
    state: metric_states.MetricState | None = None
    appended: list_appends.ListAppend | None = None

    @property
    def is_tensor(self) -> bool:
        return self.metric is None

    @property
    def aggregated_over_epoch(self) -> bool:
        """A tensor logged with ``on_epoch=True``: Lightning reduces it over every batch of the
        epoch, so a call returns it for every micro-batch."""
        return self.is_tensor and self.state is None and self.appended is None and bool(self.kwargs.get("on_epoch"))


class _LogRecorder:
    """Stands in for ``LightningModule.log``/``log_dict`` while a step is traced."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.calls: list[LogCall] = []
        self.tensors: list[torch.Tensor] = []

    def reset(self):
        """Forget earlier traces; in place, since export restores attributes a forward reassigns."""
        self.calls.clear()
        self.tensors.clear()

    def log(self, name, value, **kwargs):
        traced = [key for key, given in kwargs.items()
                  if isinstance(given, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool))]
        if traced:
            where = calling_user_location() or "unknown source line"
            raise Error(f"self.log({name!r}, ..., {traced[0]}=...) at {where} is given a value computed "
                        "from tensors (batch_idx, the batch, a .item()): a compiled step's keyword arguments "
                        f"of self.log are read once, at capture. Give {traced[0]} a Python value (batch_size="
                        "len(x) is one), or log the value it should weight as a tensor of its own")
        if isinstance(value, torch.Tensor):
            self.calls.append(LogCall(name, kwargs))
            self.tensors.append(value)
        elif isinstance(value, (int, float, bool)):
            # logged per micro-batch and replica as a tensor would be (a sum counts each)
            self.calls.append(LogCall(name, kwargs, constant=value))
            self.tensors.append(torch.full((), value))
        elif isinstance(value, (torch.SymInt, torch.SymFloat)):     # a tensor's .item()
            self.calls.append(LogCall(name, kwargs))
            self.tensors.append(logged_items.as_tensor(value))
        elif metric_states.is_metric(value):
            paths = [path for path, m in metric_states.metrics_of(self.module).items() if m is value]
            if not paths:
                raise Error(f"self.log({name!r}, <{type(value).__name__}>): the metric must be an "
                            "attribute of the LightningModule (self.<name> = ...) for its state to be "
                            "carried by the compiled step")
            self.calls.append(LogCall(name, kwargs, metric=paths[0]))
        else:
            raise Error(f"self.log({name!r}, ...) got a {type(value).__name__}; inside a compiled "
                        "step log a tensor, a number or a torchmetrics object held by the module")

    def log_dict(self, dictionary, **kwargs):
        for name, value in dictionary.items():
            self.log(name, value, **kwargs)


def _is_lightning_module(module: torch.nn.Module) -> bool:
    return any(cls.__name__ == "LightningModule" for cls in type(module).__mro__)


@contextlib.contextmanager
def _recording_logs(module: torch.nn.Module, recorder: _LogRecorder):
    if not _is_lightning_module(module):
        yield
        return
    object.__setattr__(module, "log", recorder.log)
    object.__setattr__(module, "log_dict", recorder.log_dict)
    try:
        yield
    finally:
        del module.log, module.log_dict


class _Taken:
    """The guards of a step's last trace (its host branches, and the values it read through the
    caller's adapter) and the assignments it made on its module (``attribute_writes``), kept off
    lists: export restores the module's attributes after tracing."""

    guards: list = []
    reads: list = []
    assignments: list = []


class StepCall(torch.nn.Module):
    """Exports ``module.<method>(*args)`` and returns ``(result, logged tensors)``: its
    ``self.log`` tensors, the torchmetrics states it updated and the tensors it appended to lists
    the module holds, in the order of ``recorder.calls``.

    ``host_known``: ``(position, values)`` when the argument at ``position`` is known on the host
    per micro-batch and holds ``values`` in the micro-batch captured: the step may then branch
    in Python on what it computes from it alone (``host_branches``; ``taken.guards`` lists the
    branches taken)."""

    def __init__(self, module: torch.nn.Module, method: str, host_known: tuple | None = None):
        super().__init__()
        self.module = module
        self.method = method
        _keep_frames_of(getattr(type(module), method, None))
        self.recorder = _LogRecorder(module)
        self.host_known = host_known
        self.taken = _Taken()

    def forward(self, *args):
        self.recorder.reset()
        self.taken.guards, self.taken.reads, self.taken.assignments = [], [], []
        adapt = _STEP_ARGUMENTS.get()[0]
        scope = contextlib.nullcontext([])
        tracking = contextlib.nullcontext()
        if self.host_known is not None:
            position, values = self.host_known
            tracking = host_branches.tracking(args[position], values)
        with tracking as tracked:
            if adapt is not None:
                args, scope = adapt(self.module, args)
            with (_recording_logs(self.module, self.recorder), metric_states.lifted(self.module) as metrics,
                  list_appends.watching(self.module) as watch, attribute_writes.noted(self.module) as assigned,
                  scope as adapter_reads):
                result = getattr(self.module, self.method)(*args)
                specs, values = metric_states.updated_states(metrics)
                appends = watch.appends()
        if tracked is not None:
            self.taken.guards = list(tracked.guards)
        self.taken.reads, self.taken.assignments = list(adapter_reads), list(assigned)
        self.recorder.calls.extend(LogCall(spec.key, state=spec) for spec in specs)
        self.recorder.calls.extend(LogCall(append.name, appended=append) for append, _ in appends)
        return result, list(self.recorder.tensors) + values + [tensor for _, tensor in appends]


_STEP_ARGUMENTS = contextvars.ContextVar("ipu_backend_step_arguments", default=(None, None))


def _keep_frames_of(function) -> None:
    """Keep ``function``'s frames in the stack traces of the nodes it makes: torch.export keeps
    only frames of ``forward`` methods (and anchors it is told of), so a step method's lines,
    which the errors name, would be lost. (torch versions without anchors keep every frame.)"""
    register = getattr(torch.fx.proxy, "_register_stack_trace_anchor", None)
    if register is not None and callable(function):
        register(inspect.unwrap(function))


@contextlib.contextmanager
def step_arguments(adapt, host_known: int | None = None):
    """While the block runs, a step method captured (:class:`StepCall`) gets the arguments
    ``adapt(module, args)`` gives as ``(arguments, context manager)``, and runs inside that
    context: how a caller passes a step values it reads elsewhere than in its arguments (the
    Lightning face's counters, read through the module's trainer) as program inputs. The context
    manager yields a list that holds, once it ends, the guards of the other values the step read
    through it (objects with ``current()``, ``holds(value)``, ``attribute`` and ``value``, as
    ``python_reads.Read``).
    ``host_known``: the position of an argument whose values the host knows before each call,
    per micro-batch, so that executors that can let the step branch in Python on it (see
    ``host_branches``)."""
    token = _STEP_ARGUMENTS.set((adapt, host_known))
    try:
        yield
    finally:
        _STEP_ARGUMENTS.reset(token)


def host_known_input() -> int | None:
    """The position of the step's argument known on the host (:func:`step_arguments`)."""
    return _STEP_ARGUMENTS.get()[1]


_CAPTURING = contextvars.ContextVar("ipu_backend_capturing", default=False)


def capturing() -> bool:
    """Whether a model is being captured for the emulated IPUs now, in this thread
    (PopTorch's ``isRunningOnIpu``). torch traces ``torch.cond`` branches with its compiler,
    which cannot read the context variable but answers ``is_compiling()``."""
    return torch.compiler.is_compiling() or _CAPTURING.get()


@contextlib.contextmanager
def _capture_scope():
    token = _CAPTURING.set(True)
    try:
        yield
    finally:
        _CAPTURING.reset(token)


def annotations(node: torch.fx.Node | None = None) -> dict:
    """The user's ``torch.fx.traceback`` annotations (pipeline blocks) of a node, or those that
    nodes recorded now get, without the private ones torch adds itself."""
    custom = (torch.fx.traceback.current_meta if node is None else node.meta).get("custom") or {}
    return {key: value for key, value in custom.items() if not key.startswith("_")}


FLOAT32_PRECISION_KEY = "ipu_backend.float32_precision"
"""The key of the graph module's ``meta`` entry holding torch's float32 precision settings as
they were at capture (a :class:`~ipu_backend.compiler.float32_precision.Float32Precision`): the
program's products are traced with them."""


def export(module: torch.nn.Module, args: tuple, kwargs: dict | None = None,
           decompose=None, complete=None) -> torch.export.ExportedProgram:
    """torch.export (non-strict) decomposed to core ATen, ``poptorch.for_loop`` bodies outlined,
    with errors a user can act on, and torch's float32 precision settings recorded on the graph
    module. ``decompose``: how the export is decomposed (:func:`decompose_to_core_aten` unless
    given: a caller may take the decomposition from elsewhere). ``complete(exported)`` finishes
    torch.export's program before it is checked and decomposed (``layer_calls`` puts held
    weights back)."""
    precision = float32_precision.torch_setting()
    fused_losses.install(_CAPTURING.get)       # not torch.compile's tracing of a user's own code
    loss_checks.install(_CAPTURING.get)
    cumulative_batch_norm.install(_CAPTURING.get)
    transformer_modules.install(_CAPTURING.get)
    refused_calls.install(_CAPTURING.get)
    distribution_checks.install(_CAPTURING.get)
    containers.register((args, kwargs))
    # The module's results may hold container subclasses too: registered as it returns them.
    hook = module.register_forward_hook(lambda _, __, result: containers.register(result))
    target = _Anchored(module) if _Anchored.needed(module, args, kwargs) else module
    attributes = _plain_tensor_attributes(target)     # non-strict export writes into them for real
    try:
        # preserve_node_meta keeps torch.fx.traceback.annotate(...) tags (pipeline blocks) on nodes.
        with torch.fx.traceback.preserve_node_meta(), _capture_scope():
            exported = torch.export.export(target, tuple(args), kwargs or None, strict=False)
    except GuardOnDataDependentSymNode as error:
        where = traceback_location(error.__traceback__) or "unknown source line"
        op = _op_implementation(error.__traceback__)
        if op == "one_hot":
            raise Error(f"F.one_hot at {where} has no num_classes: it would take the class count from the "
                        "largest value of its input, which a program traced once cannot read. Give num_classes "
                        "(OneHot num classes must be specified and must be constant.)") from error
        if op is not None:
            raise Error(f"{op} at {where} computes the shape of its result from the values of a tensor, a "
                        "shape that a program traced once cannot have: give the op the sizes it would read "
                        "(its count or size arguments), or compute a fixed-size result and mask it") from error
        raise Error(
            f"the program branches on the value of a tensor at {where}. A compiled program is "
            "traced once, so Python control flow cannot depend on tensor data. Use torch.where "
            "for element-wise choices, or torch.cond(pred, true_fn, false_fn, operands) to "
            "branch (it lowers to lax.cond). In a Lightning step, a branch on batch_idx, "
            "self.current_epoch or self.global_step (or on what is computed from them alone) is "
            "decided on the host, except with manual optimization; mixed with other tensors they "
            "are data too.") from error
    except Error:
        raise
    except SyntaxError as error:      # torch's code for the graph calls an op named like a keyword
        raise Error(f"torch.export wrote invalid Python for the program's graph ({(error.text or '').strip()}): "
                    "an op overload named after a Python keyword, as aten.random_.from, which "
                    "Tensor.random_(from, to) calls, cannot be captured. Draw integers with "
                    "torch.randint(low, high, shape) instead") from error
    except (RuntimeError, TypeError, ValueError, IndexError) as error:
        where = traceback_location(error.__traceback__)
        if where is None or not _raised_by_torch(error.__traceback__):
            raise
        if _holds_packed_sequence(error.__traceback__):
            raise Error(f"a PackedSequence (nn.utils.rnn.pack_padded_sequence or pack_sequence) reached {where}: its "
                        "batch sizes are computed from the lengths' values, a shape that a program traced once "
                        "cannot have. Give the RNN the padded batch and mask the padded steps (ignore_index or "
                        "a mask made from the lengths; the last real step's output by gather at lengths - 1)"
                        ) from error
        if type(error) is not RuntimeError:          # keep torch's exception type, add the line
            error.add_note(f"(while capturing the program, at {where})")
            raise
        raise Error(f"{error}{_why_refused(error)}\n(while capturing the program, at {where})") from error
    finally:
        hook.remove()
    if _mutated_attributes_as_buffers(target, exported, attributes):
        return export(module, args, kwargs, decompose, complete)
    if complete is not None:
        complete(exported)
    if target is not module:
        _Anchored.drop(exported)
    _refuse_mutated_constants(exported, type(module).__name__)
    _refuse_changes_through_detach(exported.graph_module)
    product_dtypes.refuse_mixed_products(exported.graph_module)
    region_blocks.annotate_regions(exported.graph_module)
    _detach_no_grad_regions(exported.graph_module)
    with without_treespec_deprecation():
        exported = (decompose or decompose_to_core_aten)(exported)
    loops.outline_loops(exported.graph_module)
    logged_items.read_from_tensors(exported.graph_module)
    hints.check_multi_convs(exported.graph_module)
    hints.check_overlaps(exported)
    exported.graph_module.meta[FLOAT32_PRECISION_KEY] = precision
    return exported


def _why_refused(error: RuntimeError) -> str:
    """What a torch error met while capturing means for the user's code, where torch's words do
    not say it."""
    if ".numpy() is not supported for tensor subclasses" in str(error):
        return (" (.numpy() reads a tensor's values into NumPy, which a program traced once cannot: "
                "keep the computation in torch; a value to log can be logged as the tensor itself)")
    return ""


def refuse_backward_hooks(module: torch.nn.Module) -> None:
    """A module backward hook (``register_full_backward_hook``, its pre-hook, or a global one) is
    called in torch's backward pass, which a compiled training program does not run: it would
    be dropped silently, so it is refused, naming the module."""
    hooked = [name or type(module).__name__ for name, sub in module.named_modules()
              if sub._backward_hooks or sub._backward_pre_hooks]
    if _module_hooks._global_backward_hooks or _module_hooks._global_backward_pre_hooks:
        hooked.append("every module (a global hook)")
    if hooked:
        raise Error(f"{hooked[0]} has a backward hook (register_full_backward_hook or its pre-hook): torch "
                    "calls it in its backward pass, which the compiled program does not run (it "
                    "differentiates the program itself), so the hook would never be called. Remove it before "
                    "compiling a training model, and compute what it does in forward or after the call")


class _Anchored(torch.nn.Module):
    """``module`` with one unused buffer, its anchor. torch.export's constant lifting inserts the
    lifted constants before the graph's first node, and misplaces them (a node used before it is
    defined) when no placeholder comes first: a module without inputs, parameters and buffers
    that reads tensors of its own (PopTorch's ``test_cpu_output``). The anchor is dropped from
    the export afterwards."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self.register_buffer("anchor", torch.zeros(()), persistent=False)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @staticmethod
    def needed(module: torch.nn.Module, args: tuple, kwargs: dict | None) -> bool:
        tensors = [x for x in torch_pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        return not tensors and next(iter(module.parameters()), None) is None \
            and next(iter(module.buffers()), None) is None

    @staticmethod
    def drop(exported: torch.export.ExportedProgram) -> None:
        specs = exported.graph_signature.input_specs
        spec = next(s for s in specs if s.target == "anchor")
        placeholder = next(n for n in exported.graph.nodes if n.op == "placeholder" and n.name == spec.arg.name)
        exported.graph.erase_node(placeholder)
        specs.remove(spec)
        exported.constants.pop("anchor", None)
        exported.graph_module.recompile()


def _writes(node: torch.fx.Node, value: torch.fx.Node) -> bool:
    """Whether the op of ``node`` writes in place into its argument ``value``."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return False
    given = dict(zip((a.name for a in node.target._schema.arguments), node.args)) | dict(node.kwargs)
    return any(given.get(a.name) is value and a.alias_info is not None and a.alias_info.is_write
               for a in node.target._schema.arguments)


def _mutated_constants(exported: torch.export.ExportedProgram) -> list[tuple[str, torch.fx.Node]]:
    """``(target, writer node)`` of each constant tensor the program writes into in place."""
    constants = {spec.arg.name: spec.target for spec in exported.graph_signature.input_specs
                 if spec.kind is torch.export.graph_signature.InputKind.CONSTANT_TENSOR}
    return [(constants[node.name], user) for node in exported.graph.nodes
            if node.op == "placeholder" and node.name in constants
            for user in node.users if _writes(user, node)]


def _plain_tensor_attributes(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of each tensor attribute of ``module``'s modules that is neither a parameter nor a
    buffer, by its name from ``module``."""
    return {f"{prefix}.{name}" if prefix else name: value.detach().clone()
            for prefix, owner in module.named_modules() for name, value in vars(owner).items()
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter)}


def _mutated_attributes_as_buffers(module: torch.nn.Module, exported: torch.export.ExportedProgram,
                                   before: dict[str, torch.Tensor]) -> bool:
    """Register each plain tensor attribute that forward changes in place as a non-persistent
    buffer of its module, the same tensor with its value ``before`` the capture wrote into it
    (``state_dict()`` is unchanged): the program then keeps its new value from call to call, as
    torch eager does. Whether any was (capture again)."""
    converted = False
    for target, _ in _mutated_constants(exported):
        if target not in before:
            continue
        owner_name, _, attribute = target.rpartition(".")
        owner = module.get_submodule(owner_name)
        tensor = vars(owner)[attribute]
        with torch.no_grad():
            tensor.copy_(before[target])
        delattr(owner, attribute)
        owner.register_buffer(attribute, tensor, persistent=False)
        converted = True
    return converted


def _refuse_mutated_constants(exported: torch.export.ExportedProgram, model: str) -> None:
    """A tensor that forward reads from elsewhere than its module and inputs (a global, a
    closure's) is a constant of the program: writing into it in place would be lost, so it is
    refused with the fix."""
    for name, user in _mutated_constants(exported):
        where = user_location(user.meta.get("stack_trace")) or "unknown source line"
        raise Error(
            f"forward of {model} changes a tensor in place at {where} that is neither an input nor "
            f"an attribute of the model (torch.export names it `{name}`): it is a constant of the "
            "compiled program, so the change would be lost. Make it a buffer of the module "
            "(`self.register_buffer(name, tensor, persistent=False)` in __init__) or an input of "
            "forward, whose new values the program keeps, as torch does")


def _refuse_changes_through_detach(graph_module: torch.fx.GraphModule) -> None:
    """A tensor changed in place through ``detach()`` (``y.detach().clamp_(...)``) and read
    afterwards keeps its gradient history in torch; the decomposed program would give it none.
    The same change under ``torch.no_grad()`` keeps it (``no_grad_update``): refused, naming that."""
    order = {node: index for index, node in enumerate(graph_module.graph.nodes)}
    for node in graph_module.graph.nodes:
        for alias in node.all_input_nodes:
            base = _detached_base(alias) if _writes(node, alias) else None
            if base is not None and _has_gradient(base) and any(order[user] > order[node] for user in base.users):
                where = user_location(node.meta.get("stack_trace")) or "unknown source line"
                if node.target is torch.ops.aten.embedding_renorm_.default:
                    raise Error(f"max_norm of nn.Embedding, nn.EmbeddingBag or F.embedding at {where} renormalizes "
                                "the looked-up rows of the weight in place during forward, and a compiled program "
                                "changes parameters only through the optimizer's update. Remove max_norm, or "
                                "renormalize the weight on the host before each call (with torch.no_grad(): "
                                "weight.renorm_(2, 0, max_norm), which changes every row), which the next call "
                                "computes with")
                raise Error(f"the model changes a tensor in place through .detach() at {where} and uses the "
                            "tensor afterwards: torch keeps its gradient history through such a change, which "
                            "the compiled program would lose. Make the change on the tensor itself under "
                            "`with torch.no_grad():` (y.clamp_(...)), which the compiled program follows as "
                            "torch does")


def _detached_base(node: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor whose ``detach()`` ``node`` is, or is a view or in-place result of."""
    while node is not None and node.target is not torch.ops.aten.detach.default:
        node = _alias_source(node)
    return None if node is None else node.args[0]


def _has_gradient(node: torch.fx.Node) -> bool:
    """Whether ``node`` depends, through no ``detach``, on a placeholder that requires grad."""
    return any(getattr(p.meta.get("val"), "requires_grad", False) for p in placeholders_reached(node))


def placeholders_reached(node: torch.fx.Node, follows=lambda source: True) -> set[torch.fx.Node]:
    """The placeholders ``node`` depends on through no ``detach`` (the paths autograd follows),
    going only through the sources ``follows`` accepts."""
    reached, stack, seen = set(), [node], {node}
    while stack:
        current = stack.pop()
        if current.op == "placeholder":
            reached.add(current)
            continue
        if current.target is torch.ops.aten.detach.default:
            continue
        for source in current.all_input_nodes:
            if source not in seen and follows(source):
                seen.add(source)
                stack.append(source)
    return reached


def _detach_no_grad_regions(graph_module: torch.fx.GraphModule) -> None:
    """Detach what a ``torch.no_grad()`` block of the step computes, so that no gradient flows
    through it (torch records none there). torch.export marks such a block as a
    ``wrap_with_set_grad_enabled(False, ...)`` call, which decomposition would inline unmarked.
    A tensor the block changes in place, itself or through a view, keeps its history in torch:
    after the block it is a ``no_grad_update`` of its value before, whose gradient flows to that
    value unchanged."""
    graph = graph_module.graph
    order = {node: index for index, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.target is not torch.ops.higher_order.wrap_with_set_grad_enabled or node.args[0]:
            continue
        region = getattr(graph_module, node.args[1].target)
        operands = node.args[2:]
        annotations = {"custom": node.meta["custom"]} if "custom" in node.meta else {}   # its block
        before = {}
        for operand in _changed_operands(region, operands):
            with graph.inserting_before(node):       # a copy: a later use of the operand reads the change
                before[operand] = graph.call_function(torch.ops.aten.clone.default, (operand,))
            before[operand].meta.update(val=operand.meta.get("val"), **annotations)
            later = [use for use in operand.users if order.get(use, -1) > order[node]]
            if later:
                with graph.inserting_after(node):
                    after = graph.call_function(NO_GRAD_UPDATE, (before[operand], operand))
                after.meta.update(val=operand.meta.get("val"), stack_trace=operand.meta.get("stack_trace"),
                                  **annotations)
                for use in later:
                    use.replace_input_with(operand, after)
        results = region.graph.output_node().args[0]
        for user in list(node.users):
            result = results[user.args[1]] if user.target is operator.getitem else None
            source = before.get(_changed_operand(region, result, operands)) if before else None
            with graph.inserting_after(user):
                kept = (graph.call_function(torch.ops.aten.detach.default, (user,)) if source is None else
                        graph.call_function(NO_GRAD_UPDATE, (source, user)))
            user.replace_all_uses_with(kept, delete_user_cb=lambda use: use is not kept)
            kept.meta.update(val=user.meta.get("val"), stack_trace=user.meta.get("stack_trace"), **annotations)
    graph_module.recompile()


def _changed_operands(region: torch.fx.GraphModule, operands: tuple) -> list:
    """The operands of a ``no_grad`` region that it writes into, itself or through views."""
    placeholders = [node for node in region.graph.nodes if node.op == "placeholder"]
    written = {_viewed_placeholder(arg) for node in region.graph.nodes if node.op == "call_function"
               for arg in node.all_input_nodes if _writes(node, arg)}
    return [operand for placeholder, operand in zip(placeholders, operands)
            if placeholder in written and isinstance(operand, torch.fx.Node)]


def _viewed_placeholder(node: torch.fx.Node) -> torch.fx.Node | None:
    """The placeholder ``node`` is, or is a view or in-place result of."""
    while node is not None and node.op != "placeholder":
        node = _alias_source(node)
    return node


def _alias_source(node: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor ``node`` is a view or in-place result of (an op whose first argument its result
    aliases), or None."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.arguments or schema.arguments[0].alias_info is None \
            or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    return node.args[0]


def _changed_operand(region: torch.fx.GraphModule, result, operands: tuple):
    """The operand of a ``no_grad`` region that ``result`` of the region is, changed in place
    (followed back through in-place ops to a placeholder of the region), or None."""
    while isinstance(result, torch.fx.Node) and result.op == "call_function":
        written = [arg for arg in result.args if isinstance(arg, torch.fx.Node) and _writes(result, arg)]
        if len(written) != 1:
            return None
        result = written[0]
    if not isinstance(result, torch.fx.Node) or result.op != "placeholder":
        return None
    placeholders = [node for node in region.graph.nodes if node.op == "placeholder"]
    return operands[placeholders.index(result)]


def _raised_by_torch(tb) -> bool:
    """Whether the innermost frame of ``tb`` is torch's (a shape check while tracing): the
    user's own exceptions, and this package's, already say where they come from."""
    while tb.tb_next is not None:
        tb = tb.tb_next
    return os.path.realpath(tb.tb_frame.f_code.co_filename).startswith(_TORCH_DIR)


def _op_implementation(tb) -> str | None:
    """The torch op whose implementation (a decomposition, reference or shape function) ``tb``
    passed through last, by name, or None: an op, not the user's code, read a tensor's value."""
    name = None
    while tb is not None:
        if os.path.realpath(tb.tb_frame.f_code.co_filename).startswith(_OP_IMPLEMENTATIONS):
            name = tb.tb_frame.f_code.co_name
        tb = tb.tb_next
    return name


def _holds_packed_sequence(tb) -> bool:
    """Whether a frame of ``tb`` held a ``PackedSequence`` (torch's RNNs fail on its fake
    batch sizes with errors that do not say so)."""
    while tb is not None:
        if any(isinstance(value, torch.nn.utils.rnn.PackedSequence) for value in tb.tb_frame.f_locals.values()):
            return True
        tb = tb.tb_next
    return False


_TORCH_DIR = os.path.dirname(os.path.realpath(torch.__file__)) + os.sep
_OP_IMPLEMENTATIONS = tuple(os.path.join(_TORCH_DIR, path) for path in (
    "_decomp" + os.sep, "_refs" + os.sep, "_meta_registrations.py", "_prims" + os.sep))


def decompose_to_core_aten(exported: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``exported.run_decompositions()`` with our table, at a fraction of its cost.

    torch re-collects and re-patches all ~500 CompositeImplicitAutograd (CIA) ops on every call,
    most of an export's time. Patching a CIA op with its own default decomposition only matters
    when the graph still calls it, so we patch just those and the ops whose table entry is a
    different decomposition; the rest decompose through their CIA kernel exactly as in
    ``run_decompositions``.
    This reaches into ``torch.export.exported_program``'s private helpers, so it is pinned to the
    torch minor versions checked by ``tests/compiler/test_capture_decompositions.py``.
    """
    cia_table, python_table = _split_core_aten_decompositions()
    called = _called_ops(exported.graph_module)
    cia_to_decomp = {op: fn for op, fn in cia_table.items()
                     if op in called or not _is_default_cia_decomposition(fn)}
    if _ATTENTION in called and _ATTENTION in cia_table:
        cia_to_decomp[_ATTENTION] = functools.partial(_attention_whole_or_decomposed,
                                                      decomposition=cia_table[_ATTENTION])
    with _signature_lookups_once():
        return _exported_program._decompose_exported_program(
            exported, cia_to_decomp=cia_to_decomp, python_decomp_table=dict(python_table),
            joint_loss_index=None, decompose_custom_triton_ops=False)


@contextlib.contextmanager
def _signature_lookups_once():
    """Within the block, torch's copying of parameter and buffer metadata onto the decomposed
    graph reads the signature's input-to-parameter and input-to-buffer tables once, not once
    per placeholder: each read rebuilds the table from every input, so the copy grew with the
    square of the weight count (a model of many layers has hundreds of weights)."""
    populate = _exported_program._populate_param_buffer_metadata_to_new_gm

    def populate_with_tables(metadata, graph_module, signature):
        tables = types.SimpleNamespace(inputs_to_parameters=dict(signature.inputs_to_parameters),
                                       inputs_to_buffers=dict(signature.inputs_to_buffers))
        return populate(metadata, graph_module, tables)

    _exported_program._populate_param_buffer_metadata_to_new_gm = populate_with_tables
    try:
        yield
    finally:
        _exported_program._populate_param_buffer_metadata_to_new_gm = populate


_ATTENTION = torch.ops.aten.scaled_dot_product_attention.default


def _attention_whole_or_decomposed(*args, decomposition, **kwargs):
    """A ``scaled_dot_product_attention`` call kept whole where ``attention_choice.kept_whole`` says
    so (torch keeps an op whose decomposition answers NotImplemented), else decomposed."""
    if attention_choice.kept_whole(*args, **kwargs):
        return NotImplemented
    return decomposition(*args, **kwargs)


def _called_ops(graph_module: torch.fx.GraphModule) -> set:
    """Every op the graph and its nested graphs (``torch.cond`` branches) call."""
    return {node.target for module in graph_module.modules() if isinstance(module, torch.fx.GraphModule)
            for node in module.graph.nodes if node.op == "call_function"}


def _is_default_cia_decomposition(fn) -> bool:
    """torch makes a fresh closure per op, so compare the code they share."""
    return getattr(getattr(fn, "func", None), "__code__", None) is _DEFAULT_CIA_DECOMPOSITION_CODE


_DEFAULT_CIA_DECOMPOSITION_CODE = _export_utils._get_decomp_for_cia(torch.ops.aten.linear.default).func.__code__


_TORCH_DECOMPOSED = (
    torch.ops.aten.upsample_nearest2d.vec, torch.ops.aten.upsample_bilinear2d.vec,
    torch.ops.aten.upsample_bilinear2d.default, torch.ops.aten.grid_sampler_2d.default)
"""Ops core ATen keeps whole (``F.interpolate``'s nearest and bilinear modes, ``F.grid_sample``)
that have no lowering of their own: decomposed with torch's own
decompositions (``torch._decomp``) into indexing and arithmetic, so they compute torch's formula."""


_KEPT_WHOLE = (torch.ops.aten.detach.default, torch.ops.aten.std.correction, torch.ops.aten.std_mean.correction,
               torch.ops.aten.linalg_solve.default, torch.ops.aten.linalg_inv.default, torch.ops.aten.inverse.default,
               torch.ops.aten.linalg_cholesky.default, torch.ops.aten.softplus.default, torch.ops.aten.sinc.default,
               torch.ops.aten._euclidean_dist.default, torch.ops.aten.hardswish.default,
               torch.ops.aten.hardsigmoid.default, torch.ops.aten.xlogy.Tensor,
               torch.ops.aten.cosine_similarity.default)
"""Ops core ATen decomposes whose decomposition differentiates otherwise, or drops a check:
``detach`` becomes a plain ``alias``, through which gradients would flow; ``std`` becomes
``sqrt(var)``, whose gradient is NaN where the deviation is 0 (constant rows, padding), where
torch's is 0; ``softplus`` and ``sinc`` become a ``where`` whose untaken branch gives NaN
gradients (``0 * inf``) where torch's are finite, ``_euclidean_dist`` (``cdist``'s matmul form) a
square root whose gradient is NaN at a zero distance, where torch's is 0, ``xlogy`` a product
whose gradient is NaN at ``x = 0, y = 0``, ``hardswish`` and ``hardsigmoid`` clamps whose gradients
at ±3 are not torch's, ``cosine_similarity`` a clamp of the norms at ``eps``, which torch makes without
autograd (the clamp's gradient would be 0 below ``eps``); ``linalg.solve``, ``inv`` and ``cholesky``
become their ``_ex`` variants, whose check of a singular input (``_linalg_check_errors``) export
drops."""


@functools.cache
def _split_core_aten_decompositions() -> tuple[dict, dict]:
    """torch's default core-ATen table, but :data:`_KEPT_WHOLE`, split into CIA overrides and
    Python decompositions, once."""
    with _cia_ops_materialized_once():
        table = dict(torch.export.default_decompositions().items())
        table.update(torch._decomp.get_decompositions(_TORCH_DECOMPOSED))
        table[torch.ops.aten.grid_sampler_2d.default] = grid_sampling.grid_sampler_2d
        for op in _KEPT_WHOLE:
            table.pop(op, None)
        return _exported_program._split_decomp_table_to_cia_and_python_decomp(table)


@contextlib.contextmanager
def _cia_ops_materialized_once():
    """Within the block, torch's walk over every op namespace for CIA ops materializes the C++
    dispatcher's CIA ops once, not once per namespace (it repeats it for each of some fifty):
    materializing only creates the ``torch.ops`` entries, so a second pass finds nothing new, and
    the passes were most of the time a process's first capture spent building these tables."""
    materialize = _export_utils._materialize_cpp_cia_ops
    materialize()
    _export_utils._materialize_cpp_cia_ops = lambda: None
    try:
        yield
    finally:
        _export_utils._materialize_cpp_cia_ops = materialize
