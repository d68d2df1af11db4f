"""torch's float32 precision settings: read at capture, followed by the products traced off the
CPU (TF32 where torch CUDA would use it), ignored on the CPU (full float32, torch's CPU numbers)."""

import json
import re
import subprocess
import sys
import textwrap

import jax
import pytest
import torch
from torch import nn

from ipu_backend.compiler import capture, compile_module, float32_precision, to_jax
from ipu_backend.compiler.float32_precision import Float32Precision
from ipu_backend.compiler import backend

# Each case sets torch's switches in a process of its own (forked from one that imported torch):
# once the legacy and the new switches are both used in a process, torch's legacy getters raise,
# so the suite's own process stays clean.
SETTINGS_SCRIPT = textwrap.dedent(f"""
    import importlib.util, json, os, sys, torch
    spec = importlib.util.spec_from_file_location("float32_precision", {float32_precision.__file__!r})
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for case in sys.argv[1:]:
        child = os.fork()
        if child == 0:
            exec(case)
            print(json.dumps(module.torch_setting().__dict__), flush=True)
            os._exit(0)
        os.waitpid(child, 0)
""")

CASES = {
    "": ("ieee", "tf32"),                        # torch's defaults: cuDNN convolutions in TF32
    "torch.set_float32_matmul_precision('high')": ("tf32", "tf32"),
    "torch.set_float32_matmul_precision('medium')": ("tf32", "tf32"),
    "torch.set_float32_matmul_precision('high'); torch.set_float32_matmul_precision('highest')":
        ("ieee", "tf32"),
    "torch.backends.cuda.matmul.allow_tf32 = True": ("tf32", "tf32"),
    "torch.backends.cudnn.allow_tf32 = False": ("ieee", "ieee"),
    "torch.backends.cuda.matmul.fp32_precision = 'tf32'": ("tf32", "tf32"),
    "torch.backends.cudnn.conv.fp32_precision = 'ieee'": ("ieee", "ieee"),
    "torch.backends.fp32_precision = 'tf32'": ("tf32", "tf32"),
    # both kinds of switch in one process, which torch's legacy getters refuse to answer
    "torch.set_float32_matmul_precision('high'); torch.backends.cuda.matmul.fp32_precision = 'ieee'":
        ("ieee", "tf32"),
}


def test_each_torch_setting_gives_the_precision_torch_cuda_uses():
    chosen = subprocess.run([sys.executable, "-c", SETTINGS_SCRIPT, *CASES], check=True,
                            capture_output=True, text=True).stdout.splitlines()
    for case, line, (matmul, convolution) in zip(CASES, chosen, CASES.values(), strict=True):
        assert json.loads(line) == {"matmul": matmul, "convolution": convolution}, case


class ConvThenLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.linear = nn.Linear(12, 5)

    def forward(self, x):
        return self.linear(self.conv(x).flatten(1))


def _precisions(program, args, kind: str) -> set[str]:
    """The precisions of the ``kind`` ("dot_general" or "convolution") ops of ``program``'s
    lowered forward and backward."""
    params, buffers = program.state(ConvThenLinear())
    inputs = tuple(to_jax(a) for a in args)

    def loss(p):
        return program.fn(p, buffers, inputs, jax.random.key(0))[0].sum()

    text = jax.jit(jax.grad(loss)).lower(params).as_text()
    lines = [line for line in text.splitlines() if f"stablehlo.{kind}" in line]
    assert lines, f"no {kind} in the lowered program"
    return {precision for line in lines for precision in re.findall(r"\b(DEFAULT|HIGHEST|HIGH)\b", line)}


@pytest.fixture
def torch_setting(monkeypatch):
    """Pretend torch's switches say ``setting`` while a module is captured."""
    def set_(setting: Float32Precision):
        monkeypatch.setattr(capture.float32_precision, "torch_setting", lambda: setting)
    return set_


@pytest.mark.parametrize("matmul, convolution", [("ieee", "ieee"), ("tf32", "ieee"), ("ieee", "tf32"),
                                                 ("tf32", "tf32")])
def test_off_the_cpu_products_follow_the_setting_read_at_capture(monkeypatch, torch_setting, matmul,
                                                                 convolution):
    torch_setting(Float32Precision(matmul, convolution))
    args = (torch.randn(2, 2, 4, 4),)
    program = compile_module(ConvThenLinear(), args)
    torch_setting(Float32Precision())       # what torch says at trace time does not matter
    monkeypatch.setattr(backend, "on_cpu", lambda: False)
    expected = {"ieee": {"HIGHEST"}, "tf32": {"DEFAULT"}}
    assert _precisions(program, args, "dot_general") == expected[matmul]
    assert _precisions(program, args, "convolution") == expected[convolution]


def test_on_the_cpu_every_product_is_full_float32(torch_setting):
    torch_setting(Float32Precision("tf32", "tf32"))
    args = (torch.randn(2, 2, 4, 4),)
    program = compile_module(ConvThenLinear(), args)
    assert _precisions(program, args, "dot_general") == {"HIGHEST"}


def test_programs_are_keyed_by_the_setting_off_the_cpu_only(monkeypatch):
    assert float32_precision.program_key() is None          # the CPU: products are full float32
    monkeypatch.setattr(float32_precision.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(float32_precision, "torch_setting", lambda: Float32Precision("tf32", "ieee"))
    assert float32_precision.program_key() == Float32Precision("tf32", "ieee")


def test_tuned_float32_convolutions_after_tf32_ones_in_a_process_warn(monkeypatch):
    """Only where XLA times the convolutions' algorithms (torch.backends.cudnn.benchmark): its
    autotuner keeps them per shape; cuDNN's heuristics choose afresh for each program."""
    import warnings

    import ipu_backend as poptorch
    monkeypatch.setattr(float32_precision, "_CONVOLUTIONS_COMPILED", set())
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    setting = {"now": Float32Precision("ieee", "ieee")}
    monkeypatch.setattr(float32_precision, "program_key", lambda: setting["now"])

    def compile_one():
        model = nn.Linear(3, 2)
        poptorch.inferenceModel(model)(torch.ones(4, 3))

    message = "float32 convolutions tuned while compiling .* compiles after one with TF32 convolutions"
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=f".*{message}")
        compile_one()                                    # float32 first: nothing to warn of
        setting["now"] = Float32Precision("tf32", "tf32")
        compile_one()
    setting["now"] = Float32Precision("ieee", "ieee")
    with pytest.warns(UserWarning, match=message):
        compile_one()
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=f".*{message}")
        compile_one()
