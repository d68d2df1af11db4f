"""A model split over IPUs, run: each stage's programs on its own emulated IPUs, pipelined or
sharded, with the numbers of single-IPU training.

One compiled program per stage and role on the stage's devices (one device per replica: replica
``r`` of IPU ``i`` is JAX device ``r · num_ipus + i``, or one its other IPUs share where JAX has
fewer devices, see :func:`~ipu_backend.runtime.devices.ipu_devices`),
driven by a host loop in the order of :mod:`~ipu_backend.runtime.schedule` that only dispatches:
every computation, gradient accumulation included, happens inside the stage programs, so the host
never waits and stages on different devices overlap.
"""

from collections import defaultdict

import jax
import numpy as np

from ipu_backend.compiler.list_appends import EVERY_MICRO_BATCH
from ipu_backend.compiler.metric_states import TOTAL_SUFFIX
from ipu_backend.runtime.hyperparameters import row
from ipu_backend.runtime.recording import PIPELINED, SHARDED, StageFacts
from ipu_backend.runtime.schedule import inference_order, training_order
from ipu_backend.runtime.stage_program import MultiIpuSettings, StageProgram
from ipu_backend.runtime.stages import Partition
from ipu_backend.runtime.step import call_key

_call_key = jax.jit(call_key)
"""A call's random key, made once for all its stages (one dispatch where eager ``fold_in`` costs a dozen)."""
_HOST_REDUCE = {"sum": np.sum, "max": np.max, "min": np.min}


def _stacked(host: dict, index: int, cells: list) -> np.ndarray:
    """``[R, D', A', ...]``: output ``index`` of the micro-batches ``cells`` ((d, m), a grid in order)."""
    rows = sorted({d for d, _ in cells})
    columns = sorted({m for _, m in cells})
    return np.moveaxis(np.stack([np.stack([host[d, m][index] for m in columns]) for d in rows]), 2, 0)


def _merge(dicts) -> dict:
    return {name: value for d in dicts for name, value in d.items()}


class MultiIpuProgram:
    """What the executor runs for a model split over IPUs, in place of its single-IPU step:
    called with the executor's arguments, ``(state, inputs, hyper, key, index)`` in training and
    ``(state, inputs, key, index)`` in inference, it returns ``(state, outputs, logs)``.

    It is a program that places and compiles itself: its stage programs were compiled (and its
    memory checked) when it was built, and each call puts the state and inputs on the stages'
    devices from wherever they are. The executor takes it as it is, with no ahead-of-time step.
    """

    def __init__(self, part: Partition, stages: list[StageProgram], settings: MultiIpuSettings, layout, output_dtypes,
                 rule, usage, tensor_leaves: list[int], log_names: tuple[str, ...], totals: dict):
        self.part, self.stages, self.settings = part, stages, settings
        self.layout, self.output_dtypes, self.rule = layout, output_dtypes, rule
        self.memory = usage
        """Per-IPU memory estimate (:class:`~ipu_backend.runtime.memory.IpuMemory`, one replica)."""
        self._tensor_leaves = tensor_leaves
        self._log_names = log_names
        first_log = len(part.array_outputs) - len(log_names)
        index = {name: first_log + i for i, name in enumerate(log_names)}
        self._reduced = {index[name]: how for name, how in totals.items() if how in _HOST_REDUCE}
        """Output index -> how the call's total of that logged metric state reduces it."""
        self._whole = {index[name] for name, how in totals.items() if how == EVERY_MICRO_BATCH}
        """Output indices returned for every micro-batch whatever the output mode (logs aggregated
        over the epoch, appended tensors)."""
        self._owner = {}
        for stage in stages:
            self._owner.update((n, stage) for n in stage.plan.owned + stage.plan.buffers)
        self.placement = {n: stage.plan.ipu for stage in stages for n in stage.plan.owned}
        """Parameter name → IPU (of the stage updating it, for a tied weight)."""

    def __call__(self, state, inputs, *rest):
        *rest, key, index = rest
        rest = (*rest, _call_key(key, index))
        state = self.place(state)
        if self.settings.training:
            state, arrays, totals = self._train(state, inputs, *rest)
        else:
            state, arrays, totals = self._infer(state, inputs, *rest)
        results = len(arrays) - len(self._log_names)
        totals = {self._log_names[i - results] + TOTAL_SUFFIX: total for i, total in totals.items()}
        return state, arrays[:results], dict(zip(self._log_names, arrays[results:])) | totals

    @property
    def execution(self) -> str:
        return PIPELINED if self.settings.pipelined else SHARDED

    def stage_facts(self) -> tuple[StageFacts, ...]:
        """Each stage's IPU, graph nodes and compiled programs, for a recorder."""
        return tuple(StageFacts(s.plan.index, s.plan.ipu, s.plan.nodes, s.programs) for s in self.stages)

    # --- state ---------------------------------------------------------------------------------
    def _stage_of(self, name: str) -> StageProgram:
        return self._owner.get(name, self.stages[0])

    def place(self, state: dict) -> dict:
        """Each weight, buffer and optimizer state on its stage's devices (a no-op when it is)."""
        shardings = {"params": {n: self._stage_of(n).rep for n in state["params"]},
                     "buffers": {n: self._stage_of(n).rep for n in state["buffers"]}}
        if "opt" in state:
            shardings["opt"] = jax.tree.map(lambda n: self._stage_of(n).opt_sharding, self._opt_names(state["opt"]))
            shardings["scaler"] = None
        return jax.device_put(state, shardings)

    def _opt_names(self, opt: dict):
        """The optimizer state's structure down to parameter names (state of a parameter, or its
        master copy, goes where the parameter goes)."""
        if self.settings.schedule.master_weights:
            return {"rule": {n: n for n in opt["rule"]}, "master": {n: n for n in opt["master"]}}
        return {n: n for n in opt}

    def _stage_opt(self, opt: dict, stage: StageProgram) -> dict:
        def pick(tree):
            return {n: tree[n] for n in stage.plan.owned if n in tree}

        if self.settings.schedule.master_weights:
            return {"rule": pick(opt["rule"]), "master": pick(opt["master"])}
        return pick(opt)

    def _merged_opt(self, opts: list) -> dict:
        if self.settings.schedule.master_weights:
            return {"rule": _merge(o["rule"] for o in opts), "master": _merge(o["master"] for o in opts)}
        return _merge(opts)

    def _stage_params(self, state: dict) -> list[dict]:
        """Each stage's parameters on its devices: a tied weight's copy too."""
        return [{n: state["params"][n] if n not in s.plan.borrowed else jax.device_put(state["params"][n], s.rep)
                 for n in s.plan.params} for s in self.stages]

    def _owned_params(self, params: list[dict]) -> dict:
        return _merge({n: p[n] for n in s.plan.owned} for s, p in zip(self.stages, params))

    def _user_inputs(self, inputs: list) -> list[dict]:
        """The executor's tensor inputs (``[D, A, R, m, ...]`` each) on the stages reading them."""
        arrays = dict(zip(self._tensor_leaves, inputs))
        return [{i: jax.device_put(arrays[i], stage.batch) for i in stage.input_avals} for stage in self.stages]

    # --- outputs -------------------------------------------------------------------------------
    def _wanted(self, d: int, m: int, micro_batches: int) -> bool:
        mode = self.settings.schedule.output_mode
        last_micro = m == micro_batches - 1
        if mode in ("all", "sum"):
            return True
        if mode == "every_n":
            return (d + 1) % self.settings.schedule.output_period == 0
        return last_micro and d == self.settings.schedule.device_iterations - 1

    def _collect(self, collected: dict, outputs: dict, d: int, m: int, micro_batches: int) -> None:
        """Keep a micro-batch's outputs the call returns: those the output mode selects, and of
        every micro-batch those returned whole or reduced over the call."""
        if self._wanted(d, m, micro_batches):
            kept = outputs
        else:
            kept = {i: v for i, v in outputs.items() if i in self._whole or i in self._reduced}
        if kept:
            collected.setdefault((d, m), {}).update(kept)

    def _gather_outputs(self, collected: dict, micro_batches: int) -> tuple[list[np.ndarray], dict]:
        """``[R, D', A', ...]`` per array output from ``{(d, m): {output index: [R, ...]}}`` (``m``
        of ``micro_batches`` per iteration), and each logged metric state's total over all the
        call's micro-batches (``[R, 1, 1, ...]``)."""
        host = jax.device_get(collected)
        arrays, totals = [], {}
        for index in range(len(self.part.array_outputs)):
            cells = sorted(key for key in host if index in host[key])
            if index in self._reduced:
                totals[index] = _HOST_REDUCE[self._reduced[index]](_stacked(host, index, cells), axis=(1, 2),
                                                                   keepdims=True)
                cells = [(d, m) for d, m in cells if self._wanted(d, m, micro_batches)]
            stacked = _stacked(host, index, cells)
            if self.settings.schedule.output_mode == "sum" and index not in self._whole:
                stacked = stacked.sum(axis=(1, 2), keepdims=True, dtype=stacked.dtype)
            arrays.append(stacked)
        return arrays, totals

    # --- training ----------------------------------------------------------------------------
    def _train(self, state, inputs, hyper, key):
        schedule, stages = self.settings.schedule, self.stages
        params = self._stage_params(state)
        buffers = [{n: state["buffers"][n] for n in s.plan.buffers} for s in stages]
        opt = [self._stage_opt(state["opt"], s) for s in stages]
        user = self._user_inputs(inputs)
        keys = [jax.device_put(key, s.rep) for s in stages]
        placed = None if schedule.hyperparameters_per_iteration else [jax.device_put(hyper, s.rep) for s in stages]
        dynamic = schedule.dynamic_loss_scaling
        first = row(hyper, schedule, 0)
        scalers = [jax.device_put(state["scaler"] if dynamic else {"scale": self.rule.loss_scale(first)}, s.rep)
                   for s in stages]
        accs = [s.zero_accumulator() for s in stages]
        order = training_order(schedule.accumulation, len(stages), self.settings.pipelined)
        collected = {}
        for d in range(schedule.device_iterations):
            received = defaultdict(dict)                          # (stage, micro) -> name -> value
            cotangents = defaultdict(lambda: defaultdict(list))   # (stage, micro) -> name -> [ct]
            stash = {}
            for role, k, m in order:
                program = stages[k].programs
                if role == "F":
                    sent, outputs, buffers[k], stash[k, m] = program["forward"](
                        params[k], buffers[k], received.pop((k, m), {}), user[k], keys[k],
                        stages[k].index(d), stages[k].index(m))
                    self._send(sent, m, received)
                elif role == "FB":
                    accs[k], outputs, buffers[k], received_cts = program["forward_backward"](
                        accs[k], params[k], buffers[k], received.pop((k, m), {}), user[k], keys[k],
                        stages[k].index(d), stages[k].index(m), scalers[k]["scale"])
                    self._send_back(received_cts, m, cotangents)
                else:
                    accs[k], received_cts = program["backward"](
                        accs[k], params[k], stash.pop((k, m)), dict(cotangents.pop((k, m), {})),
                        scalers[k]["scale"])
                    self._send_back(received_cts, m, cotangents)
                    continue
                self._collect(collected, outputs, d, m, schedule.accumulation)
            hypers = placed or [jax.device_put(row(hyper, schedule, d), s.rep) for s in stages]
            self._update(params, opt, accs, hypers, keys, scalers, d)
        new_state = {"params": self._owned_params(params), "buffers": _merge(buffers),
                     "opt": self._merged_opt(opt), "scaler": scalers[0] if dynamic else state["scaler"]}
        return new_state, *self._gather_outputs(collected, schedule.accumulation)

    def _update(self, params, opt, accs, hypers, keys, scalers, d: int) -> None:
        """Every stage's optimizer step, in place of the lists it is given. A stage owning a tied
        weight receives the other stages' gradients of it first and sends them the new value after;
        the stages exchange what their updates need of each other (whether all gradients are
        finite, their squared norms) as scalars."""
        stages = self.stages
        lent = [{n: [jax.device_put(accs[j][n], s.data) for j in lenders] for n, lenders in s.lenders.items()}
                for s in stages]
        finites = [s.programs["finite"](accs[k], scalers[k]) for k, s in enumerate(stages) if "finite" in s.programs]
        norms = [s.programs["norm"](accs[k], lent[k], scalers[k]) for k, s in enumerate(stages)
                 if "norm" in s.programs]
        for k, stage in enumerate(stages):
            owned, opt[k], accs[k], scalers[k] = stage.programs["update"](
                {n: params[k][n] for n in stage.plan.owned}, opt[k], accs[k], hypers[k], keys[k],
                stage.index(d), scalers[k], [jax.device_put(f, stage.rep) for f in finites],
                [jax.device_put(norm, stage.rep) for norm in norms], lent[k])
            params[k].update(owned)
        for k, stage in enumerate(stages):
            for n in stage.plan.borrowed:
                params[k][n] = jax.device_put(params[self._owner[n].plan.index][n], stage.rep)

    def _send(self, sent: dict, m: int, received) -> None:
        for name, value in sent.items():
            for reader in self.part.consumers[name]:
                received[reader, m][name] = jax.device_put(value, self.stages[reader].data)

    def _send_back(self, received_cts: dict, m: int, cotangents) -> None:
        for name, ct in received_cts.items():
            producer = self.part.producer[name]
            cotangents[producer, m][name].append(jax.device_put(ct, self.stages[producer].data))

    # --- inference ---------------------------------------------------------------------------
    def _infer(self, state, inputs, key):
        schedule, stages = self.settings.schedule, self.stages
        params = self._stage_params(state)
        buffers = [{n: state["buffers"][n] for n in s.plan.buffers} for s in stages]
        user = self._user_inputs(inputs)
        keys = [jax.device_put(key, s.rep) for s in stages]
        received = defaultdict(dict)
        collected = {}
        for k, d in inference_order(schedule.device_iterations, len(stages), self.settings.pipelined):
            sent, outputs, buffers[k] = stages[k].programs["infer"](
                params[k], buffers[k], received.pop((k, d), {}), user[k], keys[k], stages[k].index(d))
            self._send(sent, d, received)
            self._collect(collected, outputs, d, 0, 1)
        return {"params": self._owned_params(params), "buffers": _merge(buffers)}, *self._gather_outputs(collected, 1)


def multi_ipu_program(executor) -> MultiIpuProgram | None:
    """The multi-IPU program a ``trainingModel``/``inferenceModel`` executor last compiled (its
    placement and memory figures), or None for a single-IPU model or before the first compilation."""
    compiled = next(reversed(executor._compiled.values()), None) if executor._compiled else None
    call = getattr(compiled, "call", None)
    return call if isinstance(call, MultiIpuProgram) else None
