"""torch's autograd calls a captured program cannot follow, refused by name while a model is
captured.

torch.export records the operations a forward runs, not what torch's backward pass would do:
``torch.autograd.grad`` called by the model's own code (a gradient penalty, say) fails the trace
with an internal error that names nothing of the user's; a hook on a tensor's gradient
(``Tensor.register_hook``) and the backward of a ``torch.autograd.Function`` of the user's would
be dropped silently, the program differentiating the forward instead. While a model is captured,
in the capturing thread, stand-ins refuse the first two from the user's code with an error naming
its line, and mark a Function's outputs ``unsupported_gradient``: the forward runs (an inference
model), and differentiating through it raises, naming the Function and its line. torch's own
calls, and every call anywhere else, go to torch's functions, but one: torch's reentrant
activation checkpoint (``checkpoint(fn, x, use_reentrant=True)``) runs ``fn`` under
``torch.no_grad()`` and again with gradients in its backward, so the capture, which would detach
its result, calls ``fn`` itself, under ``no_grad`` only where torch's checkpoint passes no
gradient (no input requires one).
"""

import sys
from collections.abc import Callable

import torch
import torch.utils._pytree as torch_pytree
from torch.utils.checkpoint import CheckpointFunction

from ipu_backend.compiler.custom_ops import UNSUPPORTED_GRADIENT
from ipu_backend.compiler.sources import calling_user_location, is_library_file
from ipu_backend.errors import Error

_TORCH_AUTOGRAD_GRAD = torch.autograd.grad
_TORCH_REGISTER_HOOK = torch.Tensor.register_hook
_TORCH_FUNCTION_APPLY = torch.autograd.Function.__dict__["apply"]


def _from_user(capturing: Callable[[], bool]) -> bool:
    """Whether a model is being captured and the stand-in's caller is the user's code."""
    return capturing() and not is_library_file(sys._getframe(2).f_code.co_filename)


def _checkpointed(function, inputs: tuple):
    """``function(*inputs)`` as torch's reentrant checkpoint differentiates it: through the
    function when an input requires a gradient, else not at all (its output then requires none)."""
    if any(isinstance(value, torch.Tensor) and value.requires_grad for value in inputs):
        return function(*inputs)
    with torch.no_grad():
        return function(*inputs)


def install(capturing: Callable[[], bool]) -> None:
    """Put the stand-ins in place (once); ``capturing()`` tells whether this thread is capturing
    a model."""
    if torch.autograd.grad is not _TORCH_AUTOGRAD_GRAD:
        return

    def grad(*args, **kwargs):
        if _from_user(capturing):
            raise Error(f"torch.autograd.grad is called inside the captured program, at {calling_user_location()}: "
                        "a compiled program takes the gradients of the loss it returns, after its forward, "
                        "and cannot differentiate within it (a gradient penalty, say). Compute such a term "
                        "outside the compiled model")
        return _TORCH_AUTOGRAD_GRAD(*args, **kwargs)

    grad.__doc__ = _TORCH_AUTOGRAD_GRAD.__doc__
    torch.autograd.grad = grad

    def register_hook(tensor, hook):
        if _from_user(capturing):
            raise Error(f"Tensor.register_hook is called inside the captured program, at {calling_user_location()}: "
                        "a hook on a gradient runs in torch's backward pass, which the compiled program does not "
                        "run (it differentiates the program itself), so the hook would never be called")
        return _TORCH_REGISTER_HOOK(tensor, hook)

    def apply(cls, *args, **kwargs):
        if cls is CheckpointFunction and capturing():        # args: the function, preserve_rng_state, its inputs
            return _checkpointed(args[0], args[2:])
        result = _TORCH_FUNCTION_APPLY.__func__(cls, *args, **kwargs)
        if not _from_user(capturing):
            return result
        reason = (f"the torch.autograd.Function {cls.__qualname__}, applied at {calling_user_location()}, has a "
                  "backward of its own, which the compiled program cannot follow (it would differentiate the "
                  "Function's forward instead): a training program cannot take gradients through it. Write the "
                  "gradient you want with differentiable operations (a straight-through estimator as "
                  "x + (f(x) - x).detach(), a reversed gradient as 2 * x.detach() - x), or run the model for "
                  "inference only")
        return torch_pytree.tree_map_only(
            torch.Tensor, lambda t: UNSUPPORTED_GRADIENT(t, reason) if t.is_floating_point() else t, result)

    register_hook.__doc__ = _TORCH_REGISTER_HOOK.__doc__
    torch.Tensor.register_hook = register_hook
    torch.autograd.Function.apply = classmethod(apply)
