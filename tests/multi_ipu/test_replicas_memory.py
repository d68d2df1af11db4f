"""Replicated pipelines, recomputation, optimizer offload and the IPU memory model: the same
numbers as plain torch (fp32: 1e-5 relative, 1e-6 absolute), measurably less stashed memory
with recomputation, optimizer state in host memory with offload, and the out-of-memory error."""

import jax
import jsonargparse
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ipu_backend as poptorch
from ipu_backend.options import in_force
from ipu_backend.runtime.multi_ipu import multi_ipu_program
from ipu_backend.runtime.weights import weight_store
from tests.multi_ipu.models import ATOL, RTOL, TwoStages, assert_same_parameters, regression_data, torch_training, twins


def test_replicated_pipeline_equals_torch_over_replicas_and_micro_batches():
    torch.manual_seed(3)
    model, reference = twins(TwoStages())
    replicas, accumulation, micro = 2, 3, 2
    x, y = regression_data(replicas * accumulation * micro * 2)
    # Each micro-batch of the combined batch is (micro-batch a, replica r): torch sees them in
    # that order, and averages gradients over all of them.
    expected_out, expected_loss = torch_training(reference, torch.optim.SGD(reference.parameters(), lr=0.1),
                                                 x, y, accumulation=accumulation * replicas, micro=micro)
    opts = poptorch.Options().replicationFactor(replicas).deviceIterations(2).outputMode(poptorch.OutputMode.All)
    opts.Training.gradientAccumulation(accumulation)
    ipu = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    out, loss = ipu(x, y)
    torch.testing.assert_close(out, expected_out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(loss, expected_loss, rtol=RTOL, atol=ATOL)
    assert_same_parameters(model, reference)
    devices = jax.devices()                        # replica r of IPU i is device 2r + i
    for name, array in weight_store(model).params.items():
        ipu_index = ipu.ipuPlacement()[name]
        assert array.devices() == {devices[ipu_index], devices[2 + ipu_index]}, name


class Deep(nn.Module):
    """A wide first stage (where activations dominate) and a small second one."""

    def __init__(self, checkpoint: bool = False):
        super().__init__()
        self.checkpoint = checkpoint
        self.up, self.mid, self.down = nn.Linear(6, 64), nn.Linear(64, 64), nn.Linear(64, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x, y):
        with poptorch.Block("B1", ipu_id=0):
            h = torch.tanh(self.up(x))
            if self.checkpoint:
                h = poptorch.recomputationCheckpoint(h)
            h = self.down(torch.tanh(self.mid(h)))
        with poptorch.Block("B2", ipu_id=1):
            out = self.head(h)
            loss = F.mse_loss(out, y)
        return out, loss


def train_deep(checkpoint: bool, recompute: int):
    torch.manual_seed(4)
    model, reference = twins(Deep(checkpoint))
    x, y = regression_data(2 * 3 * 4)
    expected_out, expected_loss = torch_training(reference, torch.optim.SGD(reference.parameters(), lr=0.05),
                                                 x, y, accumulation=3, micro=4)
    opts = poptorch.Options().deviceIterations(2).outputMode(poptorch.OutputMode.All)
    opts.Training.gradientAccumulation(3)
    if recompute:
        opts._Popart.set("autoRecomputation", recompute)
    ipu = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.05))
    out, loss = ipu(x, y)
    torch.testing.assert_close(out, expected_out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(loss, expected_loss, rtol=RTOL, atol=ATOL)
    assert_same_parameters(model, reference)
    return multi_ipu_program(ipu).memory[0].stash


def test_recomputation_stashes_less_with_unchanged_numbers():
    stored = train_deep(checkpoint=False, recompute=0)
    standard = train_deep(checkpoint=False, recompute=1)          # RecomputationType.Standard
    checkpointed = train_deep(checkpoint=True, recompute=3)       # RecomputationType.Pipeline
    recomputed = train_deep(checkpoint=False, recompute=3)
    # Stage 0 of 2 holds 3 micro-batches: without recomputation each keeps every activation
    # (≥ 3 × [4, 64] floats); recomputed, only its input x [4, 6]; checkpointed, x and h [4, 64];
    # with Standard recomputation, the matrix products' results but not what tanh makes of them.
    assert stored >= 3 * 3 * 4 * 64 * 4
    assert recomputed == 3 * 4 * 6 * 4
    assert checkpointed == recomputed + 3 * 4 * 64 * 4
    assert recomputed < standard < stored


def test_offloaded_optimizer_state_lives_in_host_memory_with_unchanged_numbers():
    torch.manual_seed(5)
    model, reference = twins(TwoStages())
    x, y = regression_data(2 * 3 * 4)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
    expected_out, expected_loss = torch_training(reference, reference_optimizer, x, y, accumulation=3, micro=4)
    opts = poptorch.Options().deviceIterations(2).outputMode(poptorch.OutputMode.All)
    opts.Training.gradientAccumulation(3)
    opts.TensorLocations.setOptimizerLocation(poptorch.TensorLocationSettings().useOnChipStorage(False))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    ipu = poptorch.trainingModel(model, opts, optimizer)
    out, loss = ipu(x, y)
    torch.testing.assert_close(out, expected_out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(loss, expected_loss, rtol=RTOL, atol=ATOL)
    assert_same_parameters(model, reference)
    for name, slots in ipu._opt_state.items():
        for slot in slots.values():
            assert slot.sharding.memory_kind == "pinned_host", name
    assert weight_store(model).params["fc1.weight"].sharding.memory_kind == "device"
    assert all(u.optimizer == 0 and u.offloaded > 0 for u in multi_ipu_program(ipu).memory)
    ipu.copyWeightsToHost()
    for p, q in zip(model.parameters(), reference.parameters()):
        for slot in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(optimizer.state[p][slot], reference_optimizer.state[q][slot],
                                       rtol=RTOL, atol=ATOL)


TINY = poptorch.IpuSpec(memory_bytes=100, tiles=4, name="tiny")


def test_a_model_too_large_for_the_ipu_raises_out_of_memory_or_warns():
    spec = TINY
    opts = poptorch.Options().deviceIterations(2).setIpuSpec(spec)
    opts.Training.gradientAccumulation(3)
    with pytest.raises(poptorch.OutOfMemoryError) as error:
        poptorch.trainingModel(TwoStages(), opts).compile(*regression_data(24))
    message = str(error.value)
    assert "Out of memory on 2 of 2 IPU(s) (tiny, 100 B each)" in message
    # IPU0: fc1 (6·8 + 8 floats) and BatchNorm-free norm; IPU1: fc2 (8·3 + 3 floats)
    assert "IPU0 (stages 0): " in message and "weights 224 B" in message
    assert "IPU1 (stages 1): " in message and "weights 108 B" in message
    assert "more stages" in message and "autoRecomputation" in message and "useOnChipStorage(False)" in message
    # The same settings on the execution strategy (a setting left at its default gives way)
    opts = poptorch.Options(device_iterations=2, gradient_accumulation=3).setExecutionStrategy(
        poptorch.PipelinedExecution("B1", "B2", ipu_spec=spec, memory_check="warn"))
    with pytest.warns(UserWarning, match="Out of memory on 2 of 2 IPU"):
        poptorch.trainingModel(TwoStages(), opts).compile(*regression_data(24))


def test_ipu_spec_and_memory_check_set_in_both_places_must_agree():
    opts = poptorch.Options(device_iterations=2, ipu_spec=TINY).setExecutionStrategy(
        poptorch.PipelinedExecution("B1", "B2", ipu_spec=poptorch.IpuSpec(memory_bytes=10**6)))
    with pytest.raises(poptorch.Error, match="ipu_spec is set both in Options .* and in the execution strategy"):
        poptorch.inferenceModel(TwoStages(), opts).compile(regression_data(2)[0])
    opts = poptorch.Options(memory_check="off").setExecutionStrategy(
        poptorch.PipelinedExecution(memory_check="warn"))
    with pytest.raises(poptorch.Error, match="memory_check is set both"):
        in_force(opts)
    assert in_force(poptorch.Options(memory_check="warn").setExecutionStrategy(
        poptorch.PipelinedExecution(ipu_spec=TINY))) == (TINY, "warn")


class Regression(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x, y=None):
        out = self.fc(x)
        return out if y is None else (out, F.mse_loss(out, y))


def test_a_single_ipu_model_too_large_for_its_ipu_raises_out_of_memory_or_warns():
    model = Regression()
    with pytest.raises(poptorch.OutOfMemoryError, match=r"Out of memory on 1 of 1 IPU\(s\) \(tiny, 100 B each\)"
                       r":\n  IPU0 \(stages 0\): .* weights 84 B") as error:
        poptorch.trainingModel(model, poptorch.Options(ipu_spec=TINY)).compile(*regression_data(4))
    assert "more stages" in str(error.value)
    x = regression_data(4)[0]
    with pytest.warns(UserWarning, match="Out of memory on 1 of 1 IPU"):
        out = poptorch.inferenceModel(model, poptorch.Options(ipu_spec=TINY, memory_check="warn"))(x)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=RTOL, atol=ATOL)


def test_ipu_spec_and_memory_check_in_a_lightning_yaml_and_through_dict_and_clone():
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--opts", type=poptorch.Options)
    config = parser.parse_string("""
opts:
  class_path: ipu_backend.Options
  init_args:
    ipu_spec: {memory_bytes: 100, tiles: 4, name: tiny}
    memory_check: warn
""")
    opts = parser.instantiate(config).opts
    assert opts.ipu_spec == TINY and opts.memory_check == "warn"
    assert opts == poptorch.Options().setIpuSpec(TINY).setMemoryCheck("warn")
    assert poptorch.Options.from_dict(opts.toDict()) == opts == opts.clone()
    assert opts.toDict()["ipu_spec"] == {"memory_bytes": 100, "tiles": 4, "name": "tiny"}
    opts._freeze()
    with pytest.raises(poptorch.Error, match="frozen"):
        opts.setMemoryCheck("off")
    with pytest.raises(poptorch.Error, match="memory_check must be one of error, warn, off"):
        poptorch.Options(memory_check="never")
    with pytest.raises(poptorch.Error, match="IpuSpec.memory_bytes must be a positive int"):
        poptorch.Options(ipu_spec={"memory_bytes": -1})
