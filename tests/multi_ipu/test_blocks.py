"""Blocks, stages and execution strategies: which IPU each part of a model lands on, and
PopTorch's errors. Most tests only capture and partition the model (no XLA compilation)."""

import re

import pytest
import torch
import torch.fx.traceback as fx_traceback
from torch import nn

import ipu_backend as poptorch
from ipu_backend.compiler import compile_module
from ipu_backend.runtime.stages import partition, sources_from_program
from tests.multi_ipu.models import TwoStages, regression_data


class Chain(nn.Module):
    """Four linear layers called in order; ``forward`` is replaced per test."""

    def __init__(self):
        super().__init__()
        self.l0, self.l1, self.l2, self.l3 = (nn.Linear(4, 4) for _ in range(4))


def layer_ipus(model, strategy=None, args=None):
    """``{layer: (stage, ipu)}`` after partitioning ``model``'s capture with ``strategy``."""
    program = compile_module(model, args or (torch.randn(2, 4),))
    part = partition(program.graph_module, sources_from_program(program), program.mutated_buffers,
                     program.output_spec, strategy or poptorch.PipelinedExecution())
    return {name.split(".")[0]: (stage.index, stage.ipu) for stage in part.stages for name in stage.params}


def test_blocks_do_nothing_outside_a_capture():
    model = TwoStages()
    before = dict(fx_traceback.current_meta)
    out, loss = model(*regression_data(4))
    assert out.shape == (4, 3) and loss.ndim == 0
    assert fx_traceback.current_meta == before


def test_scope_start_begin_block_and_block_function_place_their_layers():
    class Model(Chain):
        @poptorch.BlockFunction("D", ipu_id=3)
        def tail(self, x):
            return self.l3(x)

        def forward(self, x):
            with poptorch.Block("A", ipu_id=0):
                x = self.l0(x)
            poptorch.Block.start("B", ipu_id=1)
            x = self.l1(x)
            x = self.l2(x)                          # BeginBlock(l2) starts block C
            return self.tail(x)

    model = Model()
    poptorch.BeginBlock(model.l2, "C", ipu_id=2)
    assert layer_ipus(model) == {"l0": (0, 0), "l1": (1, 1), "l2": (2, 2), "l3": (3, 3)}
    poptorch.removeBlocks(model)
    assert layer_ipus(model)["l2"] == (1, 1)       # back in block B, which lasts until D starts


def test_operations_before_the_first_block_run_on_ipu_0():
    class Model(Chain):
        def forward(self, x):
            return self.l2(self.l1(self.l0(x)))

    model = Model()
    poptorch.BeginBlock(model.l1, ipu_id=1)
    poptorch.BeginBlock(model.l2, ipu_id=1)
    # l3, used by no operation, stays with stage 0
    assert layer_ipus(model) == {"l0": (0, 0), "l1": (1, 1), "l2": (1, 1), "l3": (0, 0)}


def test_auto_ids_and_explicit_stages_by_block_id():
    class Model(Chain):
        def forward(self, x):
            poptorch.Block.useAutoId()
            for layer in (self.l0, self.l1, self.l2, self.l3):
                with poptorch.Block():              # "0", "1", "2", "3"
                    x = layer(x)
            return x

    strategy = poptorch.PipelinedExecution(poptorch.Stage("0", "1").ipu(1), poptorch.Stage("2", "3").ipu(0))
    assert layer_ipus(Model(), strategy) == {"l0": (0, 1), "l1": (0, 1), "l2": (1, 0), "l3": (1, 0)}
    strategy = poptorch.PipelinedExecution("0", ["1", "2"], "3")    # IPUs default to the stage index
    assert layer_ipus(Model(), strategy) == {"l0": (0, 0), "l1": (1, 1), "l2": (1, 1), "l3": (2, 2)}


def test_auto_increment_gives_each_block_its_own_stage_even_on_one_ipu():
    class Model(Chain):
        def forward(self, x):
            poptorch.Block.useAutoId()
            for layer, ipu in zip((self.l0, self.l1, self.l2), (0, 1, 0)):
                with poptorch.Block(ipu_id=ipu):
                    x = layer(x)
            return x

    strategy = poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement)
    assert layer_ipus(Model(), strategy) == {"l0": (0, 0), "l1": (1, 1), "l2": (2, 0), "l3": (0, 0)}


def test_int_user_ids_are_blocks_of_their_own():
    class Model(Chain):
        def forward(self, x):
            with poptorch.Block(1, ipu_id=1):
                x = self.l1(self.l0(x))
            with poptorch.Block("1", ipu_id=0):
                return self.l3(self.l2(x))

    strategy = poptorch.PipelinedExecution(poptorch.AutoStage.AutoIncrement)
    assert layer_ipus(Model(), strategy) == {"l0": (0, 1), "l1": (0, 1), "l2": (1, 0), "l3": (1, 0)}
    block = poptorch.BeginBlock(torch.relu, 3, 2)
    assert (block._user_id, block._ipu_id) == (3, 2)
    with pytest.raises(poptorch.Error, match="user_id must be a str, an int or None, got 1.5"):
        poptorch.Block(1.5)


def test_begin_block_accepts_a_function_and_refuses_a_second_block():
    layer = nn.Linear(2, 2)
    poptorch.BeginBlock(layer, ipu_id=1)
    with pytest.raises(poptorch.Error, match="module has already been assigned to a block"):
        poptorch.BeginBlock(layer, ipu_id=2)
    wrapped = poptorch.BeginBlock(torch.relu, "R", ipu_id=0)
    torch.testing.assert_close(wrapped(torch.tensor([-1.0, 2.0])), torch.tensor([0.0, 2.0]))
    with pytest.raises(poptorch.Error, match="not an instance of torch.nn.Module or function"):
        poptorch.BeginBlock(3)


def test_no_active_block_after_a_block_scope_closes():
    class Model(nn.Module):
        def forward(self, x):
            with poptorch.Block("A", ipu_id=0):
                x = x * 4
            return x * 4

    with pytest.raises(poptorch.Error, match="No active Block, all the ops must belong to a Block"):
        layer_ipus(Model())


def test_unknown_block_and_same_as_ipu_without_an_ipu():
    with pytest.raises(poptorch.Error, match=re.escape("Unknown Block 'B2' list of expected Blocks: ['B1', 'B3']")):
        layer_ipus(TwoStages(), poptorch.PipelinedExecution("B1", "B3"), regression_data(2))

    class Model(Chain):
        def forward(self, x):
            with poptorch.Block("A"):
                return self.l0(x)

    with pytest.raises(poptorch.Error, match="AutoStage.SameAsIpu was selected but no IPU was specified for block A"):
        layer_ipus(Model())


def test_strategy_arguments_are_checked():
    with pytest.raises(poptorch.Error, match="B1 associated with more than one stage"):
        poptorch.PipelinedExecution("B1", poptorch.Stage("B2", "B1"))
    with pytest.raises(poptorch.Error, match="supposed to be strings"):
        poptorch.Stage("B1", 2)
    with pytest.raises(poptorch.Error, match="memory_check"):
        poptorch.PipelinedExecution(memory_check="never")


def partitioned(model, args):
    program = compile_module(model, args)
    return partition(program.graph_module, sources_from_program(program), program.mutated_buffers,
                     program.output_spec, poptorch.PipelinedExecution())


def test_a_parameter_read_by_two_stages_is_owned_by_the_first_and_borrowed_by_the_other():
    class Tied(Chain):
        def forward(self, x):
            with poptorch.Block("A", ipu_id=0):
                x = self.l0(x)
            with poptorch.Block("B", ipu_id=1):
                return self.l1(self.l0(x))

    first, second = partitioned(Tied(), (torch.randn(2, 4),)).stages
    assert first.owned[:2] == ("l0.weight", "l0.bias") and first.borrowed == ()     # l2, l3 unused: stage 0
    assert second.params == ("l0.weight", "l0.bias", "l1.weight", "l1.bias")
    assert second.borrowed == ("l0.weight", "l0.bias") and second.owned == ("l1.weight", "l1.bias")


def test_a_buffer_read_by_two_stages_is_refused():
    class SharedBuffer(Chain):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.full((4,), 2.0))

        def forward(self, x):
            with poptorch.Block("A", ipu_id=0):
                x = self.l0(x) * self.scale
            with poptorch.Block("B", ipu_id=1):
                return self.l1(x) * self.scale

    with pytest.raises(poptorch.Error, match="the buffer scale is used by stages"):
        partitioned(SharedBuffer(), (torch.randn(2, 4),))


def training_options(accumulation, strategy=None):
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(accumulation)
    return opts if strategy is None else opts.setExecutionStrategy(strategy)


def test_pipelined_training_needs_accumulation_of_twice_the_stages_minus_one():
    model = TwoStages()
    ipu = poptorch.trainingModel(model, training_options(2))
    with pytest.raises(poptorch.Error, match="^" + re.escape(
            "poptorch.Options().Training.gradientAccumulation must be greater than or equal to the number "
            "of pipeline stages (3) when using poptorch.PipelinedExecution. Please note that a model with "
            "2 pipeline stages in PopTorch will have an additional 1 stages when training. (It is 2.)")):
        ipu.compile(*regression_data(4))
    sharded = poptorch.trainingModel(model, training_options(2, poptorch.ShardedExecution("B1", "B2")))
    sharded.compile(*regression_data(4))           # sharded execution has no such rule


def test_pipelined_inference_needs_a_device_iteration_per_stage():
    ipu = poptorch.inferenceModel(TwoStages(), poptorch.Options())
    with pytest.raises(poptorch.Error, match="^" + re.escape(
            "poptorch.Options().deviceIterations must be greater than or equal to the number of pipeline "
            "stages (2) when using PopTorch.PipelinedExecution. (It is 1.)")):
        ipu.compile(regression_data(2)[0])


class ThreeIpus(Chain):
    def forward(self, x):
        for index, layer in enumerate((self.l0, self.l1, self.l2)):
            with poptorch.Block(f"B{index}", ipu_id=index):
                x = layer(x)
        return x


def test_ipu_count_must_be_a_power_of_two_unless_rounded():
    opts = poptorch.Options().deviceIterations(3)
    with pytest.raises(poptorch.Error, match="specifies the use of 3 IPUs, however PopTorch must reserve a minimum of 4"):
        poptorch.inferenceModel(ThreeIpus(), opts).compile(torch.randn(3, 4))
    # Checked before the pipeline's device iterations, its sentence after a cause (PopTorch's regex).
    with pytest.raises(poptorch.Error, match=".+The model specifies the use of 3 IPUs, however PopTorch must"):
        poptorch.inferenceModel(ThreeIpus(), poptorch.Options())(torch.randn(1, 4))
    model = ThreeIpus()
    with pytest.warns(UserWarning, match="Reserving 4 IPUs when the model specifies the use of only 3"):
        out = poptorch.inferenceModel(model, opts.clone().autoRoundNumIPUs(True))(x := torch.randn(3, 4))
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)


def test_more_ipus_than_devices_share_them_more_replicas_and_unknown_strategies_are_refused():
    opts = poptorch.Options().deviceIterations(3).replicationFactor(4).autoRoundNumIPUs(True)
    model = ThreeIpus()
    with pytest.warns(UserWarning, match="3 IPUs × 4 replicas run on 8 JAX CPU device.*2 emulated IPUs"):
        out = poptorch.inferenceModel(model, opts)(x := torch.randn(36, 4))
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)
    with pytest.raises(poptorch.Error, match="16 replicas need 16 devices, but JAX has 8 CPU device.*"
                                             "IPU_BACKEND_CPU_DEVICES=48"):
        poptorch.inferenceModel(ThreeIpus(), opts.clone().replicationFactor(16)).compile(torch.randn(144, 4))
    opts = poptorch.Options().deviceIterations(4).setExecutionStrategy("phased")
    with pytest.raises(poptorch.Error, match="is not emulated"):
        poptorch.inferenceModel(TwoStages(), opts).compile(torch.randn(4, 6))


class UnderNoGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)
        poptorch.BeginBlock(self.a, "a", ipu_id=0)
        poptorch.BeginBlock(self.b, "b", ipu_id=1)

    def forward(self, x):
        with torch.no_grad():
            return self.b(self.a(x))


def test_a_no_grad_region_over_several_blocks_is_refused():
    """Its operations would all land in one stage."""
    with pytest.raises(poptorch.Error, match=r"torch.no_grad\(\) or torch.enable_grad\(\) region starting at "
                                             r".*test_blocks.py:\d+: .* holds operations of the blocks 'a', 'b'"):
        poptorch.inferenceModel(UnderNoGrad(), poptorch.Options().deviceIterations(2))(torch.randn(4, 4))


def test_an_autocast_region_inside_a_block_stays_in_its_stage():
    model = Chain()
    poptorch.BeginBlock(model.l2, "late", ipu_id=1)

    def forward(x):
        h = model.l1(model.l0(x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = model.l2(h)
        return model.l3(h.float())

    model.forward = forward
    assert layer_ipus(model) == {"l0": (0, 0), "l1": (0, 0), "l2": (1, 1), "l3": (1, 1)}
