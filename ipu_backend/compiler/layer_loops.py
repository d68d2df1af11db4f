"""Chains of repeated-layer calls become one loop over the layers' stacked weights.

A *chain* is a sequence of ``repeated_layer`` calls (``layer_calls``) of one template, annotated
alike (in one pipeline block), where each call takes some outputs of the one before as the same inputs
(the *carry*: a transformer's hidden state), and every other input and weight is computed
before the chain starts. The chain's calls are replaced by one node, lowered as a ``lax.scan``
whose body is the template (``lowerings/layers.py``); the weights are stacked inside the program,
so each layer's parameters stay the user's own. Whatever used a call's output (an intermediate
hidden state returned by the model, a buffer's new value) reads it from the loop's stacked
outputs. Anything else (a call on its own, or calls that do not feed each other) is lowered
call by call from the template, with the same numbers.
"""

import operator
from dataclasses import dataclass

import torch

from ipu_backend.compiler import capture
from ipu_backend.compiler.layer_calls import REPEATED_LAYER, TEMPLATE_KEY, Template

PLAN_KEY = "ipu_layer_loop"
"""``node.meta[PLAN_KEY]``: the :class:`LoopPlan` of a :func:`layer_loop` node."""


@dataclass(frozen=True)
class LoopPlan:
    """How a chain of ``layers`` calls of ``template`` loops: ``carry`` maps input positions to
    the outputs of the call before that feed them; ``stacked`` are the outputs some user reads
    for layers other than the last carry (kept per layer)."""

    template: Template
    layers: int
    carry: tuple[tuple[int, int], ...]
    stacked: tuple[int, ...]

    def slot(self, layer: int, output: int) -> int:
        return layer * self.template.output_count + output


@dataclass(frozen=True)
class Stack:
    """Parameters one loop reads as one column of its weights: ``members`` (state_dict names,
    layer by layer), which a caller may pass as one array stacked on a new leading axis under
    ``key`` (``blocks.0:24.qkv.weight`` for ``blocks.0.qkv.weight`` ... ``blocks.23.qkv.weight``):
    the loop then reads that array as it is, and the program's boundary has one parameter, not
    one per layer."""

    key: str
    members: tuple[str, ...]


@dataclass(frozen=True)
class StackedMember:
    """What a stack member's placeholder holds when the program is given the stack: the loop that
    reads every member takes ``stacked`` whole."""

    stacked: object
    index: int


def layer_loop(inputs, state):
    """The target of a chain's node: ``inputs`` and ``state`` per layer (the carried inputs of
    all but the first are None), lowered in ``lowerings/layers.py``."""
    raise NotImplementedError("a graph node target, evaluated by its lowering only")


def _output_users(call: torch.fx.Node) -> dict[int, list[torch.fx.Node]]:
    """Output index -> the getitem nodes reading it."""
    users = {}
    for user in call.users:
        if user.target is not operator.getitem:
            return None
        users.setdefault(user.args[1], []).append(user)
    return users


def _carry(previous: torch.fx.Node, call: torch.fx.Node) -> tuple | None:
    pairs = []
    for position, value in enumerate(call.args[0]):
        if isinstance(value, torch.fx.Node) and value.target is operator.getitem and value.args[0] is previous:
            pairs.append((position, value.args[1]))
    return tuple(pairs) or None


def _chains(graph: torch.fx.Graph) -> list[list[torch.fx.Node]]:
    """The graph's chains of two or more calls, each in graph order."""
    order = {node: index for index, node in enumerate(graph.nodes)}
    chains, current, carry = [], [], None

    def close():
        if len(current) >= 2:
            chains.append(list(current))

    for node in graph.nodes:
        if node.target is not REPEATED_LAYER:
            continue
        if current and _extends(current, carry, node, order):
            carry = carry or _carry(current[-1], node)
            current.append(node)
            continue
        close()
        current, carry = [node], None
    close()
    return chains


def _extends(chain: list, carry, node: torch.fx.Node, order: dict) -> bool:
    """Whether ``node`` continues ``chain`` (whose carry is ``carry``, None for a chain of one)."""
    last = chain[-1]
    if node.meta[TEMPLATE_KEY] is not last.meta[TEMPLATE_KEY] or capture.annotations(node) != capture.annotations(last):
        return False
    pairs = _carry(last, node)
    if pairs is None or (carry is not None and pairs != carry):
        return False
    carried = {position for position, _ in pairs}
    start = order[chain[0]]
    others = [v for p, v in enumerate(node.args[0]) if p not in carried] + list(node.args[1])
    return all(isinstance(v, torch.fx.Node) and order[v] < start for v in others) and \
        _output_users(last) is not None and _output_users(node) is not None


def loop_layer_chains(graph_module: torch.fx.GraphModule) -> int:
    """Replace each chain of calls by one loop node; returns the number of loops made."""
    graph = graph_module.graph
    chains = _chains(graph)
    for chain in chains:
        _replace(graph, chain)
    if chains:
        graph.lint()
        graph_module.recompile()
    return len(chains)


def _replace(graph: torch.fx.Graph, chain: list[torch.fx.Node]) -> None:
    template = chain[0].meta[TEMPLATE_KEY]
    carry = _carry(chain[0], chain[1])
    carried_inputs = {position for position, _ in carry}
    carried_outputs = {output for _, output in carry}
    readers = [_output_users(call) for call in chain]
    last = len(chain) - 1
    stacked = set()
    for layer, users in enumerate(readers):
        for output, nodes in users.items():
            inside = layer < last and output in carried_outputs and all(
                user is chain[layer + 1] for node in nodes for user in node.users)
            if not inside and not (layer == last and output in carried_outputs):
                stacked.add(output)
    plan = LoopPlan(template, len(chain), carry, tuple(sorted(stacked)))
    with graph.inserting_before(chain[0]):
        inputs = tuple(tuple(None if layer and position in carried_inputs else value
                             for position, value in enumerate(call.args[0]))
                       for layer, call in enumerate(chain))
        loop = graph.call_function(layer_loop, (inputs, tuple(tuple(c.args[1]) for c in chain)))
    loop.meta.update({key: value for key, value in chain[0].meta.items() if key != TEMPLATE_KEY})
    loop.meta[PLAN_KEY] = plan
    values = [None] * (len(chain) * template.output_count)
    for layer, call in enumerate(chain):
        for output, meta in enumerate(call.meta["val"]):
            if output in stacked or (layer == last and output in carried_outputs):
                values[plan.slot(layer, output)] = meta
    loop.meta["val"] = values
    for layer, users in enumerate(readers):
        for output, nodes in users.items():
            for node in nodes:
                node.args = (loop, plan.slot(layer, output))
    for call in reversed(chain):
        graph.erase_node(call)
    for node in list(loop.users):
        if values[node.args[1]] is None:
            graph.erase_node(node)


def parameter_stacks(graph_module: torch.fx.GraphModule, param_of: dict) -> tuple[Stack, ...]:
    """The stacks of the graph's loops: each column of a loop's weights whose members are
    distinct parameters (``param_of``: placeholder node -> name) that nothing else reads, named
    as one layer path with consecutive indices."""
    stacks = []
    for node in graph_module.graph.nodes:
        if node.target is not layer_loop:
            continue
        rows = node.args[1]
        suffixes = node.meta[PLAN_KEY].template.call.state_names
        for position, suffix in enumerate(suffixes):
            column = [row[position] for row in rows]
            if len(set(column)) == len(column) and all(n in param_of and len(n.users) == 1 for n in column):
                key = _stack_key([param_of[n] for n in column], suffix)
                if key is not None:
                    stacks.append(Stack(key, tuple(param_of[n] for n in column)))
    return tuple(stacks)


def _stack_key(names: list[str], suffix: str) -> str | None:
    """``parent.first:end.suffix`` for ``parent.i.suffix`` with consecutive ``i``, else None."""
    paths = [name[:-len(suffix) - 1] for name in names if name.endswith("." + suffix)]
    if len(paths) != len(names):
        return None
    parents, indices = zip(*(path.rpartition(".")[::2] for path in paths))
    if len(set(parents)) != 1 or not all(i.isdigit() for i in indices):
        return None
    first = int(indices[0])
    if [int(i) for i in indices] != list(range(first, first + len(names))):
        return None
    parent = parents[0] + "." if parents[0] else ""
    return f"{parent}{first}:{first + len(names)}.{suffix}"


def unrolled(nodes):
    """The call_function nodes of ``nodes`` as an unrolled capture runs them: a repeated-layer
    call as its template's nodes, a loop as its template's nodes once per layer (for op counts)."""
    for node in nodes:
        if node.op != "call_function":
            continue
        if node.target is REPEATED_LAYER:
            yield from unrolled(node.meta[TEMPLATE_KEY].program.graph_module.graph.nodes)
        elif node.target is layer_loop:
            plan = node.meta[PLAN_KEY]
            inner = list(unrolled(plan.template.program.graph_module.graph.nodes))
            for _ in range(plan.layers):
                yield from inner
        else:
            yield node
