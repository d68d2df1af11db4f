"""The execution report page: the pipeline diagram (IPUs × time slots, as in Graphcore's
pipelining tutorial) and the summary: bubble fraction, per-IPU utilization, steps/s."""

from html import escape

from ipu_backend.profiling.execution import MODEL_NOTE, program_timeline, stages_by_ipu
from ipu_backend.profiling.html_page import legend, page, percent, table
from ipu_backend.profiling.timeline import BACKWARD, FORWARD, UPDATE

COLORS = {FORWARD: "#3b6fb6", BACKWARD: "#e08a2e", UPDATE: "#7d8594"}
_LETTER = {FORWARD: "F", BACKWARD: "B", UPDATE: "U"}
_ROW, _LEFT, _MAX_WIDTH = 30, 90, 1000


def diagram(report: dict) -> str:
    """One row per IPU (``<g class="ipu-row">``), one rectangle per slot of replica 0."""
    line, _ = program_timeline(report)
    ipus = stages_by_ipu(report)
    ipu_of = {s["stage"]: s["ipu"] for s in report["stages"]}
    lanes = {stage: lane for stages in ipus.values() for lane, stage in enumerate(stages)}
    rows = {ipu: sum(len(ipus[i]) for i in ipus if i < ipu) for ipu in ipus}
    slot = max(4.0, min(36.0, _MAX_WIDTH / line.length))
    height = sum(len(s) for s in ipus.values()) * _ROW + 30
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_LEFT + slot * line.length + 10:.0f}" '
             f'height="{height}" role="img" aria-label="pipeline diagram">']
    for ipu, stages in ipus.items():
        parts.append(f'<g class="ipu-row" data-ipu="{ipu}"><text x="0" y="{rows[ipu] * _ROW + 19}" '
                     f'font-size="13">IPU {ipu}</text>')
        for s in line.slots:
            if ipu_of[s.stage] != ipu:
                continue
            x, y = _LEFT + s.start * slot, (rows[ipu] + lanes[s.stage]) * _ROW
            label = _LETTER[s.role] + ("" if s.micro_batch is None else str(s.micro_batch))
            parts.append(f'<rect class="slot {s.role}" x="{x:.2f}" y="{y + 2}" width="{slot * s.length - 1:.2f}" '
                         f'height="{_ROW - 4}" fill="{COLORS[s.role]}"><title>stage {s.stage}: {label}</title></rect>')
            if slot >= 18:
                parts.append(f'<text x="{x + slot * s.length / 2:.2f}" y="{y + 19}" font-size="11" fill="#fff" '
                             f'text-anchor="middle">{label}</text>')
        parts.append("</g>")
    axis_y = height - 8
    parts.append(f'<text x="{_LEFT}" y="{axis_y}" font-size="11">time → ({line.length} slots)</text></svg>')
    return "".join(parts)


def _rates(summary: dict, training: bool) -> list[list]:
    if not summary["calls"]:
        return [["calls", "none yet"]]
    rows = [["calls measured", summary["calls"]],
            ["time per call", f"{summary['seconds_per_call'] * 1e3:.2f} ms (host → IPU "
                              f"{summary['host_to_ipu_seconds'] * 1e3:.2f} ms, compute {summary['compute_seconds'] * 1e3:.2f}"
                              f" ms, IPU → host {summary['ipu_to_host_seconds'] * 1e3:.2f} ms)"],
            ["optimizer steps/s" if training else "device iterations/s", f"{summary['steps_per_second']:,.1f}"]]
    if summary["samples_per_second"] is not None:
        rows.append(["samples/s", f"{summary['samples_per_second']:,.1f}"])
    return rows


def render(report: dict, summary: dict, index: int) -> str:
    schedule = report["schedule"]
    what = ("one device iteration: forward (F) and backward (B) of each micro-batch, then the optimizer update (U)"
            if schedule["training"] else "one call: the forward (F) of each device iteration")
    rows = [["execution", f"{schedule['execution']}, {schedule['stages']} stage(s), {schedule['replicas']} replica(s)"],
            ["bubble fraction", percent(summary["bubble_fraction"])],
            *[[f"IPU {ipu} utilization", percent(u)] for ipu, u in summary["utilization"].items()],
            *_rates(summary, schedule["training"])]
    names = {FORWARD: "forward", BACKWARD: "backward", UPDATE: "optimizer update"}
    roles = [role for role in names if schedule["training"] or role == FORWARD]
    return (f"<h2>Program {index} ({escape(report['kind'])})</h2>" + table(None, rows)
            + f"<p>The schedule of {escape(what)}, replica 0 (every replica runs the same schedule):</p>"
            + legend({names[role]: COLORS[role] for role in roles})
            + diagram(report))


def execution_page(name: str, reports: list[dict], summaries: list[dict]) -> str:
    body = "".join(render(r, s, i) for i, (r, s) in enumerate(zip(reports, summaries)))
    return page(f"Execution report: {name}", f'<p class="note">{escape(MODEL_NOTE)}</p>{body}'
                '<p class="note">The Chrome/Perfetto trace of the latest calls is <code>execution_trace.json</code> '
                "(open it at ui.perfetto.dev or chrome://tracing).</p>")
