"""Find the user's source line behind a graph node or an exception."""

import importlib.util
import linecache
import os
import re
import sys
import types

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _package_dir(name: str) -> str | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.realpath(list(spec.submodule_search_locations)[0]) + os.sep


_LIBRARY_DIRS = tuple(
    d for d in (_package_dir(n) for n in (
        "torch", "ipu_backend", "lightning", "pytorch_lightning", "lightning_fabric",
        "torchmetrics")) if d
) + (os.path.dirname(os.__file__) + os.sep,)


def is_library_file(path: str) -> bool:
    """Whether ``path`` belongs to torch, Lightning, the standard library or this package."""
    return os.path.realpath(path).startswith(_LIBRARY_DIRS)


def location(path: str, line: int) -> str:
    """``file:line: code``."""
    code = linecache.getline(path, line).strip()
    return f"{path}:{line}" + (f": {code}" if code else "")


def user_location(stack_trace: str | None) -> str | None:
    """``file:line: code`` of the innermost user frame in an FX node's stack trace."""
    if not stack_trace:
        return None
    frames = [(path, int(line)) for path, line in _FRAME.findall(stack_trace)]
    files = [f for f in frames if not f[0].startswith("<eval_with_key>")]       # not FX's generated code
    user = [f for f in files if not is_library_file(f[0])] or files
    return location(*user[-1]) if user else None


def traceback_location(tb: types.TracebackType | None) -> str | None:
    """``file:line: code`` of the innermost user frame of a traceback."""
    user = None
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename
        if not is_library_file(path) and not path.startswith("<"):
            user = (path, tb.tb_lineno)
        tb = tb.tb_next
    return location(*user) if user else None


def calling_user_location() -> str | None:
    """``file:line: code`` of the innermost user frame on the current stack."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not is_library_file(path) and not path.startswith("<"):
            return location(path, frame.f_lineno)
        frame = frame.f_back
    return None
