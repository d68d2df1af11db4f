"""Model parity: each loss on a small model, compiled together with the model (loss and every
parameter's gradient against torch)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.compiler.model_harness import check_model


def _classifier():
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 5))


def _regressor():
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))


def _log_probabilities():
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 5), nn.LogSoftmax(dim=-1))


def _probabilities():
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3), nn.Sigmoid())


def _labels():
    return torch.tensor([0, 3, 4, 1, 3, 2, 0, 4])


def _ignored_labels():
    return torch.tensor([0, -100, 4, 1, 3, -100, 0, 2])


def _regression_targets():
    return torch.randn(8, 3) * 1.5


def _binary_targets():
    return torch.rand(8, 3)


def _target_distribution():
    return torch.randn(8, 5).softmax(dim=-1)


def _class_probabilities():
    return torch.randn(8, 5).softmax(dim=-1)


LOSSES = {
    "cross_entropy": (_classifier, F.cross_entropy, _labels),
    "cross_entropy_ignore_index_class_weights": (
        _classifier, nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5, 1.5, 3.0])),
        _ignored_labels),
    "cross_entropy_label_smoothing": (
        _classifier, nn.CrossEntropyLoss(label_smoothing=0.2), _labels),
    "cross_entropy_ignore_index_label_smoothing_sum": (
        _classifier, nn.CrossEntropyLoss(ignore_index=-100, label_smoothing=0.1, reduction="sum"),
        _ignored_labels),
    "cross_entropy_probability_targets": (
        _classifier, nn.CrossEntropyLoss(label_smoothing=0.1), _class_probabilities),
    "nll_ignore_index": (_log_probabilities, nn.NLLLoss(ignore_index=3), _labels),
    "mse": (_regressor, nn.MSELoss(), _regression_targets),
    "l1_sum": (_regressor, nn.L1Loss(reduction="sum"), _regression_targets),
    "smooth_l1": (_regressor, nn.SmoothL1Loss(beta=0.5), _regression_targets),
    "bce": (_probabilities, nn.BCELoss(), _binary_targets),
    "bce_with_logits_pos_weight": (
        _regressor, nn.BCEWithLogitsLoss(pos_weight=torch.tensor([0.5, 2.0, 1.0])), _binary_targets),
    "kl_div": (_log_probabilities, nn.KLDivLoss(reduction="batchmean"), _target_distribution),
    "kl_div_log_target_sum": (
        _log_probabilities, nn.KLDivLoss(reduction="sum", log_target=True),
        lambda: _target_distribution().log()),
}


@pytest.mark.parametrize("name", LOSSES)
def test_loss_on_small_model(name):
    torch.manual_seed(0)
    make_model, loss_fn, make_targets = LOSSES[name]
    check_model(make_model(), (torch.randn(8, 6),), loss_fn, (make_targets(),))
