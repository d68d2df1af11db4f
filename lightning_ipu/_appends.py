"""What a compiled step appended to lists the module holds (``self.validation_step_outputs.append(loss)``),
appended to them on the host after each call.

The step's appended tensors are outputs of the program, returned for every micro-batch (see
``ipu_backend.compiler.list_appends``). On the CPU the step runs once per micro-batch-sized
batch and appends its items each time; here one call runs the combined batch, so each list gets,
micro-batch by micro-batch in the order of the combined batch, the items the step appended, each
of the shape and structure the step appended (a tensor, or a tuple, list or dict of them).
"""

from collections import defaultdict

import torch
import torch.utils._pytree as torch_pytree
from lightning.pytorch.utilities.exceptions import MisconfigurationException


def extend(module: torch.nn.Module, program, logged: dict) -> None:
    """Append the call's values (``logged``: the executor's logs, per micro-batch in order) to
    the lists ``program``'s step appended to."""
    lists: dict = defaultdict(lambda: defaultdict(list))
    for call in program.logs:
        if call.appended is not None:
            lists[call.appended.module, call.appended.attribute][call.appended.item].append(call.appended)
    for (path, attribute), items in lists.items():
        target = getattr(module.get_submodule(path), attribute, None)
        first = items[0][0]
        if not isinstance(target, list):
            raise MisconfigurationException(
                f"the compiled step appends to {first.where}, which is now a {type(target).__name__}: keep "
                "it a list, clearing it in place (.clear()) rather than replacing it")
        per_item = [(leaves[0].spec, [_per_micro_batch(logged[leaf.name], leaf.shape) for leaf in leaves])
                    for _, leaves in sorted(items.items())]
        micro_batches = per_item[0][1][0].shape[0]
        for micro in range(micro_batches):
            target.extend(torch_pytree.tree_unflatten([values[micro] for values in leaves], spec)
                          for spec, leaves in per_item)


def _per_micro_batch(value: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``[micro-batches, *shape]`` from a logged value (micro-batches' values concatenated)."""
    return value.reshape(-1, *shape)
