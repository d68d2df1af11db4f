"""PopTorch's questions about the machine and its logging. The emulated IPUs stand for the
hardware (one per JAX device, Mk2 by default): scripts that choose a path by what hardware is
present take the hardware's. ``setLogLevel`` sets the level of this package's ``ipu_backend``
logger."""

import logging

import jax

_LOG_LEVELS = {"TRACE": (0, logging.DEBUG), "DEBUG": (1, logging.DEBUG), "INFO": (2, logging.INFO),
               "WARN": (3, logging.WARNING), "ERR": (4, logging.ERROR), "OFF": (6, logging.CRITICAL + 1)}


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
