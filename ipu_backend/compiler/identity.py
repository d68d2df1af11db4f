"""What a captured program computes, as a digest: two captures with equal digests lower to the
same JAX function, whatever module object they came from.

The digest covers the graph (every node's operation, arguments, output shape and dtype and the
annotations a lowering reads: pipeline blocks, name scopes, ...), nested graphs (``torch.cond``
branches, loop bodies, the templates of repeated layers), the values of constant tensors, the
graph module's own settings (torch's float32 precision at capture), and the program's signature:
weights (names, shapes, dtypes, ``requires_grad``), inputs and outputs, what it updates in place
and its ``self.log`` calls. Debugging facts (source lines, node provenance, module paths) are
left out. A value whose meaning cannot be written down stably (an arbitrary object, a function
with a closure) makes the program :class:`Unidentifiable`: it is then never shared.
"""

import enum
import hashlib
import types
from dataclasses import fields, is_dataclass

import torch
import torch.fx

from ipu_backend.compiler import registry

DEBUG_META = frozenset({
    "stack_trace", "seq_nr", "from_node", "tensor_meta", "torch_fn", "original_aten", "nn_module_stack",
    "source_fn_stack", "unbacked_bindings", "partitioner_tag", "eager_input_vals",
})
"""Node metadata no lowering reads: provenance and source lines, for messages and reports."""

_LIBRARY_MODULES = ("torch", "operator", "_operator", "builtins", "math", "ipu_backend")
"""Functions from these modules are named, not read: their code is that of the installed
versions, which the persistent cache's key covers."""


class Unidentifiable(Exception):
    """A value of the program has no stable description."""


def digest(parts) -> str:
    """The SHA-256 of ``parts`` written as :func:`describe` writes them."""
    return hashlib.sha256(describe(parts).encode()).hexdigest()


def tensor_digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().cpu().contiguous()
    raw = data.view(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
    return f"tensor({tuple(data.shape)},{data.dtype},{hashlib.sha256(raw).hexdigest()})"


def describe(value) -> str:
    """``value`` as text that is equal for equal values and differs for different ones."""
    if value is None or isinstance(value, (bool, int, str, bytes)):
        return repr(value)
    if isinstance(value, (float, complex)):
        return repr(value)
    if isinstance(value, torch.fx.Node):
        return "%" + value.name
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({','.join(describe(v) for v in value)})"
    if isinstance(value, dict):
        return "dict(" + ",".join(f"{describe(k)}:{describe(v)}" for k, v in value.items()) + ")"
    if isinstance(value, (set, frozenset)):
        return "set(" + ",".join(sorted(describe(v) for v in value)) + ")"
    if isinstance(value, slice):
        return f"slice({describe(value.start)},{describe(value.stop)},{describe(value.step)})"
    if value is Ellipsis:
        return "..."
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(value)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"sym({value})"
    if isinstance(value, torch.fx.GraphModule):
        return f"graph({graph_digest(value)})"
    if isinstance(value, torch.Tensor):
        if isinstance(value, torch._subclasses.FakeTensor) or value.device.type == "meta":
            return f"fake({tuple(value.shape)},{value.dtype})"
        return tensor_digest(value)
    if isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)):
        return f"op({value})"
    if isinstance(value, torch.utils._pytree.TreeSpec):
        return f"spec({value})"
    if isinstance(value, enum.Enum):
        return f"{_qualified(type(value))}.{value.name}"
    if isinstance(value, type):
        return f"type({_qualified(value)})"
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        return _function(value)
    if isinstance(value, torch.nn.Module):
        # A layer a repeated-layer template was captured from: the template's program, described
        # beside it, is what its calls compute; lowerings read nothing of the module itself.
        return f"module({_qualified(type(value))})"
    identity = getattr(value, "identity", _MISSING)
    if identity is not _MISSING:          # a Program (a repeated layer's template)
        if identity is None:
            raise Unidentifiable("a nested program has no identity")
        return f"program({identity})"
    if is_dataclass(value):
        return f"{_qualified(type(value))}(" + ",".join(
            f"{f.name}={describe(getattr(value, f.name))}" for f in fields(value)) + ")"
    raise Unidentifiable(f"a {_qualified(type(value))} has no stable description")


_MISSING = object()


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _function(fn) -> str:
    """A library function by name; another by its code (one with a closure has no identity)."""
    module = getattr(fn, "__module__", None) or ""
    name = f"{module}.{getattr(fn, '__qualname__', getattr(fn, '__name__', '?'))}"
    if module.split(".")[0] in _LIBRARY_MODULES:
        return f"fn({name})"
    code = getattr(fn, "__code__", None)
    if code is None or getattr(fn, "__closure__", None):
        raise Unidentifiable(f"function {name} is not described by its code alone")
    return f"fn({name},{hashlib.sha256(code.co_code + repr(code.co_consts).encode()).hexdigest()})"


def graph_digest(graph_module: torch.fx.GraphModule) -> str:
    """The digest of a graph module: its nodes, nested graphs, constants and settings."""
    lines = ["meta:" + describe({k: v for k, v in graph_module.meta.items() if k not in DEBUG_META})]
    for node in graph_module.graph.nodes:
        lines.append(_node(graph_module, node))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _node(graph_module: torch.fx.GraphModule, node: torch.fx.Node) -> str:
    meta = {k: v for k, v in node.meta.items() if k not in DEBUG_META}
    if "custom" in meta:        # the user's annotations, without those torch adds (named "_...")
        meta["custom"] = {k: v for k, v in meta["custom"].items() if not k.startswith("_")}
    target = node.target
    if node.op == "get_attr":
        target = describe(getattr(graph_module, node.target))
    elif node.op == "call_function":
        target = describe(target)
        lowering = registry.lookup(node.target)
        if lowering is not None:
            target += "->" + _function(lowering)
    else:
        target = describe(target)
    return f"{node.op} {node.name} {target} {describe(node.args)} {describe(node.kwargs)} {describe(meta)}"
