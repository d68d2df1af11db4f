"""The performance guide's throughput chart, drawn from the benchmarks' results.

Reads ``device_iterations.json``, ``compiler_throughput.json`` and ``lightning_trainer.json``
from bench/results/ (``make bench`` writes them, then runs this script) and writes
docs/img/throughput.svg: per workload, this project's throughput over torch eager's and over the
same network hand-written in JAX, measured in the same run. A workload whose results file is
missing is left out and named. Run alone to redraw from the results on disk:
``.venv/bin/python bench/plots.py [--results DIR] [--out FILE]``.
"""

import argparse
import json
import pathlib
import sys

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
CHART = ROOT / "docs" / "img" / "throughput.svg"
TORCH, JAX = "over torch eager", "over hand-written JAX"

# (results file, label, path to the ratio over torch eager, path to the ratio over hand-written JAX)
WORKLOADS = [
    ("device_iterations", "MLP training, D = 100", ("mlp", "executor_vs_torch_eager"),
     ("mlp", "executor_vs_handwritten_jax")),
    ("device_iterations", "seed CNN training, D = 10", ("seed_cnn", "executor_vs_torch_eager"),
     ("seed_cnn", "executor_vs_handwritten_jax_im2col")),
    ("device_iterations", "seed CNN training, D = 1",
     ("seed_cnn_one_iteration", "executor_vs_torch_eager"),
     ("seed_cnn_one_iteration", "executor_vs_handwritten_jax_im2col")),
    ("compiler_throughput", "seed CNN forward (compiler)",
     ("seed_cnn", "forward", "compiled_vs_torch_eager"),
     ("seed_cnn", "forward", "compiled_vs_handwritten_jax")),
    ("compiler_throughput", "seed CNN fwd+bwd (compiler)",
     ("seed_cnn", "forward_backward", "compiled_vs_torch_eager"),
     ("seed_cnn", "forward_backward", "compiled_vs_handwritten_jax")),
    ("compiler_throughput", "encoder layer forward (compiler)",
     ("encoder_layer", "forward", "compiled_vs_torch_eager"),
     ("encoder_layer", "forward", "compiled_vs_handwritten_jax")),
    ("compiler_throughput", "encoder layer fwd+bwd (compiler)",
     ("encoder_layer", "forward_backward", "compiled_vs_torch_eager"),
     ("encoder_layer", "forward_backward", "compiled_vs_handwritten_jax")),
    ("lightning_trainer", "Lightning MLP, logs each step",
     ("ipu_vs_cpu_trainer", "logs_every_step"), None),
    ("lightning_trainer", "Lightning MLP, logs nothing", ("ipu_vs_cpu_trainer", "logs_nothing"), None),
]


def _lookup(document: dict, path):
    for key in path:
        document = document[key]
    return document


def ratios(results_dir: pathlib.Path) -> tuple[list, list]:
    """``[(label, {comparison: ratio})]`` for the workloads whose results exist, and the names
    of the results files that do not."""
    loaded, missing, rows = {}, [], []
    for name, label, over_torch, over_jax in WORKLOADS:
        if name not in loaded:
            path = results_dir / f"{name}.json"
            loaded[name] = json.loads(path.read_text()) if path.exists() else None
            if loaded[name] is None:
                missing.append(path.name)
        if loaded[name] is None:
            continue
        row = {TORCH: _lookup(loaded[name], over_torch)}
        if over_jax is not None:
            row[JAX] = _lookup(loaded[name], over_jax)
        rows.append((label, row))
    return rows, missing


def draw(rows: list, out: pathlib.Path) -> None:
    """Horizontal bars from 1× (parity), two per workload, on a log scale."""
    plt.rcParams["svg.hashsalt"] = "lightning-ipu"  # the same ids in every drawing of the chart
    figure, axes = plt.subplots(figsize=(8, 0.55 * len(rows) + 1.8))
    height = 0.38
    for offset, (comparison, colour) in zip((-height / 2, height / 2),
                                           ((TORCH, "tab:orange"), (JAX, "tab:blue"))):
        positions = [i + offset for i, (_, row) in enumerate(rows) if comparison in row]
        values = [row[comparison] for _, row in rows if comparison in row]
        bars = axes.barh(positions, [v - 1 for v in values], height, left=1, color=colour,
                         label=comparison)
        axes.bar_label(bars, labels=[f"{v:.2f}×" for v in values], padding=3, fontsize=8)
    axes.axvline(1.0, color="black", linewidth=0.8)
    axes.set_xscale("log")
    ticks = [0.5, 1, 2, 5, 10, 20, 50]
    axes.set_xticks(ticks, [f"{t:g}×" for t in ticks])
    axes.set_xlim(0.4, 80)
    axes.set_yticks(range(len(rows)), [label for label, _ in rows])
    axes.invert_yaxis()
    axes.set_xlabel("throughput ratio (log scale; right of 1×: this project is faster)")
    axes.set_title("This project's throughput over torch eager and hand-written JAX\n"
                   "(Lightning: the IPU Trainer over the CPU Trainer)", fontsize=10)
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=8, frameon=False)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, metadata={"Date": None})
    plt.close(figure)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=pathlib.Path, default=RESULTS,
                        help="folder of the benchmarks' JSON results")
    parser.add_argument("--out", type=pathlib.Path, default=CHART, help="the chart to write")
    args = parser.parse_args(argv)
    rows, missing = ratios(args.results)
    if missing:
        print(f"no {', '.join(missing)} in {args.results}: run make bench; its workloads are left out")
    if not rows:
        sys.exit(f"no results in {args.results}: run make bench first")
    draw(rows, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
