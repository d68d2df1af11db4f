"""Which of a training program's results is the loss the optimizer minimises, and which
parameters it gives gradients to."""

import torch
import torch.utils._pytree as torch_pytree

from ipu_backend.compiler import host_branches
from ipu_backend.compiler.custom_ops import IDENTITY_LOSS
from ipu_backend.errors import Error


def _step_result_loss(program, nodes):
    """A Lightning step's loss: the returned tensor, or the ``"loss"`` entry of a returned dict."""
    spec = program.output_spec.child(0)     # a step method's outputs are (result, logs)
    leaves = program.output_leaves()[:spec.num_leaves]
    result = torch_pytree.tree_unflatten(leaves, spec)
    loss = result.get("loss") if isinstance(result, dict) else result
    return loss if isinstance(loss, torch.fx.Node) and loss in nodes else None


def _final_identity_losses(graph) -> list:
    """The ``identity_loss`` results that feed no other one. As in PopTorch, an ``identity_loss``
    whose value flows into another is only its reduction; the last one is the loss."""
    marked = [n for n in graph.nodes if n.target is IDENTITY_LOSS]
    feeding, seen = set(), set()
    stack = [arg for n in marked for arg in n.all_input_nodes]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.target is IDENTITY_LOSS:
            feeding.add(node)
        stack.extend(node.all_input_nodes)
    return [n for n in marked if n not in feeding]


def find_loss(program, step_method: bool = False) -> int:
    """Index, among the array results, of the loss: the output of the final ``identity_loss`` if
    the model uses it; for a step method, the returned tensor or its ``"loss"`` entry; otherwise
    the only scalar float output (PopTorch's rule for returned losses)."""
    nodes = program.result_arrays()
    marked = _final_identity_losses(program.graph_module.graph)
    if len(marked) > 1:
        raise Error("Multiple independent losses found in graph. Graph must have one final loss. "
                    "Wrap final graph loss in poptorch.identity_loss. (identity_loss at "
                    f"{', '.join(program.source_locations.get(n.name) or '?' for n in marked)}: "
                    "combine them into one, e.g. identity_loss(loss_a + loss_b, reduction='none'))")
    if marked:
        if marked[0] not in nodes:
            raise Error("the identity_loss result must be returned by the model's forward "
                        f"(it is computed at {program.source_locations.get(marked[0].name)})")
        return nodes.index(marked[0])
    if step_method:
        loss = _step_result_loss(program, nodes)
        if loss is None:
            raise Error("training_step must return the loss: a scalar tensor or a dict with a "
                        "'loss' entry (manual optimization is not supported by this executor)")
        return nodes.index(loss)
    scalars = [i for i, n in enumerate(nodes)
               if n.meta["val"].ndim == 0 and n.meta["val"].is_floating_point()]
    if len(scalars) == 1:
        return scalars[0]
    if not scalars:
        raise Error("Couldn't find a loss in graph! A training model must return its loss: return "
                    "a scalar loss from forward (for example `return output, loss`) or mark it "
                    "with poptorch.identity_loss")
    raise Error(f"the model returns {len(scalars)} scalar outputs, so which one is the loss is "
                "ambiguous: mark the loss with poptorch.identity_loss(loss, reduction='none')")


def parameters_without_gradient(program, loss_index: int, model: torch.nn.Module,
                                step_method: bool = False) -> frozenset[str]:
    """The parameters torch leaves without ``.grad`` after the loss's backward pass, and its
    optimizers skip: frozen (``requires_grad=False``) or not used by the loss. A step with
    several variants (``compiler/host_branches.py``) must leave the same ones in each: a
    compiled step cannot skip a parameter in some micro-batches only."""
    without = _without_gradient(program, loss_index, model)
    for variant in program.variants[1:]:
        other = _without_gradient(variant.program, find_loss(variant.program, step_method), model)
        if other != without:
            raise Error(f"the parameters {sorted(other ^ without)} get a gradient in one way of the Python "
                        f"branch at {host_branches.diverging_line(program.variants[0], variant)} but not in "
                        "the other: torch's optimizers skip a parameter without a gradient, which a "
                        "compiled step cannot do per micro-batch. Use them in every branch (e.g. times 0) "
                        "or choose the value with torch.where")
    return without


def _without_gradient(program, loss_index: int, model: torch.nn.Module) -> frozenset[str]:
    reached = program.parameters_with_gradient(program.result_arrays()[loss_index])
    return frozenset(name for name, p in torch.nn.Module.named_parameters(model)
                     if not p.requires_grad or name not in reached)
