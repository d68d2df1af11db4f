"""The persistent executable cache: where each executor keeps its programs, what their keys cover,
loading instead of compiling (with torch eager's numbers), and the directory's bound.
fp32 tolerance: 1e-5 relative (1e-6 absolute)."""

import copy
import json
import os
import subprocess
import sys

import jax
import jaxlib
import pytest
import torch
import torch.nn.functional as F

import ipu_backend as poptorch
from ipu_backend.compiler import float32_precision
from ipu_backend.compiler.float32_precision import Float32Precision
from ipu_backend.runtime import executable_cache, lifecycle, program_cache

RTOL, ATOL = 1e-5, 1e-6


class Regression(torch.nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.hidden = torch.nn.Linear(6, width)
        self.out = torch.nn.Linear(width, 3)

    def forward(self, x, y):
        out = self.out(torch.tanh(self.hidden(x)))
        return out, F.mse_loss(out, y)


def data(n: int = 4):
    generator = torch.Generator().manual_seed(0)
    return torch.randn(n, 6, generator=generator), torch.randn(n, 3, generator=generator)


def entries(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(executable_cache.SUFFIX)) \
        if os.path.isdir(directory) else []


@pytest.fixture
def new_process(monkeypatch):
    """Starts the process's in-memory programs afresh, as a new process would (returned: do it again)."""
    def forget():
        monkeypatch.setattr(program_cache, "SHARED", program_cache.ProgramCache())
    forget()
    return forget


def train(net, opts=None, steps: int = 2):
    model = poptorch.trainingModel(net, opts, optimizer=torch.optim.Adam(net.parameters(), lr=0.01))
    x, y = data()
    losses = [model(x, y)[1] for _ in range(steps)]
    model.copyWeightsToHost()
    return losses


def eager(net, steps: int = 2):
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    x, y = data()
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = net(x, y)[1]
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


def test_a_new_process_loads_the_program_instead_of_compiling_it(new_process, monkeypatch, tmp_path, caplog):
    opts = poptorch.Options().enableExecutableCaching(str(tmp_path))
    torch.manual_seed(0)
    train(Regression(), opts)
    assert len(entries(tmp_path)) == 1

    new_process()

    def no_compilation(jitted, *args):
        raise AssertionError("the program was compiled although the cache holds it")

    monkeypatch.setattr(lifecycle, "compile_jitted", no_compilation)
    torch.manual_seed(1)
    net = Regression()
    reference = copy.deepcopy(net)
    with caplog.at_level("INFO", logger="ipu_backend"):
        losses = train(net, opts)
    assert any(r.getMessage().startswith("loaded the training program") for r in caplog.records)
    torch.testing.assert_close(torch.stack(losses), torch.stack(eager(reference)), rtol=RTOL, atol=ATOL)
    for (name, p), (_, q) in zip(net.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=name)


class TwoStages(Regression):
    """The regression split over two IPUs."""

    def __init__(self):
        super().__init__()
        self.out = poptorch.BeginBlock(self.out, ipu_id=1)


def test_a_new_process_loads_the_stage_programs_of_a_split_model(new_process, monkeypatch, tmp_path, caplog):
    opts = poptorch.Options().enableExecutableCaching(str(tmp_path))
    opts.Training.gradientAccumulation(4)
    x, y = data(8)

    def run(net):
        model = poptorch.trainingModel(net, opts, optimizer=torch.optim.Adam(net.parameters(), lr=0.01))
        for _ in range(2):
            model(x, y)
        model.copyWeightsToHost()

    torch.manual_seed(0)
    run(TwoStages())
    stored = entries(tmp_path)
    assert len(stored) > 1

    new_process()

    def no_compilation(lowered):
        raise AssertionError("a stage program was compiled although the cache holds it")

    monkeypatch.setattr(executable_cache.xla_compile, "compile_now", no_compilation)
    torch.manual_seed(1)
    net = TwoStages()
    reference = copy.deepcopy(net)
    with caplog.at_level("INFO", logger="ipu_backend"):
        run(net)
    assert any(r.getMessage().startswith("loaded the training program") for r in caplog.records)
    assert entries(tmp_path) == stored
    optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    for _ in range(2):      # four micro-batches of equal size: their mean is the whole batch's
        optimizer.zero_grad()
        reference(x, y)[1].backward()
        optimizer.step()
    for (name, p), (_, q) in zip(net.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=name)


class EqualStages(torch.nn.Module):
    """Two stages whose gradient-norm programs lower to the same text, on other IPUs and with
    other parameter names."""

    def __init__(self):
        super().__init__()
        self.w0 = poptorch.BeginBlock(torch.nn.Linear(3, 3), "w0", ipu_id=0)
        self.w1 = poptorch.BeginBlock(torch.nn.Linear(3, 3), "w1", ipu_id=1)

    def forward(self, x, y):
        out = self.w1(self.w0(x))
        return out, F.mse_loss(out, y)


def test_equal_stage_programs_of_one_model_are_each_their_own_entry(new_process, tmp_path):
    opts = poptorch.Options().enableExecutableCaching(str(tmp_path))
    opts.Training.gradientAccumulation(3)
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(3, 3, generator=generator), torch.randn(3, 3, generator=generator)
    torch.manual_seed(0)
    net = EqualStages()
    reference = copy.deepcopy(net)
    model = poptorch.trainingModel(net, opts, optimizer=poptorch.optim.SGD(net.parameters(), lr=0.1,
                                                                            max_grad_norm=0.01))
    model(x, y)
    model.copyWeightsToHost()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference(x, y)[1].backward()           # three micro-batches of one row: their mean is the batch's
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
    optimizer.step()
    for (name, p), (_, q) in zip(net.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=name)


def files(directory) -> set[str]:
    """Every file under ``directory``, whatever wrote it."""
    return {str(path.relative_to(directory)) for path in directory.rglob("*") if path.is_file()}


def test_each_executor_caches_where_its_own_options_say(new_process, monkeypatch, tmp_path):
    default, first, second = tmp_path / "default", tmp_path / "first", tmp_path / "second"
    monkeypatch.setenv(executable_cache.DIRECTORY_VARIABLE, str(default))
    train(Regression(width=5), poptorch.Options().enableExecutableCaching(str(first)), steps=1)
    written_first = files(first)
    train(Regression(width=7), poptorch.Options().enableExecutableCaching(str(second)), steps=1)
    train(Regression(width=9), poptorch.Options().enableExecutableCaching(None), steps=1)
    assert files(first) == written_first, "another executor wrote into the first one's cache"
    assert len(entries(first)) == len(entries(second)) == 1
    assert entries(first) != entries(second)
    assert not files(default), "an executor that did not ask wrote into a cache"
    train(Regression(width=11), steps=1)
    assert len(entries(default)) == 1, "the default executor caches in $IPU_BACKEND_CACHE_DIR"
    # A program another executor compiled in this process still goes where this one's options say.
    train(Regression(width=5), poptorch.Options().enableExecutableCaching(str(second)), steps=1)
    assert len(entries(second)) == 2


def test_cache_directory_settings(monkeypatch, tmp_path):
    monkeypatch.setenv(executable_cache.DIRECTORY_VARIABLE, str(tmp_path))
    assert executable_cache.directory("auto") == str(tmp_path)
    assert executable_cache.directory("/elsewhere") == "/elsewhere"
    assert executable_cache.directory(None) is None
    monkeypatch.setenv(executable_cache.DIRECTORY_VARIABLE, "off")
    assert executable_cache.directory("auto") is None
    assert executable_cache.directory("/elsewhere") == "/elsewhere", "an explicit path wins"
    monkeypatch.delenv(executable_cache.DIRECTORY_VARIABLE)
    monkeypatch.setenv(executable_cache.POPTORCH_VARIABLE, str(tmp_path / "poptorch"))
    assert executable_cache.directory("auto") == str(tmp_path / "poptorch"), "PopTorch's variable"
    monkeypatch.delenv(executable_cache.POPTORCH_VARIABLE)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert executable_cache.directory("auto") == str(tmp_path / "xdg" / "ipu_backend")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert executable_cache.directory("auto") == str(tmp_path / "home" / ".cache" / "ipu_backend")


def test_caching_turned_off_by_the_environment_writes_nothing(new_process, monkeypatch, tmp_path):
    monkeypatch.setenv(executable_cache.DIRECTORY_VARIABLE, "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    train(Regression(width=4), steps=1)
    assert not any(tmp_path.rglob("*"))


def program_key(width=8, opts=None, **changes):
    """The process key of a training model's program, as its executor makes it."""
    torch.manual_seed(0)
    net = Regression(width)
    model = poptorch.trainingModel(net, opts, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    model.compile(*data())
    return next(iter(model._compiled.values())).shared_key


def test_cache_keys_cover_graph_options_and_versions(monkeypatch):
    base = executable_cache.entry_key(program_key())
    assert base is not None
    assert executable_cache.entry_key(program_key()) == base, "another module object, the same program"
    assert executable_cache.entry_key(program_key(width=9)) != base
    assert executable_cache.entry_key(program_key(opts=poptorch.Options().deviceIterations(2))) != base
    seeded = poptorch.Options().randomSeed(3).enableExecutableCaching("/elsewhere")
    assert executable_cache.entry_key(program_key(opts=seeded)) == base, "the seed is an input"
    for module in (torch, jax, jaxlib):
        monkeypatch.setattr(module, "__version__", module.__version__ + "+other")
        assert executable_cache.entry_key(program_key()) != base, module.__name__
        monkeypatch.undo()
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
    assert executable_cache.entry_key(program_key()) != base


def test_gpu_cache_keys_tell_tuned_convolutions_apart(monkeypatch):
    """A program whose convolutions XLA timed (torch.backends.cudnn.benchmark) is not the one a
    process choosing them as torch's heuristics do may load."""
    monkeypatch.setattr(float32_precision, "program_key", lambda: Float32Precision())   # as on a GPU
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    heuristic = executable_cache.entry_key(program_key())
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    assert executable_cache.entry_key(program_key()) != heuristic


def test_decompositions_are_kept_under_keys_that_cover_versions(monkeypatch, tmp_path):
    """A decomposition (``compiler.decomposition_cache``) is looked up by its graph's key and what
    decomposed it: another torch version reads none of it."""
    store = executable_cache.Decompositions(executable_cache.ExecutableCache(str(tmp_path)))
    store.put("graph", b"decomposed")
    assert store.get("graph") == b"decomposed" and store.get("other graph") is None
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert store.get("graph") is None


def test_an_unreadable_entry_is_compiled_again(new_process, tmp_path, caplog):
    opts = poptorch.Options().enableExecutableCaching(str(tmp_path))
    torch.manual_seed(0)
    train(Regression(width=6), opts, steps=1)
    (entry,) = entries(tmp_path)
    (tmp_path / entry).write_bytes(b"not a pickle")
    new_process()
    torch.manual_seed(0)
    net = Regression(width=6)
    reference = copy.deepcopy(net)
    with caplog.at_level("INFO", logger="ipu_backend"):
        losses = train(net, opts, steps=1)
    assert any("unreadable executable cache entry" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(losses[0], eager(reference, steps=1)[0], rtol=RTOL, atol=ATOL)


def test_the_directory_keeps_its_bound_by_evicting_the_least_recently_used(tmp_path):
    cache = executable_cache.ExecutableCache(str(tmp_path), limit=250)
    decomposition = executable_cache.DECOMPOSITION_SUFFIX
    names = ("old" + executable_cache.SUFFIX, "old" + decomposition, "used" + executable_cache.SUFFIX,
             "new" + decomposition)
    for age, name in enumerate(names):
        path = tmp_path / name
        path.write_bytes(b"x" * 100)
        os.utime(path, ns=(age * 10**9, age * 10**9))
    assert cache.read("old", decomposition) == b"x" * 100      # read just now: the most recent
    (tmp_path / "unrelated.txt").write_bytes(b"y" * 1000)
    cache.evict()
    assert files(tmp_path) == {"old" + decomposition, "new" + decomposition, "unrelated.txt"}


def test_the_cache_size_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(executable_cache.SIZE_VARIABLE, "3")
    assert executable_cache.ExecutableCache("/unused").limit == 3 * 2**20
    monkeypatch.setenv(executable_cache.SIZE_VARIABLE, "lots")
    with pytest.raises(poptorch.Error, match=executable_cache.SIZE_VARIABLE):
        executable_cache.ExecutableCache("/unused")


SECOND_PROCESS = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 8)   # as tests/conftest.py: the same devices, the same key
compilations = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **kwargs: compilations.append(event) if event == "/jax/core/compile/backend_compile_duration" else None)
import torch
import ipu_backend as poptorch
from ipu_backend.compiler import capture
decompositions = []
decompose = capture.decompose_to_core_aten
capture.decompose_to_core_aten = lambda exported: decompositions.append(exported) or decompose(exported)
from tests.runtime.test_executable_cache import Regression, train
torch.manual_seed(0)
net = Regression()
losses = train(net, poptorch.Options().enableExecutableCaching(sys.argv[1]))
print(json.dumps({"compilations": len(compilations), "decompositions": len(decompositions),
                  "losses": [float(loss) for loss in losses],
                  "weights": {name: p.tolist() for name, p in net.state_dict().items()}}))
"""


def test_a_second_process_compiles_nothing(new_process, tmp_path):
    """The same script run again in a new process loads its program: XLA compiles nothing, and
    its capture takes the decomposition kept by the first."""
    torch.manual_seed(0)
    train(Regression(), poptorch.Options().enableExecutableCaching(str(tmp_path)))
    assert len(entries(tmp_path)) == 1
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", SECOND_PROCESS, str(tmp_path)], cwd=root, env=environment,
                            check=True, capture_output=True, text=True)
    second = json.loads(result.stdout.splitlines()[-1])
    assert second["compilations"] == 0 and second["decompositions"] == 0
    torch.manual_seed(0)
    reference = Regression()
    losses = eager(reference)
    torch.testing.assert_close(torch.tensor(second["losses"]), torch.stack(losses), rtol=RTOL, atol=ATOL)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(torch.tensor(second["weights"][name]), value, rtol=RTOL, atol=ATOL, msg=name)


def test_a_program_loaded_from_the_cache_is_saved_and_cached_again_from_its_bytes(new_process, tmp_path):
    """XLA:CPU cannot serialize a loaded executable again (the copy lacks compiled functions): a
    program loaded from the cache is saved, and written to another executor's cache, as loaded."""
    first, second, path = tmp_path / "first", tmp_path / "second", str(tmp_path / "model.poptorch")
    torch.manual_seed(0)
    train(Regression(width=6), poptorch.Options().enableExecutableCaching(str(first)), steps=1)
    new_process()
    torch.manual_seed(0)
    net = Regression(width=6)
    reference = copy.deepcopy(net)
    model = poptorch.trainingModel(net, poptorch.Options().enableExecutableCaching(str(first)),
                                   optimizer=torch.optim.Adam(net.parameters(), lr=0.01))
    model.compile(*data())                                  # loaded from the first cache
    model.save(path)
    torch.manual_seed(0)
    other = Regression(width=6)
    poptorch.trainingModel(other, poptorch.Options().enableExecutableCaching(str(second)),
                           optimizer=torch.optim.Adam(other.parameters(), lr=0.01)).compile(*data())
    assert len(entries(second)) == 1                        # reused from memory, written here
    expected = torch.stack(eager(reference))

    new_process()
    loaded = poptorch.load(path)
    x, y = data()
    torch.testing.assert_close(torch.stack([loaded(x, y)[1] for _ in range(2)]), expected, rtol=RTOL, atol=ATOL)
    new_process()
    torch.manual_seed(0)
    losses = train(Regression(width=6), poptorch.Options().enableExecutableCaching(str(second)))
    torch.testing.assert_close(torch.stack(losses), expected, rtol=RTOL, atol=ATOL)


def test_a_cache_that_cannot_be_written_warns_and_the_model_runs(new_process, tmp_path, caplog):
    blocked = tmp_path / "a file"
    blocked.write_text("not a directory")
    torch.manual_seed(0)
    net = Regression(width=3)
    reference = copy.deepcopy(net)
    with caplog.at_level("WARNING", logger="ipu_backend"):
        losses = train(net, poptorch.Options().enableExecutableCaching(str(blocked / "cache")), steps=1)
    assert any("cannot be written" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(losses[0], eager(reference, steps=1)[0], rtol=RTOL, atol=ATOL)
