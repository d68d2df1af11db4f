"""The modelled timeline of one device iteration: which stage works on which micro-batch when.

The emulated IPUs run fused XLA programs, so nothing inside a call is sampled. The timeline is
the executor's own dispatch schedule (:func:`~ipu_backend.runtime.schedule.training_order` and
:func:`~ipu_backend.runtime.schedule.inference_order`) laid out in *slots*: every forward and
every backward pass of a micro-batch on a stage takes one slot, as in Graphcore's pipeline
diagrams. In a pipelined training cycle ``t`` each IPU has a forward slot then a backward slot
(stage ``k`` runs the forward of micro-batch ``t − k`` and the backward of micro-batch
``t − (2S − 2 − k)``; the last stage runs both halves of micro-batch ``t − S + 1``); the optimizer
update takes one more slot on every IPU. Measured call times scale the slots (``trace.py``).
"""

from dataclasses import dataclass

from ipu_backend.runtime.recording import BACKWARD, UPDATE
from ipu_backend.runtime.schedule import inference_order, training_order

FORWARD = "forward"


@dataclass(frozen=True)
class Slot:
    """One pass of one stage, in slot units from the start of the device iteration."""

    role: str                 # FORWARD, BACKWARD or UPDATE
    stage: int
    micro_batch: int | None   # None for the optimizer update
    start: int
    length: int = 1

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class Timeline:
    """The slots of one device iteration (training) or of one call (inference, where the device
    iterations are the micro-batches that flow through the pipeline)."""

    slots: tuple[Slot, ...]
    stages: int
    micro_batches: int
    pipelined: bool
    training: bool

    @property
    def length(self) -> int:
        return max(slot.end for slot in self.slots)

    @property
    def pass_length(self) -> int:
        """Slots of the forward and backward passes, without the optimizer update."""
        return max(slot.end for slot in self.slots if slot.role != UPDATE)


def _training_slots(micro_batches: int, stages: int, pipelined: bool) -> list[Slot]:
    order = training_order(micro_batches, stages, pipelined)
    slots = []
    if pipelined:
        last = stages - 1
        for role, k, m in order:
            cycle = m + (k if role != "B" else 2 * last - k)
            if role in ("F", "FB"):
                slots.append(Slot(FORWARD, k, m, 2 * cycle))
            if role in ("B", "FB"):
                slots.append(Slot(BACKWARD, k, m, 2 * cycle + 1))
    else:
        for role, k, m in order:
            for name in ((FORWARD,) if role == "F" else (BACKWARD,) if role == "B" else (FORWARD, BACKWARD)):
                slots.append(Slot(name, k, m, len(slots)))
    end = max(slot.end for slot in slots)
    return slots + [Slot(UPDATE, k, None, end) for k in range(stages)]


def _inference_slots(micro_batches: int, stages: int, pipelined: bool) -> list[Slot]:
    order = inference_order(micro_batches, stages, pipelined)
    if pipelined:
        return [Slot(FORWARD, k, m, k + m) for k, m in order]
    return [Slot(FORWARD, k, m, i) for i, (k, m) in enumerate(order)]


def timeline(training: bool, micro_batches: int, stages: int, pipelined: bool) -> Timeline:
    """The timeline of ``micro_batches`` through ``stages`` (one stage: a single-IPU model)."""
    build = _training_slots if training else _inference_slots
    return Timeline(tuple(build(micro_batches, stages, pipelined)), stages, micro_batches, pipelined, training)


def manual_timeline(passes: list[str]) -> Timeline:
    """A manual-optimization step on one IPU: its forward, then its ``manual_backward`` calls
    (BACKWARD) and optimizer steps (UPDATE) in the order the step makes them."""
    slots = [Slot(FORWARD, 0, 0, 0)] + [Slot(role, 0, 0 if role == BACKWARD else None, start)
                                        for start, role in enumerate(passes, start=1)]
    return Timeline(tuple(slots), 1, 1, False, True)


def busy_slots(line: Timeline, stages: set[int], passes_only: bool = False) -> int:
    """Slots in which at least one of ``stages`` (those of one IPU) works."""
    return len({t for slot in line.slots if slot.stage in stages and not (passes_only and slot.role == UPDATE)
                for t in range(slot.start, slot.end)})


def bubble_fraction(line: Timeline, ipu_stages: list[set[int]]) -> float:
    """Idle share of the IPUs' forward/backward slots (the pipeline's ramp-up and ramp-down)."""
    total = line.pass_length * len(ipu_stages)
    return 1 - sum(busy_slots(line, stages, passes_only=True) for stages in ipu_stages) / total


def utilization(line: Timeline, stages: set[int]) -> float:
    """Busy share of one IPU's slots, optimizer update included."""
    return busy_slots(line, stages) / line.length
