"""torch.distributions' argument checks while a model is captured.

A distribution validates its parameters and samples by default (``validate_args``): Python
``if`` statements on tensor values, which a compiled program, traced once, cannot take: the
capture leaves them out and says so: a distribution built without ``validate_args=True`` of its own skips
its checks inside the program, where invalid parameters or samples give unchecked results (NaN,
say) instead of torch's ``ValueError``. A distribution given ``validate_args=True`` keeps its
checks, so capturing it fails on them, naming the line.
"""

import contextlib
import warnings

from torch.distributions import Distribution


class _Skipped:
    """Falsy, like ``validate_args=False``; remembers that a distribution asked."""

    def __init__(self):
        self.asked = False

    def __bool__(self) -> bool:
        self.asked = True
        return False


@contextlib.contextmanager
def skipped():
    """Within the block, distributions that follow torch's default skip their checks; leaving it
    without error, a warning says so when one did."""
    default = Distribution._validate_args
    if default is not True:                  # turned off by the user, or skipped already
        yield
        return
    stand_in = _Skipped()
    Distribution._validate_args = stand_in
    try:
        yield
    finally:
        Distribution._validate_args = default
    if stand_in.asked:
        warnings.warn("torch.distributions' argument checks (validate_args) are not evaluated in the "
                      "compiled program: invalid parameters or samples give unchecked results, not "
                      "torch's ValueError (Distribution.set_default_validate_args(False) silences this)",
                      stacklevel=4)
