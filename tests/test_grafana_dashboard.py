"""deploy/grafana/kvtierd.json: it parses, its panels are laid out, and every metric its queries use is one
a real daemon exports (its /metrics scraped, histograms' _bucket/_sum/_count series included)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from daemon_fixtures import Daemon

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "kvtierd.json"
# What the dashboard is for (the README's Grafana section): each must be queried.
REQUIRED = ("kvtierd_cache_hit_tokens_total", "kvtierd_ttft_seconds_bucket", "kvtierd_inter_token_latency_seconds_bucket",
            "kvtierd_pages", "kvtierd_tier_bytes", "kvtierd_tier_healthy", "kvtierd_cache_evictions_total",
            "kvtierd_tier_evictions_total", "kvtierd_restore_decisions_total")
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (Grafana's $variables taken out first)."""
    expr = re.sub(r"\$\{?\w+\}?", "", expr)
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings: label values, templates
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)  # label matchers, ranges
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)  # label lists
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        if expr[m.end():].lstrip().startswith("(") or m.group() in PROMQL_WORDS:
            continue  # a function or an aggregation, or a keyword
        if m.start() and (expr[m.start() - 1].isdigit() or expr[m.start() - 1] == "."):
            continue  # the exponent or unit of a number
        names.add(m.group())
    return names


def queries(dashboard: dict) -> list[str]:
    found = []
    for panel in dashboard["panels"] + [p for row in dashboard["panels"] for p in row.get("panels", [])]:
        found += [t["expr"] for t in panel.get("targets", [])]
    return found


def exported(text: str) -> set[str]:
    """The series names an exposition holds: each TYPE line's name, a histogram's by its three series."""
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
        names |= {f"{name}{s}" for s in ("_bucket", "_sum", "_count")} if kind in ("histogram", "summary") else {name}
    return names


def test_metric_names_are_read_from_promql():
    assert metric_names('histogram_quantile(0.95, sum by (le, priority) (rate(kvtierd_ttft_seconds_bucket'
                        '{instance=~"$instance"}[$__rate_interval])))') == {"kvtierd_ttft_seconds_bucket"}
    assert metric_names("sum by (tier) (rate(a_total[5m])) / ignoring(tier) group_left sum(rate(b_total[5m])) "
                        "> 1e3") == {"a_total", "b_total"}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_the_dashboard_queries_only_what_kvtierd_exports(dashboard: dict, daemon: Daemon):
    with daemon.client() as http:
        names = exported(http.get("/metrics").text)
    used = set().union(*(metric_names(q) for q in queries(dashboard)))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            used |= set(re.findall(r"label_values\((\w+),", variable["definition"]))
    assert used, "no queries found"
    assert used - names == set(), f"queried, not exported: {sorted(used - names)}"
    assert set(REQUIRED) <= used, f"not shown: {sorted(set(REQUIRED) - used)}"


def test_the_panels_are_laid_out_with_unique_ids_and_one_data_source(dashboard: dict):
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24
        mine = {(g["x"] + dx, g["y"] + dy) for dx in range(g["w"]) for dy in range(g["h"])}
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert p["targets"] and all(t["expr"] for t in p["targets"]), p["title"]
