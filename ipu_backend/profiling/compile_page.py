"""The compile report page: per-IPU memory as stacked bars against the IPU's capacity, and per
stage its FLOPs and operation counts."""

from html import escape

from ipu_backend.profiling.html_page import count, legend, page, percent, size, table

MEMORY_KINDS = {"weights": "#3b6fb6", "optimizer": "#e08a2e", "accumulators": "#8a5cc2",
                "stash": "#3f9c5a", "temporaries": "#9aa3b2"}
_LABELS = {"weights": "weights and buffers", "optimizer": "optimizer state", "accumulators": "gradient accumulators",
           "stash": "stashed activations", "temporaries": "temporaries"}
_BAR, _GAP, _LEFT, _WIDTH = 28, 14, 150, 700


def memory_chart(memory: list[dict], capacity: int) -> str:
    """One horizontal stacked bar per IPU (``<g class="ipu-bar">``). The scale reaches the
    capacity when the fullest IPU uses a visible share of it, else the fullest IPU."""
    fullest = max(u["total"] for u in memory)
    shows_capacity = fullest >= 0.05 * capacity
    scale = max(fullest, capacity if shows_capacity else 0, 1) * 1.05
    height = len(memory) * (_BAR + _GAP) + 30
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_LEFT + _WIDTH + 280}" height="{height}" '
             f'role="img" aria-label="memory per IPU">']
    for row, usage in enumerate(memory):
        y = 10 + row * (_BAR + _GAP)
        parts.append(f'<g class="ipu-bar" data-ipu="{usage["ipu"]}" data-total="{usage["total"]}">'
                     f'<text x="0" y="{y + 19}" font-size="13">IPU {usage["ipu"]}</text>')
        x = _LEFT
        for kind, color in MEMORY_KINDS.items():
            width = _WIDTH * usage[kind] / scale
            if usage[kind]:
                parts.append(f'<rect class="{kind}" x="{x:.2f}" y="{y}" width="{max(width, 1):.2f}" height="{_BAR}" '
                             f'fill="{color}"><title>{_LABELS[kind]}: {size(usage[kind])}</title></rect>')
            x += width
        parts.append(f'<text x="{x + 8:.2f}" y="{y + 19}" font-size="12">{size(usage["total"])} '
                     f'({percent(usage["total"] / capacity)} of {size(capacity)})</text></g>')
    if shows_capacity:
        x = _LEFT + _WIDTH * capacity / scale
        parts.append(f'<line class="capacity" x1="{x:.2f}" x2="{x:.2f}" y1="2" y2="{height - 18}" stroke="#c0392b" '
                     f'stroke-dasharray="4 3"/><text x="{x - 40:.2f}" y="{height - 4}" font-size="12" '
                     f'fill="#c0392b">capacity</text>')
    parts.append("</svg>")
    note = "" if shows_capacity else (f'<p class="note">The scale is the fullest IPU: the capacity '
                                      f'({size(capacity)}) is off the chart.</p>')
    return legend({_LABELS[k]: c for k, c in MEMORY_KINDS.items()}) + "".join(parts) + note


def _stage_rows(stages: list[dict]) -> list[list]:
    """One row per compiled program; the stage's ATen operation count on its first row."""
    return [[s["stage"], s["ipu"], s["aten_ops"] if first else "", name, count(costs["flops"]),
             size(costs["bytes_accessed"]), costs["hlo_ops"]]
            for s in stages for first, (name, costs) in zip([True] + [False] * len(s["programs"]),
                                                             s["programs"].items())]


def _top_ops(stage: dict, limit: int = 12) -> str:
    aten = ", ".join(f"{escape(name)} × {n}" for name, n in list(stage["aten_op_counts"].items())[:limit])
    return f"<p><b>Stage {stage['stage']}</b> ATen operations: {aten or 'none'}</p>"


def _phases(memory: list[dict]) -> str:
    """What each phase of a phased strategy holds on each IPU (an IPU needs its largest phase)."""
    rows = [[f"IPU {u['ipu']}", phase, ", ".join(map(str, held["stages"])),
             *(size(held[k]) for k in ("weights", "optimizer", "accumulators", "stash")), size(held["total"])]
            for u in memory for phase, held in sorted(u.get("phases", {}).items())]
    if not rows:
        return ""
    return ("<h2>Residency per phase (one replica)</h2>"
            + table(["IPU", "phase", "stages", "weights", "optimizer", "accumulators", "stash", "total"], rows)
            + '<p class="note">A phase\'s tensors are on its IPUs while it runs; the bars above show '
              "the largest phase of each IPU.</p>")


def _hints(stages: list[dict]) -> str:
    """PopTorch's planning hints and name scopes: what was asked, where (none changes a number)."""
    rows = [[s["stage"], h["kind"], h["value"], h["op"], h["name_scope"], h["location"] or ""]
            for s in stages for h in s.get("hints", ())]
    rows += [[s["stage"], "MultiConv", ", ".join(f"{k}={v}" for k, v in group["settings"].items()),
              f"{group['convolutions']} convolution(s)", "", ""]
             for s in stages for group in s.get("multi_convs", ())]
    scopes = ", ".join(f"{escape(scope)} × {n}" for s in stages for scope, n in s.get("name_scopes", {}).items())
    return ((("<h2>Hints</h2>" + table(["stage", "hint", "value", "on", "name scope", "source"], rows)
              + '<p class="note">Poplar planning hints are recorded; emulated IPUs compute the same '
                "numbers without them.</p>") if rows else "")
            + (f"<p><b>Name scopes</b> (operations): {scopes}</p>" if scopes else ""))


def render(name: str, report: dict, index: int) -> str:
    schedule, spec = report["schedule"], report["ipu_spec"]
    seconds = report["compile_seconds"]
    facts = table(None, [
        ["model", name if name == report["kind"] else f"{name} ({report['kind']})"],
        ["execution", f"{schedule['execution']}: {schedule['stages']} stage(s) on {schedule['ipus_per_replica']} "
                      f"IPU(s) × {schedule['replicas']} replica(s)"],
        ["schedule", f"{schedule['device_iterations']} device iteration(s) × {schedule['gradient_accumulation']} "
                     f"micro-batch(es) per call"],
        ["compile time", "reused (compiled earlier in this process)" if seconds is None else f"{seconds:.2f} s"],
        ["emulated IPU", f"{spec['name']}: {size(spec['memory_bytes'])}, {spec['tiles']} tiles"],
    ])
    memory_rows = [[f"IPU {u['ipu']}", ", ".join(map(str, u["stages"])), *(size(u[k]) for k in MEMORY_KINDS),
                    size(u["offloaded_to_host"]), size(u["total"]), percent(u["fraction"])] for u in report["memory"]]
    return (f"<h2>Program {index}</h2>{facts}"
            f"<h2>Memory per IPU (one replica)</h2>{memory_chart(report['memory'], spec['memory_bytes'])}"
            + table(["IPU", "stages", *MEMORY_KINDS, "on the host", "total", "of capacity"], memory_rows)
            + _phases(report["memory"])
            + "<h2>Stages</h2>"
            + table(["stage", "IPU", "ATen ops", "program", "FLOPs", "bytes accessed", "HLO ops"],
                    _stage_rows(report["stages"]))
            + f'<p class="note">{escape(report["flops_note"])}</p>'
            + "".join(_top_ops(s) for s in report["stages"])
            + _hints(report["stages"]))


def compile_page(name: str, reports: list[dict]) -> str:
    """The page of every program an executor compiled."""
    return page(f"Compile report: {name}", "".join(render(name, r, i) for i, r in enumerate(reports)))
