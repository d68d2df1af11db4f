"""A compiled program is reused only when what it computes is the same: new executors of a
changed model run the changed model (against torch eager), equal models share one program, and
the process's programs are bounded. fp32 tolerance: 1e-5 relative (1e-6 absolute)."""

import copy

import pytest
import torch
import torch.nn.functional as F

import ipu_backend as poptorch
from ipu_backend.compiler import compile_module
from ipu_backend.runtime import program_cache

RTOL, ATOL = 1e-5, 1e-6


class Activated(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(6, 8)
        self.act = torch.nn.ReLU()
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.out(self.act(self.hidden(x)))


class Weighted(torch.nn.Module):
    """A loss weighted by a Python attribute the forward reads."""

    def __init__(self, alpha: float = 1.0):
        super().__init__()
        self.linear = torch.nn.Linear(6, 3)
        self.alpha = alpha

    def forward(self, x, y):
        out = self.linear(x)
        return out, self.alpha * F.mse_loss(out, y)


@pytest.fixture
def fresh_programs(monkeypatch, tmp_path):
    """Empty program caches, in the process and on disk, so that the test sees its own compilations."""
    cache = program_cache.ProgramCache()
    monkeypatch.setattr(program_cache, "SHARED", cache)
    monkeypatch.setenv("IPU_BACKEND_CACHE_DIR", str(tmp_path / "executables"))
    return cache


def compiled_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.getMessage().startswith(("compiled the", "reused the", "loaded the"))]


def outcomes(caplog) -> list[str]:
    """How each program came to be, in order: ``compiled``, ``reused`` or ``loaded``."""
    return [line.split()[0] for line in compiled_lines(caplog)]


def data(n: int = 4):
    generator = torch.Generator().manual_seed(0)
    return torch.randn(n, 6, generator=generator), torch.randn(n, 3, generator=generator)


def test_a_swapped_submodule_is_compiled_for_a_new_executor():
    torch.manual_seed(0)
    net = Activated()
    x, _ = data()
    first = poptorch.inferenceModel(net)
    torch.testing.assert_close(first(x), net(x), rtol=RTOL, atol=ATOL)
    first.destroy()
    net.act = torch.nn.Tanh()
    second = poptorch.inferenceModel(net)
    torch.testing.assert_close(second(x), net(x), rtol=RTOL, atol=ATOL)


def test_a_changed_attribute_is_compiled_for_a_new_training_model():
    torch.manual_seed(0)
    net = Weighted(alpha=1.0)
    x, y = data()
    first = poptorch.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    first(x, y)
    first.destroy()
    net.alpha = 0.0
    before = copy.deepcopy(net.state_dict())
    second = poptorch.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    _, loss = second(x, y)
    second.copyWeightsToHost()
    assert float(loss) == 0.0
    for name, value in net.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=f"{name} moved under a zero loss")


def test_equal_models_share_one_program(fresh_programs, caplog):
    x, _ = data()
    with caplog.at_level("INFO", logger="ipu_backend"):
        for seed in (0, 1):
            torch.manual_seed(seed)
            net = Activated()
            torch.testing.assert_close(poptorch.inferenceModel(net)(x), net(x), rtol=RTOL, atol=ATOL)
    assert outcomes(caplog) == ["compiled", "reused"], compiled_lines(caplog)
    assert len(fresh_programs) == 1


def test_equal_training_models_share_one_program_with_their_own_optimizers(fresh_programs, caplog):
    x, y = data()
    with caplog.at_level("INFO", logger="ipu_backend"):
        for seed in (0, 1):
            torch.manual_seed(seed)
            net = Weighted()
            reference = copy.deepcopy(net)
            model = poptorch.trainingModel(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
            optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
            for _ in range(2):
                model(x, y)
                optimizer.zero_grad()
                reference(x, y)[1].backward()
                optimizer.step()
            model.copyWeightsToHost()
            for (name, p), (_, q) in zip(net.named_parameters(), reference.named_parameters()):
                torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=name)
    assert outcomes(caplog) == ["compiled", "reused"], compiled_lines(caplog)


@pytest.mark.parametrize("setting", [
    lambda opts: opts.randomSeed(7),
    lambda opts: opts.showCompilationProgressBar(False),
    lambda opts: opts.logCycleCount(True),
], ids=["seed", "progress bar", "cycle count"])
def test_options_outside_the_program_share_it(fresh_programs, caplog, setting):
    x, _ = data()
    with caplog.at_level("INFO", logger="ipu_backend"):
        for changed in (False, True):
            torch.manual_seed(0)
            net = Activated()
            opts = poptorch.Options()
            if changed:
                setting(opts)
            torch.testing.assert_close(poptorch.inferenceModel(net, opts)(x), net(x), rtol=RTOL, atol=ATOL)
    assert outcomes(caplog) == ["compiled", "reused"], compiled_lines(caplog)
    assert len(fresh_programs) == 1


@pytest.mark.parametrize("change", ["activation", "options", "optimizer", "frozen"])
def test_programs_that_compute_differently_are_not_shared(fresh_programs, change):
    x, y = data()

    def run(changed: bool):
        torch.manual_seed(0)
        net = Weighted()
        if changed and change == "activation":
            net.linear = torch.nn.Sequential(torch.nn.Linear(6, 3), torch.nn.Tanh())
        opts = poptorch.Options()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        if changed and change == "options":
            opts.Training.setAutomaticLossScaling(True)
        if changed and change == "optimizer":
            optimizer = torch.optim.SGD(net.parameters(), lr=0.1, nesterov=True, momentum=0.5)
        if changed and change == "frozen":
            net.linear.bias.requires_grad_(False)
        poptorch.trainingModel(net, opts, optimizer=optimizer)(x, y)

    run(changed=False)
    run(changed=True)
    assert len(fresh_programs) == 2


def test_identity_of_captures():
    x = torch.randn(2, 6)

    def identity(net):
        return compile_module(net, (x,)).identity

    torch.manual_seed(0)
    base = identity(Activated())
    torch.manual_seed(1)
    assert identity(Activated()) == base, "other weights, same computation"
    swapped = Activated()
    swapped.act = torch.nn.Tanh()
    assert identity(swapped) != base
    leaky, steeper = Activated(), Activated()
    leaky.act, steeper.act = torch.nn.LeakyReLU(0.1), torch.nn.LeakyReLU(0.2)
    assert identity(leaky) != identity(steeper), "a constant baked in"

    class Scaled(torch.nn.Module):
        def __init__(self, scale):
            super().__init__()
            self.scale = torch.tensor([scale])

        def forward(self, x):
            return x * self.scale

    assert identity(Scaled(1.0)) == identity(Scaled(1.0))
    assert identity(Scaled(1.0)) != identity(Scaled(2.0)), "a constant tensor's value"
    assert compile_module(Activated(), (torch.randn(3, 6),)).identity != base, "input shapes"


def test_the_process_keeps_a_bounded_number_of_programs(monkeypatch, caplog):
    cache = program_cache.ProgramCache(size=3)
    monkeypatch.setattr(program_cache, "SHARED", cache)
    torch.manual_seed(0)
    net = Activated()
    model = poptorch.inferenceModel(net)
    with pytest.warns(UserWarning, match="compiling again"):
        for n in range(1, 6):
            x = torch.randn(n, 6)
            torch.testing.assert_close(model(x), net(x), rtol=RTOL, atol=ATOL)
    assert len(cache) == 3


def test_program_cache_evicts_the_least_recently_used():
    cache = program_cache.ProgramCache(size=2)
    cache["a"], cache["b"] = 1, 2
    assert cache.get("a") == 1          # "b" is now the least recently used
    cache["c"] = 3
    assert list(cache) == ["a", "c"]
    assert cache.get("b") is None


def test_program_cache_size_from_the_environment(monkeypatch):
    monkeypatch.setenv(program_cache.SIZE_VARIABLE, "5")
    assert program_cache.ProgramCache().size == 5
    monkeypatch.setenv(program_cache.SIZE_VARIABLE, "none")
    with pytest.raises(poptorch.Error, match=program_cache.SIZE_VARIABLE):
        program_cache.ProgramCache()
