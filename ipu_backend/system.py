"""PopTorch's questions about the machine and its logging. The emulated IPUs stand for the
hardware (one per JAX device, Mk2 by default): scripts that choose a path by what hardware is
present take the hardware's. ``setLogLevel`` sets the level of this package's ``ipu_backend``
logger, whose warnings go to the console (stderr) as PopTorch's do, whatever handlers the root
logger has (a test runner's log capture among them)."""

import logging
import sys

import jax

_LOG_LEVELS = {"TRACE": (0, logging.DEBUG), "DEBUG": (1, logging.DEBUG), "INFO": (2, logging.INFO),
               "WARN": (3, logging.WARNING), "ERR": (4, logging.ERROR), "OFF": (6, logging.CRITICAL + 1)}


class _Console(logging.StreamHandler):
    """Warnings and errors to the ``sys.stderr`` of the moment (a redirection sees them)."""

    def __init__(self):
        super().__init__()
        self.setLevel(logging.WARNING)
        self.setFormatter(logging.Formatter("[%(name)s] [%(levelname)s] %(message)s"))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        """``sys.stderr`` is looked up at each message, never kept."""

    def emit(self, record: logging.LogRecord) -> None:
        """Unless the root logger already writes to the console (``logging.basicConfig``): the
        message is shown once."""
        if not any(getattr(handler, "stream", None) in (sys.stderr, sys.__stderr__)
                   for handler in logging.getLogger().handlers):
            super().emit(record)


logging.getLogger("ipu_backend").addHandler(_Console())


def ipuHardwareIsAvailable(num_ipus: int = 1) -> bool:  # noqa: N802
    """Whether ``num_ipus`` IPUs are present: as many as JAX devices carry emulated IPUs."""
    return num_ipus <= len(jax.devices())


def ipuHardwareVersion() -> int:  # noqa: N802
    """The IPU version present: 2, the emulated IPUs being Mk2 IPUs."""
    return 2


def setLogLevel(level: str | int) -> None:  # noqa: N802
    """The level of the ``ipu_backend`` logger: ``"TRACE"``, ``"DEBUG"``, ``"INFO"``, ``"WARN"``,
    ``"ERR"``, ``"OFF"``, or PopTorch's integers 0 to 4 and 6 for them."""
    if isinstance(level, int) and not isinstance(level, bool):
        names = [name for name, (number, _) in _LOG_LEVELS.items() if number == level]
        if not names:
            raise ValueError("Invalid log level integer")
        level = names[0]
    if level not in _LOG_LEVELS:
        raise ValueError(f"Unknown log level: {level}. Valid values are {', '.join(sorted(_LOG_LEVELS))}")
    logging.getLogger("ipu_backend").setLevel(_LOG_LEVELS[level][1])
