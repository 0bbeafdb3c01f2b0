"""kvtierctl pin | unpin | pins: prefixes and sessions kept on the device, the host or the disk tier (/admin/pins)."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer
from rich import box
from rich.table import Table

from kvtierd.cli.ctl import (FileOpt, MessagesOpt, TextOpt, TokenIdsOpt, _call, _count, _duration, _fail,
                             _prefix_body, _print_json, _row, _run, app)


@app.command()
def pin(
    ctx: typer.Context,
    session: Annotated[Optional[str], typer.Option("--session", help="Pin a session's context (it follows the session).")] = None,
    text: TextOpt = None,
    file: FileOpt = None,
    messages_file: MessagesOpt = None,
    token_ids: TokenIdsOpt = None,
    tenant: Annotated[Optional[str], typer.Option("--tenant", help="The prefix's namespace (public: the public one), or the session's tenant.")] = None,
    ttl: Annotated[Optional[float], typer.Option("--ttl", help="Seconds until the pin lapses (default: never).")] = None,
    tier: Annotated[str, typer.Option("--tier", help="device, host or disk: where it is never evicted from.")] = "device",
) -> None:
    """Pin a session or a prefix in a tier: its KV is never evicted from there while pinned (computed first if needed)."""
    prefix = _prefix_body(text, file, messages_file, token_ids, required=False)
    if bool(prefix) == (session is not None):
        _fail("give --session ID or a prefix (--text, --file, --messages-file or --token-ids)", 2)
    body: dict[str, Any] = {"session_id": session} if session is not None else {**prefix}
    if tenant is not None:
        body["tenant"] = tenant
    if ttl is not None:
        body["ttl_s"] = ttl
    if tier != "device":
        body["tier"] = tier
    data = _call(ctx, "POST", "/admin/pins", body=body)
    if ctx.obj.json:
        _print_json(data)
    elif tier == "device":
        p = data["pin"]
        typer.echo(f"pinned {p['kind']} as {p['id']}: {_count(p['pages'])} pages "
                   f"({_count(data['pinned_pages'])} of {_count(data['budget_pages'])} pinned pages used)")
    else:
        p, used = data["pin"], data[tier]
        typer.echo(f"pinned {p['kind']} as {p['id']} in the {tier} tier: {_mib(p['bytes'])} "
                   f"({_mib(used['pinned_bytes'])} of its {_mib(used['budget_bytes'])} pin budget used)")


@app.command()
def unpin(ctx: typer.Context, pin_id: Annotated[str, typer.Argument(metavar="PIN_ID")]) -> None:
    """Remove a pin: its pages become evictable again."""
    data = _call(ctx, "DELETE", f"/admin/pins/{pin_id}")
    if ctx.obj.json:
        _print_json(data)
    else:
        typer.echo(f"unpinned {pin_id} ({_count(data['freed_pages'])} pages)")


@app.command()
def pins(ctx: typer.Context) -> None:
    """List pins and the pin budget."""
    _run(ctx, "GET", "/admin/pins", render=render_pins)


def render_pins(data: dict[str, Any]) -> Table:
    rows = data["pins"]
    table = Table(title=f"Pins ({_count(data['pinned_pages'])} of {_count(data['budget_pages'])} budget pages)",
                  caption=None if rows else "no pins", box=box.SIMPLE_HEAD)
    for name in ("Id", "Kind", "Tenant", "Session", "Pages", "Tokens", "Tier", "Size", "Expires in"):
        table.add_column(name, justify="right" if name in ("Pages", "Tokens", "Size") else "left")
    for p in rows:
        _row(table, p["id"], p["kind"], p["tenant"], p["session_id"] or "", _count(p["pages"]),
             _count(p["num_tokens"]), p["tier"], "" if p["bytes"] is None else _mib(p["bytes"]),
             "never" if p["expires_in_s"] is None else _duration(max(0.0, p["expires_in_s"])))
    return table


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):,.1f} MiB"
