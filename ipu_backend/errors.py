"""The one exception type users catch, named as in PopTorch (``poptorch.Error``)."""


class Error(RuntimeError):
    """A program that cannot be compiled or run on emulated IPUs; the message names cause and fix."""


class RecoverableError(Error):
    """PopTorch's error after which the device can be used again (after its ``recovery_action``).
    Emulated IPUs never fail this way; the class exists so that handlers of it keep working."""

    recovery_action = "none"


class UnrecoverableError(Error):
    """PopTorch's error after which the device cannot be used again. Emulated IPUs never fail this
    way; the class exists so that handlers of it keep working."""


class IndexOutOfRange(Error, IndexError):
    """An index input outside the rows it selects: an ``IndexError`` as torch raises, and an
    ``Error``."""
