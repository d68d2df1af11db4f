"""The options the runtime compiles with: on XLA:CPU the device-iterations loop of the MLP bench
(bench/device_iterations.py) updates its weights in place, with no copy of a weight in the loop's
body (XLA's default copy insertion copied the output layer's weight at the start of every
iteration); on GPUs, XLA's Triton matrix products only where ``Options.autotuneMatmuls`` asks, and
cuDNN's convolution algorithms chosen by its heuristics, as torch's are, unless
``torch.backends.cudnn.benchmark`` asks for them to be timed."""

import copy
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ipu_backend as poptorch
from ipu_backend.compiler import float32_precision
from ipu_backend.runtime import xla_compile


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(64, 128)
        self.out = torch.nn.Linear(128, 10)

    def forward(self, x, y):
        logits = self.out(torch.relu(self.hidden(x)))
        return logits, F.cross_entropy(logits, y)


def computation(hlo: str, name: str) -> str:
    """The text of the computation ``name`` in an HLO module's text."""
    start = re.search(rf"^%?{re.escape(name)} .*\{{$", hlo, re.MULTILINE).end()
    return hlo[start:hlo.index("\n}", start)]


def test_device_iterations_loop_updates_weights_without_copying_them():
    torch.manual_seed(0)
    model = Classifier()
    training = poptorch.trainingModel(model, poptorch.Options().deviceIterations(4),
                                      torch.optim.SGD(model.parameters(), lr=0.1))
    training(torch.randn(4 * 32, 64), torch.randint(0, 10, (4 * 32,)))
    hlo = next(iter(training._compiled.values())).executable.as_text()
    bodies = re.findall(r"while\(.*?body=%?([\w.\-]+)", hlo)
    assert bodies
    weight_shapes = {f"f32[{','.join(map(str, p.shape))}]" for p in model.parameters()}
    for body in bodies:
        copied = re.findall(r"= (f32\[[\d,]*\])\{[\d,]*\} copy\(", computation(hlo, body))
        assert not weight_shapes & set(copied), f"loop {body} copies weights shaped {copied}"


# --- XLA's Triton matrix products on GPUs (Options.autotuneMatmuls) ---------------------------

def on_a_gpu(monkeypatch):
    """Have the runtime choose its compile options as for XLA's GPU backend (the programs still
    compile for the CPU, which accepts every XLA option)."""
    monkeypatch.setattr(xla_compile, "on_cpu", lambda: False)
    monkeypatch.setattr(xla_compile, "on_gpu", lambda: True)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)


def test_cpu_programs_compile_with_the_cpu_options():
    assert xla_compile.compile_options() == xla_compile.CPU_OPTIONS


def test_gpu_programs_compile_without_triton_products_unless_asked(monkeypatch):
    on_a_gpu(monkeypatch)
    assert xla_compile.compile_options() == {xla_compile.GPU_TRITON_GEMM: False}
    with xla_compile.matmul_autotuning(True):
        assert xla_compile.compile_options() is None
    with xla_compile.matmul_autotuning(False):
        assert xla_compile.compile_options() == {xla_compile.GPU_TRITON_GEMM: False}


def test_xla_flags_naming_triton_products_are_followed(monkeypatch):
    on_a_gpu(monkeypatch)
    monkeypatch.setenv("XLA_FLAGS", f"--{xla_compile.GPU_TRITON_GEMM}=true")
    assert xla_compile.compile_options() is None


def test_gpu_programs_with_convolutions_choose_algorithms_as_torch_does(monkeypatch):
    """XLA's autotuner times cuDNN's algorithms and may keep a less exact one (on an H100 the seed
    CNN's first filter gradient came 6e-4 off torch's update); torch times them only under
    ``cudnn.benchmark``."""
    on_a_gpu(monkeypatch)
    untuned = {xla_compile.GPU_TRITON_GEMM: False, xla_compile.GPU_AUTOTUNE_LEVEL: 0}
    assert xla_compile.compile_options(has_convolutions=True) == untuned
    assert xla_compile.compile_options(has_convolutions=False) == {xla_compile.GPU_TRITON_GEMM: False}
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    assert xla_compile.compile_options(has_convolutions=True) == {xla_compile.GPU_TRITON_GEMM: False}
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    with xla_compile.matmul_autotuning(True):
        assert xla_compile.compile_options(has_convolutions=True) is None
    monkeypatch.setenv("XLA_FLAGS", f"--{xla_compile.GPU_AUTOTUNE_LEVEL}=4")
    assert xla_compile.compile_options(has_convolutions=True) == {xla_compile.GPU_TRITON_GEMM: False}
    monkeypatch.setenv("XLA_FLAGS", f"--{xla_compile.GPU_AUTOTUNE_LEVEL}=0")
    assert xla_compile.compile_options(has_convolutions=True) == untuned


def test_convolutions_are_found_in_lowered_programs():
    x = jnp.ones((1, 1, 8, 8))
    conv = jax.jit(lambda a: jax.lax.conv(a, jnp.ones((2, 1, 3, 3)), (1, 1), "VALID")).lower(x)
    assert xla_compile.has_convolutions(conv)
    assert not xla_compile.has_convolutions(jax.jit(lambda a: a @ a).lower(x))


def test_the_gpu_options_are_ones_xla_accepts():
    """A misspelt option would fail every GPU compilation: XLA refuses unknown names."""
    x = jnp.arange(16.0).reshape(4, 4)
    lowered = jax.jit(lambda a: a @ a).lower(x)
    options = {xla_compile.GPU_TRITON_GEMM: False, xla_compile.GPU_AUTOTUNE_LEVEL: 0}
    np.testing.assert_array_equal(lowered.compile(options)(x), np.asarray(x @ x))
    with pytest.raises(jax.errors.JaxRuntimeError, match="No such compile option"):
        lowered.compile({xla_compile.GPU_TRITON_GEMM + "_misspelt": False})


@pytest.mark.parametrize("autotune", [False, True])
def test_executors_compile_with_their_autotuning_setting_and_torch_numbers(monkeypatch, autotune):
    on_a_gpu(monkeypatch)
    asked = []
    choose = xla_compile.compile_options
    monkeypatch.setattr(xla_compile, "compile_options", lambda *a: asked.append(choose(*a)) or asked[-1])
    torch.manual_seed(0)
    model, x, y = Classifier(), torch.randn(32, 64), torch.randint(0, 10, (32,))
    reference = copy.deepcopy(model)
    options = poptorch.Options().autotuneMatmuls(autotune).enableExecutableCaching(None)
    training = poptorch.trainingModel(model, options, torch.optim.SGD(model.parameters(), lr=0.1))
    _, loss = training(x, y)
    expected_options = None if autotune else {xla_compile.GPU_TRITON_GEMM: False}
    assert asked and all(chosen == expected_options for chosen in asked)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected_loss = reference(x, y)[1]
    expected_loss.backward()
    optimizer.step()
    training.copyWeightsToHost()
    torch.testing.assert_close(loss, expected_loss.detach(), rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_turning_cudnn_benchmark_on_compiles_the_program_again(monkeypatch):
    """On GPUs a program compiled with heuristic convolution algorithms is not run for a call
    that asks for tuned ones, nor the other way round."""
    monkeypatch.setattr(float32_precision, "program_key", lambda: float32_precision.Float32Precision())
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    torch.manual_seed(0)
    model, x, y = Classifier(), torch.randn(32, 64), torch.randint(0, 10, (32,))
    inference = poptorch.inferenceModel(model, poptorch.Options().enableExecutableCaching(None))
    inference(x, y)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    with pytest.warns(UserWarning, match="cudnn.benchmark settings changed since the last call: compiling again"):
        inference(x, y)
    assert len(inference._compiled) == 2
