"""torch's named-tuple results (``torch.return_types.max``, ``topk``, ``sort``, ...) as JAX
pytrees, so a program may return them as the user's code does and come back with the same
type and fields (``.values``, ``.indices``). Registers on import."""

import jax
import torch.return_types


def _register(cls) -> None:
    jax.tree_util.register_pytree_node(cls, lambda value: (tuple(value), None),
                                       lambda _, children: cls(tuple(children)))


for _cls in torch.return_types.all_return_types:
    _register(_cls)
