"""Pipeline blocks of the operations inside grad-mode and autocast regions.

torch.export records a ``torch.no_grad()``, ``torch.enable_grad()`` or ``torch.autocast`` region
of a step as one higher-order call of a subgraph, made by a pass that gives the call none of the
annotations its operations were recorded under; decomposition then inlines the subgraph's
operations with the call's. Without this, every operation of such a region would lose its block
(``poptorch.BeginBlock``) and land on the first stage: a stand-in's buffer updates, an EMA, a
model run under ``no_grad`` over several IPUs.
"""

import torch

from ipu_backend.compiler.custom_ops import BLOCK_KEY
from ipu_backend.compiler.sources import user_location
from ipu_backend.errors import Error

_REGIONS = {torch.ops.higher_order.wrap_with_set_grad_enabled: "a torch.no_grad() or torch.enable_grad()",
            torch.ops.higher_order.wrap_with_autocast: "a torch.autocast"}


def annotate_regions(graph_module: torch.fx.GraphModule) -> None:
    """Give each region's call the annotations of the operations in it (inner regions first).
    A region whose operations belong to several blocks cannot keep them apart: refused."""
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or node.target not in _REGIONS:
            continue
        region = next(getattr(graph_module, arg.target) for arg in node.args
                      if isinstance(arg, torch.fx.Node) and arg.op == "get_attr")
        annotate_regions(region)
        annotated = [n for n in region.graph.nodes
                     if n.op == "call_function" and BLOCK_KEY in n.meta.get("custom", {})]
        blocks = {n.meta["custom"][BLOCK_KEY] for n in annotated}
        if len(blocks) > 1:
            names = ", ".join(sorted(repr(block[0]) if block else "none" for block in blocks))
            where = user_location(annotated[0].meta.get("stack_trace")) or "unknown source line"
            raise Error(f"{_REGIONS[node.target]} region starting at {where} holds operations of the "
                        f"blocks {names}; a region's operations must belong to one block. Start the "
                        "blocks outside the region, or open a region inside each block (an "
                        "inferenceModel computes no gradients: it needs no torch.no_grad())")
        if annotated:
            node.meta["custom"] = {**node.meta.get("custom", {}), **annotated[-1].meta["custom"]}
