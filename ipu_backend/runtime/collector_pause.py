"""The garbage collector kept off the objects that exist when a compilation starts.

Capture and tracing allocate many short-lived objects, so the collector runs often while a
program compiles, and each of its full passes walks every object of the process as well: the
modules of torch and JAX, the user's data. :func:`hold` sets the objects that exist aside
(``gc.freeze``) until the last compilation open ends (:func:`release`); what the compilation
creates is collected as before. A process that froze objects itself is left as it is."""

import gc
import threading

_LOCK = threading.Lock()
_holders = 0
_frozen_here = False


def hold() -> None:
    """A compilation starts: freeze the objects that exist, unless the process froze some."""
    global _holders, _frozen_here
    with _LOCK:
        if _holders == 0 and gc.get_freeze_count() == 0:
            gc.freeze()
            _frozen_here = True
        _holders += 1


def release() -> None:
    """A compilation ended: the last one to end gives the frozen objects back to the collector."""
    global _holders, _frozen_here
    with _LOCK:
        _holders -= 1
        if _holders == 0 and _frozen_here:
            gc.unfreeze()
            _frozen_here = False
