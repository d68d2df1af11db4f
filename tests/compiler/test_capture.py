"""Capture: program structure, step methods with self.log, source lines and error messages."""

import os
import re
import subprocess
import sys

import jax
import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from ipu_backend import Error
from ipu_backend.compiler import compile_module, to_jax
from tests.compiler.harness import assert_close, line_of

THIS_FILE = __file__


def run(program, module, *args, seed=0):
    params, buffers = program.state(module)
    inputs = torch.utils._pytree.tree_map(lambda a: to_jax(a) if isinstance(a, torch.Tensor) else a, args)
    return jax.jit(program.logged_fn)(params, buffers, inputs, jax.random.key(seed))


class Structured(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.norm = torch.nn.BatchNorm1d(3)

    def forward(self, x):
        h = self.norm(self.linear(x))
        return {"h": h, "pair": (h.sum(), [h * 2, None]), "k": 3}


def test_output_structure_and_state_order_follow_torch():
    torch.manual_seed(0)
    module = Structured().train()
    x = torch.randn(5, 4)
    program = compile_module(module, (x,))
    assert [s.name for s in program.params] == ["linear.weight", "linear.bias", "norm.weight", "norm.bias"]
    assert [s.name for s in program.buffers] == ["norm.running_mean", "norm.running_var",
                                                  "norm.num_batches_tracked"]
    assert program.buffers[2].dtype == torch.int64
    assert set(program.mutated_buffers) == {"norm.running_mean", "norm.running_var",
                                            "norm.num_batches_tracked"}
    outputs, new_buffers, logged = run(program, module, x)
    expected = module(x)
    assert set(outputs) == {"h", "pair", "k"} and outputs["k"] == 3
    assert isinstance(outputs["pair"], tuple) and isinstance(outputs["pair"][1], list)
    assert outputs["pair"][1][1] is None
    assert_close(outputs["h"], expected["h"], 1e-5, 1e-6)
    assert_close(outputs["pair"][0], expected["pair"][0], 1e-5, 1e-5)
    assert_close(outputs["pair"][1][0], expected["pair"][1][0], 1e-5, 1e-6)
    for name, value in module.named_buffers():
        assert_close(new_buffers[name], value, 1e-5, 1e-6, name)
    assert logged == {}


class ReplacesItsBuffer(torch.nn.Module):
    def __init__(self, initial):
        super().__init__()
        self.register_buffer("y", initial)

    def forward(self, x):
        x = x + 1
        self.y = x * 3
        return x


def test_a_buffer_replaced_in_forward_is_updated_as_torch_or_poptorchs_error():
    x = torch.tensor([5.0])
    module, reference = ReplacesItsBuffer(torch.tensor([2.0])), ReplacesItsBuffer(torch.tensor([2.0]))
    outputs, new_buffers, _ = run(compile_module(module, (x,)), ReplacesItsBuffer(torch.tensor([2.0])), x)
    assert_close(outputs, reference(x), 0, 0)
    assert_close(new_buffers["y"], reference.y, 0, 0)
    with pytest.raises(Error, match=r"^Buffer y is reassigned within the model when calling the forward "
                                    r"method\. This is not supported\. Consider using self\.y\.copy_\(src\).*"
                                    r"new value is torch\.float32 \[1\] and the buffer torch\.int64 \[1\]"):
        compile_module(ReplacesItsBuffer(torch.tensor([2])), (x,))


class RemovesItsBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("y", torch.tensor([2]))

    def forward(self, x):
        if "y" in self._buffers:
            del self._buffers["y"]
        return x + 1


def test_a_buffer_removed_in_forward_is_poptorchs_error():
    with pytest.raises(Error, match=r"^Buffer y is removed from the model when calling the forward method\."):
        compile_module(RemovesItsBuffer(), (torch.tensor([5.0]),))


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        self.log("train_loss", loss, prog_bar=True, on_step=True)
        self.log_dict({"abs_mean": self.layer(x).abs().mean(), "lr_const": 0.5})
        return {"loss": loss}


def test_training_step_capture_returns_logged_values_as_outputs():
    torch.manual_seed(0)
    module = Regressor()
    batch = (torch.randn(8, 3), torch.randn(8, 2))
    program = compile_module(module, (batch, 0), method="training_step")
    assert [s.name for s in program.params] == ["layer.weight", "layer.bias"]
    calls = {call.name: call for call in program.logs}
    assert calls["train_loss"].kwargs == {"prog_bar": True, "on_step": True}
    assert calls["train_loss"].is_tensor and calls["abs_mean"].is_tensor
    assert calls["lr_const"].constant == 0.5 and calls["lr_const"].is_tensor      # an output too
    outputs, _, logged = run(program, module, batch, 0)
    x, y = batch
    expected_loss = F.mse_loss(module.layer(x), y)
    assert_close(outputs["loss"], expected_loss, 1e-5, 1e-6)
    assert_close(logged["train_loss"], expected_loss, 1e-5, 1e-6)
    assert_close(logged["abs_mean"], module.layer(x).abs().mean(), 1e-5, 1e-6)
    assert float(logged["lr_const"]) == 0.5
    assert "log" not in vars(module), "the log recorder must be removed after capture"


def test_logging_an_unsupported_value_is_a_clear_error():
    class LogsAnObject(Regressor):
        def training_step(self, batch, batch_idx):
            self.log("thing", object())
            return super().training_step(batch, batch_idx)

    with pytest.raises(Error, match=r"self.log\('thing', \.\.\.\) got a object"):
        compile_module(LogsAnObject(), ((torch.randn(2, 3), torch.randn(2, 2)), 0), method="training_step")


def test_source_locations_point_at_user_lines():
    class Net(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x)  # relu-line

    program = compile_module(Net(), (torch.randn(3),))
    assert f"{THIS_FILE}:{line_of(THIS_FILE, '# relu-line')}" in program.source_locations["relu"]


def test_unsupported_op_names_the_op_and_the_user_line():
    class Spectral(torch.nn.Module):
        def forward(self, x):
            return torch.fft.rfft(x).abs()  # fft-line

    with pytest.raises(Error) as info:
        compile_module(Spectral(), (torch.randn(8),))
    message = str(info.value)
    assert "aten._fft_r2c.default" in message
    assert f"{THIS_FILE}:{line_of(THIS_FILE, '# fft-line')}" in message
    assert "register a lowering" in message


def test_an_error_in_a_step_method_names_the_step_methods_line():
    """torch.export keeps only ``forward`` frames in a node's stack trace; a step method's are
    kept too."""
    class Spectral(pl.LightningModule):
        def training_step(self, batch, batch_idx):
            return torch.fft.rfft(batch).abs().sum()  # step-fft-line

    with pytest.raises(Error, match=re.escape(f"{THIS_FILE}:{line_of(THIS_FILE, '# step-fft-line')}")):
        compile_module(Spectral(), (torch.randn(8), 0), method="training_step")


@pytest.mark.parametrize("fn,op,why", [
    (lambda x: x * x.sum().item(), "aten._local_scalar_dense.default", "x.item()"),
    (lambda x: x[torch.nonzero(x > 0).squeeze(1)], "aten.nonzero.default", "size depends on the data"),
    (lambda x: torch.unique((x > 0).long()).float(), "aten._unique2.default", "size depends on the data"),
], ids=["item", "nonzero", "unique"])
def test_ops_without_a_lowering_by_nature_say_why(fn, op, why):
    class Reads(torch.nn.Module):
        def forward(self, x):
            return fn(x)

    with pytest.raises(Error, match=re.escape(op) + ".*" + re.escape(why)):
        compile_module(Reads(), (torch.randn(6),))


def test_data_dependent_branch_explains_and_points_to_torch_cond():
    class Branchy(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # branch-line
                return x * 2
            return x

    with pytest.raises(Error) as info:
        compile_module(Branchy(), (torch.randn(3),))
    message = str(info.value)
    assert f"{THIS_FILE}:{line_of(THIS_FILE, '# branch-line')}" in message
    assert "torch.cond" in message and re.search(r"branches on the value of a tensor", message)


class DataSizedResults(torch.nn.Module):
    """Results whose sizes torch would read from the values of ``x``."""

    def __init__(self, op: str):
        super().__init__()
        self.op = op

    def forward(self, x):
        if self.op == "one_hot":
            return F.one_hot(x)  # one-hot-line
        return torch.repeat_interleave(x)  # repeat-line


@pytest.mark.parametrize("op, line, message", [
    ("one_hot", "# one-hot-line", r"^F.one_hot at .* has no num_classes: .* Give num_classes \(OneHot num classes "
                                  r"must be specified and must be constant.\)"),
    ("repeat_interleave", "# repeat-line", r"^torch.repeat_interleave at .* repeats by a tensor without "
                                           r"output_size: .* Pass output_size=")])
def test_results_sized_by_tensor_values_are_refused_naming_the_op_and_its_size_argument(op, line, message):
    with pytest.raises(Error, match=message) as info:
        program = compile_module(DataSizedResults(op), (torch.tensor([1, 0, 3]),))
        jax.jit(program.logged_fn)({}, {}, (to_jax(torch.tensor([1, 0, 3])),), jax.random.key(0))
    assert f"{THIS_FILE}:{line_of(THIS_FILE, line)}" in str(info.value)


def test_shape_mistake_names_the_shapes_and_the_user_line():
    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.linear(x)  # shape-line

    x = torch.randn(2, 5)
    with pytest.raises(RuntimeError):
        Head()(x)
    with pytest.raises(Error) as info:       # a RuntimeError too, as torch's
        compile_module(Head(), (x,))
    message = str(info.value)
    assert "[2, 5] X [4, 2]" in message
    assert f"{THIS_FILE}:{line_of(THIS_FILE, '# shape-line')}" in message


def test_users_own_exception_passes_through_capture_unchanged():
    class Checked(torch.nn.Module):
        def forward(self, x):
            raise ValueError("my own check")

    with pytest.raises(ValueError, match="^my own check$"):
        compile_module(Checked(), (torch.randn(3),))


class Gated(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.tensor([2.0, -3.0, 4.0]))

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda v: v * self.weight, lambda v: v - self.weight.exp(), (x,))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_torch_cond_lowers_to_lax_cond_with_gradients(sign):
    module = Gated()
    x = torch.tensor([0.5, 1.5, 2.0]) * sign
    program = compile_module(module, (x,))
    params, buffers = program.state(module)

    def loss(p, v):
        return program.fn(p, buffers, (v,), jax.random.key(0))[0][0].sum()

    value, (param_grads, x_grad) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, to_jax(x))
    x_torch = x.clone().requires_grad_(True)
    expected = module(x_torch)[0].sum()
    expected.backward()
    assert_close(value, expected, 1e-5, 1e-6)
    assert_close(param_grads["weight"], module.weight.grad, 1e-5, 1e-6)
    assert_close(x_grad, x_torch.grad, 1e-5, 1e-6)
    assert "cond" in str(jax.make_jaxpr(loss)(params, to_jax(x)))


CAPTURE_IN_NEW_PROCESS = """
import sys
import torch
from ipu_backend.compiler import compile_module
compile_module(torch.nn.Linear(3, 2), (torch.randn(4, 3),))
print("torchmetrics" in sys.modules)
"""


def test_capture_does_not_import_torchmetrics():
    """Whether a module holds torchmetrics objects is told without importing torchmetrics (its
    import takes seconds of a first compilation that needs none of it)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", CAPTURE_IN_NEW_PROCESS], cwd=root, env=environment,
                            check=True, capture_output=True, text=True)
    assert result.stdout.split()[-1] == "False"


class GradientPenalty(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x):
        x = x.clone().requires_grad_(True)
        out = torch.tanh(self.linear(x))
        slope, = torch.autograd.grad(out.sum(), x, create_graph=True)  # the penalised slope
        return out.mean() + (slope.norm(dim=1) - 1).pow(2).mean()


def test_torch_autograd_grad_inside_forward_is_refused_naming_the_line():
    line = line_of(__file__, "# the penalised slope")
    with pytest.raises(Error, match=rf"torch.autograd.grad is called inside the captured program, at .*"
                                    rf"test_capture.py:{line}: .*outside the compiled model"):
        compile_module(GradientPenalty(), (torch.randn(3, 4),))
    x = torch.randn(3, requires_grad=True)                 # outside a capture: torch's own
    torch.testing.assert_close(torch.autograd.grad((x ** 2).sum(), x)[0], 2 * x.detach())



class PackedTagger(torch.nn.Module):
    def __init__(self, rnn):
        super().__init__()
        self.rnn = rnn

    def forward(self, x, lengths):
        packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.rnn(packed)  # the packed batch
        return torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])[0]


@pytest.mark.parametrize("rnn", [torch.nn.LSTM, torch.nn.GRU])
def test_a_packed_sequence_is_refused_naming_the_line_and_the_padded_alternative(rnn):
    line = line_of(__file__, "# the packed batch")
    with pytest.raises(Error, match=rf"a PackedSequence .* reached .*test_capture.py:{line}: .*computed from the "
                                    rf"lengths' values.*mask the padded steps"):
        compile_module(PackedTagger(rnn(3, 4, batch_first=True)), (torch.randn(2, 5, 3), torch.tensor([5, 3])))



class RandomFrom(torch.nn.Module):
    def forward(self, x):
        return x.clone().random_(5, 100)


def test_random_from_to_is_refused_naming_torch_randint():
    """torch.export writes ``aten.random_.from(...)``, invalid Python, for ``random_(from, to)``."""
    with pytest.raises(Error, match=r"invalid Python .*aten\.random_\.from.*torch\.randint\(low, high, shape\)"):
        compile_module(RandomFrom(), (torch.zeros(3),))



class Reversed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, gradient):
        return -gradient


class WithCustomBackward(torch.nn.Module):
    def __init__(self, hook: bool):
        super().__init__()
        self.hook = hook
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.linear(x)
        if self.hook:
            y.register_hook(lambda gradient: -gradient)  # a hook on the gradient
            return y.sum()
        return Reversed.apply(y).sum()  # a Function with its own backward


def test_a_custom_backward_runs_forward_only_and_a_gradient_hook_is_refused_naming_the_line():
    x = torch.randn(3, 4)
    module = WithCustomBackward(hook=False)
    program = compile_module(module, (x,))
    params, buffers = program.state(module)
    outputs, _ = program.fn(params, buffers, (to_jax(x),), jax.random.key(0))   # the forward runs
    assert_close(outputs, module(x), 1e-5, 1e-6)
    line = line_of(__file__, "# a Function with its own backward")
    with pytest.raises(Error, match=rf"Function Reversed, applied at .*test_capture.py:{line}: .*cannot follow"):
        jax.grad(lambda p: program.fn(p, buffers, (to_jax(x),), jax.random.key(0))[0])(params)
    line = line_of(__file__, "# a hook on the gradient")
    with pytest.raises(Error, match=rf"register_hook is called inside the captured program, at .*test_capture.py:{line}"):
        compile_module(WithCustomBackward(hook=True), (x,))
