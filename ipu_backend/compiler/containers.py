"""Subclasses of dict, list and tuple as model inputs and outputs, as PopTorch takes them without
a custom parser: each such class met in a model's arguments or results becomes a torch pytree
node on first sight (its items flattened like its base class's, the class rebuilt from them)."""

import torch.utils._pytree as torch_pytree


def _is_ours_to_register(cls: type) -> bool:
    """A user's container class: not a namedtuple (torch has those) nor one of torch's own
    (``torch.Size``, ``torch.return_types``), whose handling torch decides."""
    named = issubclass(cls, tuple) and hasattr(cls, "_fields")
    return not named and not cls.__module__.split(".")[0] == "torch"


def _register(cls: type) -> None:
    if issubclass(cls, dict):
        torch_pytree.register_pytree_node(
            cls, lambda d: (list(d.values()), list(d.keys())),
            lambda values, keys: cls(zip(keys, values)),
            flatten_with_keys_fn=lambda d: ([(torch_pytree.MappingKey(k), v) for k, v in d.items()], list(d.keys())))
    else:
        torch_pytree.register_pytree_node(
            cls, lambda s: (list(s), None), lambda values, _: cls(values),
            flatten_with_keys_fn=lambda s: ([(torch_pytree.SequenceKey(i), v) for i, v in enumerate(s)], None))


def register(tree) -> None:
    """Make every dict, list or tuple subclass found in ``tree`` a pytree node."""
    cls = type(tree)
    if isinstance(tree, (dict, list, tuple)):
        if cls not in torch_pytree.SUPPORTED_NODES and _is_ours_to_register(cls):
            _register(cls)
        for child in (tree.values() if isinstance(tree, dict) else tree):
            register(child)
