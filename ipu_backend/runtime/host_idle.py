"""Host work that can wait for the devices: it runs while a call's program computes.

A PopTorch call returns tensors, so its thread waits for the program it starts; the host work
of the next call (fetching its combined batch) would begin only after that wait. Work queued
here runs in the wait instead: the executor runs the queue once its program is launched.
"""

import weakref

_QUEUED: "weakref.WeakSet" = weakref.WeakSet()


def queue(work) -> None:
    """Have ``work.run_idle()`` called in the next call's device time. Queued once however often
    it is queued, and held weakly: work for an iterator the user abandoned goes with it."""
    _QUEUED.add(work)


def run_queued() -> None:
    """Run the queued work (executors call this once their program is launched)."""
    while True:
        try:
            work = _QUEUED.pop()
        except KeyError:        # empty, or another thread's call ran the last of it
            return
        work.run_idle()
