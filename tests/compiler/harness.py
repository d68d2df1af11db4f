"""Op parity harness: compile a small torch function, compare forward and gradients with torch.

Tolerances (relative, absolute) per dtype, unless a case states its own:
fp32 1e-5/1e-6; fp16 1e-2/1e-3; bf16 2e-2/1e-2 (torch and XLA round half-precision
intermediates differently).
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import numpy as np
import torch

from ipu_backend.compiler import compile_module, to_jax, to_torch

TOLERANCES = {
    torch.float32: (1e-5, 1e-6),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (2e-2, 1e-2),
}


@dataclass
class OpCase:
    """``fn(*make_inputs(dtype))`` compared with torch for each dtype in ``dtypes``.

    ``ops`` names the op overloads the case exists to test: the check asserts they appear in the
    lowered graph, and the coverage test asserts every registered lowering is named by a case.
    """

    name: str
    fn: Callable
    make_inputs: Callable[[torch.dtype], tuple]
    dtypes: tuple = (torch.float32,)
    grad: bool = True
    tolerances: dict = field(default_factory=dict)
    ops: tuple = ()

    def __str__(self):
        return self.name


def case_params(cases):
    """pytest parameters: one per (case, dtype), with readable ids."""
    import pytest
    return [pytest.param(case, dtype, id=f"{case.name}-{str(dtype).removeprefix('torch.')}")
            for case in cases for dtype in case.dtypes]


class FnModule(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def graph_ops(graph_module) -> set:
    """Every op a graph (nested graphs included) calls."""
    ops = set()
    for node in graph_module.graph.nodes:
        if node.op == "call_function":
            ops.add(node.target)
        elif node.op == "get_attr" and isinstance(getattr(graph_module, node.target), torch.fx.GraphModule):
            ops |= graph_ops(getattr(graph_module, node.target))
    return ops


def _is_float(x):
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _to_jax_tree(tree):
    return torch.utils._pytree.tree_map(lambda x: to_jax(x) if isinstance(x, torch.Tensor) else x, tree)


def assert_close(actual, expected, rtol, atol, what=""):
    """Compare a JAX array (or number) with a torch tensor, exactly for integers and bools."""
    expected_np = expected.detach().float().numpy() if expected.is_floating_point() else expected.numpy()
    actual_np = to_torch(actual).float().numpy() if expected.is_floating_point() else np.asarray(actual)
    assert actual_np.shape == expected_np.shape, f"{what}: shape {actual_np.shape} != {expected_np.shape}"
    if expected.is_floating_point():
        np.testing.assert_allclose(actual_np, expected_np, rtol=rtol, atol=atol, err_msg=what)
    else:
        np.testing.assert_array_equal(actual_np, expected_np.astype(actual_np.dtype), err_msg=what)


def check_case(case: OpCase, dtype: torch.dtype, seed: int = 0):
    """Forward and (for float inputs) vector-Jacobian products equal torch within tolerance."""
    rtol, atol = case.tolerances.get(dtype, TOLERANCES.get(dtype, (0, 0)))
    torch.manual_seed(seed)
    inputs = case.make_inputs(dtype)
    module = FnModule(case.fn)
    program = compile_module(module, inputs)
    params, buffers = program.state(module)
    missing = set(case.ops) - graph_ops(program.graph_module)
    assert not missing, f"{case.name}: the graph does not call {missing}"
    key = jax.random.key(seed)

    grad_inputs = [x.detach().clone().requires_grad_(True) if _is_float(x) and case.grad else x
                   for x in inputs]
    expected = case.fn(*grad_inputs)
    expected_leaves, _ = torch.utils._pytree.tree_flatten(expected)
    tensor_expected = [e for e in expected_leaves if isinstance(e, torch.Tensor)]
    float_positions = [i for i, x in enumerate(grad_inputs) if _is_float(x) and x.requires_grad]
    float_outputs = [i for i, e in enumerate(tensor_expected) if e.is_floating_point() and e.requires_grad]
    with_grads = case.grad and bool(float_positions) and bool(float_outputs)
    cotangents = [torch.randn_like(tensor_expected[i]) for i in float_outputs] if with_grads else []
    jax_inputs = _to_jax_tree(tuple(inputs))

    def forward(*floats):
        args = list(jax_inputs)
        for pos, value in zip(float_positions, floats):
            args[pos] = value
        outs, _ = program.fn(params, buffers, tuple(args), key)
        leaves = jax.tree_util.tree_leaves(outs)
        return [leaves[i] for i in float_outputs], leaves

    @jax.jit
    def outputs_and_vjp(floats, cts):
        """One compiled program for the forward and, when needed, its vector-Jacobian product."""
        if not with_grads:
            return forward(*floats)[1], []
        _, vjp, leaves = jax.vjp(forward, *floats, has_aux=True)
        return leaves, vjp(cts)

    actual_leaves, jax_grads = outputs_and_vjp([jax_inputs[i] for i in float_positions],
                                               [to_jax(c) for c in cotangents])
    assert len(actual_leaves) == len(tensor_expected), "output structure differs from torch"
    for i, (a, e) in enumerate(zip(actual_leaves, tensor_expected)):
        assert_close(a, e, rtol, atol, f"{case.name} output {i}")
    if not with_grads:
        return
    torch_grads = torch.autograd.grad([tensor_expected[i] for i in float_outputs],
                                      [grad_inputs[i] for i in float_positions],
                                      cotangents, allow_unused=True)
    for pos, a, e in zip(float_positions, jax_grads, torch_grads):
        if e is None:
            e = torch.zeros_like(grad_inputs[pos])
        assert_close(a, e, rtol, atol, f"{case.name} gradient of input {pos}")


def line_of(path: str, marker: str) -> int:
    """The line number in ``path`` of the line holding ``marker`` (for source-location checks)."""
    with open(path) as source:
        for number, line in enumerate(source, 1):
            if marker in line and "line_of(" not in line:
                return number
    raise AssertionError(marker)
