"""trainingModel/inferenceModel against torch eager on the CPU: device iterations, accumulation,
replication, output modes, weights, errors. fp32 tolerance: 1e-5 relative (1e-6 absolute)."""

import copy
import io
import re

import jax
import pytest
import torch
import torch.nn.functional as F

import ipu_backend as poptorch
from ipu_backend.runtime import lifecycle as executor_module
from ipu_backend.runtime import program_cache
from ipu_backend.runtime.schedule import Schedule

RTOL, ATOL = 1e-5, 1e-6


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(6, 8)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x, y=None):
        out = self.out(torch.tanh(self.hidden(x)))
        if y is None:
            return out
        return out, F.mse_loss(out, y)


def data(n, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=generator), torch.randn(n, 3, generator=generator)


def assert_params_equal(model, reference):
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL, msg=name)


def torch_steps(model, batches, lr=0.05):
    """Plain torch: one SGD step per batch, each on the batch's mean loss."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def test_device_iterations_equal_torch_steps_and_split_calls():
    torch.manual_seed(0)
    reference = Regression()
    ten, five_twice = copy.deepcopy(reference), copy.deepcopy(reference)
    x, y = data(40)
    expected_losses = torch_steps(reference, zip(x.split(4), y.split(4)))

    opts = poptorch.Options().deviceIterations(10)
    opts.outputMode(poptorch.OutputMode.All)
    model = poptorch.trainingModel(ten, opts, torch.optim.SGD(ten.parameters(), lr=0.05))
    _, losses = model(x, y)
    torch.testing.assert_close(losses, expected_losses, rtol=RTOL, atol=ATOL)
    assert_params_equal(ten, reference)

    model = poptorch.trainingModel(five_twice, poptorch.Options().deviceIterations(5),
                                   torch.optim.SGD(five_twice.parameters(), lr=0.05))
    for half in (slice(0, 20), slice(20, 40)):
        _, final_loss = model(x[half], y[half])
    torch.testing.assert_close(final_loss, expected_losses[-1], rtol=RTOL, atol=ATOL)
    assert final_loss.shape == ()
    assert_params_equal(five_twice, reference)


class SmallCNN(torch.nn.Module):
    """Two convolutions (the first, on a single-channel input, XLA's; the second im2col, whose
    input gradient is its summed one), tiling and overlapping max pooling, as device iterations
    lower them inside the scan."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 4, 3)
        self.conv2 = torch.nn.Conv2d(4, 6, 3, padding=1)
        self.out = torch.nn.Linear(6 * 2 * 2, 3)

    def forward(self, x, y):
        h = torch.relu(F.max_pool2d(self.conv1(x), 2))
        h = torch.relu(F.max_pool2d(self.conv2(h), 3, 2))
        out = self.out(h.flatten(1))
        return out, F.cross_entropy(out, y)


def test_convolutions_in_device_iterations_equal_torch_sgd_steps():
    torch.manual_seed(0)
    reference = SmallCNN()
    model = copy.deepcopy(reference)
    x, y = torch.randn(12, 1, 12, 12), torch.randint(0, 3, (12,))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for xb, yb in zip(x.split(4), y.split(4)):
        optimizer.zero_grad()
        reference(xb, yb)[1].backward()
        optimizer.step()
    training = poptorch.trainingModel(model, poptorch.Options().deviceIterations(3),
                                      torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    training(x, y)
    assert_params_equal(model, reference)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradient_accumulation_equals_torch_accumulating_loss_over_micro_batches(reduction):
    torch.manual_seed(1)
    reference = Regression()
    ipu = copy.deepcopy(reference)
    x, y = data(24)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    for step in range(2):
        optimizer.zero_grad()
        for micro in range(4):
            rows = slice(step * 12 + micro * 3, step * 12 + micro * 3 + 3)
            _, loss = reference(x[rows], y[rows])
            (loss / 4 if reduction == "mean" else loss).backward()
        optimizer.step()

    opts = poptorch.Options().deviceIterations(2)
    opts.Training.gradientAccumulation(4)
    opts.Training.accumulationAndReplicationReductionType(
        poptorch.ReductionType.Mean if reduction == "mean" else poptorch.ReductionType.Sum)
    model = poptorch.trainingModel(ipu, opts, torch.optim.SGD(ipu.parameters(), lr=0.05))
    model(x, y)
    assert_params_equal(ipu, reference)


@pytest.mark.parametrize("replicas", [1, 2, 4, 8])
def test_replication_equals_the_large_batch_torch_step(replicas):
    torch.manual_seed(2)
    reference = Regression()
    ipu = copy.deepcopy(reference)
    x, y = data(4 * replicas * 3)
    torch_steps(reference, zip(x.split(4 * replicas), y.split(4 * replicas)))

    opts = poptorch.Options().deviceIterations(3).replicationFactor(replicas)
    model = poptorch.trainingModel(ipu, opts, torch.optim.SGD(ipu.parameters(), lr=0.05))
    _, loss = model(x, y)
    assert loss.shape == (() if replicas == 1 else (replicas,))
    assert_params_equal(ipu, reference)


def test_replica_count_must_be_a_power_of_two_unless_rounded():
    """PopTorch reserves IPUs in powers of two: 3 replicas is its error, or its warning and 4
    reserved IPUs with ``autoRoundNumIPUs``, the numbers those of 3 replicas."""
    torch.manual_seed(2)
    reference = Regression()
    ipu = copy.deepcopy(reference)
    x, y = data(4 * 3)
    torch_steps(reference, [(x, y)])
    with pytest.raises(poptorch.Error, match=r"use of 3 IPUs.*autoRoundNumIPUs"):
        poptorch.trainingModel(ipu, poptorch.Options().replicationFactor(3))(x, y)
    opts = poptorch.Options().replicationFactor(3).autoRoundNumIPUs(True)
    model = poptorch.trainingModel(ipu, opts, torch.optim.SGD(ipu.parameters(), lr=0.05))
    with pytest.warns(UserWarning, match="Reserving 4 IPUs"):
        model(x, y)
    assert_params_equal(ipu, reference)


@pytest.mark.parametrize("mode", list(poptorch.OutputMode))
def test_inference_output_modes_match_popTorch_shapes_and_values(mode):
    torch.manual_seed(3)
    model = Regression()
    x = torch.randn(10, 2, 6)
    expected = model(x.reshape(10, 2, 6))
    opts = poptorch.Options().deviceIterations(10)
    opts.outputMode(mode, output_return_period=5)
    out = poptorch.inferenceModel(model, opts)(x)
    if mode in (poptorch.OutputMode.All, poptorch.OutputMode.Default):
        torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)
    elif mode == poptorch.OutputMode.EveryN:
        torch.testing.assert_close(out, expected[[4, 9]], rtol=RTOL, atol=ATOL)
    elif mode == poptorch.OutputMode.Final:
        torch.testing.assert_close(out, expected[9:], rtol=RTOL, atol=ATOL)
    else:
        torch.testing.assert_close(out, expected.sum(0, keepdim=True), rtol=RTOL, atol=1e-5)


@pytest.mark.parametrize("mode", [poptorch.OutputMode.All, poptorch.OutputMode.Final,
                                  poptorch.OutputMode.Sum, poptorch.OutputMode.EveryN])
def test_training_output_modes_return_each_steps_loss_before_its_update(mode):
    torch.manual_seed(4)
    reference = Regression()
    ipu = copy.deepcopy(reference)
    x, y = data(8 * 2)
    losses = torch_steps(reference, zip(x.split(2), y.split(2)))
    opts = poptorch.Options().deviceIterations(8)
    opts.outputMode(mode, output_return_period=4)
    _, loss = poptorch.trainingModel(ipu, opts, torch.optim.SGD(ipu.parameters(), lr=0.05))(x, y)
    expected = {poptorch.OutputMode.All: losses, poptorch.OutputMode.Final: losses[-1],
                poptorch.OutputMode.Sum: losses.sum(), poptorch.OutputMode.EveryN: losses[[3, 7]]}[mode]
    torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL)



def test_every_n_returns_every_accumulated_micro_batch_of_every_nth_iteration():
    """PopART's EveryN anchors: 4 iterations x 2 accumulated micro-batches, every 2nd iteration's
    two micro-batches (iterations 1 and 3)."""
    torch.manual_seed(4)
    reference = Regression()
    ipu = copy.deepcopy(reference)
    x, y = data(8 * 2)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    losses = []
    for step in range(4):
        optimizer.zero_grad()
        for micro in range(2):
            rows = slice(4 * step + 2 * micro, 4 * step + 2 * micro + 2)
            loss = F.mse_loss(reference(x[rows]), y[rows])
            (loss / 2).backward()
            losses.append(loss.detach())
        optimizer.step()
    opts = poptorch.Options().deviceIterations(4).outputMode(poptorch.OutputMode.EveryN, output_return_period=2)
    opts.Training.gradientAccumulation(2)
    _, loss = poptorch.trainingModel(ipu, opts, torch.optim.SGD(ipu.parameters(), lr=0.05))(x, y)
    torch.testing.assert_close(loss, torch.stack(losses)[[2, 3, 6, 7]], rtol=RTOL, atol=ATOL)

class Normalised(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 3)
        self.norm = torch.nn.BatchNorm1d(3)

    def forward(self, x, y):
        out = self.norm(self.linear(x))
        return out, F.mse_loss(out, y)


def test_batchnorm_running_statistics_follow_torch_over_device_iterations():
    torch.manual_seed(5)
    reference = Normalised()
    ipu = copy.deepcopy(reference)
    x, y = data(4 * 3)
    torch_steps(reference, zip(x.split(4), y.split(4)))
    model = poptorch.trainingModel(ipu, poptorch.Options().deviceIterations(3),
                                   torch.optim.SGD(ipu.parameters(), lr=0.05))
    model(x, y)
    for name, buffer in reference.named_buffers():
        torch.testing.assert_close(dict(ipu.named_buffers())[name], buffer, rtol=RTOL, atol=ATOL, msg=name)
    assert_params_equal(ipu, reference)


def test_training_and_inference_models_share_weights_and_host_edits_reach_the_device():
    torch.manual_seed(6)
    net = Regression()
    x, y = data(4)
    training = poptorch.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    inference = poptorch.inferenceModel(net)
    before = inference(x)
    training(x, y)
    after = inference(x)
    assert not torch.allclose(before, after), "inference must see the trained weights"
    torch.testing.assert_close(after, net(x), rtol=RTOL, atol=ATOL)   # the host module shows them too
    with torch.no_grad():
        net.out.bias.add_(1.0)
    inference.copyWeightsToDevice()
    torch.testing.assert_close(inference(x), after + 1.0, rtol=RTOL, atol=ATOL)
    training(x, y)                                  # the host copy is stale again: loading wins over it
    fresh = Regression()
    inference.load_state_dict(fresh.state_dict())  # PopTorch's executor method: loads and copies to the device
    torch.testing.assert_close(inference(x), fresh(x), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(net.out.weight, fresh.out.weight, rtol=0, atol=0)


def test_state_dict_after_training_shows_device_weights():
    torch.manual_seed(7)
    reference = Regression()
    ipu = copy.deepcopy(reference)
    x, y = data(4)
    torch_steps(reference, [(x, y)])
    poptorch.trainingModel(ipu, optimizer=torch.optim.SGD(ipu.parameters(), lr=0.05))(x, y)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(ipu.state_dict()[name], value, rtol=RTOL, atol=ATOL, msg=name)


def test_a_saved_training_model_loads_as_the_users_module_with_the_devices_weights():
    torch.manual_seed(7)
    reference = Regression()
    ipu = copy.deepcopy(reference)
    x, y = data(4)
    torch_steps(reference, [(x, y)])
    executor = poptorch.trainingModel(ipu, optimizer=torch.optim.SGD(ipu.parameters(), lr=0.05))
    executor(x, y)
    saved = io.BytesIO()
    torch.save(executor, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    assert type(loaded) is Regression
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.parametrize("set_optimizer", [True, False], ids=["setOptimizer", "param_groups_edited"])
def test_set_optimizer_changes_learning_rate_without_recompiling(set_optimizer, monkeypatch):
    """A new learning rate reaches the device whether or not setOptimizer is called (a scheduler
    edits param_groups); the hyper-parameters are rebuilt only when they change."""
    from ipu_backend.runtime.optimizers import OptimizerRule
    built = []
    original = OptimizerRule.hyperparameters
    monkeypatch.setattr(OptimizerRule, "hyperparameters",
                        lambda rule, optimizer: built.append(1) or original(rule, optimizer))
    torch.manual_seed(8)
    reference = Regression()
    ipu = copy.deepcopy(reference)
    x, y = data(10)
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    ipu_optimizer = torch.optim.SGD(ipu.parameters(), lr=0.05)
    model = poptorch.trainingModel(ipu, optimizer=ipu_optimizer)
    for step, lr in enumerate((0.05, 0.2, 0.2, 0.01, 0.01)):
        for group in torch_optimizer.param_groups + ipu_optimizer.param_groups:
            group["lr"] = lr
        if set_optimizer:
            model.setOptimizer(ipu_optimizer)
        rows = slice(step * 2, step * 2 + 2)
        torch_optimizer.zero_grad()
        reference(x[rows], y[rows])[1].backward()
        torch_optimizer.step()
        model(x[rows], y[rows])
    assert len(model._compiled) == 1
    assert len(built) == 3, "hyper-parameters are built once per distinct learning rate"
    assert_params_equal(ipu, reference)


def test_new_input_shapes_recompile_with_a_warning():
    model = poptorch.inferenceModel(Regression())
    model(torch.randn(4, 6))
    with pytest.warns(UserWarning, match="compiling again"):
        out = model(torch.randn(6, 6))
    assert out.shape == (6, 3)


def test_keyword_arguments_bind_to_forward():
    torch.manual_seed(9)
    net = Regression()
    x, y = data(4)
    _, loss = poptorch.inferenceModel(net)(x=x, y=y)
    torch.testing.assert_close(loss, net(x, y)[1], rtol=RTOL, atol=ATOL)


# --- errors -----------------------------------------------------------------------------------

def test_batch_not_divisible_names_the_numbers():
    opts = poptorch.Options().deviceIterations(3).replicationFactor(2)
    model = poptorch.inferenceModel(Regression(), opts)
    with pytest.raises(poptorch.Error, match=r"Invalid batch dimension.*\(8\).*deviceIterations\(3\).*"
                                             r"replicationFactor\(2\).*= 6"):
        model(torch.randn(8, 6))


def test_more_than_64_ipus_in_one_process_is_poptorchs_error():
    model = poptorch.inferenceModel(Regression(), poptorch.Options().replicationFactor(128))
    with pytest.raises(poptorch.Error, match=r"^Too many IPUs requested \(128\)\. Experiments that need "
                                             r"more than 64 IPUs require distributed execution\."):
        model(torch.randn(128, 6))


class ScaledRegression(Regression):
    def forward(self, x, scale, y):
        out = super().forward(x) * scale
        return out, F.mse_loss(out, y)


def test_scalar_input_of_a_one_micro_batch_call_equals_torch():
    torch.manual_seed(4)
    reference = ScaledRegression()
    model = copy.deepcopy(reference)
    x, y = data(4)
    scale = torch.tensor(1.5)
    out, _ = poptorch.inferenceModel(model)(x, scale, y)
    torch.testing.assert_close(out, reference(x, scale, y)[0], rtol=RTOL, atol=ATOL)
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05))
    losses = torch.stack([training(x, scale, y)[1] for _ in range(2)])
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    expected = []
    for _ in range(2):
        optimizer.zero_grad()
        loss = reference(x, scale, y)[1]
        loss.backward()
        optimizer.step()
        expected.append(loss.detach())
    torch.testing.assert_close(losses, torch.stack(expected), rtol=RTOL, atol=ATOL)
    assert_params_equal(model, reference)
    with pytest.raises(poptorch.Error, match=r"0-d \(scalar\) input cannot be split into the call's 2 "):
        poptorch.inferenceModel(ScaledRegression(), poptorch.Options().deviceIterations(2))(
            torch.randn(2, 6), scale, torch.randn(2, 3))


def test_zero_sized_input_is_an_error():
    with pytest.raises(poptorch.Error, match="non-empty batch"):
        poptorch.inferenceModel(Regression())(torch.randn(0, 6))


def test_inference_model_rejects_gradient_accumulation_with_poptorchs_message():
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(2)
    message = ("You must set poptorch.Options().Training.gradientAccumulation to 1 or leave it as its "
               "default value (1) when running a poptorch.inferenceModel().")
    pipelined = " Use poptorch.Options().deviceIterations to process a sufficient number of batches each " \
                "run for pipelined execution instead."
    with pytest.raises(poptorch.Error, match="^" + re.escape(message + pipelined) + "$"):
        poptorch.inferenceModel(Regression(), opts)
    sharded = poptorch.Options().setExecutionStrategy(poptorch.ShardedExecution())
    sharded.Training.gradientAccumulation(2)
    with pytest.raises(poptorch.Error, match="^" + re.escape(message) + "$"):
        poptorch.inferenceModel(Regression(), sharded)


def test_training_model_without_a_loss_is_an_error():
    with pytest.raises(poptorch.Error, match=r"^Couldn't find a loss in graph! .*must return its loss"):
        poptorch.trainingModel(Regression())(torch.randn(2, 6))


class TwoLosses(Regression):
    def forward(self, x, y):
        out = super().forward(x)
        return F.mse_loss(out, y), F.l1_loss(out, y)


def test_several_scalar_outputs_need_identity_loss():
    x, y = data(2)
    with pytest.raises(poptorch.Error, match="ambiguous.*identity_loss"):
        poptorch.trainingModel(TwoLosses())(x, y)


class TwoMarkedLosses(Regression):
    def forward(self, x, y):
        out = super().forward(x)
        return (poptorch.identity_loss((out - y) ** 2, "mean"),
                poptorch.identity_loss((out - y).abs(), "mean"))


def test_several_independent_identity_losses_are_poptorchs_error():
    x, y = data(2)
    with pytest.raises(poptorch.Error, match=r"^Multiple independent losses found in graph\. Graph must "
                                             r"have one final loss\. Wrap final graph loss in "
                                             r"poptorch\.identity_loss\. \(identity_loss at .*test_executor"):
        poptorch.trainingModel(TwoMarkedLosses())(x, y)


class ChainedIdentityLosses(Regression):
    """PopTorch's custom-loss pattern: an identity_loss feeding the final one is its reduction."""

    def __init__(self, reduction):
        super().__init__()
        self.reduction = reduction

    def forward(self, x, y):
        partial = poptorch.identity_loss(super().forward(x) - y, reduction=self.reduction)
        return partial, poptorch.identity_loss(partial * partial * 5.0, reduction="mean")


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_an_identity_loss_feeding_the_final_one_trains_as_torch(reduction):
    torch.manual_seed(0)
    reference = ChainedIdentityLosses(reduction)
    model = copy.deepcopy(reference)
    batches = [data(4, seed) for seed in range(3)]
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.002)   # small: "sum" makes large losses
    expected = []
    for x, y in batches:
        optimizer.zero_grad()
        partial, loss = reference(x, y)
        loss.backward()
        optimizer.step()
        expected.append((partial.detach(), loss.detach()))
    executor = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.002))
    for (x, y), (expected_partial, expected_loss) in zip(batches, expected):
        partial, loss = executor(x, y)
        torch.testing.assert_close(partial, expected_partial, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(loss, expected_loss, rtol=RTOL, atol=ATOL)
    assert_params_equal(model, reference)


def test_executors_read_back_the_output_mode_their_default_resolves_to():
    opts = poptorch.Options()
    training, inference = poptorch.trainingModel(Regression(), opts), poptorch.inferenceModel(Regression(), opts)
    assert training.options.output_mode is poptorch.OutputMode.Final
    assert inference.options.output_mode is poptorch.OutputMode.All
    assert opts.defaultOutputMode(), "the user's options are left as they were"
    every_2 = poptorch.Options().outputMode(poptorch.OutputMode.EveryN, 2)
    assert poptorch.trainingModel(Regression(), every_2).options.output_return_period == 2


def test_options_freeze_once_used():
    opts = poptorch.Options()
    poptorch.inferenceModel(Regression(), opts)
    with pytest.raises(poptorch.Error, match="Can't modify frozen Options"):
        opts.deviceIterations(2)


def test_programs_are_compiled_once_per_model_options_and_signature(caplog, monkeypatch, tmp_path):
    monkeypatch.setattr(program_cache, "SHARED", program_cache.ProgramCache())
    monkeypatch.setenv("IPU_BACKEND_CACHE_DIR", str(tmp_path))
    net = Regression()
    x = torch.randn(4, 6)
    with caplog.at_level("INFO", logger="ipu_backend"):
        first = poptorch.inferenceModel(net)
        first(x)
        second = poptorch.inferenceModel(net)
        second(x)
    compile_lines = [r for r in caplog.records if "compiled the inference program" in r.getMessage()]
    assert len(compile_lines) == 1, "the second executor must reuse the first's program"
    assert re.search(r"in \d+\.\d\d s", compile_lines[0].getMessage())
    assert second.isCompiled()


def test_compile_without_running_then_call():
    net = Regression()
    x, y = data(4)
    model = poptorch.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    before = copy.deepcopy(net.state_dict())
    assert not model.isCompiled()
    model.compile(x, y)
    assert model.isCompiled()
    for name, value in net.state_dict().items():
        assert torch.equal(value, before[name]), "compile() must not train"
    model(x, y)
    assert not torch.equal(net.out.weight, before["out.weight"])


def test_executable_caching_writes_the_persistent_cache(tmp_path):
    opts = poptorch.Options().enableExecutableCaching(str(tmp_path / "cache"))
    poptorch.inferenceModel(Regression(), opts)(torch.randn(4, 6))
    assert any((tmp_path / "cache").iterdir()), "no executable was written to the cache"


@pytest.mark.parametrize("make_optimizer", [
    lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    lambda p: torch.optim.Adam(p, lr=0.01),
    lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5),
    lambda p: poptorch.optim.AdamW(p, lr=0.01),
], ids=["sgd_nesterov", "adam", "adamw", "rmsprop", "poptorch_adamw"])
def test_every_optimizer_over_six_steps_equals_torch(make_optimizer):
    torch.manual_seed(10)
    reference = Regression()
    ipu = copy.deepcopy(reference)
    x, y = data(6 * 4)
    torch_optimizer = make_optimizer(reference.parameters())
    for xb, yb in zip(x.split(4), y.split(4)):
        torch_optimizer.zero_grad()
        reference(xb, yb)[1].backward()
        torch_optimizer.step()
    ipu_optimizer = make_optimizer(ipu.parameters())
    model = poptorch.trainingModel(ipu, poptorch.Options().deviceIterations(3), ipu_optimizer)
    model(x[:12], y[:12])
    model(x[12:], y[12:])
    assert_params_equal(ipu, reference)
    model.copyWeightsToHost()
    # Each slot within 1e-5 of its largest element: RMSprop divides each gradient element by its
    # own root mean square, so an element that nearly cancels in the batch sum (rounded in
    # another order than torch's) becomes a momentum of the same size as the others, its
    # relative rounding error with it.
    for p, q in zip(ipu_optimizer.param_groups[0]["params"], torch_optimizer.param_groups[0]["params"]):
        for slot, value in torch_optimizer.state[q].items():
            torch.testing.assert_close(ipu_optimizer.state[p][slot], value, rtol=RTOL,
                                       atol=ATOL + RTOL * value.abs().max().item(), msg=slot)


def test_optimizer_state_round_trips_through_a_checkpoint():
    torch.manual_seed(11)
    reference = Regression()
    resumed = copy.deepcopy(reference)
    x, y = data(4 * 4)
    optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    model = poptorch.trainingModel(reference, poptorch.Options().deviceIterations(2), optimizer)
    model(x[:8], y[:8])
    model.copyWeightsToHost()
    checkpoint = {"model": copy.deepcopy(reference.state_dict()), "optimizer": copy.deepcopy(optimizer.state_dict())}
    model(x[8:], y[8:])

    resumed.load_state_dict(checkpoint["model"])
    resumed_optimizer = torch.optim.Adam(resumed.parameters(), lr=0.01)
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    poptorch.trainingModel(resumed, poptorch.Options().deviceIterations(2), resumed_optimizer)(x[8:], y[8:])
    assert_params_equal(resumed, reference)


def test_replicas_fold_onto_fewer_devices_with_the_same_numbers(monkeypatch):
    import ipu_backend.runtime.devices as devices
    available = jax.devices()[:2]
    monkeypatch.setattr(devices.jax, "local_devices", lambda: available)
    torch.manual_seed(12)
    reference = Regression()
    ipu = copy.deepcopy(reference)
    x, y = data(8 * 2)
    torch_steps(reference, zip(x.split(8), y.split(8)))
    opts = poptorch.Options().deviceIterations(2).replicationFactor(8)
    model = poptorch.trainingModel(ipu, opts, torch.optim.SGD(ipu.parameters(), lr=0.05))
    with pytest.warns(UserWarning, match="8 replicas run on 2 JAX CPU device"):
        model(x, y)
    assert_params_equal(ipu, reference)


def test_batchnorm_statistics_are_per_replica_and_buffers_come_from_replica_zero():
    torch.manual_seed(13)
    reference = Normalised()
    ipu = copy.deepcopy(reference)
    x, y = data(2 * 3)                      # 2 replicas × micro-batch 3, one step
    replicas = [copy.deepcopy(reference) for _ in range(2)]
    grads = None
    for replica, rows in zip(replicas, (slice(0, 3), slice(3, 6))):
        replica(x[rows], y[rows])[1].backward()
        step = [p.grad / 2 for p in replica.parameters()]
        grads = step if grads is None else [g + s for g, s in zip(grads, step)]
    with torch.no_grad():
        for p, g in zip(reference.parameters(), grads):
            p -= 0.05 * g
    model = poptorch.trainingModel(ipu, poptorch.Options().replicationFactor(2),
                                   torch.optim.SGD(ipu.parameters(), lr=0.05))
    model(x, y)
    assert_params_equal(ipu, reference)
    for name, buffer in replicas[0].named_buffers():
        torch.testing.assert_close(dict(ipu.named_buffers())[name], buffer, rtol=RTOL, atol=ATOL, msg=name)


def test_offloaded_optimizer_state_of_one_ipu_lives_in_host_memory_with_unchanged_numbers(monkeypatch):
    """setOptimizerLocation(useOnChipStorage(False)) on a single-IPU model, 2 replicas: AdamW's
    moments stay in host memory between calls, are left out of the IPU's memory, and the
    numbers equal torch's large-batch AdamW steps."""
    torch.manual_seed(11)
    reference = Regression()
    ipu = copy.deepcopy(reference)
    x, y = data(16)
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
    for xs, ys in zip(x.split(8), y.split(8)):
        torch_optimizer.zero_grad()
        reference(xs, ys)[1].backward()
        torch_optimizer.step()
    opts = poptorch.Options().replicationFactor(2)
    opts.TensorLocations.setOptimizerLocation(poptorch.TensorLocationSettings().useOnChipStorage(False))
    checked = []
    monkeypatch.setattr(executor_module.memory, "check", lambda usage, *setting: checked.append(usage))
    model = poptorch.trainingModel(ipu, opts, optimizer=torch.optim.AdamW(ipu.parameters(), lr=0.01))
    for xs, ys in zip(x.split(8), y.split(8)):
        model(xs, ys)
    assert {leaf.sharding.memory_kind for leaf in jax.tree_util.tree_leaves(model._opt_state)} == {"pinned_host"}
    [[ipu0]] = checked
    assert ipu0.optimizer == 0 and ipu0.offloaded > 0
    assert_params_equal(ipu, reference)


def test_programs_are_captured_on_plain_tensors_not_views_of_the_batch():
    """torch.export replays a view input's view from its base: the micro-batch a program is
    captured on is a copy of the combined batch's first part (or the batch itself when it is one
    micro-batch), never a view."""
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    micro = executor_module.first_micro_batch((x, {"y": y, "k": 3}), Schedule(device_iterations=4, accumulation=1,
                                                                               replicas=1))
    assert micro[0]._base is None and micro[1]["y"]._base is None and micro[1]["k"] == 3
    assert torch.equal(micro[0], x[:2]) and torch.equal(micro[1]["y"], y[:2])
    whole = executor_module.first_micro_batch((x,), Schedule(device_iterations=1, accumulation=1, replicas=1))
    assert whole[0] is x
