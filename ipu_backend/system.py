"""PopTorch's questions about the machine and its logging: there is no IPU hardware (every IPU is
emulated), and ``setLogLevel`` sets the level of this package's ``ipu_backend`` logger."""

import logging

_LOG_LEVELS = {"TRACE": (0, logging.DEBUG), "DEBUG": (1, logging.DEBUG), "INFO": (2, logging.INFO),
               "WARN": (3, logging.WARNING), "ERR": (4, logging.ERROR), "OFF": (6, logging.CRITICAL + 1)}


def ipuHardwareIsAvailable(num_ipus: int = 1) -> bool:  # noqa: N802
    """Whether ``num_ipus`` physical IPUs are present: never, here (the IPUs are emulated)."""
    return False


def ipuHardwareVersion() -> int:  # noqa: N802
    """The version of the IPU hardware present; as in PopTorch without hardware, an error."""
    raise AssertionError("No IPU hardware available on this system")


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
