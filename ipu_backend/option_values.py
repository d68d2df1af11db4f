"""The values PopTorch's options accept: each check turns a user's value into the one an option
keeps, or raises PopTorch's error for it (the error types are PopTorch's too)."""

import dataclasses
import enum
import os
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import torch

from ipu_backend.errors import Error
from ipu_backend.hardware import MEMORY_CHECKS, IpuSpec


class FrozenOptionsError(Error, AttributeError):
    """A setter called on options that a model or a DataLoader already uses.

    Also an ``AttributeError``, the type PopTorch raises here.
    """


class InvalidArgument(Error, ValueError):
    """An option or argument whose value is out of range (also a ``ValueError``, as in PopTorch)."""


class FailedCheck(Error, AssertionError):
    """A value PopTorch checks with ``assert`` (also an ``AssertionError``, as in PopTorch)."""


class WrongArgumentType(Error, TypeError):
    """An option or argument of the wrong type (also a ``TypeError``)."""


class ConfigFileError(Error):
    """A line of a file given to :meth:`Options.loadFromFile` that is not valid Python."""


_Member = TypeVar("_Member", bound=enum.Enum)


def _int_at_least(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise WrongArgumentType(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise InvalidArgument(f"{name} must be >= {minimum}, got {value}")
    return value


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise WrongArgumentType(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


def _str(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise WrongArgumentType(f"{name} must be a str, got {value!r} ({type(value).__name__})")
    return value


def _path_or_none(value: Any, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise WrongArgumentType(f"{name} must be a path (str) or None, got {value!r}")
    return os.fspath(value)


def parse_member(enum_type: type[_Member], value: Any, name: str,
                 allowed: Iterable[_Member] | None = None) -> _Member:
    """``value`` as a member of ``enum_type``: the member itself, or its name in any case.

    ``allowed`` narrows the accepted members; the error lists exactly those.
    """
    allowed = tuple(enum_type if allowed is None else allowed)
    if isinstance(value, enum_type):
        member = value
    elif isinstance(value, str):
        member = {m.name.lower(): m for m in enum_type}.get(value.lower())
    else:
        member = None
    if member in allowed:
        return member
    names = ", ".join(m.name for m in allowed)
    raise InvalidArgument(
        f"{name} must be one of {names} (poptorch.{enum_type.__name__} members, or their names "
        f"in any case), got {value!r}")


_PARTIALS_TYPES = {"float": torch.float32, "half": torch.float16}


def _partials_type(value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in _PARTIALS_TYPES.values():
        return value
    if isinstance(value, str) and value.lower() in _PARTIALS_TYPES:
        return _PARTIALS_TYPES[value.lower()]
    raise InvalidArgument(
        "partials_type must be torch.float or torch.half (or 'float' / 'half'), "
        f"got {value!r}")


def _ipu_spec(value: Any) -> IpuSpec:
    """An :class:`IpuSpec`, or the mapping of its fields that ``toDict`` gives."""
    if isinstance(value, IpuSpec):
        return value
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(IpuSpec)})
        if unknown:
            raise InvalidArgument(f"ipu_spec has no field(s) {unknown}; its fields are memory_bytes, "
                                  "tiles and name")
        return IpuSpec(**value)
    raise WrongArgumentType(f"ipu_spec must be a poptorch.IpuSpec (or a mapping of its fields), got "
                            f"{value!r}")


def _memory_check(value: Any) -> str:
    if value not in MEMORY_CHECKS:
        raise InvalidArgument(f"memory_check must be one of {', '.join(MEMORY_CHECKS)}, got {value!r}")
    return value


def _plain(value: Any) -> Any:
    """A setting as ``toDict`` reports it: enums by member name, dtypes by partials type name, an
    IPU spec as the mapping of its fields."""
    if isinstance(value, IpuSpec):
        return dataclasses.asdict(value)
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, torch.dtype):
        return next(name for name, dtype in _PARTIALS_TYPES.items() if dtype == value)
    return value
