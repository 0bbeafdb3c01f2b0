"""`kvtierctl top`: a refreshing terminal view of the daemon's /metrics (the math is in metrics_view)."""

from __future__ import annotations

import itertools
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kvtierd.cli.admin_client import AdminClient, ConnectionProblem
from kvtierd.cli.metrics_view import Scrape, TopView, top_view

BAR_WIDTH = 40


def run_top(client: AdminClient, interval: float, once: bool, as_json: bool) -> None:
    """Shows a frame every `interval` seconds until interrupted; one frame with `once`.
    `as_json` prints each frame's numbers as one JSON line instead."""
    views = itertools.islice(_views(client, interval), 1 if once else None)
    if as_json:
        for view in views:
            sys.stdout.write(json.dumps(asdict(view)) + "\n")
            sys.stdout.flush()
    elif once:
        Console().print(render_top(next(views)))
    else:
        with Live(auto_refresh=False) as live:
            for view in views:
                live.update(render_top(view), refresh=True)


def _views(client: AdminClient, interval: float) -> Iterator[TopView]:
    prev = None
    while True:
        text = client.text("/metrics")
        try:
            cur = Scrape.parse(text)
        except ValueError as e:
            raise ConnectionProblem(f"/metrics from {client.socket_path} is not Prometheus text: {e}") from e
        yield top_view(cur, prev)
        prev = cur
        time.sleep(interval)


def render_top(v: TopView) -> RenderableType:
    window = "since start" if v.since_start else f"last {v.window_s:.1f}s"
    title = Text.assemble(("kvtierd top", "bold"), f"  up {_uptime(v.uptime_s)}  ·  rates {window}")

    traffic = Table(show_header=False, box=None, padding=(0, 2))
    traffic.add_column("Field", style="bold", no_wrap=True)
    traffic.add_column("Value")
    traffic.add_row("Requests", f"{v.requests_total:,} total · {v.requests_per_s:.2f}/s · {v.running} running · "
                                f"{v.waiting} waiting · {v.loading} loading · {v.active_streams} streaming")
    traffic.add_row("Tokens/s", f"prompt {v.prompt_tokens_per_s:,.1f} · generated {v.generated_tokens_per_s:,.1f}")
    traffic.add_row("Hit rate", _pairs({k: _pct(r) for k, r in v.hit_rate_by_tier.items()}) + "   by source: "
                    + _pairs({k: _pct(r) for k, r in v.hit_rate_by_source.items()}))
    for tier, p in v.pages.items():
        traffic.add_row(f"Pages {tier}", Text.assemble(
            _bar(p), f" {p['used']:,} used · {p['cached']:,} cached · {p['free']:,} free of {p['capacity']:,}"))
    traffic.add_row("Fragmentation", f"{_pct(v.fragmentation)} of running requests' slots · "
                                     f"{v.session_pools:,} session pools kept")
    traffic.add_row("Evictions", _pairs(v.evictions))
    traffic.add_row("Errors", _pairs(v.errors))

    ttft = Table(title="Time to first token", title_justify="left", box=None, padding=(0, 2))
    for name in ("priority", "requests", "p50", "p95"):
        ttft.add_column(name, justify="left" if name == "priority" else "right")
    for row in v.ttft:
        ttft.add_row(row.priority, f"{row.count:,}", _latency(row.p50_s), _latency(row.p95_s))
    transfers = Table(title=f"Transfers  ({v.transfers_in_flight} in flight · {v.loads_past_deadline} loads "
                            "past their deadline, recomputed)", title_justify="left", box=None, padding=(0, 2))
    for name in ("tier", "direction", "chunks", "p50", "p95", "MB/s"):
        transfers.add_column(name, justify="left" if name in ("tier", "direction") else "right")
    for t in v.transfers or []:
        transfers.add_row(t.tier, t.direction, f"{t.count:,}", _latency(t.p50_s), _latency(t.p95_s),
                          f"{t.bytes_per_s / 1e6:,.1f}")
    return Group(title, traffic, Text(), ttft, Text(), transfers)


def _bar(pages: dict[str, int]) -> Text:
    """Used, cached and free pages as one bar of BAR_WIDTH cells."""
    total = pages["capacity"] or 1
    used = round(BAR_WIDTH * pages["used"] / total)
    cached = min(round(BAR_WIDTH * pages["cached"] / total), BAR_WIDTH - used)
    return Text.assemble(("█" * used, "red"), ("▓" * cached, "cyan"), ("░" * (BAR_WIDTH - used - cached), "dim"))


def _pairs(values: dict[str, object]) -> str:
    return " · ".join(f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}" for k, v in values.items()) or "—"


def _pct(ratio: float) -> str:
    return f"{ratio * 100:.1f}%"


def _latency(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _uptime(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h {s % 3600 // 60:02d}m {s % 60:02d}s"
