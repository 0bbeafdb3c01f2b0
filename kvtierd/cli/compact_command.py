"""kvtierctl compact: move the live KV pages together (/admin/compact) and print fragmentation before -> after."""

from __future__ import annotations

from typing import Any

import typer

from kvtierd.cli.ctl import _bytes, _call, _count, _pct, _print_json, app


@app.command()
def compact(ctx: typer.Context) -> None:
    """Move live KV pages together: free pages in one run, each sequence's pages in order (bigger copies)."""
    data = _call(ctx, "POST", "/admin/compact")
    if ctx.obj.json:
        _print_json(data)
    else:
        typer.echo(render_compaction(data))


def render_compaction(data: dict[str, Any]) -> str:
    before, after = data["before"], data["after"]
    return "\n".join([
        f"moved {_count(data['pages_moved'])} pages ({_bytes(data['bytes_moved'])}) in {data['ms']:.1f} ms",
        f"free space  {_pct(before['free_space_ratio'])} -> {_pct(after['free_space_ratio'])} fragmented   "
        f"free runs {_count(before['free_runs'])} -> {_count(after['free_runs'])}, "
        f"{_count(after['free_pages'])} free pages",
        f"sequences   {_pct(before['sequence_ratio'])} -> {_pct(after['sequence_ratio'])} fragmented   "
        f"{_count(before['scattered_pages'])} -> {_count(after['scattered_pages'])} of "
        f"{_count(after['chained_pages'])} chained pages not followed by their next page",
    ])
