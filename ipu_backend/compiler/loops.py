"""``poptorch.for_loop`` in the captured graph: the body is traced once between two marker ops,
then outlined into a nested graph that one ``FOR_LOOP`` node runs ``count`` times.

While a model is captured, ``for_loop`` calls ``loop_start(inputs)`` (copies of the carried
inputs: the body gets them by value), the body once, then ``loop_end(outputs, starts, count)``.
:func:`outline_loops` moves the nodes recorded between the two markers that depend on the
carried values (or draw random numbers, which differ per trip) into a body graph whose
placeholders are the carried values, then the outer values it reads. Nodes in between that
depend on neither are loop-invariant and stay outside, computed once. The lowering runs the body
graph with ``lax.fori_loop``: one body in the program whatever the trip count, differentiable
(the trip count is static).
"""

import operator

import torch
import torch.fx

from ipu_backend.compiler.sources import user_location
from ipu_backend.errors import Error


_EAGER_MARKER = ("poptorch.for_loop's markers ran outside a model capture, where they would run "
                 "the body once: call the model through poptorch.inferenceModel/trainingModel, or "
                 "as a plain torch module")


@torch.library.custom_op("ipu_backend::loop_start", mutates_args=())
def _loop_start(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    raise Error(_EAGER_MARKER)


@_loop_start.register_fake
def _(inputs):
    return [torch.empty_like(t) for t in inputs]


_loop_start.register_autograd(lambda ctx, grads: list(grads))


@torch.library.custom_op("ipu_backend::loop_end", mutates_args=())
def _loop_end(outputs: list[torch.Tensor], starts: list[torch.Tensor], count: int) -> list[torch.Tensor]:
    raise Error(_EAGER_MARKER)


@_loop_end.register_fake
def _(outputs, starts, count):
    return [torch.empty_like(t) for t in outputs]


_loop_end.register_autograd(lambda ctx, grads: (list(grads), None, None))

LOOP_START = torch.ops.ipu_backend.loop_start.default
LOOP_END = torch.ops.ipu_backend.loop_end.default


def for_loop(body: torch.fx.GraphModule, count: int, carried: list, captured: list):
    """The target of an outlined loop's node (see :func:`outline_loops`); never called: the
    node is lowered (``lowerings/control_flow.py``)."""
    raise Error("an outlined poptorch.for_loop is lowered to JAX, not called")


FOR_LOOP = for_loop


def mark_loop(inputs: list, body, count: int) -> list:
    """Record the loop while capturing: markers around one trace of ``body``."""
    starts = _loop_start(list(inputs))
    outputs = body(*starts)
    if not isinstance(outputs, (list, tuple)):
        outputs = [outputs]
    outputs = list(outputs)
    check_outputs(inputs, outputs)
    return _loop_end(outputs, starts, count)


def check_outputs(inputs: list, outputs: list) -> None:
    if len(outputs) != len(inputs) or not all(isinstance(o, torch.Tensor) for o in outputs):
        raise Error(f"poptorch.for_loop: the body must return as many tensors as it takes "
                    f"({len(inputs)}), got {len(outputs)} value(s): each iteration's outputs "
                    "are the next one's inputs")
    for index, (inp, out) in enumerate(zip(inputs, outputs)):
        if inp.shape != out.shape or inp.dtype != out.dtype:
            raise Error(f"poptorch.for_loop: body output {index} has shape {tuple(out.shape)} "
                        f"and dtype {out.dtype}, but input {index} has shape {tuple(inp.shape)} "
                        f"and dtype {inp.dtype}; each output must match its input")


def _is_random(node: torch.fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def outline_loops(graph_module: torch.fx.GraphModule) -> None:
    """Replace each ``loop_start`` ... ``loop_end`` region of ``graph_module`` by one ``FOR_LOOP``
    node over a nested body graph, innermost loops first."""
    pairs, open_starts = [], []
    for node in graph_module.graph.nodes:
        if node.target is LOOP_START:
            open_starts.append(node)
        elif node.target is LOOP_END:
            if not open_starts:
                raise Error("poptorch.for_loop: the loop's start was removed from the captured "
                            "graph; make the body use its inputs")
            pairs.append((open_starts.pop(), node))
    for index, (start, end) in enumerate(pairs):
        _outline(graph_module, start, end, index)
    if pairs:
        graph_module.graph.lint()
        graph_module.delete_all_unused_submodules()     # inner bodies now live in outer ones
        graph_module.recompile()


def _outline(graph_module: torch.fx.GraphModule, start: torch.fx.Node, end: torch.fx.Node,
             index: int) -> None:
    """Outline one loop (see :func:`outline_loops`). The carried values are the items of
    ``start``; ``end``'s second argument is ignored (functionalization may have replaced a
    carried value the body updated in place by its new value there)."""
    graph = graph_module.graph
    outputs, count = end.args[0], end.args[2]
    items = {user.args[1]: user for user in start.users if user.target is operator.getitem}
    start_items = [items.get(i) for i in range(len(start.args[0]))]
    position = {node: i for i, node in enumerate(graph.nodes)}
    between = [n for n in graph.nodes if position[start] < position[n] < position[end]]
    carried = {item for item in start_items if item is not None}
    body_nodes = []
    for node in between:
        if node in carried:
            continue
        if node.op == "call_function" and (_is_random(node) or any(
                arg in carried for arg in node.all_input_nodes)):
            carried.add(node)
            body_nodes.append(node)
    in_body = set(body_nodes)
    for node in body_nodes:
        outside = [user for user in node.users if user is not end and user not in in_body]
        if outside:
            where = user_location(node.meta.get("stack_trace")) or "unknown source line"
            raise Error(f"a value computed inside the poptorch.for_loop body ({where}) is used "
                        "outside the loop; return it from the body instead")

    captured = []
    for node in body_nodes + [n for n in outputs if isinstance(n, torch.fx.Node)]:
        for arg in (node.all_input_nodes if node in in_body else [node]):
            if arg not in in_body and arg not in start_items and arg not in captured:
                captured.append(arg)

    body = torch.fx.Graph()
    env = {}
    for i, item in enumerate(start_items):
        placeholder = body.placeholder(f"carried_{i}")
        if item is not None:
            env[item] = placeholder
            placeholder.meta = dict(item.meta)
    for i, node in enumerate(captured):
        env[node] = body.placeholder(f"captured_{i}")
        env[node].meta = dict(node.meta)
    for node in body_nodes:
        env[node] = body.node_copy(node, env.__getitem__)
    body.output([env[n] for n in outputs])
    body_module = torch.fx.GraphModule(graph_module, body)

    name = f"for_loop_body_{index}"
    graph_module.add_submodule(name, body_module)
    starts_inputs = start.args[0]
    with graph.inserting_before(end):
        body_attr = graph.get_attr(name)
        loop = graph.call_function(FOR_LOOP, (body_attr, count, list(starts_inputs), captured))
    loop.meta = dict(end.meta)
    end.replace_all_uses_with(loop)
    graph.erase_node(end)
    for node in reversed(body_nodes):
        graph.erase_node(node)
    for item in start_items:
        if item is not None:
            graph.erase_node(item)
    graph.erase_node(start)
