"""Host work that can wait for the devices: it runs while a call's program computes.

A PopTorch call returns tensors, so its thread waits for the program it starts, and the host
work of the next call (fetching its combined batch) used to begin only after that wait. Work
queued here runs in the wait instead: the executor runs the queue once its program is launched.
"""

import weakref

_QUEUED: list[weakref.WeakMethod] = []


def run_while_computing(method) -> None:
    """Queue the bound ``method`` for the next call's device time. It is held weakly: work queued
    by an iterator the user abandoned is dropped with it."""
    _QUEUED.append(weakref.WeakMethod(method))


def run_queued() -> None:
    """Run the queued work, oldest first (called by executors after launching a program)."""
    while True:
        try:
            method = _QUEUED.pop(0)()
        except IndexError:      # another thread's call ran the last of it
            return
        if method is not None:
            method()
