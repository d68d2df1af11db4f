"""Partition a captured model into stages, one per group of blocks, and evaluate one stage.

Each call_function node of the core-ATen graph carries its block (``ipu_backend.blocks`` tags it);
the execution strategy (a :class:`~ipu_backend.runtime.settings.Staging`) maps blocks to stages
and IPUs. A stage owns the parameters and buffers
its nodes read, reads the user inputs it needs, *receives* the values of earlier stages it uses
and *sends* the values later stages use. :func:`run_stage` evaluates one stage's nodes with the
lowerings, with the same random key per node as the whole graph would use, so a partitioned
model computes exactly what the unpartitioned one does.
"""

import operator
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.utils._pytree as torch_pytree
from torch.export.graph_signature import InputKind

from ipu_backend.compiler import integer_ranges, interpreter
from ipu_backend.compiler.custom_ops import BLOCK_KEY
from ipu_backend.compiler.dtypes import to_jax
from ipu_backend.compiler.sources import user_location
from ipu_backend.errors import Error
from ipu_backend.runtime.settings import Staging

_IMPLICIT = object()
"""Marks nodes recorded before any block started: PopTorch puts them in stage 0 on IPU 0."""


def has_blocks(graph_module: torch.fx.GraphModule) -> bool:
    """Whether any node of the graph was recorded inside a block."""
    return any(BLOCK_KEY in node.meta.get("custom", {}) for node in graph_module.graph.nodes
               if node.op == "call_function")


@dataclass(frozen=True)
class StagePlan:
    """What one stage computes and exchanges. Node names identify exchanged values."""

    index: int
    ipu: int
    nodes: tuple[torch.fx.Node, ...]
    params: tuple[str, ...]           # every parameter it reads
    borrowed: tuple[str, ...]         # those of ``params`` another stage owns (tied weights)
    buffers: tuple[str, ...]
    mutated: tuple[str, ...]          # buffers whose new value this stage computes
    inputs: tuple[int, ...]           # indices of the flattened user inputs it reads
    received: tuple[str, ...]         # values of earlier stages it reads
    sent: tuple[str, ...]             # values later stages read
    outputs: tuple[int, ...]          # indices, among the model's array outputs, it produces
    phase: int | None = None          # its execution phase (phased strategies)

    @property
    def owned(self) -> tuple[str, ...]:
        """The parameters this stage updates: all it reads but the borrowed ones."""
        return tuple(n for n in self.params if n not in self.borrowed)


@dataclass(frozen=True)
class Partition:
    graph_module: torch.fx.GraphModule
    stages: tuple[StagePlan, ...]
    sources: Mapping[str, tuple]      # placeholder name -> ("param"|"buffer", name) | ("constant", array) | ("input", index)
    output_leaves: tuple              # the user outputs, flattened: graph nodes or constants
    mutated_buffers: tuple[str, ...]  # buffer names in the order the graph outputs their new values
    producer: Mapping[str, int]       # value name -> stage computing it
    consumers: Mapping[str, tuple]    # sent value name -> stages reading it
    node_index: Mapping[str, int]     # node name -> position in the graph (its random key)
    forward_stages: int               # PopTorch's count: IPU switches in program order + 1
    num_ipus: int
    out_spec: torch_pytree.TreeSpec

    @property
    def array_outputs(self) -> list[torch.fx.Node]:
        return [leaf for leaf in self.output_leaves if isinstance(leaf, torch.fx.Node)]


def _where(node: torch.fx.Node) -> str:
    return user_location(node.meta.get("stack_trace")) or "unknown source line"


class _StageAssigner:
    """PopTorch's block → (stage id, IPU) rules for one strategy."""

    def __init__(self, staging: Staging):
        self.staging = staging
        self.explicit = {block: (index, stage.ipu_id) for index, stage in enumerate(staging.stages)
                         for block in stage.blocks}
        self.auto_ids: dict[str, int] = {}
        self.run_key, self.runs = None, 0          # phased strategies: the current run of operations

    def __call__(self, block, node) -> tuple:
        if self.staging.phased:
            return self._phased(block, node)
        if block is _IMPLICIT:
            return 0, 0
        user_id, ipu_id = block
        if self.staging.stages:
            if user_id not in self.explicit:
                raise Error(f"Unknown Block '{user_id}' list of expected Blocks: {list(self.explicit)} "
                            f"(the block is used at {_where(node)})")
            index, stage_ipu = self.explicit[user_id]
            ipu = stage_ipu if stage_ipu is not None else ipu_id
            return index, index if ipu is None else ipu
        if self.staging.same_as_ipu:
            if ipu_id is None:
                raise Error(f"poptorch.AutoStage.SameAsIpu was selected but no IPU was specified for "
                            f"block {user_id} (at {_where(node)}): give the block an ipu_id, or name "
                            "the stages in the execution strategy")
            return ipu_id, ipu_id
        stage_id = self.auto_ids.setdefault(user_id, len(self.auto_ids) + 1)
        return stage_id, stage_id if ipu_id is None else ipu_id

    def _phased(self, block, node) -> tuple[tuple[int, int], int]:
        """A phased strategy: a stage per run of consecutive operations of one block on one IPU,
        numbered ``(phase, run)`` in program order. The blocks of a phase may exchange values
        both ways, and a block may be entered again after another (or on another IPU, as its
        ``ipu_id`` says): the runs of a phase then execute in program order, which is always a
        valid order, each on the IPU of its stage."""
        if block is _IMPLICIT:
            return (0, -1), 0
        user_id, ipu_id = block
        found = self.staging.phase_of(user_id)
        if found is None:
            raise Error(f"Unknown Block '{user_id}' list of expected Blocks: "
                        f"{[b for stage in self.staging.stages for b in stage.blocks]} "
                        f"(the block is used at {_where(node)})")
        phase, position, stage = found
        ipu = stage.ipu_id if stage.ipu_id is not None else ipu_id
        ipu = self.staging.default_ipu(phase, position) if ipu is None else ipu
        if self.run_key != (phase, user_id, ipu):
            self.run_key, self.runs = (phase, user_id, ipu), self.runs + 1
        return (phase, self.runs), ipu


def _block_of(node: torch.fx.Node):
    custom = node.meta.get("custom", {})
    if BLOCK_KEY not in custom:
        return _IMPLICIT
    block = custom[BLOCK_KEY]
    if block is None:
        raise Error(f"No active Block, all the ops must belong to a Block: {node.target} at "
                    f"{_where(node)} runs after a `with poptorch.Block(...)` scope closed. Move it "
                    "into a block, or use poptorch.Block.start / BeginBlock, which last until the "
                    "next block starts")
    return block


def sources_from_program(program, prefix: str = "") -> dict[str, tuple] | None:
    """Where each graph input comes from, read from the placeholders' export descriptors; None
    when the graph has lifted tensor constants, whose values only the export holds."""
    params = {spec.name for spec in program.params}
    buffers = {spec.name for spec in program.buffers}
    sources, user_index = {}, 0
    for node in program.graph_module.graph.nodes:
        if node.op != "placeholder":
            continue
        target = getattr(node.meta.get("desc"), "target", None)
        name = None if target is None else program.aliases.get(target[len(prefix):], target[len(prefix):])
        if target is None:
            sources[node.name] = ("input", user_index)
            user_index += 1
        elif name in params:
            sources[node.name] = ("param", name)
        elif name in buffers:
            sources[node.name] = ("buffer", name)
        else:
            return None
    return sources


def sources_from_export(exported: torch.export.ExportedProgram, prefix: str = "",
                        aliases: Mapping[str, str] | None = None) -> dict[str, tuple]:
    """Where each graph input comes from, per the export's graph signature (tied weights under
    the name ``aliases`` maps their other names to)."""
    aliases = aliases or {}
    placeholders = [n for n in exported.graph_module.graph.nodes if n.op == "placeholder"]
    sources, user_index = {}, 0
    for spec, node in zip(exported.graph_signature.input_specs, placeholders):
        if spec.kind == InputKind.PARAMETER:
            sources[node.name] = ("param", aliases.get(spec.target[len(prefix):], spec.target[len(prefix):]))
        elif spec.kind == InputKind.BUFFER:
            sources[node.name] = ("buffer", aliases.get(spec.target[len(prefix):], spec.target[len(prefix):]))
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            sources[node.name] = ("constant", to_jax(exported.constants[spec.target]))
        elif spec.kind == InputKind.USER_INPUT:
            sources[node.name] = ("input", user_index)
            user_index += 1
        else:
            raise Error(f"graph input {node.name} of kind {spec.kind.name} is not supported")
    return sources


def _assign_stages(nodes, staging: Staging) -> tuple[dict[str, int], list[int], int, list]:
    """``(stage index of each call_function node, IPU of each stage, IPU switches, phase of each
    stage)``. Stages are numbered in the order of their stage ids; the switches, in program order
    from IPU 0, give PopTorch's count of pipeline stages; phases are None but for phased
    strategies."""
    assign = _StageAssigner(staging)
    stage_id, ipu_of_stage = {}, {0: 0} if not any(n.op == "call_function" for n in nodes) else {}
    switches, last_ipu = 0, 0
    for node in nodes:
        if node.op != "call_function":
            continue
        sid, ipu = assign(_block_of(node), node)
        if ipu_of_stage.setdefault(sid, ipu) != ipu:
            raise Error(f"stage {sid} holds blocks on IPU {ipu_of_stage[sid]} and IPU {ipu} (at "
                        f"{_where(node)}); a stage runs on one IPU")
        if ipu != last_ipu:
            switches, last_ipu = switches + 1, ipu
        stage_id[node.name] = sid
    order = {sid: index for index, sid in enumerate(sorted(ipu_of_stage))}
    return ({name: order[sid] for name, sid in stage_id.items()},
            [ipu_of_stage[sid] for sid in sorted(ipu_of_stage)], switches,
            [sid[0] if isinstance(sid, tuple) else None for sid in sorted(ipu_of_stage)])


def partition(graph_module: torch.fx.GraphModule, sources: Mapping[str, tuple], mutated: tuple[str, ...],
              out_spec: torch_pytree.TreeSpec, staging: Staging) -> Partition:
    """Split ``graph_module`` (core ATen, its nodes tagged with blocks) into stages. ``sources``
    says where each placeholder comes from; ``mutated`` names the buffers whose new values the
    graph outputs first, ``out_spec`` is the structure of the user outputs that follow.
    ``staging`` is read for its ``stages`` (each with ``blocks`` and ``ipu_id``), ``same_as_ipu``,
    ``phased``, ``phase_of`` and ``default_ipu``, which an execution strategy has too."""
    nodes = list(graph_module.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = next(n for n in nodes if n.op == "output")
    output_leaves = tuple(output.args[0][len(mutated):])

    producer, ipu_of_stage, switches, phases = _assign_stages(nodes, staging)
    num_stages = len(ipu_of_stage)
    last = num_stages - 1

    def user_stages(node) -> list[int]:
        stages = []
        for user in node.users:
            if user.op == "call_function":
                stages.append(producer[user.name])
            elif user.op == "output":
                stages.append(producer.get(node.name, last))
        return stages

    owned = {i: {"params": [], "borrowed": [], "buffers": [], "inputs": [], "mutated": []}
             for i in range(num_stages)}
    for node in placeholders:
        kind, value = sources[node.name]
        stages = sorted(set(user_stages(node)))
        if kind in ("param", "buffer"):
            if len(stages) > 1 and kind == "buffer":
                raise Error(f"the buffer {value} is used by stages {stages}; each buffer must be used "
                            "by one stage only: move all its uses into one block, or into blocks of "
                            "one stage")
            if node in output_leaves:
                raise Error(f"the model returns the {value} tensor itself; return a computed value "
                            "(for example a clone) instead")
            # A parameter several stages read (a tied weight) is owned by the first; the others
            # hold a copy and send their gradient contributions to it.
            for reader in stages or [0]:
                owned[reader]["params" if kind == "param" else "buffers"].append(value)
                if reader != (stages or [0])[0]:
                    owned[reader]["borrowed"].append(value)
        elif kind == "input":
            for s in stages:
                owned[s]["inputs"].append(value)

    for name, new_value in zip(mutated, output.args[0][: len(mutated)]):
        readers = [s for s in range(num_stages) if name in owned[s]["buffers"]]
        writer = producer.get(new_value.name, last) if isinstance(new_value, torch.fx.Node) else last
        if readers and readers[0] != writer:
            raise Error(f"the buffer {name} is read in stage {readers[0]} but updated in stage "
                        f"{writer}; update a buffer in the stage that reads it")
        if not readers:
            owned[writer]["buffers"].append(name)
        owned[writer]["mutated"].append(name)

    sent: dict[int, list[str]] = {i: [] for i in range(num_stages)}
    received: dict[int, list[str]] = {i: [] for i in range(num_stages)}
    consumers = {}
    for node in nodes:
        if node.op != "call_function":
            continue
        source = producer[node.name]
        readers = sorted({s for s in user_stages(node) if s != source})
        for reader in readers:
            if reader < source:
                user = next(u for u in node.users if producer.get(u.name) == reader)
                raise Error(f"{user.target} at {_where(user)} (stage {reader}) uses a value computed "
                            f"later, in stage {source} ({node.target} at {_where(node)}); stages must "
                            "run in order")
            received[reader].append(node.name)
        if readers:
            sent[source].append(node.name)
            consumers[node.name] = tuple(readers)

    array_outputs = [leaf for leaf in output_leaves if isinstance(leaf, torch.fx.Node)]
    stages = []
    for index, ipu in enumerate(ipu_of_stage):
        stage_nodes = tuple(n for n in nodes if n.op == "call_function" and producer[n.name] == index)
        outputs = tuple(i for i, leaf in enumerate(array_outputs)
                        if producer.get(leaf.name, last) == index)
        stages.append(StagePlan(
            index=index, ipu=ipu, nodes=stage_nodes,
            params=tuple(owned[index]["params"]), borrowed=tuple(owned[index]["borrowed"]),
            buffers=tuple(owned[index]["buffers"]),
            mutated=tuple(owned[index]["mutated"]), inputs=tuple(sorted(owned[index]["inputs"])),
            received=tuple(received[index]), sent=tuple(sent[index]), outputs=outputs,
            phase=phases[index]))
    ipus = {stage.ipu for stage in stages}
    return Partition(
        graph_module=graph_module, stages=tuple(stages), sources=sources,
        output_leaves=output_leaves, mutated_buffers=mutated, producer=producer,
        consumers=consumers, node_index={n.name: i for i, n in enumerate(nodes)},
        forward_stages=switches + 1, num_ipus=max(len(ipus), max(ipus) + 1), out_spec=out_spec)


def run_stage(part: Partition, stage: StagePlan, params: Mapping, buffers: Mapping,
              received: Mapping, inputs: Mapping, key):
    """Evaluate ``stage``: ``(sent, outputs, new_buffers)``.

    ``params``/``buffers`` hold the stage's own (by name), ``received`` the values of earlier
    stages (by node name), ``inputs`` the user inputs it reads (by flattened index). ``sent``
    maps node names to the values later stages read, ``outputs`` the indices of the stage's
    array outputs to their values, ``new_buffers`` every buffer of the stage, updated.
    """
    graph_module = part.graph_module
    env = {}

    def value(node):
        if node.name in env:
            return env[node.name]
        if node.op == "get_attr":
            return getattr(graph_module, node.target)
        if node.op != "placeholder":
            return received[node.name]
        kind, source = part.sources[node.name]
        if kind == "constant":
            return source
        return {"param": params, "buffer": buffers, "input": inputs}[kind][source]

    checks = integer_ranges.checks(graph_module)
    with interpreter.as_captured(graph_module):
        for node in stage.nodes:
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), value)
            if node.target is operator.getitem:
                env[node.name] = args[0][args[1]]
            else:
                ctx = interpreter.LoweringContext(node, key, (part.node_index[node.name],))
                env[node.name] = interpreter.lower_node(ctx, args, kwargs, checks.get(node))

    output = next(n for n in graph_module.graph.nodes if n.op == "output")
    new_values = dict(zip(part.mutated_buffers, output.args[0][: len(part.mutated_buffers)]))
    new_buffers = dict(buffers)
    new_buffers.update((name, value(new_values[name])) for name in stage.mutated)
    array_outputs = part.array_outputs
    outputs = {i: value(array_outputs[i]) for i in stage.outputs}
    sent = {name: env[name] for name in stage.sent}
    return sent, outputs, new_buffers
