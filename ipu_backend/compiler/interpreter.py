"""Evaluate a core-ATen FX graph with JAX arrays, one lowering per node.

This runs only while JAX traces the program, so its cost is paid once per compilation.
"""

import contextlib
import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import torch

from ipu_backend.compiler import (  # noqa: F401  (return_types registers pytrees)
    capture, integer_faults, integer_ranges, registry, return_types)
from ipu_backend.compiler.dtypes import jax_dtype
from ipu_backend.compiler.lowering_options import lowering_options
from ipu_backend.compiler.lowerings import views
from ipu_backend.compiler.sources import user_location
from ipu_backend.errors import Error


@dataclass
class LoweringContext:
    """What a lowering may need besides its arguments. ``computed(node)`` looks up the value of
    an earlier node (None when not held); ``shared`` holds values that several nodes of one
    graph evaluation compute once (see :meth:`once`)."""

    node: torch.fx.Node
    base_key: jax.Array
    path: tuple = field(default=())
    computed: Callable[[torch.fx.Node], object] | None = None
    shared: dict | None = None

    @property
    def out(self):
        """The node's output as torch's fake tensor(s): shape and dtype that torch produces."""
        return self.node.meta.get("val")

    def value_of(self, node: torch.fx.Node):
        """The value already computed for an earlier ``node`` of the graph, or None where the
        caller does not hold it (another pipeline stage's). Lets a lowering start from a value
        before the views that lead to its argument (a matrix before its ``expand``)."""
        return None if self.computed is None else self.computed(node)

    def once(self, key, compute: Callable[[], object]):
        """``compute()``, evaluated once per graph evaluation for each ``key`` and shared by the
        nodes that ask for it (several ``select`` nodes unbinding one tensor share one split,
        whose gradient is one concatenation)."""
        if self.shared is None:
            return compute()
        if key not in self.shared:
            self.shared[key] = compute()
        return self.shared[key]

    def key(self) -> jax.Array:
        """A random key owned by this node: deterministic per seed, distinct per node."""
        key = self.base_key
        for index in self.path:
            key = jax.random.fold_in(key, index)
        return key

    def location(self) -> str:
        return user_location(self.node.meta.get("stack_trace")) or "unknown source line"

    def run_subgraph(self, graph_module: torch.fx.GraphModule, args, index: int):
        """Evaluate a nested graph (``torch.cond`` branches) with keys of its own."""
        return run_graph(graph_module, args, self.base_key, self.path + (index,))

    def run_body(self, graph_module: torch.fx.GraphModule, args, trip):
        """Evaluate a loop body on trip ``trip`` (a traced index): its random numbers differ per
        trip, as they do when the body runs again in torch."""
        return run_graph(graph_module, args, jax.random.fold_in(self.key(), trip))


def unsupported_ops(graph_module: torch.fx.GraphModule) -> list[tuple[str, str]]:
    """``(op, user location)`` for each node, nested graphs included, that has no lowering."""
    missing = []
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and node.target is not operator.getitem:
            if registry.lookup(node.target) is None:
                missing.append((str(node.target),
                                user_location(node.meta.get("stack_trace")) or "unknown source line"))
        if node.op == "get_attr":
            value = getattr(graph_module, node.target)
            if isinstance(value, torch.fx.GraphModule):
                missing.extend(unsupported_ops(value))
    return missing


def reject_boolean_mask_indexing(graph_module: torch.fx.GraphModule) -> None:
    """Raise, before anything is traced, for ``x[mask]`` with a boolean mask: torch.export keeps
    it with a data-dependent size, which no lowering can give."""
    for node in graph_module.graph.nodes:
        if node.target is torch.ops.aten.index.Tensor and any(
                isinstance(i, torch.fx.Node) and i.meta["val"].dtype in (torch.bool, torch.uint8)
                for i in node.args[1]):
            raise views.boolean_mask_error(
                user_location(node.meta.get("stack_trace")) or "unknown source line")


def as_captured(graph_module: torch.fx.GraphModule):
    """A context in which lowerings trace ``graph_module`` with the settings its capture recorded
    (torch's float32 precision); a graph without them (a nested branch) keeps those in force."""
    precision = graph_module.meta.get(capture.FLOAT32_PRECISION_KEY)
    return contextlib.nullcontext() if precision is None else lowering_options(float32=precision)


def run_graph(graph_module: torch.fx.GraphModule, inputs, base_key, path=()):
    """Evaluate ``graph_module`` on ``inputs`` (one per placeholder); returns the output node's args."""
    with as_captured(graph_module):
        return _run_graph(graph_module, inputs, base_key, path)


def _run_graph(graph_module: torch.fx.GraphModule, inputs, base_key, path):
    env, shared = {}, {}
    checks = integer_ranges.checks(graph_module)
    placeholders = iter(inputs)
    for index, node in enumerate(graph_module.graph.nodes):
        if node.op == "placeholder":
            env[node] = next(placeholders)
        elif node.op == "get_attr":
            env[node] = getattr(graph_module, node.target)
        elif node.op == "call_function":
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
            if node.target is operator.getitem:
                env[node] = args[0][args[1]]
            else:
                ctx = LoweringContext(node, base_key, path + (index,), env.get, shared)
                env[node] = lower_node(ctx, args, kwargs, checks.get(node))
        elif node.op == "output":
            return torch.fx.node.map_arg(node.args[0], env.__getitem__)
        else:
            raise Error(f"unexpected graph node {node.op} {node.target}")
    raise Error("graph has no output node")


def lower_node(ctx: LoweringContext, args, kwargs, integer_check: str | None):
    """The node's value, by its lowering; ``integer_check``: what ``integer_ranges.checks``
    says the program must check of it while it runs (None: nothing)."""
    rule = registry.lookup(ctx.node.target)
    if rule is None:
        raise Error(f"{ctx.node.target} has no lowering (called from {ctx.location()})")
    try:
        result = rule(ctx, *args, **kwargs)
    except OverflowError as error:
        raise Error(f"{ctx.node.target} at {ctx.location()}: {error}. The device carries int64 as "
                    "int32: keep integer constants within [-2**31, 2**31 - 1]") from error
    result = _match_torch(result, ctx.out, ctx)
    if integer_check is not None:
        integer_faults.check(integer_check, ctx.node, ctx.location(), args, kwargs, result)
    return result


def _match_torch(result, meta, ctx):
    """Cast to the dtype torch gives this op (so type promotion always follows torch) and check
    the shape, so that a wrong lowering fails here, naming itself, rather than far downstream."""
    if isinstance(meta, torch.Tensor):
        want = jax_dtype(meta.dtype)
        if getattr(result, "dtype", None) != want:
            result = jnp.asarray(result, dtype=want)
        static = all(isinstance(size, int) for size in meta.shape)    # else data-dependent (bincount)
        if static and tuple(result.shape) != tuple(meta.shape):
            raise Error(f"lowering of {ctx.node.target} gave shape {tuple(result.shape)} where torch "
                        f"gives {tuple(meta.shape)} (at {ctx.location()})")
        return result
    if isinstance(meta, (tuple, list)) and isinstance(result, (tuple, list)):
        return type(result)(_match_torch(r, m, ctx) for r, m in zip(result, meta))
    return result
