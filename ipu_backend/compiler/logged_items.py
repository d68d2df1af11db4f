"""``self.log(name, x.item())`` in a compiled step: the logged number is the tensor's value.

torch.export makes ``x.item()`` a symbolic number, which the step's ``self.log`` stand-in turns
back into a tensor (:func:`as_tensor`); :func:`read_from_tensors` then has that tensor read ``x``
itself, so no value leaves the program. Other uses of ``.item()`` stay refused, naming the line
(``program._why_unlowered``): a number read into Python cannot change from call to call.
"""

import torch

aten = torch.ops.aten


def as_tensor(value) -> torch.Tensor:
    """A tensor of a ``.item()`` result (a ``SymInt`` or ``SymFloat``), in the default float dtype,
    as Lightning makes one of a logged number."""
    return torch.scalar_tensor(value, dtype=torch.get_default_dtype())


def read_from_tensors(graph_module: torch.fx.GraphModule) -> None:
    """``scalar_tensor(x.item())`` becomes ``x`` cast to the tensor's dtype."""
    graph = graph_module.graph
    for node in list(graph.nodes):
        item = node.args[0] if node.target is aten.scalar_tensor.default and node.args else None
        if not isinstance(item, torch.fx.Node) or item.target is not aten._local_scalar_dense.default:
            continue
        with graph.inserting_before(node):
            read = graph.call_function(aten._to_copy.default, (item.args[0],), {"dtype": node.kwargs["dtype"]})
        read.meta.update(node.meta)
        node.replace_all_uses_with(read)
        graph.erase_node(node)
        if not item.users:
            graph.erase_node(item)
    graph_module.recompile()
