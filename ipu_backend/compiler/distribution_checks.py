"""torch.distributions' argument checks, made while the compiled program runs.

A distribution validates its parameters and the values it scores by default (``validate_args``)
with Python ``if``s on ``torch._is_all_true(valid)``, which a program traced once cannot take.
While a model is captured, in the capturing thread, ``torch._is_all_true`` is a stand-in that
turns each such check into one the program makes as it runs (``_assert_async``, see
``runtime_checks``) and lets the ``if`` pass: a call whose parameters or values break a
constraint raises after it, naming the distribution, the parameter and the constraint, where
torch raises ``ValueError``. ``validate_args=False`` (or
``Distribution.set_default_validate_args(False)``) leaves the checks out, as in torch.
"""

import sys
from collections.abc import Callable

import torch

_TORCH_IS_ALL_TRUE = torch._is_all_true


def install(capturing: Callable[[], bool]) -> None:
    """Put the stand-in for ``torch._is_all_true`` in place (once); ``capturing()`` tells
    whether this thread is capturing a model."""
    if torch._is_all_true is not _TORCH_IS_ALL_TRUE:
        return

    def _is_all_true(valid):
        if not capturing() or not isinstance(valid, torch.Tensor):
            return _TORCH_IS_ALL_TRUE(valid)
        torch._assert_async(torch.all(valid), _what(sys._getframe(1).f_locals))
        return True

    _is_all_true.__doc__ = _TORCH_IS_ALL_TRUE.__doc__
    torch._is_all_true = _is_all_true


def _what(checking: dict) -> str:
    """The check a distribution's method makes, from its local names (``Distribution.__init__``
    checks ``param`` against ``constraint``; ``_validate_sample``, a value against ``support``)."""
    owner = type(checking.get("self")).__name__
    if "param" in checking and "constraint" in checking:
        return (f"Expected parameter {checking['param']} of distribution {owner} to satisfy the constraint "
                f"{checking['constraint']!r}, but found invalid values (torch raises ValueError; "
                "validate_args=False leaves the check out)")
    if "support" in checking:
        return (f"Expected value argument to be within the support ({checking['support']!r}) of the "
                f"distribution {owner}, but found invalid values (torch raises ValueError; "
                "validate_args=False leaves the check out)")
    return f"a check of {owner}'s arguments failed (torch raises ValueError)"
