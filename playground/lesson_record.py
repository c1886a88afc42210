"""The session's record: every finished lesson's before/after table and chart, written as one self-contained HTML
page (no script, no link out, charts as inline SVG, every text escaped) and as JSON, for the presenter to keep."""
from __future__ import annotations

import html
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

from .course import METRICS, format_value, switch_text, verdict

if TYPE_CHECKING:
    from .lessons import LessonRunner


def record_json(records: list[dict], machine: str) -> str:
    return json.dumps({"machine": machine, "lessons": records}, indent=2, default=str) + "\n"


def record_html(records: list[dict], machine: str) -> str:
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>Lessons: what the room measured</title>"
             f"<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}}table{{border-collapse:collapse}}"
             f"td,th{{border:1px solid #ccc;padding:.3em .6em;text-align:right}}td:first-child{{text-align:left}}"
             f"</style></head><body><h1>What the room measured</h1><p>{html.escape(machine)}</p>"]
    if not records:
        parts.append("<p>No lesson has finished yet.</p>")
    for r in records:
        metric = METRICS[r["metric"]]
        parts.append(f"<h2>{html.escape(r['title'])}</h2><p>Workload {html.escape(r['workload'])}, "
                     f"{r['users']} simulated users; switch: {html.escape(switch_text(r['switch']))}; "
                     f"{html.escape(r['precision'])} on {html.escape(r['device'])}.</p><table>"
                     "<tr><th></th><th>before</th><th>after</th></tr>")
        for name, m in METRICS.items():
            cells = (m.label, format_value(m, r["before"][name]), format_value(m, r["after"][name]))
            parts.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
        parts.append(f"</table><p>{html.escape(verdict(r).replace('**', ''))}</p>")
        parts.append(svg_chart(r["chart"], r["flip_at_s"], f"{metric.label}" + (f" ({metric.unit})" if metric.unit
                                                                               else "")))
    parts.append("</body></html>")
    return "\n".join(parts)


def svg_chart(points: list, flip_at_s: float, label: str, width: int = 640, height: int = 200) -> str:
    if not points:
        return "<p>(no samples)</p>"
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x_max, y_max = max(max(xs), flip_at_s, 1e-9), max(max(ys), 1e-9)
    pad = 30

    def sx(x):
        return pad + (width - 2 * pad) * x / x_max

    def sy(y):
        return height - pad - (height - 2 * pad) * y / y_max
    path = " ".join(f"{'M' if i == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}" for i, (x, y) in enumerate(points))
    return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' role='img'>"
            f"<text x='{pad}' y='16' font-size='12'>{html.escape(label)}; max {y_max:.3g}</text>"
            f"<line x1='{sx(flip_at_s):.1f}' x2='{sx(flip_at_s):.1f}' y1='{pad}' y2='{height - pad}' "
            f"stroke='#d33' stroke-dasharray='4'/><text x='{sx(flip_at_s) + 4:.1f}' y='{pad + 10}' font-size='11' "
            f"fill='#d33'>switch</text><path d='{path}' fill='none' stroke='#36c' stroke-width='2'/>"
            f"<text x='{pad}' y='{height - 8}' font-size='11'>0 s</text><text x='{width - pad - 30}' "
            f"y='{height - 8}' font-size='11'>{x_max:.0f} s</text></svg>")


def machine_name(runner: LessonRunner) -> str:
    """What the record says the numbers were measured on."""
    from .results import machine_description
    weights = runner.pg.service.snapshot().precision
    return f"{machine_description(runner.pg.llm)}, weights {weights}: measured with watch-llm"


def record_folder() -> Path:
    """Where this process writes the session's record: one folder, rewritten at each preparation (anyone may
    press Prepare, so it must not add files with each press), served to every page (app.launch allows it)."""
    return Path(tempfile.gettempdir()) / f"watch-llm-lessons-record-{os.getpid()}"


def record_links(files: list[str]) -> str:
    """Markdown links to the record's files as gradio serves them (relative: right behind a proxy's prefix too)."""
    return " · ".join(f"[{Path(f).name}](gradio_api/file={quote(str(Path(f).resolve()))})" for f in files)


def write_record(records: list[dict], machine: str, folder: Path) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    page, data = folder / "lessons-record.html", folder / "lessons-record.json"
    page.write_text(record_html(records, machine), encoding="utf-8")
    data.write_text(record_json(records, machine), encoding="utf-8")
    return [str(page), str(data)]
