"""``compactd eval --report DIR``: ``report.json`` and ``index.html``, a static page whose charts
(matplotlib, the Agg backend, inline SVG) put the configurations side by side. The page loads
nothing from anywhere: it opens from the folder, offline."""

from __future__ import annotations

import html
import importlib.util
import io
import json
import os
from pathlib import Path
from typing import Any

from compactd.storage.errors import BadInput
from compactd.worker.probes import KINDS

KIND_LABELS = {"ids": "identifiers", "paths": "file paths", "errors": "error names",
               "numbers": "numbers with units", "instructions": "user instructions"}
CHART_SIZE = (7.5, 3.4)
PROBES_NOTE = (
    "A probe is a detail of a range a compaction replaced; it is <b>kept</b> when the final "
    "request still holds it, <b>found</b> when <code>history_search</code> returns a message "
    "holding it among its first five hits for words a model would use, and <b>lost</b> "
    "otherwise.")
STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 62rem; color: #222; }
h1 { font-size: 1.5rem; } h2 { font-size: 1.15rem; margin-top: 2rem; }
table { border-collapse: collapse; margin: 1rem 0; }
th, td { border-bottom: 1px solid #ddd; padding: .3rem .8rem; text-align: right; }
th:first-child, td:first-child { text-align: left; }
figure { margin: 1rem 0; } figcaption { color: #555; font-size: .9rem; }
.note { color: #555; font-size: .9rem; }
"""


class ReportError(BadInput):
    """The report cannot be drawn or written."""


def check_report_dir(directory: Path) -> None:
    """Refuse ``--report directory`` before the replays, which may take long, rather than after
    them: the chart library must be installed, and the folder must be one, or be creatable
    under the nearest folder that exists. Nothing is created here (bad input leaves no
    folder behind)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ReportError(MATPLOTLIB_MISSING)
    if directory.exists():
        if not directory.is_dir():
            raise ReportError(f"--report {directory}: not a folder")
        target = directory
    else:
        target = directory.parent
        while not target.exists() and target != target.parent:
            target = target.parent
        if not target.is_dir():
            raise ReportError(f"--report {directory}: {target} is not a folder")
    if not os.access(target, os.W_OK | os.X_OK):
        raise ReportError(f"--report {directory}: {target} is not writable")


MATPLOTLIB_MISSING = "--report draws charts with matplotlib: pip install 'compactd[eval]'"


def write_report(directory: Path, report: dict[str, Any]) -> list[Path]:
    """Write ``report.json`` and ``index.html`` into ``directory`` (created when missing)."""
    try:
        import matplotlib
    except ImportError:
        raise ReportError(MATPLOTLIB_MISSING) from None
    matplotlib.use("Agg")
    page_text = render_html(report)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        data = directory / "report.json"
        data.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
        page = directory / "index.html"
        page.write_text(page_text, encoding="utf-8")
    except OSError as exc:
        raise ReportError(f"--report {directory}: {exc.strerror or exc}") from None
    return [data, page]


def render_html(report: dict[str, Any]) -> str:
    configs = report["configs"]
    names = ", ".join(html.escape(c["name"]) for c in configs)
    parts = [
        "<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>compactd eval: {names}</title><style>{STYLE}</style></head><body>",
        f"<h1>What each configuration keeps: {names}</h1>",
        f'<p class="note">{len(report["transcripts"])} transcripts replayed through each '
        f"configuration on its own temporary store{_window(report)}. {PROBES_NOTE}</p>",
        _table(configs),
        _figure(_probe_chart(configs), "Probes by kind: kept in context, found by search, lost "
                                       "(one bar per configuration)"),
        _figure(_tokens_chart(configs), "Tokens: the transcripts as sent without compaction, "
                                        "the final requests, and what the summarizer read"),
        _settings(configs),
        "</body></html>",
    ]
    return "\n".join(parts)


def _window(report: dict[str, Any]) -> str:
    window = report.get("context_window")
    return f", as sessions with a context window of {window:,} tokens" if window else ""


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def _table(configs: list[dict[str, Any]]) -> str:
    rows = [
        ("sessions compacted", lambda c: f"{c['compacted_sessions']} of {c['sessions']}"),
        ("compactions", lambda c: c["compactions"]),
        ("failed runs", lambda c: c["failed"]),
        ("summarizer calls", lambda c: c["calls"]),
        ("summarizer input tokens", lambda c: f"{c['input_tokens']:,}"),
        ("coverage", lambda c: _pct(c["coverage"])),
        ("compression", lambda c: f"{c['compression']}x" if c["compression"] else "–"),
        ("billed tokens (in / out)",
         lambda c: f"{c['usage']['input_tokens']:,} / {c['usage']['output_tokens']:,}"),
        ("cost", lambda c: ("unpriced" if c["cost"]["usd"] is None
                            else f"${c['cost']['usd']:.4f}")),
        ("probes", lambda c: c["probes"]["probes"]),
        ("probes kept or found", lambda c: _pct(c["probes"]["retention"])),
        ("session facts in the final request", lambda c: _pct(c["retention"])),
    ]
    head = "".join(f"<th>{html.escape(c['name'])}</th>" for c in configs)
    body = "".join(
        f"<tr><td>{label}</td>"
        + "".join(f"<td>{html.escape(str(value(c)))}</td>" for c in configs) + "</tr>"
        for label, value in rows)
    return f'<table id="figures"><tr><th></th>{head}</tr>{body}</table>'


def _settings(configs: list[dict[str, Any]]) -> str:
    items = "".join(
        f"<li><b>{html.escape(c['name'])}</b> ({html.escape(c['path'])}): "
        f"<code>{html.escape(json.dumps(c['settings']))}</code></li>" for c in configs)
    return f"<h2>Settings</h2><ul>{items}</ul>"


def _figure(svg: str, caption: str) -> str:
    return f"<figure>{svg}<figcaption>{html.escape(caption)}</figcaption></figure>"


def _svg(fig: Any) -> str:
    import matplotlib.pyplot as plt

    out = io.StringIO()
    fig.savefig(out, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = out.getvalue()
    return text[text.index("<svg"):]


def _probe_chart(configs: list[dict[str, Any]]) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=CHART_SIZE)
    n = len(configs)
    width = 0.8 / n
    for i, c in enumerate(configs):
        xs = [k + i * width for k in range(len(KINDS))]
        by_kind = c["probes"]["by_kind"]
        shares = {state: [_share(by_kind[kind], state) for kind in KINDS]
                  for state in ("kept", "found", "lost")}
        bottom = [0.0] * len(KINDS)
        for state, colour in (("kept", "#2b8a3e"), ("found", "#74c0fc"), ("lost", "#e03131")):
            ax.bar(xs, shares[state], width * 0.95, bottom=bottom, color=colour,
                   label=state if i == 0 else None, edgecolor="white")
            bottom = [b + s for b, s in zip(bottom, shares[state], strict=True)]
        for x, kind in zip(xs, KINDS, strict=True):
            ax.text(x, 1.02, f"{c['name'][:12]} ({by_kind[kind]['probes']})", ha="center",
                    fontsize=7, rotation=90, va="bottom")
    ax.set_xticks([k + width * (n - 1) / 2 for k in range(len(KINDS))])
    ax.set_xticklabels([KIND_LABELS[k] for k in KINDS], fontsize=8)
    ax.set_ylim(0, 1.6)
    ax.set_ylabel("share of probes")
    ax.legend(loc="upper right", fontsize=8, ncol=3)
    return _svg(fig)


def _share(counts: dict[str, int], state: str) -> float:
    return counts[state] / counts["probes"] if counts["probes"] else 0.0


def _tokens_chart(configs: list[dict[str, Any]]) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=CHART_SIZE)
    series = (("without compaction", "source_tokens", "#adb5bd"),
              ("final requests", "final_tokens", "#1971c2"),
              ("summarizer input", "input_tokens", "#f08c00"))
    width = 0.8 / len(series)
    for j, (label, key, colour) in enumerate(series):
        xs = [i + j * width for i in range(len(configs))]
        ax.bar(xs, [c[key] for c in configs], width * 0.95, color=colour, label=label)
    ax.set_xticks([i + width for i in range(len(configs))])
    ax.set_xticklabels([c["name"] for c in configs], fontsize=9)
    ax.set_ylabel("tokens")
    ax.legend(fontsize=8)
    return _svg(fig)
