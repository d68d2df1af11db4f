"""The schedule: how one host call is split (device iterations x micro-batches x replicas), and
for a model split over IPUs which stage runs which micro-batch when.

Pipelined training follows Graphcore's schedule: with S stages a step has 2S−1 pipeline stages
(the forward of each IPU, then the backward of all but the last); micro-batch ``m`` reaches
pipeline stage ``p`` at cycle ``m + p``, so IPU ``k`` runs the forward of micro-batch ``t − k``
and the backward of micro-batch ``t − (2S − 2 − k)`` at cycle ``t`` (ramp-up, a steady state
where every IPU alternates forward and backward, ramp-down). Sharded execution runs one
micro-batch at a time through every stage and back.

The multi-IPU program dispatches in this order and the execution reports draw it: this module is
the one source of both.
"""

from dataclasses import dataclass

import numpy as np

from ipu_backend.runtime.replica_groups import group_of_replica


OUTPUT_MODE_NAMES = {"all": "All", "final": "Final", "sum": "Sum", "every_n": "EveryN"}
"""A schedule's ``output_mode`` -> its name in ``poptorch.OutputMode``, for messages."""


@dataclass(frozen=True)
class Schedule:
    """How one host call is split: D device iterations × A micro-batches × R replicas, the
    replicas spread evenly over ``processes`` host processes (each feeds its own share)."""

    device_iterations: int
    accumulation: int
    replicas: int
    mean_reduction: bool = True
    output_mode: str = "final"          # "all" | "final" | "sum" | "every_n"
    output_period: int = 1
    dynamic_loss_scaling: bool = False
    stochastic_rounding: bool = False
    master_weights: bool = False
    processes: int = 1
    input_group_size: int = 1           # replicas sharing each share of the input data
    input_groups_orthogonal: bool = False
    per_replica_buffers: bool = False   # broadcastBuffers(False): each replica keeps its own buffers
    hyperparameters_per_iteration: bool = False   # one row of optimizer hyper-parameters per iteration

    @property
    def local_replicas(self) -> int:
        """The replicas of one process."""
        return self.replicas // self.processes

    @property
    def input_shares(self) -> int:
        """Distinct shares of the input in one micro-batch step: one per group of replicas."""
        return self.local_replicas // self.input_group_size

    @property
    def factor(self) -> int:
        """Micro-batches in one process's combined batch."""
        return self.device_iterations * self.accumulation * self.input_shares


def split_batch(array, schedule: Schedule):
    """One process's combined batch ``[D·A·g·m, ...]`` → ``[D, A, r, m, ...]`` (``r``: its replicas,
    ``g``: its input shares, one per group of replicas sharing the input); a scalar (the input of
    a call of one micro-batch) → ``[1, 1, r]``."""
    if array.ndim == 0:
        split = array.reshape(1, 1, 1)
    else:
        micro = array.shape[0] // schedule.factor
        split = array.reshape(schedule.device_iterations, schedule.accumulation, schedule.input_shares,
                              micro, *array.shape[1:])
    if schedule.input_shares == schedule.local_replicas:
        return split
    share = group_of_replica(schedule.local_replicas, schedule.input_group_size, schedule.input_groups_orthogonal)
    return np.take(split, share, axis=2)


def training_order(micro_batches: int, stages: int, pipelined: bool) -> list[tuple[str, int, int]]:
    """``(role, stage, micro_batch)`` in dispatch order for one optimizer step; role is ``"F"``
    (forward), ``"B"`` (backward) or ``"FB"`` (the last stage's forward and backward)."""
    last = stages - 1
    if not pipelined:
        return [event for m in range(micro_batches)
                for event in ([("F", k, m) for k in range(last)] + [("FB", last, m)] +
                              [("B", k, m) for k in reversed(range(last))])]
    order = []
    for cycle in range(micro_batches + 2 * stages - 2):
        for k in range(stages):
            m = cycle - k
            if 0 <= m < micro_batches:
                order.append(("FB" if k == last else "F", k, m))
        for k in reversed(range(last)):
            m = cycle - (2 * stages - 2 - k)
            if 0 <= m < micro_batches:
                order.append(("B", k, m))
    return order


def inference_order(micro_batches: int, stages: int, pipelined: bool) -> list[tuple[int, int]]:
    """``(stage, micro_batch)`` forwards in dispatch order."""
    if not pipelined:
        return [(k, m) for m in range(micro_batches) for k in range(stages)]
    return [(k, cycle - k) for cycle in range(micro_batches + stages - 1) for k in range(stages)
            if 0 <= cycle - k < micro_batches]


def stashed_micro_batches(stage: int, stages: int, pipelined: bool) -> int:
    """Micro-batches whose stash stage ``stage`` holds at once (its forward runs ahead of its
    backward by 2(S−1−k) cycles in a pipeline)."""
    if stage == stages - 1:
        return 0
    return 2 * (stages - 1 - stage) + 1 if pipelined else 1
