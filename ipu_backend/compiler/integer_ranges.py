"""Which integer operations of a graph need a run-time check, found before it is traced.

The device carries torch's int64 as int32 (``dtypes``). Three things then differ from torch:
int64 arithmetic whose result leaves int32 wraps, a float converted to int64 beyond int32 does
not keep its value, and integer division by zero gives a number where torch raises. The
lowerings check for them while the program runs (``integer_faults``), but only where they can
happen: each integer value gets a conservative interval from where it comes from (a count of
booleans, an ``arange``, a constant, a small integer dtype), and an operation whose result
provably fits, or whose divisor provably is not zero, is not checked. Any other integer the
device holds is within int32 (inputs are checked as they cross to the device, checked results
are checked), so a value of unknown origin has int32's interval.
"""

import math

import torch

from ipu_backend.compiler import index_bounds
from ipu_backend.compiler.dtypes import INT32_MAX, INT32_MIN
from ipu_backend.compiler.op_arguments import argument

aten = torch.ops.aten

OVERFLOW, CONVERSION, DIVISION, INDEX = "overflow", "conversion", "division", "index"
"""What a check looks for: an int64 result outside int32, a float converted to int64 outside
int32, an integer divisor of zero (and, for int64, the one quotient outside int32), an index
outside the dimension it selects from (``index_bounds``)."""

INT32 = (INT32_MIN, INT32_MAX)
_UNBOUNDED = (-math.inf, math.inf)
_FROM_FLOAT = ("from a float",)
_DTYPE_RANGES = {torch.bool: (0, 1), torch.uint8: (0, 255), torch.int8: (-2**7, 2**7 - 1),
                 torch.int16: (-2**15, 2**15 - 1)}

_SAME_AS_FIRST = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default,
    aten.permute.default, aten.transpose.int, aten.t.default, aten.clone.default, aten.alias.default,
    aten.select.int, aten.slice.Tensor, aten.index.Tensor, aten.gather.default,
    aten.index_select.default, aten.flip.default, aten.roll.default, aten.repeat.default,
    aten._to_copy.default, aten.lift_fresh_copy.default, aten.amax.default, aten.amin.default,
})
_CONSTANT_LAST = {aten.scalar_tensor.default: 0, aten.full.default: 1, aten.full_like.default: 1,
                  aten.new_full.default: 2}
ARITHMETIC = frozenset({
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.rsub.Tensor,
    aten.rsub.Scalar, aten.mul.Tensor, aten.mul.Scalar, aten.neg.default, aten.abs.default,
    aten.sum.default, aten.sum.dim_IntList, aten.cumsum.default, aten.prod.default,
    aten.prod.dim_int, aten.cumprod.default, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor,
    aten.pow.Scalar, aten.__lshift__.Scalar, aten.__lshift__.Tensor, aten.bitwise_left_shift.Tensor,
})
"""Int64 elementwise operations and reductions whose result may grow past their operands' range."""
_MATRIX_PRODUCTS = frozenset({aten.mm.default, aten.bmm.default, aten.addmm.default,
                              aten.addmv.default, aten.addbmm.default})
SUMS = _MATRIX_PRODUCTS | {aten.scatter_add.default, aten.scatter.reduce, aten.scatter.value_reduce,
                           aten.scatter_reduce.two, aten.index_put.default}
"""Int64 matrix products and scatters, whose results sum (or multiply) many terms."""
CHECKED_FOR_OVERFLOW = ARITHMETIC | SUMS
"""The int64 operations checked for overflow where their result may leave int32."""
_DIVISIONS = frozenset({aten.div.Tensor_mode, aten.div.Scalar_mode, aten.remainder.Tensor,
                        aten.remainder.Scalar, aten.remainder.Scalar_Tensor, aten.fmod.Tensor,
                        aten.fmod.Scalar, aten.floor_divide.default})
"""Integer divisions: the divisor is the second argument."""
_QUOTIENTS = frozenset({aten.div.Tensor_mode, aten.div.Scalar_mode, aten.floor_divide.default})


def checks(graph_module: torch.fx.GraphModule) -> dict[torch.fx.Node, str]:
    """Each node of the graph (nested graphs have their own) that needs a check -> what it
    looks for (:data:`OVERFLOW`, :data:`CONVERSION`, :data:`DIVISION` or :data:`INDEX`)."""
    intervals, found = {}, {}
    for node in graph_module.graph.nodes:
        if _index_may_leave(node, intervals):
            found[node] = INDEX
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or value.dtype.is_floating_point or value.dtype.is_complex:
            continue
        dtype = value.dtype
        if node.op == "call_function" and node.target in _DIVISIONS:
            divisor = _interval(node.args[1], intervals)
            dividend = _interval(node.args[0], intervals)
            may_overflow = (dtype == torch.int64 and node.target in _QUOTIENTS
                            and dividend[0] <= INT32_MIN and divisor[0] <= -1 <= divisor[1])
            if divisor[0] <= 0 <= divisor[1] or may_overflow:
                found[node] = DIVISION
                intervals[node] = _DTYPE_RANGES.get(dtype, INT32)
            else:
                intervals[node] = _quotient_or_remainder(node.target, dividend, divisor)
            continue
        interval = _rule(node, intervals) if node.op == "call_function" else None
        if dtype != torch.int64:
            interval = _DTYPE_RANGES.get(dtype, INT32)
        elif interval is _FROM_FLOAT:
            found[node] = CONVERSION
            interval = INT32
        elif interval is None:
            interval = INT32
        elif node.target in CHECKED_FOR_OVERFLOW and not (INT32_MIN <= interval[0] and interval[1] <= INT32_MAX):
            found[node] = OVERFLOW
            interval = INT32
        intervals[node] = interval
    return found


def _interval(arg, intervals) -> tuple:
    """The interval of a node's argument: a node's, a Python number's, else int32's."""
    if isinstance(arg, torch.fx.Node):
        return intervals.get(arg, INT32)
    if isinstance(arg, bool):
        return (int(arg), int(arg))
    if isinstance(arg, int):
        return (arg, arg)
    return INT32


def _span(*values) -> tuple:
    finite = [v for v in values if not math.isnan(v)]
    return (min(finite), max(finite)) if finite else INT32


def _index_may_leave(node, intervals) -> bool:
    """Whether an index argument of ``node`` that the host does not check may leave its range."""
    checked = node.meta.get(index_bounds.HOST_CHECKED, ())
    for number, use in enumerate(index_bounds.index_uses(node)):
        low, high = _interval(use.index, intervals)
        if number not in checked and (low < use.low or high >= use.size):
            return True
    return False


def _quotient_or_remainder(target, dividend: tuple, divisor: tuple) -> tuple:
    """The interval of an integer division's result, its divisor's interval without zero."""
    largest = max(abs(divisor[0]), abs(divisor[1]))
    if target in _QUOTIENTS:
        smallest = min(abs(divisor[0]), abs(divisor[1]))
        bound = -(-max(abs(dividend[0]), abs(dividend[1])) // smallest)
        return (-bound, bound)
    if target in (aten.fmod.Tensor, aten.fmod.Scalar):
        return (-(largest - 1), largest - 1)
    return (0, largest - 1) if divisor[0] > 0 else (-(largest - 1), largest - 1)


def _reduced(node) -> int:
    """How many elements a reduction adds into each of its results."""
    source, result = node.args[0].meta["val"], node.meta["val"]
    return max(source.numel(), 1) // max(result.numel(), 1)


def _rule(node, intervals):
    """The interval of an int64 ``node``'s result; None where unknown; :data:`_FROM_FLOAT` for
    a conversion of floats."""
    target, args, kwargs = node.target, node.args, node.kwargs
    first = args[0] if args else None
    source = first.meta.get("val") if isinstance(first, torch.fx.Node) else None
    if target is aten._to_copy.default and isinstance(source, torch.Tensor) and source.dtype.is_floating_point:
        return _FROM_FLOAT
    if target in _SAME_AS_FIRST:
        return _interval(first, intervals)
    if target in _CONSTANT_LAST:
        value = args[_CONSTANT_LAST[target]]
        return (int(value), int(value)) if isinstance(value, (int, bool)) else None
    if target in (aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default):
        return (0, 0)
    if target in (aten.ones.default, aten.ones_like.default, aten.new_ones.default):
        return (1, 1)
    if target in (aten.arange.default, aten.arange.start, aten.arange.start_step):
        return _arange(node)
    if target in (aten.argmax.default, aten.argmin.default) and isinstance(source, torch.Tensor):
        dim = args[1] if len(args) > 1 else None
        count = source.numel() if dim is None or source.dim() == 0 else source.shape[dim]
        return (0, max(count - 1, 0))
    if target in _MATRIX_PRODUCTS:
        return _matrix_product(node, intervals)
    if target in SUMS:
        return _scattered(node, intervals)
    if target is aten.where.self:
        return _span(*_interval(args[1], intervals), *_interval(args[2], intervals))
    if target in (aten.cat.default, aten.stack.default):
        return _span(*(bound for part in first for bound in _interval(part, intervals)))
    a = _interval(first, intervals)
    if target in (aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar,
                  aten.rsub.Tensor, aten.rsub.Scalar):
        b = _interval(args[1], intervals)
        alpha = kwargs.get("alpha", 1)
        if not isinstance(alpha, int):
            return _UNBOUNDED
        if target in (aten.rsub.Tensor, aten.rsub.Scalar):
            a, b = b, a
        scaled = _span(b[0] * alpha, b[1] * alpha)
        if target in (aten.add.Tensor, aten.add.Scalar):
            return (a[0] + scaled[0], a[1] + scaled[1])
        return (a[0] - scaled[1], a[1] - scaled[0])
    if target in (aten.mul.Tensor, aten.mul.Scalar):
        b = _interval(args[1], intervals)
        return _span(a[0] * b[0], a[0] * b[1], a[1] * b[0], a[1] * b[1])
    if target is aten.neg.default:
        return (-a[1], -a[0])
    if target is aten.abs.default:
        return (0 if a[0] <= 0 <= a[1] else min(abs(a[0]), abs(a[1])), max(abs(a[0]), abs(a[1])))
    if target in (aten.sum.default, aten.sum.dim_IntList):
        count = _reduced(node)
        return (count * a[0], count * a[1])
    if target is aten.cumsum.default:
        count = node.meta["val"].shape[args[1]] if node.meta["val"].dim() else 1
        return (min(a[0], count * a[0]), max(a[1], count * a[1]))
    if target in (aten.__lshift__.Scalar, aten.__lshift__.Tensor, aten.bitwise_left_shift.Tensor):
        shift = _interval(args[1], intervals)
        if shift[0] < 0 or shift[1] >= 64:
            return _UNBOUNDED
        return _span(a[0] * 2 ** shift[0], a[0] * 2 ** shift[1], a[1] * 2 ** shift[0], a[1] * 2 ** shift[1])
    if target is aten.cumprod.default:
        count = node.meta["val"].shape[args[1]] if node.meta["val"].dim() else 1
        largest = max(abs(a[0]), abs(a[1]))
        return (-largest ** count, largest ** count) if largest < 2 or count < 64 else _UNBOUNDED
    if target in (aten.prod.default, aten.prod.dim_int, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor,
                  aten.pow.Scalar):
        power = (_reduced(node) if target in (aten.prod.default, aten.prod.dim_int)
                 else args[1] if target is aten.pow.Tensor_Scalar and isinstance(args[1], int) and args[1] >= 0
                 else None)
        if power is None:
            return _UNBOUNDED
        largest = max(abs(a[0]), abs(a[1]))
        return (-largest ** power, largest ** power) if largest < 2 or power < 64 else _UNBOUNDED
    return None


def _matrix_product(node, intervals):
    """``terms`` products of the factors summed, plus ``beta`` times the bias in the add forms."""
    adds = node.target not in (aten.mm.default, aten.bmm.default)
    x, y = node.args[int(adds)], node.args[int(adds) + 1]
    shape = x.meta["val"].shape
    terms = shape[-1] * (shape[0] if node.target is aten.addbmm.default else 1)
    a, b = _interval(x, intervals), _interval(y, intervals)
    product = _span(a[0] * b[0], a[0] * b[1], a[1] * b[0], a[1] * b[1])
    total = (terms * min(product[0], 0), terms * max(product[1], 0))
    if not adds:
        return total
    beta, alpha = (argument(node.args, node.kwargs, 3, "beta", 1),
                   argument(node.args, node.kwargs, 4, "alpha", 1))
    if not (isinstance(beta, int) and isinstance(alpha, int)):
        return _UNBOUNDED
    bias, scaled = _interval(node.args[0], intervals), _span(alpha * total[0], alpha * total[1])
    bias = _span(beta * bias[0], beta * bias[1])
    return (bias[0] + scaled[0], bias[1] + scaled[1])


def _scattered(node, intervals):
    """A scatter's result: ``x``'s elements, each with up to ``terms`` values added (or
    multiplied) in; an ``index_put`` without ``accumulate`` only writes values."""
    target = node.target
    x = _interval(node.args[0], intervals)
    if target is aten.index_put.default:
        values = _interval(node.args[2], intervals)
        if not argument(node.args, node.kwargs, 3, "accumulate", False):
            return _span(*x, *values)
        shapes = [index.meta["val"].shape for index in node.args[1] if index is not None]
        terms, reduce = math.prod(torch.broadcast_shapes(*shapes)) if shapes else 1, "sum"
    else:
        values = _interval(node.args[3], intervals)
        terms = node.args[2].meta["val"].numel()
        reduce = ("sum" if target is aten.scatter_add.default
                  else argument(node.args, node.kwargs, 4, "reduce", None))
        reduce = {"add": "sum", "multiply": "prod"}.get(reduce, reduce)
    if reduce in ("sum", "mean"):
        return (min(x[0], 0) + terms * min(values[0], 0), max(x[1], 0) + terms * max(values[1], 0))
    if reduce == "prod":
        largest = max(abs(x[0]), abs(x[1]), abs(values[0]), abs(values[1]))
        return (-largest ** (terms + 1), largest ** (terms + 1)) if largest < 2 or terms < 64 else _UNBOUNDED
    return _span(*x, *values)


def _arange(node):
    result = node.meta["val"]
    args = node.args
    start = args[0] if node.target is not aten.arange.default else 0
    step = args[2] if node.target is aten.arange.start_step and len(args) > 2 else node.kwargs.get("step", 1)
    if not isinstance(start, int) or not isinstance(step, int) or result.numel() == 0:
        return None
    last = start + (result.numel() - 1) * step
    return (min(start, last), max(start, last))
