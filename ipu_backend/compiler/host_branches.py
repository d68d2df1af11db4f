"""A Python ``if`` on an input whose values the host knows before each call, per micro-batch
(the Lightning face's counters: ``batch_idx``, ``self.current_epoch``, ``self.global_step``).

While such a step is captured, :func:`tracking` (a torch function mode) follows the tensors
computed from that input alone, with Python numbers: each keeps the torch calls that made it, an
:class:`Expression` the host can evaluate on one micro-batch's values. When the step turns one
into a Python value (``if batch_idx % 2 == 0``, ``int(...)``, ``.item()``), the capture evaluates
it on the values it was given, notes a :class:`Guard` (expression, outcome, source line) and
follows that branch, as torch.compile's guards do. A capture is thus one :class:`Variant` of the
step: the one whose guards hold for the values it was captured with. At run time each
micro-batch runs the variant whose guards hold for its own values; a program of several variants
picks one per micro-batch with ``lax.switch`` on an extra input (:func:`combined`).

A value mixed with any other tensor is not known on the host, nor is one a random op or an
in-place update touched: turning it into Python stays a branch on data, which capture refuses.
"""

import hashlib
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import torch
import torch.utils._pytree as torch_pytree
from torch.overrides import TorchFunctionMode
from torch.utils import _python_dispatch
from torch.utils.weak import WeakIdKeyDictionary

from ipu_backend.compiler import attribute_writes
from ipu_backend.compiler.sources import calling_user_location
from ipu_backend.errors import Error

_CONVERSIONS = frozenset({
    torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.__float__,
    torch.Tensor.__complex__, torch.Tensor.item, torch.Tensor.tolist,
})
"""Tensor methods that give a Python value: where a traced step would branch on data."""

_RANDOM = ("rand", "bernoulli", "normal", "multinomial", "dropout", "uniform", "exponential", "geometric",
           "cauchy", "poisson")
"""Parts of the names of ops that draw random numbers: evaluated again on the host, they would
draw others."""


def _name(func) -> str:
    return getattr(func, "__name__", "") or ""


_IN_PLACE_OPERATORS = frozenset(f"__i{op}__" for op in (
    "add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "lshift", "rshift", "and", "xor", "or"))


def _in_place(func, kwargs: dict) -> bool:
    """Whether ``func`` writes into one of its arguments (``add_``, ``x += 1``, ``x[i] = ...``,
    ``out=``)."""
    name = _name(func)
    return ("out" in kwargs or name == "__setitem__" or name in _IN_PLACE_OPERATORS
            or (name.endswith("_") and not name.startswith("__")))


class _Call:
    """A torch call whose tensor arguments are all :class:`Expression` (or the root input)."""

    __slots__ = ("func", "args", "kwargs", "positions", "nested")

    def __init__(self, func, args, kwargs):
        self.func, self.args, self.kwargs = func, args, kwargs
        self.positions = [i for i, a in enumerate(args) if isinstance(a, Expression)]
        """Where the expressions are among ``args``, when they are all there (the host evaluates
        a call every micro-batch: a pytree walk costs more than the op)."""
        leaves = torch_pytree.tree_leaves((args, kwargs))
        self.nested = sum(isinstance(a, Expression) for a in leaves) != len(self.positions)

    def run(self, root: torch.Tensor, memo: dict):
        if self.func is None:
            return root
        key = id(self)
        if key not in memo:
            if self.nested:
                args, kwargs = torch_pytree.tree_map(
                    lambda a: a.evaluate(root, memo) if isinstance(a, Expression) else a, (self.args, self.kwargs))
            else:
                args, kwargs = list(self.args), self.kwargs
                for i in self.positions:
                    args[i] = args[i].evaluate(root, memo)
            memo[key] = self.func(*args, **kwargs)
        return memo[key]


class Expression:
    """A tensor of the step computed from the host-known input alone: the call that made it and
    which of its results it is (None: the result itself)."""

    __slots__ = ("call", "index")

    def __init__(self, call: _Call, index: int | None):
        self.call, self.index = call, index

    def evaluate(self, root: torch.Tensor, memo: dict) -> torch.Tensor:
        """Its value when the host-known input of one micro-batch is ``root`` (``memo``: values
        already computed for ``root``)."""
        result = self.call.run(root, memo)
        return result if self.index is None else result[self.index]


@dataclass(frozen=True, eq=False)
class Guard:
    """A Python value the captured step took from a tensor of the host-known input: the step
    follows the same branch for a micro-batch whose values give ``outcome`` again."""

    expression: Expression
    conversion: object
    outcome: object
    location: str

    def holds(self, root: torch.Tensor, memo: dict) -> bool:
        value = self.conversion(self.expression.evaluate(root, memo))
        return value == self.outcome or (value != value and self.outcome != self.outcome)   # NaN is NaN


@dataclass(frozen=True, eq=False)
class Variant:
    """One capture of a step that branches on the host-known input: its program (whose
    ``guards`` are the branches it took) and the micro-batch values it was captured with."""

    program: object
    values: torch.Tensor

    def holds(self, values: torch.Tensor) -> bool:
        """Whether a micro-batch with ``values`` takes this variant's branches."""
        memo = {}
        return all(guard.holds(values, memo) for guard in self.program.guards)


class _Tracking(TorchFunctionMode):
    """Follows the tensors computed from the root input alone, and turns them into Python values
    by evaluating them on the root's concrete values (see the module docstring)."""

    def __init__(self, root: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.known = WeakIdKeyDictionary()
        self.known[root] = Expression(_Call(None, (), {}), None)
        self.values = values
        self.memo: dict = {}
        self.guards: list[Guard] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_dynamo_compiling():     # torch.cond traces its branches with Dynamo
            return func(*args, **kwargs)
        if func in _CONVERSIONS and args and isinstance(args[0], torch.Tensor) and args[0] in self.known:
            expression = self.known[args[0]]
            with _python_dispatch._disable_current_modes(), torch._C.DisableTorchFunction():
                outcome = func(expression.evaluate(self.values, self.memo), *args[1:], **kwargs)
            where = calling_user_location() or "unknown source line"
            self.guards.append(Guard(expression, func, outcome, where))
            return outcome
        result = func(*args, **kwargs)
        tensors = [a for a in torch_pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        touched = any(t in self.known for t in tensors)
        if not touched:
            return result
        if _in_place(func, kwargs):
            # The updated tensor and whatever shares its storage change: forget every tensor.
            self.known.clear()
            return result
        if all(t in self.known for t in tensors) and not any(part in _name(func) for part in _RANDOM):
            call = _Call(func, *torch_pytree.tree_map(
                lambda a: self.known[a] if isinstance(a, torch.Tensor) else a, (args, kwargs)))
            if isinstance(result, torch.Tensor):
                self.known[result] = Expression(call, None)
            elif isinstance(result, (tuple, list)):
                for index, item in enumerate(result):
                    if isinstance(item, torch.Tensor):
                        self.known[item] = Expression(call, index)
        return result


class tracking:  # noqa: N801  (used as a context manager)
    """While the block runs, tensors computed from ``root`` alone (a capture's input, a fake
    tensor) are known on the host, where that input of the micro-batch captured holds
    ``values``; ``guards`` lists what the step turned into Python values, in order."""

    def __init__(self, root: torch.Tensor, values: torch.Tensor):
        self._mode = _Tracking(root, values)
        self.guards = self._mode.guards

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


_ARRAY = object()
"""Marks where an array goes among a variant's result leaves (None is a leaf of its own)."""


def variant_of(variants: tuple[Variant, ...], values: torch.Tensor) -> int | None:
    """The index of the variant a micro-batch with ``values`` runs (None: none captured yet)."""
    for index, variant in enumerate(variants):
        if variant.holds(values):
            return index
    return None


def combined(variants: list[Variant]):
    """One program of the ``variants`` (captures of one step): it takes one more input, last,
    each micro-batch's variant (int32 ``[1]``), and runs that one (``lax.switch``). The variants
    must give results and logs of one structure; otherwise an error names the branch."""
    first = variants[0].program
    if len(variants) == 1:
        return replace(first, variants=tuple(variants))
    for variant in variants[1:]:
        _check_same_structure(variants[0], variant)
    branches = [variant.program.logged_fn for variant in variants]
    layout = {}

    def logged_fn(params, buffers, inputs, rng_key):
        *inputs, choice = inputs

        def branch(fn):
            def run(operands):
                leaves, spec = torch_pytree.tree_flatten(fn(*operands))
                arrays = [leaf for leaf in leaves if isinstance(leaf, jax.Array)]
                static = [_ARRAY if isinstance(leaf, jax.Array) else leaf for leaf in leaves]
                layout.setdefault("first", (spec, static))
                return arrays
            return run

        index = jnp.reshape(choice, (-1,))[0].astype(jnp.int32)
        arrays = jax.lax.switch(index, [branch(fn) for fn in branches], (params, buffers, tuple(inputs), rng_key))
        spec, static = layout["first"]
        arrays = iter(arrays)
        return torch_pytree.tree_unflatten([next(arrays) if s is _ARRAY else s for s in static], spec)

    identities = tuple(v.program.identity for v in variants)
    reads = tuple(read for v in variants for read in v.program.python_reads)
    locations = {}
    for variant in variants:
        locations.update(variant.program.source_locations)
    return replace(first, logged_fn=logged_fn, variants=tuple(variants), python_reads=reads,
                   source_locations=locations,
                   identity=None if None in identities else hashlib.sha256(
                       ("variants:" + ",".join(identities)).encode()).hexdigest())


def _outputs(program) -> list:
    """What a program's results and logs are, leaf by leaf: shape and dtype, or the constant."""
    return [(tuple(leaf.meta["val"].shape), leaf.meta["val"].dtype) if isinstance(leaf, torch.fx.Node)
            else ("constant", leaf) for leaf in program.output_leaves()]


def _returns_none(program) -> bool:
    """Whether a step's result is ``None`` (Lightning's way to skip a batch)."""
    return program.output_spec.child(0).num_leaves == 1 and program.output_leaves()[0] is None


def _check_same_structure(a: Variant, b: Variant) -> None:
    pa, pb = a.program, b.program
    difference = None
    if [c.name for c in pa.logs] != [c.name for c in pb.logs]:
        difference = (f"one logs {[c.name for c in pa.logs]}, the other {[c.name for c in pb.logs]}")
    elif pa.logs != pb.logs:
        difference = "their self.log calls differ in arguments or constant values"
    elif pa.output_spec != pb.output_spec or _outputs(pa) != _outputs(pb):
        difference = "they return results of different structures, shapes or dtypes"
        if _returns_none(pa) or _returns_none(pb):
            difference += (" (one returns None, which skips a batch's optimizer step in Lightning on the CPU "
                           "but not in a compiled step, as in Lightning's IPU plugin: leave such batches "
                           "out of the dataloader)")
    elif (pa.mutated_buffers, pa.mutated_inputs, pa.stacks, pa.keywords) != (
            pb.mutated_buffers, pb.mutated_inputs, pb.stacks, pb.keywords):
        difference = "they update different buffers or inputs in place"
    else:
        differing = attribute_writes.differing(pa.assignments, pb.assignments)
        if differing is not None:
            difference = (f"they leave {differing} different (the host makes a step's assignments after "
                          "each call, the same for every micro-batch)")
    if difference is None:
        return
    raise Error(f"{_branch_point(a, b)} differ: {difference}. A step "
                "that branches on batch_idx, self.current_epoch or self.global_step runs one compiled "
                "program whose branches must return the same structure and make the same self.log "
                "calls: log the same names in every branch (or choose the value with torch.where)")


def diverging_line(a: Variant, b: Variant) -> str:
    """The line of the first guard whose outcome differs between two variants."""
    return _diverging_guard(a, b).location


def _diverging_guard(a: Variant, b: Variant) -> Guard:
    for ga, gb in zip(a.program.guards, b.program.guards):
        if not (ga.outcome == gb.outcome):
            return gb
    return (b.program.guards or a.program.guards)[0]


def _branch_point(a: Variant, b: Variant) -> str:
    """Where two variants part, as the user's code does it: an ``if`` (a tensor's truth value),
    or a Python number taken from a tensor (``float(batch_idx)``) that each variant holds another
    value of."""
    guard = _diverging_guard(a, b)
    if guard.conversion is torch.Tensor.__bool__:
        return f"the branches of the Python `if` at {guard.location}"
    name = guard.conversion.__name__.strip("_")
    return (f"the captures for each value of the Python number {name}(...) takes from a tensor at "
            f"{guard.location} (keep it a tensor where the step only computes or logs it: "
            "torch.as_tensor(x, dtype=torch.float32), not float(x))")
