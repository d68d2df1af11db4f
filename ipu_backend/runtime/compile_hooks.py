"""PopTorch's compile hooks: callables run before an executor captures its model and after the
capture ends (failed or not)."""

from collections import OrderedDict
from collections.abc import Callable

import torch.utils.hooks

# OrderedDicts: a handle refers to its hooks weakly, which a plain dict does not allow.
PRE_COMPILE: OrderedDict = OrderedDict()
POST_COMPILE: OrderedDict = OrderedDict()


def _register(hooks: dict, hook: Callable) -> torch.utils.hooks.RemovableHandle:
    handle = torch.utils.hooks.RemovableHandle(hooks)
    hooks[handle.id] = hook
    return handle


def registerPreCompileHook(hook: Callable) -> torch.utils.hooks.RemovableHandle:  # noqa: N802
    """Run ``hook()`` before every model compilation; ``handle.remove()`` unregisters it."""
    if not callable(hook):
        raise RuntimeError("Pre-compile hook must be callable")
    return _register(PRE_COMPILE, hook)


def registerPostCompileHook(hook: Callable) -> torch.utils.hooks.RemovableHandle:  # noqa: N802
    """Run ``hook()`` after every model's capture, even one that failed."""
    if not callable(hook):
        raise RuntimeError("Post-compile hook must be callable")
    return _register(POST_COMPILE, hook)


def run(hooks: dict) -> None:
    for hook in list(hooks.values()):
        hook()
