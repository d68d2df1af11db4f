"""Compile and execution reports of a 2-stage pipeline (trained, 2 replicas) and of a single-IPU
model (inference, 2 replicas): their numbers, and their pages rendered in headless Chromium."""

import json
import os
import shutil
import subprocess
from collections import Counter

import numpy as np
import pytest
import torch

import ipu_backend as poptorch
from ipu_backend.profiling import Recorder, recorder_for
from ipu_backend.runtime import memory
from ipu_backend.runtime.multi_ipu import multi_ipu_program
from tests.multi_ipu.models import TwoStages, regression_data

STAGES, ITERATIONS, MICRO_BATCHES, REPLICAS, MICRO = 2, 2, 4, 2, 2
CALLS = 2
CHROMIUM = "/usr/bin/chromium"


def load(directory, name):
    with open(os.path.join(directory, name), encoding="utf-8") as file:
        return json.load(file) if name.endswith(".json") else file.read()


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """The trained pipeline's executor and report directory, after CALLS calls."""
    root = tmp_path_factory.mktemp("reports")
    opts = poptorch.Options().deviceIterations(ITERATIONS).replicationFactor(REPLICAS).enableProfiling(str(root))
    opts.Training.gradientAccumulation(MICRO_BATCHES)
    model = TwoStages()
    executor = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = regression_data(ITERATIONS * MICRO_BATCHES * REPLICAS * MICRO)
    for _ in range(CALLS):
        executor(x, y)
    yield executor, os.path.join(root, "training")
    executor.destroy()


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """A single-IPU inference model with 2 replicas, called once."""
    root = tmp_path_factory.mktemp("reports")
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    executor = poptorch.inferenceModel(model, poptorch.Options().replicationFactor(REPLICAS).enableProfiling(str(root)))
    executor(torch.randn(REPLICAS * 4, 6))
    yield model, executor, os.path.join(root, "inference")
    executor.destroy()


def ipu_events(trace):
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] in ("forward", "backward", "update")]


# --- execution report -------------------------------------------------------------------------
def test_trace_holds_forward_and_backward_of_every_micro_batch_per_stage_replica_and_iteration(pipeline):
    _, directory = pipeline
    events = ipu_events(load(directory, "execution_trace.json"))
    passes = [e for e in events if e["cat"] != "update"]
    per_ipu = Counter(e["pid"] for e in passes)
    assert per_ipu == {ipu: CALLS * ITERATIONS * REPLICAS * MICRO_BATCHES * 2 for ipu in range(STAGES)}
    for ipu in range(STAGES):
        for replica in range(REPLICAS):
            names = Counter(e["name"] for e in passes if e["pid"] == ipu and e["tid"] == replica)
            assert names == {f"{role}{m}": CALLS * ITERATIONS for role in "FB" for m in range(MICRO_BATCHES)}
    updates = Counter((e["pid"], e["tid"]) for e in events if e["cat"] == "update")
    assert updates == {(ipu, r): CALLS * ITERATIONS for ipu in range(STAGES) for r in range(REPLICAS)}


def test_trace_fills_each_calls_measured_compute_time_without_overlap(pipeline):
    _, directory = pipeline
    trace = load(directory, "execution_trace.json")
    hosts = sorted((e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "host"), key=lambda e: e["ts"])
    events = ipu_events(trace)
    for call in range(CALLS):
        inputs, outputs = hosts[2 * call], hosts[2 * call + 1]
        assert inputs["name"].startswith("host → IPU") and outputs["name"].startswith("IPU → host")
        mine = [e for e in events if e["args"]["call"] == call]
        assert min(e["ts"] for e in mine) == pytest.approx(inputs["ts"] + inputs["dur"])
        assert max(e["ts"] + e["dur"] for e in mine) == pytest.approx(outputs["ts"])
        for lane in {(e["pid"], e["tid"]) for e in mine}:
            spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in mine if (e["pid"], e["tid"]) == lane)
            assert all(end <= start + 1e-6 for (_, end), (start, _) in zip(spans, spans[1:]))


def test_summary_gives_the_schedules_bubble_and_the_measured_rates(pipeline):
    _, directory = pipeline
    summary = load(directory, "execution_report.json")["programs"][0]
    cycles = MICRO_BATCHES + 2 * STAGES - 2
    assert summary["bubble_fraction"] == pytest.approx((2 * STAGES - 2) / cycles)
    assert summary["utilization"] == {str(i): pytest.approx((2 * MICRO_BATCHES + 1) / (2 * cycles + 1))
                                      for i in range(STAGES)}
    assert summary["calls"] == CALLS
    seconds = summary["seconds_per_call"]
    assert summary["steps_per_second"] == pytest.approx(ITERATIONS / seconds)
    assert summary["samples_per_second"] == pytest.approx(ITERATIONS * MICRO_BATCHES * REPLICAS * MICRO / seconds)
    parts = summary["host_to_ipu_seconds"] + summary["compute_seconds"] + summary["ipu_to_host_seconds"]
    assert parts == pytest.approx(seconds)


def test_single_ipu_model_has_one_lane_per_replica(single):
    _, _, directory = single
    trace = load(directory, "execution_trace.json")
    events = ipu_events(trace)
    assert {(e["pid"], e["tid"]) for e in events} == {(0, r) for r in range(REPLICAS)}
    assert [e["name"] for e in events] == ["F0"] * REPLICAS
    assert load(directory, "execution_report.json")["programs"][0]["bubble_fraction"] == 0


# --- compile report ---------------------------------------------------------------------------
def test_memory_is_the_estimate_the_pipeline_checked(pipeline):
    executor, directory = pipeline
    report = load(directory, "compile_report.json")["programs"][0]
    expected = [u.as_dict() for u in multi_ipu_program(executor).memory]
    assert [{k: u[k] for k in expected[0]} for u in report["memory"]] == expected
    capacity = poptorch.PipelinedExecution().ipu_spec.memory_bytes
    assert all(u["capacity"] == capacity and u["fraction"] == u["total"] / capacity for u in report["memory"])
    # one replica of IPU 1 holds fc2 (8·3 + 3 floats) and its SGD state (none: no momentum)
    assert report["memory"][1]["weights"] == (8 * 3 + 3) * 4
    assert report["memory"][0]["stash"] > 0 and report["memory"][1]["stash"] == 0   # the last stage stashes nothing


def test_single_ipu_memory_counts_the_weights_and_xla_temporaries(single):
    model, executor, directory = single
    usage = load(directory, "compile_report.json")["programs"][0]["memory"]
    weights = sum(p.numel() * 4 for p in model.parameters())
    executable = next(iter(executor._compiled.values())).executable
    temporaries = executable.memory_analysis().temp_size_in_bytes
    stage = memory.StageMemory(0, 0, weights, 0, 0, 0, 0, temporaries, False)
    assert usage == [{**u.as_dict(), "capacity": 900_000_000, "fraction": u.total / 900_000_000}
                     for u in memory.estimate([stage])]


def test_flops_and_op_counts_per_stage_are_those_of_the_compiled_stage_programs(pipeline):
    executor, directory = pipeline
    stages = load(directory, "compile_report.json")["programs"][0]["stages"]
    program = multi_ipu_program(executor)
    assert [s["ipu"] for s in stages] == [0, 1]
    for report, stage in zip(stages, program.stages):
        assert set(report["programs"]) == set(stage.programs)
        for name, compiled in stage.programs.items():
            assert report["programs"][name]["flops"] == compiled.cost_analysis()["flops"]
        assert report["aten_ops"] == len(stage.plan.nodes)
    # stage 0's forward multiplies the [micro, 6] batch by fc1's [6, 8] weight: 2·m·6·8 FLOPs at least
    assert stages[0]["programs"]["forward"]["flops"] >= 2 * MICRO * 6 * 8
    assert stages[0]["aten_op_counts"]["aten.tanh"] == 1
    assert stages[1]["programs"]["forward_backward"]["hlo_op_counts"]["dot"] >= 2


def test_compile_time_is_measured_and_reported(pipeline, single):
    for directory in (pipeline[1], single[2]):
        seconds = load(directory, "compile_report.json")["programs"][0]["compile_seconds"]
        assert 0 < seconds < 600


def test_pages_draw_one_memory_bar_and_one_diagram_row_per_ipu(pipeline, single):
    for directory, ipus in ((pipeline[1], STAGES), (single[2], 1)):
        assert load(directory, "compile_report.html").count('<g class="ipu-bar"') == ipus
        assert load(directory, "execution_report.html").count('<g class="ipu-row"') == ipus
    page = load(pipeline[1], "execution_report.html")
    assert page.count('class="slot forward"') == page.count('class="slot backward"') == STAGES * MICRO_BATCHES
    assert page.count('class="slot update"') == STAGES
    assert "modelled, not sampled" in page
    for name in ("compile_report.html", "execution_report.html"):
        text = load(pipeline[1], name)
        assert "<script" not in text and "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "")
        assert "<link" not in text and "https://" not in text


# --- switches ---------------------------------------------------------------------------------
def test_models_sharing_a_directory_get_their_own_folders(tmp_path):
    opts = poptorch.Options().enableProfiling(str(tmp_path))
    first, second = recorder_for(opts, True, None), recorder_for(opts, True, None)
    assert isinstance(first, Recorder)
    assert (first.directory, second.directory) == (str(tmp_path / "training"), str(tmp_path / "training_2"))
    assert recorder_for(opts, False, "validation_step").directory == str(tmp_path / "validation")
    second.close()
    assert recorder_for(opts, True, None).directory == str(tmp_path / "training_2")
    assert not isinstance(recorder_for(poptorch.Options(), True, None), Recorder)


# --- in a browser -----------------------------------------------------------------------------
def screenshot(page: str, tmp_path) -> np.ndarray:
    png = tmp_path / (os.path.basename(page) + ".png")
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'chromium-profile'}", f"--screenshot={png}",
                    "--window-size=1200,800", f"file://{page}"], check=True, capture_output=True, timeout=120)
    from PIL import Image
    assert png.exists()
    return np.asarray(Image.open(png).convert("RGB"))


@pytest.mark.skipif(shutil.which(CHROMIUM) is None, reason=f"headless Chromium ({CHROMIUM}) is not installed: "
                    "apt-get install chromium (.ci/run installs it)")
@pytest.mark.parametrize("page", ["compile_report.html", "execution_report.html"])
def test_pages_render_their_charts_in_headless_chromium(pipeline, page, tmp_path):
    pixels = screenshot(os.path.join(pipeline[1], page), tmp_path)
    assert pixels.shape == (800, 1200, 3)
    assert pixels.std() > 10                                  # not a blank page
    blue = np.all(np.abs(pixels.astype(int) - (0x3B, 0x6F, 0xB6)) <= 2, axis=-1)
    assert blue.sum() > 2000            # the weight bars / the forward slots, drawn in SVG
    if page == "execution_report.html":
        orange = np.all(np.abs(pixels.astype(int) - (0xE0, 0x8A, 0x2E)) <= 2, axis=-1)
        assert orange.sum() > 2000      # the backward slots
