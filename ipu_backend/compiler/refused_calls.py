"""torch functions a captured program cannot contain, refused by name while a model is captured.

``torch.autograd.grad`` called by the model's own code (a gradient penalty, say) differentiates
during the trace: torch.export cannot trace it and fails with an internal error that names
nothing of the user's. While a model is captured, in the capturing thread, a stand-in refuses a
call from the user's code with an error naming its line; torch's own calls, and every call
anywhere else, go to torch's function.
"""

import sys
from collections.abc import Callable

import torch

from ipu_backend.compiler.sources import calling_user_location, is_library_file
from ipu_backend.errors import Error

_TORCH_AUTOGRAD_GRAD = torch.autograd.grad


def install(capturing: Callable[[], bool]) -> None:
    """Put the stand-in for ``torch.autograd.grad`` in place (once); ``capturing()`` tells
    whether this thread is capturing a model."""
    if torch.autograd.grad is not _TORCH_AUTOGRAD_GRAD:
        return

    def grad(*args, **kwargs):
        if capturing() and not is_library_file(sys._getframe(1).f_code.co_filename):
            raise Error(f"torch.autograd.grad is called inside the captured program, at {calling_user_location()}: "
                        "a compiled program takes the gradients of the loss it returns, after its forward, "
                        "and cannot differentiate within it (a gradient penalty, say). Compute such a term "
                        "outside the compiled model")
        return _TORCH_AUTOGRAD_GRAD(*args, **kwargs)

    grad.__doc__ = _TORCH_AUTOGRAD_GRAD.__doc__
    torch.autograd.grad = grad
