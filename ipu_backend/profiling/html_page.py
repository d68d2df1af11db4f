"""A self-contained HTML page (inline CSS and SVG, nothing fetched) and the formatting the
report pages share."""

from html import escape

_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #1d2330; background: #fff; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 8px; }
table { border-collapse: collapse; margin: 8px 0; }
th, td { border: 1px solid #c8cdd6; padding: 3px 8px; text-align: right; white-space: nowrap; }
th { background: #eef1f6; } td:first-child, th:first-child { text-align: left; }
.note { color: #4a5263; max-width: 60em; } svg { display: block; margin: 8px 0; }
.legend span { display: inline-block; margin-right: 14px; }
.legend i { display: inline-block; width: 12px; height: 12px; margin-right: 4px; vertical-align: -1px; }
"""


def page(title: str, body: str) -> str:
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body>\n<h1>{escape(title)}</h1>\n{body}\n</body></html>\n")


def table(header: list[str] | None, rows: list[list]) -> str:
    """A table; without ``header``, one of label and value rows."""
    head = "" if header is None else "<tr>" + "".join(f"<th>{escape(str(h))}</th>" for h in header) + "</tr>"
    body = "".join("<tr>" + "".join(f"<td>{escape(str(cell))}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table>{head}{body}</table>"


def legend(colors: dict[str, str]) -> str:
    items = "".join(f'<span><i style="background:{color}"></i>{escape(name)}</span>' for name, color in colors.items())
    return f'<p class="legend">{items}</p>'


def size(n: float) -> str:
    """Bytes as a person reads them."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{int(n)} B"


def count(n: float) -> str:
    """A large count (FLOPs) with an SI prefix."""
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f}"


def percent(fraction: float) -> str:
    """A share in percent, with the digits a tiny share needs (``0.000032 %``)."""
    return f"{100 * fraction:.1f} %" if fraction == 0 or fraction >= 0.001 else f"{100 * fraction:.2g} %"
