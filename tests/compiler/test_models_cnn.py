"""Model parity: MLPs and CNNs (convolutions, pooling, normalization, dropout), the seed CNN under
both convolution algorithms, and torchvision's resnet18."""

import jax
import numpy as np
import pytest
import torch
from torch import nn

from examples.seed_cnn import SeedCNNWithLoss
from ipu_backend.compiler import compile_module, to_jax
from ipu_backend.compiler.lowering_options import lowering_options
from tests.compiler.model_harness import check_model


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def test_mlp():
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 3))
    check_model(model, (torch.randn(5, 12),))


def test_conv1d_stride_padding_dilation_groups():
    model = nn.Sequential(
        nn.Conv1d(4, 8, 3, stride=2, padding=2, dilation=2, groups=2), nn.ReLU(),
        nn.Conv1d(8, 6, 3, padding="same", bias=False), nn.MaxPool1d(2), nn.Flatten(), nn.Linear(30, 3))
    check_model(model, (torch.randn(2, 4, 19),))


def test_conv2d_stride_padding_dilation_groups():
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3, stride=(2, 1), padding=(1, 2), dilation=(1, 2)), nn.ReLU(),
        nn.Conv2d(6, 6, 3, groups=3, padding=1, padding_mode="zeros"), nn.SiLU(),
        nn.Conv2d(6, 6, 1, groups=6), nn.AdaptiveAvgPool2d((2, 3)), nn.Flatten(), nn.Linear(36, 4))
    # AdaptiveAvgPool2d takes 5x8 to 2x3: torch's uneven, overlapping bins.
    check_model(model, (torch.randn(2, 3, 9, 8),))


def test_conv3d_stride_padding_dilation_groups():
    model = nn.Sequential(
        nn.Conv3d(2, 4, 3, stride=(1, 2, 2), padding=1, dilation=(2, 1, 1), groups=2), nn.ReLU(),
        nn.AvgPool3d(2), nn.Flatten(), nn.Linear(32, 2))
    check_model(model, (torch.randn(2, 2, 7, 8, 9),))


def test_conv_transpose2d():
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.ReLU(),
        nn.ConvTranspose2d(4, 4, 3, stride=2, padding=1, output_padding=1, groups=2), nn.ReLU(),
        nn.ConvTranspose2d(4, 2, (2, 3), dilation=(1, 2)))
    check_model(model, (torch.randn(2, 3, 8, 6),))


def test_pooling():
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.MaxPool2d(3, stride=2, padding=1), nn.ReLU(),
        nn.AvgPool2d(2, ceil_mode=True, count_include_pad=False), nn.Conv2d(4, 4, 1),
        nn.MaxPool2d(2, ceil_mode=True), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    check_model(model, (torch.randn(3, 2, 11, 10),))


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_batchnorm2d_cnn(train):
    """Layers feeding a batch norm have no bias (see ``_before_batch_norm``)."""
    model = nn.Sequential(_before_batch_norm(nn.Conv2d(3, 4, 3), train), nn.BatchNorm2d(4), nn.ReLU(),
                          _before_batch_norm(nn.Conv2d(4, 4, 3), train), nn.BatchNorm2d(4, momentum=0.3),
                          nn.Flatten())
    if not train:
        _randomize_running_stats(model)
    # Train mode: the first conv's weight gradient sums 80 products of size ~20 back through two
    # batch norms and cancels to ~0.1 in places; float32 rounding of such a sum is ~1e-6 * 20.
    check_model(model, (torch.randn(4, 3, 6, 7),), train=train, grad_atol=1e-5 if train else None)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_batchnorm1d_mlp(train):
    model = nn.Sequential(_before_batch_norm(nn.Linear(6, 8), train), nn.BatchNorm1d(8), nn.ReLU(),
                          _before_batch_norm(nn.Linear(8, 5), train),
                          nn.BatchNorm1d(5, affine=False, momentum=0.3))
    if not train:
        _randomize_running_stats(model)
    check_model(model, (torch.randn(7, 6),), train=train)


def test_batchnorm1d_sequence_input():
    """BatchNorm1d over (N, C, L): statistics over batch and length."""
    model = nn.Sequential(_before_batch_norm(nn.Conv1d(3, 5, 3), True), nn.BatchNorm1d(5), nn.GELU())
    check_model(model, (torch.randn(4, 3, 9),))


def test_group_norm_and_layer_norm_cnn():
    model = nn.Sequential(nn.Conv2d(2, 6, 3, padding=1), nn.GroupNorm(3, 6), nn.ReLU(),
                          nn.Conv2d(6, 4, 3), nn.GroupNorm(1, 4, affine=False),
                          nn.LayerNorm([4, 3, 4]), nn.Flatten(), nn.LayerNorm(48, bias=False))
    check_model(model, (torch.randn(3, 2, 5, 6),))


def test_dropout_p0_is_exact_in_train_mode():
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.0), nn.ReLU(), nn.Dropout1d(0.0),
                          nn.Linear(16, 3))
    check_model(model, (torch.randn(4, 6),))


def test_dropout_train_mode_statistics():
    """Dropout p=0.3 in train mode: a fraction p of activations zeroed, the rest scaled by
    1/(1-p); the gradient flows through the kept ones only; masks follow the key."""
    p = 0.3
    model = nn.Sequential(nn.Linear(16, 256), nn.Dropout(p)).train()
    x = torch.randn(64, 16)
    program = compile_module(model, (x,))
    params, buffers = program.state(model)

    def total(params, key):
        return program.fn(params, buffers, (to_jax(x),), key)[0].sum()

    forward = jax.jit(lambda key: program.fn(params, buffers, (to_jax(x),), key)[0])
    output = np.asarray(forward(jax.random.key(1)))
    kept = output != 0
    assert abs(1 - kept.mean() - p) < 4 * np.sqrt(p * (1 - p) / kept.size), kept.mean()
    pre_dropout = model[0](x).detach().numpy()
    np.testing.assert_allclose(output[kept], pre_dropout[kept] / (1 - p), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(forward(jax.random.key(1))), output)
    assert not np.array_equal(np.asarray(forward(jax.random.key(2))) != 0, kept)

    grads = jax.jit(jax.grad(total))(params, jax.random.key(1))
    upstream = torch.from_numpy(kept) / (1 - p)
    (model[0](x) * upstream).sum().backward()
    # The weight's gradient sums 64 products per element, some of which cancel: compared
    # relative to the sum of their magnitudes (a different summation order moves it by ~1e-7
    # of that), not to the sum itself.
    magnitudes = {"0.weight": (upstream.T @ x.abs()).numpy(), "0.bias": upstream.sum(0).numpy()}
    for name, param in model.named_parameters():
        error = np.abs(np.asarray(grads[name]) - param.grad.numpy())
        assert (error <= 1e-5 * magnitudes[name] + 1e-6).all(), (name, (error / magnitudes[name]).max())


@pytest.mark.parametrize("algorithm", ["xla", "im2col"])
def test_seed_cnn(algorithm):
    model = SeedCNNWithLoss()
    x, labels = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
    run = check_model(model, (x, labels), conv_algorithm=algorithm)
    with lowering_options(conv_algorithm=algorithm):
        jaxpr = str(jax.make_jaxpr(run.program.fn)(run.params, run.buffers, run.inputs, run.key))
    assert ("conv_general_dilated" in jaxpr) == (algorithm == "xla")


def test_residual_blocks_train_mode():
    """resnet18's structure in miniature (runs where torchvision is absent): a stem with max
    pooling, identity and downsampling basic blocks with train-mode batch norm, a pooled head."""
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1), BasicBlock(4, 4, stride=1), BasicBlock(4, 8, stride=2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))
    check_model(model, (torch.randn(4, 3, 16, 16),), nn.functional.cross_entropy,
                (torch.tensor([0, 2, 1, 2]),))


def test_resnet18():
    """Eval mode: in train mode at a testable size the last stages' batch norms normalize over
    2 to 8 values and are ill-conditioned (torch's own float32 output differs from its float64
    one by 4e-3 at batch 2 and 32x32), so train-mode batch norm is checked on the small CNNs."""
    models = pytest.importorskip("torchvision.models", reason="torchvision is not installed")
    model = models.resnet18(num_classes=5)
    _randomize_running_stats(model)
    # Gradients pass back through 20 convolutions summing up to 4608 products each; torch's own
    # float32 gradients differ from its float64 ones by up to 6e-7 here, so 1e-6 is no margin.
    check_model(model, (torch.randn(2, 3, 32, 32),), nn.functional.cross_entropy,
                (torch.tensor([1, 4]),), train=False, grad_atol=5e-6)


def _before_batch_norm(layer, train):
    """Drop the bias of a layer feeding a train-mode batch norm: that bias's gradient is exactly
    zero (the norm subtracts the batch mean), so both frameworks return rounding noise there."""
    if train:
        layer.bias = None
    return layer


def _randomize_running_stats(model):
    """Eval-mode tests use running statistics that are not the trivial 0/1 of a fresh layer."""
    for layer in model.modules():
        if isinstance(layer, nn.modules.batchnorm._BatchNorm):
            layer.running_mean.normal_(0.0, 0.1)
            layer.running_var.uniform_(0.5, 2.0)


class BasicBlock(nn.Module):
    """torchvision's ResNet basic block: two 3x3 convolutions and a (1x1-projected) shortcut."""

    def __init__(self, in_channels, out_channels, stride):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(out_channels), nn.ReLU(),
            nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels))
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels))

    def forward(self, x):
        return torch.relu(self.body(x) + self.shortcut(x))
