"""The weights of a run's repeated layers kept out of the model's export, and put back after it.

torch.export lifts every parameter of the module tree into the graph, one placeholder each,
at a cost that grows with the depth of the model although each repeated layer stands in as one
op call (``layer_calls``). While the model is exported, the parameters of a run's layers but
the first are therefore *held*: each module inside those layers holds an empty mapping in place
of its ``_parameters``, so torch.export does not see them, and the stand-in passes none. Once
exported, :meth:`Held.put_back` adds their placeholders to the graph and its signature, named as
torch.export names them, and gives each call its weights, so that the graph is the one an
export of the whole tree gives.

The user's code must not see the difference: an empty mapping read from the model's code (a
parameter of a held layer read by name, ``self.parameters()`` walked for a penalty, a
``state_dict()``) raises :class:`NotHeld`, noted as well in case the code catches it, and the
model is exported again with that run's weights in place. Only torch.export's own walks of the
tree, and the capture's notes of what the code read (``python_reads``), see the mapping empty.
Layers with buffers or hooks of their own, or that the tree holds more than once, are not held.
"""

import os
import site
import sys
import sysconfig
from collections.abc import Iterable

import torch
from torch.export.graph_signature import InputKind, InputSpec, TensorArgument

from ipu_backend.compiler import capture, python_reads

_TORCH = os.path.dirname(torch.__file__) + os.sep
_STANDARD_LIBRARY = sysconfig.get_paths()["stdlib"] + os.sep
_INSTALLED = tuple({path + os.sep for path in (*site.getsitepackages(), sysconfig.get_paths()["purelib"],
                                               sysconfig.get_paths()["platlib"])})
"""Where installed packages live, inside the standard library's directory outside a virtual
environment: their code (a model from a library) is not the standard library's."""
_TREE_WALKERS = frozenset({capture.__file__, python_reads.__file__})
"""Files whose walks of the module tree may see a held layer's mapping empty: torch.export's
caller (whose walks lift the parameters) and the notes of attributes read (empty mappings are no guards)."""


class NotHeld(Exception):
    """The model's code reads the weights of a layer of run ``run`` in a way a held layer cannot
    answer: it is exported again with that run's weights in place."""

    def __init__(self, run: int, reason: str):
        super().__init__(reason)
        self.run = run


def _walked_by_export() -> bool:
    """Whether the code walking a held mapping now is torch.export's (through the capture),
    rather than the model's own: the first frame outside torch and the standard library tells."""
    frame = sys._getframe(3)          # past this, _walked and the mapping's method
    while frame is not None:
        if not library_code(frame.f_code.co_filename):
            return frame.f_code.co_filename in _TREE_WALKERS
        frame = frame.f_back
    return False


def library_code(filename: str) -> bool:
    """Whether ``filename`` is torch's or the standard library's (not an installed package's)."""
    return filename.startswith(_TORCH) or (filename.startswith(_STANDARD_LIBRARY)
                                           and not filename.startswith(_INSTALLED))


class _HeldParameters(dict):
    """An empty ``_parameters`` standing in for a held module's (see the module docstring)."""

    def __init__(self, held: "Held", run: int, names: Iterable[str]):
        super().__init__()
        self._held, self._run, self._names = held, run, frozenset(names)

    def _read(self):
        self._held.refuse(self._run, "the model's code reads the parameters of a repeated layer")

    def _walked(self):
        if not _walked_by_export():
            self._read()

    def __contains__(self, name):
        if name in self._names:
            self._read()
        return False

    def __getitem__(self, name):
        self._read()

    def get(self, name, default=None):
        if name in self._names:
            self._read()
        return default

    def __iter__(self):
        self._walked()
        return iter(())

    def __len__(self):
        self._walked()
        return 0

    def keys(self):
        self._walked()
        return {}.keys()

    def values(self):
        self._walked()
        return {}.values()

    def items(self):
        self._walked()
        return {}.items()

    def _write(self, *args, **kwargs):
        self._read()

    __setitem__ = __delitem__ = pop = popitem = setdefault = update = clear = copy = _write


def holdable(root: torch.nn.Module, run: tuple[torch.nn.Module, ...]) -> bool:
    """Whether the weights of ``run``'s layers but the first can be held while ``root`` is
    exported: the layers have parameters, no buffers, no hooks and no forward of their own
    instance, and the tree holds each once."""
    counts = {}
    for _, module in root.named_modules(remove_duplicate=False):
        counts[id(module)] = counts.get(id(module), 0) + 1
    for layer in run:
        if counts.get(id(layer)) != 1 or "forward" in vars(layer) or next(layer.buffers(), None) is not None:
            return False
        if layer._forward_hooks or layer._forward_pre_hooks or next(layer.parameters(), None) is None:
            return False
    return len(run) > 1


class Held:
    """The held weights of the layers of several runs, from :meth:`hold` to :meth:`release`,
    and how to put them back into an export of ``root``."""

    def __init__(self, root: torch.nn.Module):
        self.root = root
        self.refused: list[int] = []
        self.layers: list[dict[str, torch.Tensor]] = []       # per held layer: its parameters by name
        self._order: dict[int, tuple[int, str]] = {}           # id -> (place, name) as torch.export lifts
        self._tensors: dict[str, torch.Tensor] = {}            # every name, ties included
        self._saved: list[tuple[torch.nn.Module, dict]] = []

    def hold(self, run_index: int, layer: torch.nn.Module) -> int:
        """Hold ``layer``'s parameters; returns its index among the held layers."""
        if not self._order:
            self._order = {id(p): (place, name) for place, (name, p) in enumerate(self.root.named_parameters())}
            self._tensors = dict(self.root.named_parameters(remove_duplicate=False))
        self.layers.append(dict(layer.named_parameters(remove_duplicate=False)))
        for module in layer.modules():
            saved = module.__dict__["_parameters"]
            self._saved.append((module, saved))
            module.__dict__["_parameters"] = _HeldParameters(self, run_index, saved)
        return len(self.layers) - 1

    def refuse(self, run: int, reason: str):
        """Raise :class:`NotHeld` for run ``run``, noted in :attr:`refused` too: the code that
        met it may catch it (the model's) or wrap it (torch's compiler, tracing a ``torch.cond``)."""
        self.refused.append(run)
        raise NotHeld(run, reason)

    def release(self) -> None:
        """Give each held module its parameters back."""
        for module, saved in reversed(self._saved):
            module.__dict__["_parameters"] = saved
        self._saved.clear()

    def put_back(self, exported: torch.export.ExportedProgram, calls: Iterable[torch.fx.Node],
                 state_names) -> None:
        """Give each of ``calls`` (``repeated_layer`` nodes of held layers: ``args[3]`` the held
        layer's index) its weights, ``state_names(node)`` in order, as parameter placeholders of
        ``exported`` (a weight tied to one the export lifted takes its placeholder), placed and
        named as torch.export places and names them."""
        graph = exported.graph
        specs = exported.graph_signature.input_specs
        placeholders = [node for node in graph.nodes if node.op == "placeholder"]
        params = {id(self._tensors[spec.target]): (node, spec) for spec, node in zip(specs, placeholders)
                  if spec.kind == InputKind.PARAMETER}
        lifted = next(iter(params.values()))[0]        # the first layer's, never held
        for node in calls:
            tensors = [self.layers[node.args[3]][name] for name in state_names(node)]
            for tensor in tensors:
                if id(tensor) not in params:
                    params[id(tensor)] = self._placeholder(exported, placeholders[0], tensor, lifted)
            node.args = (node.args[0], [params[id(tensor)][0] for tensor in tensors], *node.args[2:])
        ordered = [params[key] for key in sorted(params, key=lambda key: self._order[key][0])]
        others = [(node, spec) for spec, node in zip(specs, placeholders) if spec.kind != InputKind.PARAMETER]
        first_other = others[0][0] if others else next(node for node in graph.nodes if node.op != "placeholder")
        for node, _ in ordered:
            first_other.prepend(node)
        specs[:] = [spec for _, spec in ordered] + [spec for _, spec in others]
        exported.graph_module.recompile()

    def _placeholder(self, exported, before: torch.fx.Node, tensor: torch.Tensor, lifted: torch.fx.Node) -> tuple:
        """A new placeholder of ``exported`` for the weight ``tensor``, and its input spec, its
        metadata as the ``lifted`` weight's."""
        target = self._order[id(tensor)][1]
        with exported.graph.inserting_before(before):
            node = exported.graph.placeholder("p_" + target.replace(".", "_"))
        node.meta["val"] = lifted.meta["val"].fake_mode.from_tensor(tensor, static_shapes=True)
        if "custom" in lifted.meta:
            node.meta["custom"] = dict(lifted.meta["custom"])
        exported.state_dict[target] = tensor
        return node, InputSpec(kind=InputKind.PARAMETER, arg=TensorArgument(name=node.name), target=target,
                               persistent=None)
