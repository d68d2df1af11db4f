"""Our cheaper decomposition pass gives exactly the graph torch's public ``run_decompositions`` gives."""

import os
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

from ipu_backend.compiler import capture


class _Branching(nn.Module):
    """A ``torch.cond`` whose branches call ops that decompose (the nested graphs are patched too)."""

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda t: nn.functional.gelu(t).detach() * t,
                          lambda t: nn.functional.silu(t), (x,))


MODELS = {
    "encoder_layer": (lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
                      lambda: (torch.randn(2, 3, 8),)),
    "lstm": (lambda: nn.LSTM(4, 3, num_layers=2, bidirectional=True), lambda: (torch.randn(3, 2, 4),)),
    "cnn_upsample": (lambda: nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Upsample(scale_factor=2),
                                           nn.Upsample(scale_factor=2, mode="bilinear"), nn.Mish(),
                                           nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2, 3),
                                           nn.LogSoftmax(-1)),
                     lambda: (torch.randn(2, 1, 6, 6),)),
    "cond_with_detach": (_Branching, lambda: (torch.randn(3),)),
}


def _table() -> dict:
    """torch's core-ATen table as the capture uses it: without ``detach`` and ``std``, with
    torch's own decompositions of the ops core ATen keeps whole that have no lowering."""
    table = dict(torch.export.default_decompositions().items())
    table.update(torch._decomp.get_decompositions(capture._TORCH_DECOMPOSED))
    for op in capture._KEPT_WHOLE:
        table.pop(op)
    return table


@pytest.mark.parametrize("name", MODELS)
def test_decomposed_graph_equals_torchs_run_decompositions(name):
    make_model, make_args = MODELS[name]
    model, args = make_model(), make_args()
    table = _table()
    expected = torch.export.export(model, args, strict=False).run_decompositions(decomp_table=table)
    actual = capture.decompose_to_core_aten(torch.export.export(model, args, strict=False))
    assert _graphs(actual) == _graphs(expected)
    assert actual.graph_signature == expected.graph_signature


def _graphs(exported):
    """The graph and its nested graphs, as text without source comments."""
    return [str(module.graph) for module in exported.graph_module.modules()
            if isinstance(module, torch.fx.GraphModule)]


def test_weight_placeholders_carry_the_metadata_torchs_run_decompositions_gives():
    """The parameter and buffer tables read once give every weight placeholder the metadata
    torch copies onto it, and torch's own copying is back in place afterwards."""
    make_model, make_args = MODELS["cnn_upsample"]
    model, args = make_model(), make_args()
    table = _table()
    expected = torch.export.export(model, args, strict=False).run_decompositions(decomp_table=table)
    actual = capture.decompose_to_core_aten(torch.export.export(model, args, strict=False))
    assert _placeholder_metadata(actual) == _placeholder_metadata(expected)
    assert len(_placeholder_metadata(actual)) == len(list(model.parameters())) + len(list(model.buffers())) + 1
    populate = torch.export.exported_program._populate_param_buffer_metadata_to_new_gm
    assert populate is capture._export_utils._populate_param_buffer_metadata_to_new_gm


def _placeholder_metadata(exported):
    """Per placeholder, its metadata as comparable text (fake values by shape and dtype, graphs
    of origin by name, not by object id)."""
    return {node.name: sorted((key, (tuple(value.shape), value.dtype) if key == "val"
                               else re.sub(r"graph_id=\d+", "", repr(value)))
                              for key, value in node.meta.items())
            for node in exported.graph.nodes if node.op == "placeholder"}


def test_split_tables_equal_torchs():
    """The CIA and Python tables, built with the CIA ops materialized once, hold the ops torch's
    own split of the same table holds."""
    table = _table()
    expected = torch.export.exported_program._split_decomp_table_to_cia_and_python_decomp(table)
    actual = capture._split_core_aten_decompositions()
    assert [set(part) for part in actual] == [set(part) for part in expected]
    assert capture._export_utils._materialize_cpp_cia_ops.__name__ == "_materialize_cpp_cia_ops"



@pytest.mark.parametrize("reset", [False, True], ids=["filters", "filters reset after import"])
def test_a_capture_shows_no_deprecation_warning_from_inside_torch(tmp_path, reset):
    # A fresh process, with Python's default warning filters (the test run's own ignore this one),
    # or with them reset after the import, as pytest does for each test of a run.
    script = (
        "import torch, warnings, ipu_backend as poptorch\n"
        + ("warnings.resetwarnings()\n" if reset else "") +
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.linear = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x, y):\n"
        "        out = self.linear(x); return out, torch.nn.functional.mse_loss(out, y)\n"
        "poptorch.trainingModel(M())(torch.randn(2, 4), torch.randn(2, 4))\n")
    env = {**os.environ, "IPU_BACKEND_CACHE_DIR": str(tmp_path), "PYTHONWARNINGS": ""}
    for _ in range(2 if reset else 1):       # the second run loads the program from the cache
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert "LeafSpec" not in done.stderr
