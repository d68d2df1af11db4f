"""nn.Transformer's modules against torch eager. A causal attention mask given without
``is_causal`` (``generate_square_subsequent_mask``) trains as torch trains it; with a key padding
mask, in eval mode without gradients, torch's nested-tensor path gives zeros at padded positions
(the final norm's bias with a norm), where the padding of every row is at its end; otherwise it
computes them. fp32: 1e-5 relative (1e-6 absolute)."""

import copy

import pytest
import torch

import ipu_backend as poptorch

RTOL, ATOL = 1e-5, 1e-6
AT_THE_END = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] * 4 + [True]])
IN_THE_MIDDLE = torch.tensor([[False] * 5, [False, True, False, False, False], [False] * 5])


class Encoder(torch.nn.Module):
    """Token features through a 2-layer encoder (with a final norm or without), mean-pooled over
    every position, padded ones too, as a careless classifier pools them."""

    def __init__(self, final_norm: bool):
        super().__init__()
        self.embed = torch.nn.Linear(4, 16)
        layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, norm=torch.nn.LayerNorm(16) if final_norm else None)
        self.head = torch.nn.Linear(16, 2)

    def forward(self, x, padding, y=None):
        features = self.encoder(self.embed(x), src_key_padding_mask=padding)
        out = self.head(features.mean(dim=1))
        return (features, out) if y is None else (out, torch.nn.functional.mse_loss(out, y))


@pytest.mark.parametrize("padding", [AT_THE_END, IN_THE_MIDDLE], ids=["padding_at_the_end", "padding_in_the_middle"])
@pytest.mark.parametrize("final_norm", [False, True], ids=["no_norm", "final_norm"])
def test_inference_gives_torchs_padded_outputs(padding, final_norm):
    torch.manual_seed(0)
    model = Encoder(final_norm).eval()
    x = torch.randn(3, 5, 4)
    with torch.no_grad():
        expected = model(x, padding)
    actual = poptorch.inferenceModel(copy.deepcopy(model))(x, padding)
    for ours, torchs in zip(actual, expected):
        torch.testing.assert_close(ours, torchs, rtol=RTOL, atol=ATOL)
    if padding is AT_THE_END and not final_norm:
        assert torch.all(actual[0][1, 3:] == 0)


@pytest.mark.parametrize("frozen_input", [True, False], ids=["nothing_requires_grad", "input_requires_grad"])
def test_training_a_head_on_a_frozen_encoder_follows_torchs_path(frozen_input):
    """With nothing the encoder reads requiring gradients, torch eager takes the nested path in
    training too; with a trained embedding before it, it does not."""
    torch.manual_seed(0)
    model = Encoder(final_norm=False)
    model.encoder.eval()
    frozen = [*model.encoder.parameters(), *(model.embed.parameters() if frozen_input else ())]
    for param in frozen:
        param.requires_grad_(False)
    reference = copy.deepcopy(model)
    x, y = torch.randn(4, 3, 5, 4), torch.randn(4, 3, 2)
    trained = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
    reference_optimizer = torch.optim.SGD(trained(reference), lr=0.05)
    for step in range(4):
        reference_optimizer.zero_grad()
        reference(x[step], AT_THE_END, y[step])[1].backward()
        reference_optimizer.step()
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(trained(model), lr=0.05))
    for step in range(4):
        training(x[step], AT_THE_END, y[step])
    for (name, ours), torchs in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(ours, torchs, rtol=RTOL, atol=ATOL, msg=name)


class Translator(torch.nn.Module):
    """nn.Transformer as its documentation uses it: the target's causal mask made by
    ``generate_square_subsequent_mask``, no ``is_causal`` hint."""

    def __init__(self):
        super().__init__()
        self.transformer = torch.nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True)

    def forward(self, src, tgt, y):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        out = self.transformer(src, tgt, src_mask=torch.zeros(src.shape[1], src.shape[1]), tgt_mask=mask)
        return out, ((out - y) ** 2).mean()


def test_a_causal_mask_without_the_hint_trains_as_in_torch():
    torch.manual_seed(0)
    model = Translator()
    reference = copy.deepcopy(model)
    src, tgt, y = torch.randn(3, 2, 6, 16), torch.randn(3, 2, 5, 16), torch.randn(3, 2, 5, 16)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    for step in range(3):
        reference_optimizer.zero_grad()
        reference(src[step], tgt[step], y[step])[1].backward()
        reference_optimizer.step()
    training = poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05))
    for step in range(3):
        training(src[step], tgt[step], y[step])
    for (name, ours), torchs in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(ours, torchs, rtol=RTOL, atol=ATOL, msg=name)
