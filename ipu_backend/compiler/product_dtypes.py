"""Matrix products of operands of different dtypes, refused as torch refuses them.

torch's kernels raise for a float16 activation into a float32 layer (``F.linear``, ``matmul``,
``mm``, ``bmm``, ``dot`` ...); the shape functions the capture runs do not check, and the
program would compute it in the wider dtype. Under ``torch.autocast`` the operands are cast to
one dtype first, so products there are not checked.
"""

import torch

from ipu_backend.compiler.sources import user_location
from ipu_backend.errors import Error

aten = torch.ops.aten
_PRODUCTS = {aten.linear.default, aten.matmul.default, aten.mm.default, aten.addmm.default, aten.bmm.default,
             aten.baddbmm.default, aten.addmv.default, aten.addbmm.default, aten.mv.default, aten.dot.default,
             aten.vdot.default, aten.bilinear.default}
_AUTOCAST = torch.ops.higher_order.wrap_with_autocast


def refuse_mixed_products(graph_module: torch.fx.GraphModule) -> None:
    """Raise for the first product in ``graph_module`` (or a region of it outside autocast)
    whose tensor operands have different dtypes; nothing where the capture ran under autocast."""
    if any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda")):
        return
    for node in graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _PRODUCTS:
            _check(node)
        elif node.target is not _AUTOCAST:
            for arg in node.args:
                if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
                    region = getattr(graph_module, arg.target)
                    if isinstance(region, torch.fx.GraphModule):
                        refuse_mixed_products(region)


def _check(node: torch.fx.Node) -> None:
    dtypes = [arg.meta["val"].dtype for arg in node.all_input_nodes if isinstance(arg.meta.get("val"), torch.Tensor)]
    if len(set(dtypes)) > 1:
        where = user_location(node.meta.get("stack_trace")) or "unknown source line"
        raise Error(f"{node.target} at {where} multiplies tensors of different dtypes "
                    f"({', '.join(str(dtype).removeprefix('torch.') for dtype in dtypes)}), which torch "
                    "refuses: cast the input to the layer's dtype (x.to(layer.weight.dtype)), convert "
                    "the model (model.half()), or compute under torch.autocast")
