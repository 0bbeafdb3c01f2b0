"""kvtierctl advise: block size, tier sizes and the reserved share, from the workload kvtierd recorded.

It reads /admin/workload and runs `cli/advice.py` on it; `--json` prints the
daemon's report with the recommendations added under "advice".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

import typer
from rich import box
from rich.console import Console, Group
from rich.table import Table

from kvtierd.cli.admin_client import EXIT_CONNECTION
from kvtierd.cli.advice import Recommendation, recommend
from kvtierd.cli.ctl import _bytes, _call, _count, _duration, _fail, _kv_table, _pct, _print_json, _row, _rows, app
from kvtierd.server.workload_report import Distribution, WorkloadReport, WorkloadStats


@app.command()
def advise(ctx: typer.Context) -> None:
    """Recommend block size, KV tier sizes and the reserved share from the recorded workload, with the numbers why."""
    data = _call(ctx, "GET", "/admin/workload")
    try:
        report = WorkloadReport.from_json(data)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        _fail(f"unexpected answer from kvtierd to GET /admin/workload (missing or malformed field: {e!s});"
              " are kvtierctl and kvtierd the same version?", EXIT_CONNECTION)
    advice = recommend(report)
    if ctx.obj.json:
        _print_json({**data, "advice": [asdict(r) for r in advice]})
    else:
        Console().print(Group(render_workload(report.workload), render_advice(advice)))


def render_workload(w: WorkloadStats) -> Table:
    table = _kv_table("Recorded workload")
    _rows(table, [
        ("Requests", (f"{_count(w.num_requests)} over {_duration(w.span_s)}; {_count(w.num_sessions)} sessions, "
                      f"{_count(w.num_returns)} returns")),
        ("Prompt tokens", _percentiles(w.prompt_tokens, _count)),
        ("Completion tokens", _percentiles(w.completion_tokens, _count)),
        ("Session tokens", _percentiles(w.session_tokens, _count)),
        ("Idle gap", _percentiles(w.idle_gap_s, _duration)),
        ("Cached tokens", _by_key(w.cached_tokens_by_source) + f" (KV written: {_count(w.computed_tokens)})"),
        ("  by tier", _by_key(w.cached_tokens_by_tier)),
        ("Hits (requests)", _by_key(w.requests_by_source)),
        *((f"Pages, {c} request", _percentiles(d, _count)) for c, d in w.request_pages.items()),
        ("Pages in use", _percentiles(w.used_pages, _count)),
        ("High class pages", _percentiles(w.high_pages, _count)),
    ])
    return table


def render_advice(advice: list[Recommendation]) -> Table:
    table = Table(title="Advice", box=box.SIMPLE_HEAD)
    table.add_column("Setting", no_wrap=True)
    table.add_column("Current", justify="right", no_wrap=True)
    table.add_column("Recommended", justify="right", no_wrap=True)
    table.add_column("Why")
    for r in advice:
        _row(table, r.setting, _value(r.unit, r.current), "—" if r.recommended is None else _value(r.unit, r.recommended),
             r.why)
    return table


def _value(unit: str, value: float) -> str:
    if unit == "bytes":
        return _bytes(int(value))
    if unit == "share":
        return _pct(value)
    return f"{_count(int(value))} {unit}"


def _percentiles(d: Distribution, fmt: Callable[[float], str]) -> str:
    if not d.count:
        return "—"
    return f"p50 {fmt(d.p50)} · p90 {fmt(d.p90)} · p99 {fmt(d.p99)} · max {fmt(d.max)} ({_count(d.count)})"


def _by_key(counts: dict[str, int]) -> str:
    return " · ".join(f"{k} {_count(v)}" for k, v in counts.items()) or "—"
