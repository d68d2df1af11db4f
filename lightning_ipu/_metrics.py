"""torchmetrics objects used in a compiled step, brought up to date on the host after each call.

The step's program returns each metric state it updated (see ``ipu_backend.compiler.metric_states``)
twice: reduced over every micro-batch of the call and per replica (``<key>:total``), and per
micro-batch the output mode returns. After the call, as DDP's ``sync`` would, the totals are
reduced over the replicas with the state's ``dist_reduce_fx`` and merged into the metric's
state; so ``compute()``, ``reset()`` and ``self.log(name, metric)`` with ``on_epoch=True`` behave
as on the CPU. A metric the step *called* (its ``forward``) also gets its batch value
(``_forward_cache``, what ``on_step=True`` logs): the metric computed on the returned
micro-batches alone, i.e. on the last optimizer step's batch in training (``OutputMode.Final``)
and on the whole combined batch in inference (``OutputMode.All``).
"""

from collections import defaultdict

import torch

from ipu_backend.lightning_seam import TOTAL_SUFFIX, metrics_of

_REDUCE = {"sum": torch.sum, "max": torch.amax, "min": torch.amin}
_MERGE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


def _reduced(value: torch.Tensor, default: torch.Tensor, reduction: str) -> torch.Tensor:
    """A state's values over leading (replica, iteration, micro-batch) axes, reduced to one."""
    return _REDUCE[reduction](value.reshape(-1, *default.shape), dim=0).to(default.dtype)


def _computed_on(metric, states: dict) -> torch.Tensor:
    """``metric.compute()`` on ``states`` in place of its own, which are left as they were."""
    saved = {name: getattr(metric, name) for name in states}
    for name, value in states.items():
        setattr(metric, name, value)
    metric._computed = None
    try:
        return metric.compute()
    finally:
        for name, value in saved.items():
            setattr(metric, name, value)
        metric._computed = None


def update(module: torch.nn.Module, program, logged: dict, steps: int) -> dict:
    """Merge the call's metric states into ``module``'s metrics; ``steps`` is the number of
    updates the call stands for. Returns the metrics by path."""
    if not any(call.state is not None or call.metric is not None for call in program.logs):
        return {}
    metrics = metrics_of(module)
    by_metric = defaultdict(list)
    for call in program.logs:
        if call.state is not None:
            by_metric[call.state.metric].append(call.state)
    for path, states in by_metric.items():
        metric = metrics[path]
        metric._update_count += steps
        if states[0].called:
            metric._forward_cache = _computed_on(metric, {
                s.attribute: _reduced(logged[s.key], metric._defaults[s.attribute], s.reduction) for s in states})
        for s in states:
            total = _reduced(logged[s.key + TOTAL_SUFFIX], metric._defaults[s.attribute], s.reduction)
            setattr(metric, s.attribute, _MERGE[s.reduction](getattr(metric, s.attribute), total))
        metric._computed = None
    return metrics
