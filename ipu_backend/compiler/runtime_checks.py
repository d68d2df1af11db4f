"""Checks a compiled program makes of its data while it runs, raised on the host after the call.

A program cannot stop mid-run (nor can an IPU's), so a check torch makes as it computes (an
integer division by zero, ``F.one_hot``'s class range) becomes a flag the program computes; only
when it is set does the program call back to the host, which records the message. The executor
raises what its call recorded once the call is over (:func:`raise_recorded`), the state the
call computed left on the device. A program with checks calls back into Python, so it is not
kept in the persistent executable cache.
"""

import contextlib
import contextvars
import functools
import threading

import jax
import numpy as np

from ipu_backend.errors import Error

_lock = threading.Lock()
_recorded: list[str] = []
_traced = threading.Event()
_guards: contextvars.ContextVar[tuple] = contextvars.ContextVar("runtime_check_guards", default=())


@contextlib.contextmanager
def guarded(taken):
    """Within the block, which traces a branch of a conditional, checks count only where
    ``taken`` (a boolean scalar) holds: vmapped, a conditional computes both branches."""
    token = _guards.set(_guards.get() + (taken,))
    try:
        yield
    finally:
        _guards.reset(token)


def report(flag, message: str) -> None:
    """In the program being traced: when ``flag`` (a boolean array) holds a true value while the
    program runs, the call raises ``message``."""
    _traced.set()
    for taken in _guards.get():
        flag = flag & taken
    jax.lax.cond(flag, lambda f: jax.debug.callback(functools.partial(_record, message), f),
                 lambda f: None, flag)


def _record(message: str, flag) -> None:
    if np.any(flag):
        with _lock:
            if message not in _recorded:
                _recorded.append(message)


def forget_recorded() -> None:
    """Forget what programs run before recorded: a call raises only what it computed."""
    with _lock:
        _recorded.clear()


def raise_recorded() -> None:
    """Raise what the checks of the calls that finished found, if anything (and forget it).
    Waits for the programs' callbacks, once a check was traced in this process: a process whose
    programs have none never waits."""
    if not _traced.is_set():
        return
    jax.effects_barrier()
    with _lock:
        found = list(_recorded)
        _recorded.clear()
    if found:
        raise Error("\n".join(found))
