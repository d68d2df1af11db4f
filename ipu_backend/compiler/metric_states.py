"""torchmetrics ``Metric`` objects inside a compiled step: their states become program outputs.

A metric keeps its state (``add_state`` tensors) in Python attributes, which a traced program
cannot carry between calls. While a step is captured, each metric a module holds starts from its
default state, so what the step leaves in the attributes is the micro-batch's own contribution
(torchmetrics' ``full_state_update=False`` contract: a state is the ``dist_reduce_fx`` reduction of
such contributions). Each state becomes an extra logged output; the runtime reduces them over the
call's micro-batches and replicas with that reduction, and the host merges the result into the
metric (see ``lightning_ipu._metrics``). The metric's attributes are left as they were.
"""

import contextlib
import sys
from dataclasses import dataclass

import torch

from ipu_backend.errors import Error

STATE_PREFIX = "metric_state:"
"""Logged outputs named ``metric_state:<metric path>.<state>`` carry a metric's state."""

TOTAL_SUFFIX = ":total"
"""The same state reduced over every micro-batch of a call (whatever the output mode keeps)."""

@dataclass(frozen=True)
class MetricState:
    """One state of one metric: where it lives, how contributions combine, and whether the step
    called the metric (so its batch value, ``_forward_cache``, is wanted)."""

    metric: str
    attribute: str
    reduction: str
    called: bool

    @property
    def key(self) -> str:
        return f"{STATE_PREFIX}{self.metric}.{self.attribute}"


def totals_of(logs) -> dict:
    """Logged name -> reduction ("sum" | "max" | "min") of the metric states among a program's
    ``self.log`` calls: the call reduces these over all its micro-batches."""
    return {call.name: call.state.reduction for call in logs if call.state is not None}


def is_metric(value) -> bool:
    """Whether ``value`` is a torchmetrics ``Metric``. torchmetrics is not imported to find out
    (its import takes seconds): a process holding a metric has imported it already."""
    defining = sys.modules.get("torchmetrics.metric")
    return defining is not None and isinstance(value, defining.Metric)


def is_metric_collection(value) -> bool:
    """Whether ``value`` is a torchmetrics ``MetricCollection`` (found as :func:`is_metric` does)."""
    defining = sys.modules.get("torchmetrics.collections")
    return defining is not None and isinstance(value, defining.MetricCollection)


def metrics_of(module: torch.nn.Module) -> dict:
    """Path (as ``named_modules`` spells it) → the torchmetrics objects ``module`` holds."""
    return {name: m for name, m in module.named_modules() if is_metric(m)}


def _reduction(metric, attribute: str) -> str | None:
    from torchmetrics.utilities import data

    names = {data.dim_zero_sum: "sum", data.dim_zero_max: "max", data.dim_zero_min: "min"}
    return names.get(metric._reductions.get(attribute))


def _unsupported(path: str, metric) -> str | None:
    """Why ``metric``'s state cannot be carried by a compiled step (None when it can)."""
    where = f"self.{path} ({type(metric).__name__})"
    host = ("Compute it on the host instead (return what it needs from the step and update it in "
            "on_train_batch_end / on_validation_batch_end), or use its functional form in the step")
    lists = [name for name, default in metric._defaults.items() if isinstance(default, list)]
    if lists:
        return (f"{where} keeps list states ({', '.join(lists)}) that grow with every batch; a "
                f"compiled step can only carry fixed-size tensor states. {host}")
    for attribute in metric._defaults:
        if _reduction(metric, attribute) is None:
            reduce_fx = metric._reductions.get(attribute)
            described = getattr(reduce_fx, "__name__", repr(reduce_fx)).removeprefix("dim_zero_")
            return (f"{where} reduces its state {attribute!r} with dist_reduce_fx={described!r}; inside "
                    f"a compiled step only 'sum', 'max' and 'min' states can be carried. {host}")
    if metric.full_state_update:
        return (f"{where} has full_state_update=True: its update reads the state accumulated so far, "
                f"which replicas and device iterations do not share inside a compiled step. {host}")
    return None


_MERGE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


def _batch_forward(metric):
    """``metric.forward`` as torchmetrics computes it for ``full_state_update=False`` (update on
    fresh states, the batch value from them, then the states merged), without its ``no_grad``
    region, which would drop the nodes' pipeline-block annotations."""
    def forward(*args, **kwargs):
        before = {name: getattr(metric, name) for name in metric._defaults}
        for name, default in metric._defaults.items():
            setattr(metric, name, default.detach().clone())
        metric.update(*args, **kwargs)
        metric._computed = None
        value = metric.compute()
        for name in metric._defaults:
            setattr(metric, name, _MERGE[_reduction(metric, name)](before[name], getattr(metric, name)))
        metric._computed = None
        metric._forward_cache = value
        return value
    return forward


def _refusal(message: str):
    def refuse(*args, **kwargs):
        raise Error(message)
    return refuse


@contextlib.contextmanager
def lifted(module: torch.nn.Module):
    """Within: every metric of ``module`` (yielded by path) starts from its default state, with
    value checks off (``validate_args`` reads the data, which a traced step cannot) and updates in
    the step's grad mode; one whose state
    cannot be carried raises a clear error when updated. A ``MetricCollection`` updates each of
    its metrics on its own: its compute groups, which share states found equal after a first
    update, would compare data, which a traced step cannot (each metric's own updates give the
    same values). On exit their attributes and bookkeeping are as they were."""
    metrics = metrics_of(module)
    collections = [m for m in module.modules() if is_metric_collection(m)]
    saved = {path: dict(metric.__dict__) for path, metric in metrics.items()}
    saved_collections = [dict(collection.__dict__) for collection in collections]
    try:
        for collection in collections:
            collection._enable_compute_groups = collection._groups_checked = collection._state_is_copy = False
            collection._groups = {index: [str(key)] for index, key in enumerate(collection.keys(keep_base=True))}
        for path, metric in metrics.items():
            for attribute, default in metric._defaults.items():
                if isinstance(default, torch.Tensor):
                    setattr(metric, attribute, default.detach().clone())
            problem = _unsupported(path, metric)
            if problem:
                metric.__dict__.update(update=_refusal(problem), forward=_refusal(problem))
            else:
                metric.forward = _batch_forward(metric)
            metric._forward_cache = None
            metric._update_count = 0
            if hasattr(metric, "validate_args"):
                metric.validate_args = False
            # torchmetrics updates under set_grad_enabled(_enable_grad); a change of grad mode would
            # drop the nodes' pipeline-block annotations, and the states have no gradient anyway
            metric._enable_grad = torch.is_grad_enabled()
        yield metrics
    finally:
        for path, metric in metrics.items():
            metric.__dict__.clear()
            metric.__dict__.update(saved[path])
        for collection, attributes in zip(collections, saved_collections):
            collection.__dict__.clear()
            collection.__dict__.update(attributes)


def updated_states(metrics: dict) -> tuple[list[MetricState], list[torch.Tensor]]:
    """The states of the metrics the step updated (their values, in the order of the specs),
    read before :func:`lifted` restores them."""
    specs, values = [], []
    for path, metric in metrics.items():
        if not metric._update_count:
            continue
        for attribute in metric._defaults:
            specs.append(MetricState(path, attribute, _reduction(metric, attribute),
                                     metric._forward_cache is not None))
            values.append(getattr(metric, attribute))
    return specs, values
