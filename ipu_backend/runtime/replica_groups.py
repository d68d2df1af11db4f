"""Groups of replicas, as PopTorch's ``CommGroupType`` arranges them: replicas that share a call's
input data (``Options.inputReplicaGrouping``) or one value of a weight (``replicaGrouping`` on a
parameter of a wrapped model).

A grouped weight holds one value per group on the host, stacked on its first dimension
(``VariableRetrievalMode.OnePerGroup``); the device keeps the stack whole and each replica reads
its group's row. The gradient of the stack is reduced over the replicas as any weight's, so each
row gets the contributions of its own group's replicas only, as on IPUs.
"""

import contextlib
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
import torch
import torch.utils._pytree as torch_pytree

from ipu_backend.enums import CommGroupType, VariableRetrievalMode
from ipu_backend.errors import Error


def group_of_replica(replicas: int, group_size: int, orthogonal: bool) -> np.ndarray:
    """Each replica's group: Consecutive groups are runs of ``group_size`` replicas; Orthogonal
    groups take every ``replicas // group_size``-th replica (``{0, m, 2m, ...}, {1, m+1, ...}``)."""
    groups = replicas // group_size
    replica = np.arange(replicas)
    return replica % groups if orthogonal else replica // group_size


@dataclass(frozen=True)
class WeightGrouping:
    """``replicaGrouping(comm_group_type, shards, variable_retrieval_mode)`` of one weight."""

    comm_group_type: CommGroupType
    shards: int
    retrieval: VariableRetrievalMode

    def table(self, name: str, replicas: int) -> np.ndarray | None:
        """Each replica's row of the weight (None: every replica shares the one value)."""
        if self.comm_group_type is CommGroupType.All:
            return None
        if self.retrieval is not VariableRetrievalMode.OnePerGroup:
            raise Error(f"{name}.replicaGrouping(..., VariableRetrievalMode.{self.retrieval.name}) is not "
                        "emulated: the host holds one value per group (VariableRetrievalMode.OnePerGroup)")
        size = 1 if self.comm_group_type is CommGroupType.NoGrouping else self.shards
        if size < 1 or replicas % size:
            raise Error(f"{name}.replicaGrouping({self.comm_group_type.name}, {self.shards}, ...): the "
                        f"group size must divide the {replicas} replicas")
        return group_of_replica(replicas, size, self.comm_group_type is CommGroupType.Orthogonal)


class GroupableParameter:
    """A parameter of a wrapped model read through the wrapper (``poptorch_model.W``): the
    parameter, plus PopTorch's ``replicaGrouping``, recorded for this wrapper only."""

    def __init__(self, parameter: torch.nn.Parameter, name: str, groupings: dict):
        object.__setattr__(self, "_parameter", parameter)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_groupings", groupings)

    def replicaGrouping(self, comm_group_type: CommGroupType, shards: int,  # noqa: N802
                        variable_retrieval_mode: VariableRetrievalMode) -> None:
        """Replicas in groups of ``shards`` (arranged as ``comm_group_type`` says) share one value
        of this weight; set before the model's first call."""
        self._groupings[self._name] = WeightGrouping(
            CommGroupType(comm_group_type), int(shards), VariableRetrievalMode(variable_retrieval_mode))

    def __getattr__(self, name):
        return getattr(self._parameter, name)

    def __setattr__(self, name, value):
        setattr(self._parameter, name, value)

    def __repr__(self) -> str:
        return repr(self._parameter)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """Torch functions see the parameter itself."""
        unwrap = lambda x: x._parameter if isinstance(x, cls) else x  # noqa: E731
        return func(*torch_pytree.tree_map(unwrap, args), **torch_pytree.tree_map(unwrap, kwargs or {}))


def _forwarded(name: str):
    """The parameter's own ``name`` operator (Python looks operators up on the class)."""
    return lambda self, *args: getattr(self._parameter, name)(*args)


for _operator in ("add", "radd", "sub", "rsub", "mul", "rmul", "truediv", "rtruediv", "matmul", "rmatmul",
                  "pow", "neg", "eq", "ne", "lt", "le", "gt", "ge", "getitem", "setitem", "len", "iter",
                  "bool", "float", "int", "array", "format"):
    setattr(GroupableParameter, f"__{_operator}__", _forwarded(f"__{_operator}__"))


def replica_rows(groupings: dict, model: torch.nn.Module, replicas: int) -> dict:
    """Each grouped weight's row for each replica (name -> int array ``[replicas]``), checked
    against the weight's shape."""
    if not groupings:
        return {}
    parameters = dict(model.named_parameters())
    rows = {}
    for name, grouping in groupings.items():
        table = grouping.table(name, replicas)
        if table is None:
            continue
        groups = int(table.max()) + 1
        shape = tuple(parameters[name].shape)
        if not shape or shape[0] != groups:
            raise Error(f"{name} is grouped over replicas in {groups} groups (replicaGrouping), so its "
                        f"first dimension must hold one value per group ({groups}); its shape is {shape}")
        rows[name] = table
    return rows


def replica_views(rows: dict):
    """``views(params, replica)``: the weights as ``replica`` reads them (its group's row of each
    grouped weight); None without grouped weights."""
    if not rows:
        return None
    tables = {name: jnp.asarray(table, jnp.int32) for name, table in rows.items()}

    def views(params: dict, replica):
        return {**params, **{name: params[name][table[replica]] for name, table in tables.items()}}

    return views


@contextlib.contextmanager
def one_group_each(model: torch.nn.Module, rows: dict):
    """While a model is captured, each grouped weight holds one group's value (the shape one
    replica reads)."""
    parameters = dict(model.named_parameters())
    saved = {name: parameters[name].data for name in rows}
    try:
        for name, data in saved.items():
            parameters[name].data = data[0]
        yield
    finally:
        for name, data in saved.items():
            parameters[name].data = data
