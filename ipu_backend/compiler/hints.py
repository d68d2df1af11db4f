"""PopTorch's compiler hints and name scopes, kept in the captured graph for the reports.

Poplar uses ``set_available_memory``, ``nop``, ``set_overlap_for_input/output`` and matmul
serialization to plan memory and host IO; on emulated IPUs they change no number. Each becomes a
``hint(x, kind, value)`` node (an identity, gradient included) so that the compile report can list
what was asked, on which operation and where. ``NameScope`` names are node annotations
(``node.meta["custom"][NAME_SCOPE_KEY]``), like pipeline blocks.
"""

from collections import Counter

import torch
import torch.fx
import torch.fx.traceback as fx_traceback

from ipu_backend.compiler.sources import user_location
from ipu_backend.errors import Error

NAME_SCOPE_KEY = "ipu_name_scope"
"""``node.meta["custom"][NAME_SCOPE_KEY]``: the ``/``-joined ``NameScope`` names around the node."""
MULTI_CONV_KEY = "ipu_multi_conv"
"""``node.meta["custom"][MULTI_CONV_KEY]``: ``(group number, settings)`` of the ``MultiConv``
region the node was recorded in."""
_CONVOLUTIONS = (torch.ops.aten.convolution.default,)


@torch.library.custom_op("ipu_backend::hint", mutates_args=())
def _hint(x: torch.Tensor, kind: str, value: str) -> torch.Tensor:
    return x.clone()


@_hint.register_fake
def _(x, kind, value):
    return torch.empty_like(x)


_hint.register_autograd(lambda ctx, grad: (grad, None, None))
HINT = torch.ops.ipu_backend.hint.default


def hint(x: torch.Tensor, kind: str, value: str) -> torch.Tensor:
    """``x``, marked in the captured graph with the hint ``kind`` (its ``value`` as text)."""
    return _hint(x, kind, value)


def _scope_of(node: torch.fx.Node) -> str:
    return node.meta.get("custom", {}).get(NAME_SCOPE_KEY) or ""


def current_name_scope() -> str:
    """The name scope that nodes recorded now get."""
    return fx_traceback.current_meta.get("custom", {}).get(NAME_SCOPE_KEY) or ""


def _annotate(key: str, value) -> None:
    """Tag the nodes recorded from now on (only while a capture keeps node meta)."""
    if fx_traceback.has_preserved_node_meta():
        custom = fx_traceback.current_meta.get("custom", {})
        fx_traceback.current_meta["custom"] = {**custom, key: value}


def set_name_scope(scope: str) -> None:
    """Tag the nodes recorded from now on with ``scope``."""
    _annotate(NAME_SCOPE_KEY, scope)


def current_multi_conv():
    """``(group, settings)`` of the ``MultiConv`` region being recorded, or None."""
    return fx_traceback.current_meta.get("custom", {}).get(MULTI_CONV_KEY)


def set_multi_conv(region) -> None:
    """Tag the nodes recorded from now on as part of the ``MultiConv`` region (None: none)."""
    _annotate(MULTI_CONV_KEY, region)


def _multi_conv_of(node: torch.fx.Node):
    return node.meta.get("custom", {}).get(MULTI_CONV_KEY)


def multi_convs_of(nodes) -> list[dict]:
    """The ``MultiConv`` regions among graph ``nodes``: their settings and convolutions."""
    groups: dict = {}
    for node in nodes:
        region = _multi_conv_of(node) if node.op == "call_function" else None
        if region is not None:
            group = groups.setdefault(region[0], {"settings": dict(region[1]), "convolutions": 0})
            group["convolutions"] += node.target in _CONVOLUTIONS
    return [groups[g] for g in sorted(groups)]


def check_multi_convs(graph_module: torch.fx.GraphModule) -> None:
    """PopTorch's error for a ``MultiConv`` region without a convolution."""
    empty = [g for g in multi_convs_of(graph_module.graph.nodes) if not g["convolutions"]]
    if empty:
        raise Error("Unexpected end_multi_conv: a poptorch.MultiConv region holds no convolution; "
                    "put the convolutions it should plan together inside it, or remove it")


def check_overlaps(exported: torch.export.ExportedProgram) -> None:
    """PopTorch's errors for ``set_overlap_for_input`` on anything but an input that nothing else
    reads, and ``set_overlap_for_output`` on anything but a tensor the model returns once."""
    user_inputs = [spec.arg.name for spec in exported.graph_signature.input_specs
                   if spec.kind is torch.export.graph_signature.InputKind.USER_INPUT]
    outputs = list(exported.graph_module.graph.output_node().args[0])
    for node in exported.graph_module.graph.nodes:
        if node.op != "call_function" or node.target is not HINT:
            continue
        source = _source(node)
        if node.args[1] == "overlap_for_input":
            if not isinstance(source, torch.fx.Node) or source.name not in user_inputs:
                raise Error("poptorch.set_overlap_for_input applied on a node which is not a tensor input "
                            "to the model.")
            if len(source.users) > 1:
                raise Error("poptorch.set_overlap_for_input must be the only op applied to an input. This is "
                            f"not the case for input {user_inputs.index(source.name)} to the model.")
        elif node.args[1] == "overlap_for_output":
            if node not in outputs:
                raise Error("poptorch.set_overlap_for_output applied on a node which is not a tensor output "
                            "to the model.")
            if outputs.count(node) > 1 or source in outputs:
                raise Error("poptorch.set_overlap_for_output cannot be used with a tensor that is returned "
                            "twice. Please check all returned tensors including those nested in tuples/lists.")


def _source(node: torch.fx.Node):
    """What a hint marks, through other hints."""
    source = node.args[0]
    while isinstance(source, torch.fx.Node) and source.target is HINT:
        source = source.args[0]
    return source


def _producer(node: torch.fx.Node) -> str:
    """The operation whose output a hint marks (through other hints), as the reports name ops."""
    source = _source(node)
    if not isinstance(source, torch.fx.Node):
        return "constant"
    if source.op == "placeholder":
        return "input"
    target = source.target
    return str(target.overloadpacket) if isinstance(target, torch._ops.OpOverload) else str(target)


def hints_of(nodes) -> list[dict]:
    """The hints among graph ``nodes``: kind, value, the operation they mark, name scope and
    source line."""
    return [{"kind": n.args[1], "value": n.args[2], "op": _producer(n), "name_scope": _scope_of(n),
             "location": user_location(n.meta.get("stack_trace"))}
            for n in nodes if n.op == "call_function" and n.target is HINT]


def name_scope_counts(nodes) -> dict[str, int]:
    """Operations per ``NameScope`` (``"outer/inner"``); operations outside every scope are not
    counted."""
    counts = Counter(_scope_of(n) for n in nodes if n.op == "call_function" and n.target is not HINT)
    counts.pop("", None)
    return dict(counts.most_common())
