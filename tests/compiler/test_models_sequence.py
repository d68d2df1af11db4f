"""Model parity: transformer blocks, attention with masks, embeddings, activation heads, LSTM/GRU."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.compiler.model_harness import check_model


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


@pytest.mark.parametrize("batch_first, norm_first", [(True, False), (False, True)],
                         ids=["batch_first", "seq_first-norm_first"])
def test_transformer_encoder_layer(batch_first, norm_first):
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=24, dropout=0.0,
                                       batch_first=batch_first, norm_first=norm_first)
    x = torch.randn(2, 5, 16) if batch_first else torch.randn(5, 2, 16)
    check_model(layer, (x,))


def test_transformer_encoder_layer_gelu_with_masks():
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=12, dropout=0.0, activation="gelu",
                                       batch_first=True)
    causal = torch.ones(4, 4, dtype=torch.bool).triu(1)
    padding = torch.tensor([[False, False, False, True], [False, False, False, False]])
    check_model(MaskedEncoder(layer), (torch.randn(2, 4, 8), causal, padding))


def test_multihead_attention_with_masks():
    attention = nn.MultiheadAttention(12, 3, batch_first=True)
    query, key = torch.randn(2, 4, 12), torch.randn(2, 6, 12)
    key_padding_mask = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    attn_mask = torch.rand(4, 6) < 0.3
    attn_mask[:, 0] = False  # every query sees at least one key
    check_model(MaskedAttention(attention), (query, key, key_padding_mask, attn_mask))


def test_multihead_attention_kdim_vdim_per_head_weights():
    attention = nn.MultiheadAttention(8, 2, kdim=5, vdim=3, bias=False, add_bias_kv=True)
    query, key, value = torch.randn(3, 2, 8), torch.randn(4, 2, 5), torch.randn(4, 2, 3)
    float_mask = torch.randn(3, 4)  # the 4 given keys; torch pads it for the key add_bias_kv adds
    check_model(PerHeadAttention(attention), (query, key, value, float_mask))


def test_scaled_dot_product_attention_causal_bool_and_float_masks():
    bool_mask = (torch.rand(5, 5) < 0.7) | torch.eye(5, dtype=torch.bool)
    float_mask = torch.randn(2, 1, 5, 5)
    check_model(SelfAttention(nn.Linear(8, 3 * 8), heads=2),
                (torch.randn(2, 5, 8), bool_mask, float_mask))


def test_embedding_with_padding_idx_and_heads():
    model = EmbeddingClassifier(vocabulary=11, dim=6, padding_idx=0)
    tokens = torch.tensor([[3, 0, 7, 10], [0, 0, 1, 5], [2, 3, 3, 9]])
    check_model(model, (tokens,))


# torch's RNN modules reassign their flat weight list while being exported, and export warns.
RNN_EXPORT_WARNING = pytest.mark.filterwarnings("ignore:The tensor attributes .*_flat_weights")


@RNN_EXPORT_WARNING
def test_lstm_multilayer_bidirectional_batch_first():
    lstm = nn.LSTM(5, 6, num_layers=2, bidirectional=True, batch_first=True)
    check_model(lstm, (torch.randn(4, 3, 5), (torch.randn(4, 4, 6), torch.randn(4, 4, 6))))


@RNN_EXPORT_WARNING
def test_gru_multilayer_bidirectional_sequence_first_default_state():
    gru = nn.GRU(5, 6, num_layers=2, bidirectional=True)
    check_model(gru, (torch.randn(3, 4, 5),))


@RNN_EXPORT_WARNING
def test_gru_classifier_with_h0():
    model = RecurrentClassifier(nn.GRU(4, 8, batch_first=True), 8, 3)
    check_model(model, (torch.randn(2, 6, 4), torch.randn(1, 2, 8)), F.cross_entropy,
                (torch.tensor([2, 0]),))


class MaskedEncoder(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, mask, padding_mask):
        return self.layer(x, src_mask=mask, src_key_padding_mask=padding_mask)


class MaskedAttention(nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.attention = attention

    def forward(self, query, key, key_padding_mask, attn_mask):
        return self.attention(query, key, key, key_padding_mask=key_padding_mask, attn_mask=attn_mask)


class PerHeadAttention(nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.attention = attention

    def forward(self, query, key, value, attn_mask):
        return self.attention(query, key, value, attn_mask=attn_mask, average_attn_weights=False)


class SelfAttention(nn.Module):
    """Multi-head self-attention written with ``F.scaled_dot_product_attention``: causal, with a
    boolean mask (True takes part) and with an additive float mask."""

    def __init__(self, projection, heads):
        super().__init__()
        self.projection = projection
        self.heads = heads

    def forward(self, x, bool_mask, float_mask):
        batch, length, dim = x.shape
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2)
                   for t in self.projection(x).chunk(3, dim=-1))
        outputs = (F.scaled_dot_product_attention(q, k, v, is_causal=True),
                   F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask),
                   F.scaled_dot_product_attention(q, k, v, attn_mask=float_mask))
        return tuple(out.transpose(1, 2).reshape(batch, length, dim) for out in outputs)


class EmbeddingClassifier(nn.Module):
    """Embedding, then SiLU/GELU layers and both softmax heads."""

    def __init__(self, vocabulary, dim, padding_idx):
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, dim, padding_idx=padding_idx)
        self.hidden = nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim),
                                    nn.GELU(approximate="tanh"), nn.Linear(dim, dim), nn.GELU())
        self.head = nn.Linear(dim, 4)

    def forward(self, tokens):
        logits = self.head(self.hidden(self.embedding(tokens)).mean(dim=1))
        return logits.softmax(dim=-1), logits.log_softmax(dim=-1), nn.Softmax(dim=0)(logits)


class RecurrentClassifier(nn.Module):
    def __init__(self, rnn, hidden, classes):
        super().__init__()
        self.rnn = rnn
        self.head = nn.Linear(hidden, classes)

    def forward(self, x, h0):
        output, _ = self.rnn(x, h0)
        return self.head(output[:, -1])
