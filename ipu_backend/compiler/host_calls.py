"""``poptorch.CPU``: a Python function called on the host in the middle of a compiled model.

The call is captured as one custom op, ``ipu_backend::host_call``, naming the function by a key
unique to its ``CPU`` object (so a program is only ever shared by models calling the same
function); its lowering is a host callback that runs the function on torch tensors, once per
replica and micro-batch, each time the program computes it. Its output shapes come from calling
the function once, at capture, on zeros shaped as its inputs (as PopTorch does).
"""

import itertools
import weakref

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ipu_backend.compiler.host_random import kept as random_states_kept
from ipu_backend.compiler.list_appends import on_host

_FUNCTIONS: "weakref.WeakValueDictionary[str, HostFunction]" = weakref.WeakValueDictionary()
_SERIAL = itertools.count()


class HostFunction:
    """A host function with the key its captured calls name it by."""

    def __init__(self, function, name: str):
        self.function = function
        self.key = f"{name}#{next(_SERIAL)}"
        _FUNCTIONS[self.key] = self

        self.single = True          # whether the function returned one tensor, when last called

    def __call__(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """The function's results, always as a list."""
        with torch.no_grad():
            outputs = self.function(*tensors)
        self.single = not isinstance(outputs, (list, tuple))
        return [outputs] if self.single else list(outputs)


def host_function(key: str) -> HostFunction:
    """The host function a captured call names (it lives as long as its ``CPU`` object)."""
    return _FUNCTIONS[key]


@torch.library.custom_op("ipu_backend::host_call", mutates_args=())
def host_call(inputs: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    return [output.clone() for output in host_function(key)(*inputs)]


@host_call.register_fake
def _(inputs, key):
    with unset_fake_temporarily(), on_host(), random_states_kept():
        zeros = [torch.zeros(tuple(x.shape), dtype=x.dtype) for x in inputs]
        shapes = [(tuple(o.shape), o.dtype) for o in host_function(key)(*zeros)]
    return [torch.empty(shape, dtype=dtype) for shape, dtype in shapes]


HOST_CALL = torch.ops.ipu_backend.host_call.default
