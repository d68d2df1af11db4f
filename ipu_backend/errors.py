"""The one exception type users catch, named as in PopTorch (``poptorch.Error``)."""


class Error(RuntimeError):
    """A program that cannot be compiled or run on emulated IPUs; the message names cause and fix."""
