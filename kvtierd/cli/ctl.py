"""`kvtierctl`: the admin CLI. It talks HTTP to a running kvtierd over its Unix socket.

Each command calls one `/admin/...` route and prints one rich table (or, with `--json`,
the daemon's JSON as is); `top` reads `/metrics` instead (`cli/top.py`). Failures print
one `error: ...` line on stderr and exit non-zero: 2 when kvtierd cannot be reached or does
not answer in its protocol, 1 when kvtierd answers with an error (for example 403: admin
routes need root or the admin group).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, NoReturn, Optional
from urllib.parse import quote

import click
import typer
from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text
from typer.core import TyperGroup

from kvtierd.cli.admin_client import (
    EXIT_CONNECTION,
    EXIT_DAEMON_ERROR,
    SOCKET_ENV,
    AdminClient,
    AdminError,
    resolve_socket_path,
)
from kvtierd.cli.top import run_top


class JsonAnywhereGroup(TyperGroup):
    """`--json` is the app's option, but users type it after the command too (`kvtierctl pins --json`):
    it is moved to the front before parsing (up to a `--`, after which everything is an argument)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        end = args.index("--") if "--" in args else len(args)
        if "--json" in args[:end]:
            args = ["--json", *(a for a in args[:end] if a != "--json"), *args[end:]]
        return super().parse_args(ctx, args)


app = typer.Typer(
    cls=JsonAnywhereGroup,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    help="kvtierctl: inspect and manage a running kvtierd over its Unix socket.",
)
sessions_app = typer.Typer(no_args_is_help=True, help="Chat sessions in the daemon's session store.")
prefixes_app = typer.Typer(no_args_is_help=True, help="Cached prefixes in the daemon's prefix index.")
app.add_typer(sessions_app, name="sessions")
app.add_typer(prefixes_app, name="prefixes")

LimitOpt = Annotated[Optional[int], typer.Option("--limit", min=1, help="Show at most N rows.")]


@dataclass(slots=True, frozen=True)
class CtlOptions:
    socket_path: Path
    json: bool
    timeout: float


@app.callback()
def main(
    ctx: typer.Context,
    # str, not Path: typer would check that the path is readable, and a socket never is.
    socket: Annotated[
        Optional[str],
        typer.Option(
            "--socket",
            envvar=SOCKET_ENV,
            show_default=False,
            help="The daemon's socket; default: $RUNTIME_DIRECTORY/kvtierd.sock, else "
            "$XDG_RUNTIME_DIR/kvtierd/kvtierd.sock, else /tmp/kvtierd-<uid>/kvtierd.sock.",
        ),
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the daemon's JSON instead of a table.")] = False,
    timeout: Annotated[float, typer.Option("--timeout", min=0.1, help="Seconds to wait for the daemon.")] = 10.0,
) -> None:
    """Inspect and manage a running kvtierd over its Unix socket."""
    ctx.obj = CtlOptions(resolve_socket_path(socket), json_output, timeout)


# ---- commands --------------------------------------------------------------------------


@app.command()
def status(ctx: typer.Context) -> None:
    """The daemon, its model and its engine."""
    _run(ctx, "GET", "/admin/status", render=render_status)


@app.command()
def tiers(ctx: typer.Context,
          tenant: Annotated[bool, typer.Option("--tenant", help="Each tenant's cached pages, share, hits and "
                                                                 "evictions instead.")] = False) -> None:
    """Capacity, use and hit rate of each KV-cache tier."""
    _run(ctx, "GET", "/admin/tiers", render=render_tenants if tenant else render_tiers)


@app.command()
def stats(ctx: typer.Context) -> None:
    """Request and token counters since the daemon started."""
    _run(ctx, "GET", "/admin/stats", render=render_stats)


@app.command()
def top(
    ctx: typer.Context,
    interval: Annotated[float, typer.Option("--interval", min=0.1, help="Seconds between frames.")] = 1.0,
    once: Annotated[bool, typer.Option("--once", help="Print one frame (rates since the daemon started) and exit.")]
    = False,
) -> None:
    """A live view from /metrics: throughput, hit rates, pages, evictions, TTFT per priority."""
    opts: CtlOptions = ctx.obj
    try:
        with AdminClient(opts.socket_path, timeout=opts.timeout) as client:
            run_top(client, interval, once, opts.json)
    except AdminError as e:
        _fail(e.message, e.exit_code)
    except KeyboardInterrupt:  # how a live view ends
        pass


@sessions_app.command("ls")
def sessions_ls(
    ctx: typer.Context,
    tenant: Annotated[Optional[str], typer.Option("--tenant", help="Only this tenant's sessions.")] = None,
    limit: LimitOpt = None,
) -> None:
    """List sessions (filtered by tenant, at most N)."""
    _run(ctx, "GET", "/admin/sessions", {"tenant": tenant, "limit": limit}, render=render_sessions)


# Frontends choose session ids, so two tenants may have the same one: then the tenant must be named.
OwnerOpt = Annotated[Optional[str], typer.Option("--tenant", help="The session's tenant (needed when several "
                                                                   "tenants have a session with this id).")]


@sessions_app.command("show")
def sessions_show(ctx: typer.Context, session_id: Annotated[str, typer.Argument(metavar="ID")],
                  tenant: OwnerOpt = None) -> None:
    """One session and its messages."""
    _run(ctx, "GET", f"/admin/sessions/{quote(session_id, safe='')}", {"tenant": tenant}, render=render_session)


@sessions_app.command("rm")
def sessions_rm(ctx: typer.Context, session_id: Annotated[str, typer.Argument(metavar="ID")],
                tenant: OwnerOpt = None) -> None:
    """Delete a session, its messages and its cached context."""
    data = _call(ctx, "DELETE", f"/admin/sessions/{quote(session_id, safe='')}", {"tenant": tenant})
    if ctx.obj.json:
        _print_json(data)
    if data.get("deleted") is not True:
        _fail(f"kvtierd did not delete session {session_id}", EXIT_DAEMON_ERROR)
    if not ctx.obj.json:
        freed = data.get("freed_blocks")
        detail = f" (freed {_count(freed)} blocks)" if isinstance(freed, int) else ""
        typer.echo(f"deleted session {session_id}{detail}")


@prefixes_app.command("ls")
def prefixes_ls(
    ctx: typer.Context,
    tenant: Annotated[Optional[str], typer.Option("--tenant", help="Only this tenant's (public: published ones).")] = None,
    limit: LimitOpt = None,
) -> None:
    """List cached prefixes (each chain's last page), most hit first."""
    _run(ctx, "GET", "/admin/prefixes", {"tenant": tenant, "limit": limit}, render=render_prefixes)


TextOpt = Annotated[Optional[str], typer.Option("--text", help="The prefix as text (tokenized as is).")]
FileOpt = Annotated[Optional[Path], typer.Option("--file", exists=True, dir_okay=False, help="The prefix as a text file.")]
MessagesOpt = Annotated[Optional[Path], typer.Option(
    "--messages-file", exists=True, dir_okay=False,
    help="The prefix as chat messages: a JSON array of {role, content}, rendered with the chat template.")]
TokenIdsOpt = Annotated[Optional[str], typer.Option("--token-ids", help="The prefix as token ids: 1,2,3")]
TagOpt = Annotated[Optional[str], typer.Option("--tag", help="A document tag, e.g. doc:v3.")]


@prefixes_app.command("publish")
def prefixes_publish(ctx: typer.Context, text: TextOpt = None, file: FileOpt = None, messages_file: MessagesOpt = None,
                     token_ids: TokenIdsOpt = None, tag: TagOpt = None) -> None:
    """Compute a prefix (a system prompt, a document) into the public namespace: every tenant may hit it."""
    body = {**_prefix_body(text, file, messages_file, token_ids), **({"tag": tag} if tag else {})}
    data = _call(ctx, "POST", "/admin/prefixes", body=body)
    if ctx.obj.json:
        _print_json(data)
    else:
        typer.echo(f"published {_count(data['num_tokens'])} tokens ({data['pages']} pages) as "
                   f"{_short_hash(data['hash'])}; computed {_count(data['computed_tokens'])} tokens")


@app.command()
def invalidate(
    ctx: typer.Context,
    session: Annotated[Optional[str], typer.Option("--session", help="A session's KV.")] = None,
    text: TextOpt = None,
    file: FileOpt = None,
    messages_file: MessagesOpt = None,
    token_ids: TokenIdsOpt = None,
    block_hash: Annotated[Optional[str], typer.Option("--hash", help="A page hash and what follows it.")] = None,
    tag: Annotated[Optional[str], typer.Option("--tag", help="Every page derived from a tagged prefix.")] = None,
    tenant: Annotated[Optional[str], typer.Option(
        "--tenant", help="A tenant's whole cache; with a prefix, the namespace it is in (public: the public one).")] = None,
    model: Annotated[Optional[str], typer.Option("--model", help="Everything cached for a model fingerprint.")] = None,
) -> None:
    """Drop cached KV at once for new requests (running requests keep theirs until they finish)."""
    prefix = _prefix_body(text, file, messages_file, token_ids, required=False)
    body: dict[str, Any] = {k: v for k, v in (("session_id", session), ("hash", block_hash), ("tag", tag),
                                               ("tenant", tenant), ("model", model)) if v is not None}
    if prefix:
        body["prefix"] = prefix
    data = _call(ctx, "POST", "/admin/invalidate", body=body)
    if ctx.obj.json:
        _print_json(data)
    else:
        typer.echo(f"invalidated {_count(data['invalidated_pages'])} pages ({data['target']})")


def _prefix_body(text: str | None, file: Path | None, messages_file: Path | None, token_ids: str | None,
                 required: bool = True) -> dict[str, Any]:
    given = [x for x in (text, file, messages_file, token_ids) if x is not None]
    if len(given) > 1 or (required and not given):
        _fail("give the prefix as one of --text, --file, --messages-file or --token-ids", 2)
    try:
        if file is not None:
            return {"text": file.read_text()}
        if messages_file is not None:
            return {"messages": json.loads(messages_file.read_text())}
        if token_ids is not None:
            return {"token_ids": [int(t) for t in token_ids.replace(",", " ").split()]}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
        _fail(f"cannot read the prefix: {e}", 2)
    return {"text": text} if text is not None else {}


# ---- tables ----------------------------------------------------------------------------


def render_status(data: dict[str, Any]) -> Table:
    model, engine = data["model"], data["engine"]
    num_blocks = engine["num_blocks"]
    table = _kv_table("kvtierd status")
    _rows(
        table,
        [
            ("Version", data["version"]),
            ("State", "draining" if data["draining"] else "serving"),
            ("Uptime", _duration(data["uptime_s"])),
            ("Socket", data["socket"]),
            ("Instance", data.get("instance") or "—"),
            # Placement: the tenants placed on this instance, and whom else it serves ([server] tenants).
            ("Tenants placed here", ", ".join(data.get("placed_here") or []) or "—"),
            ("Tenants served", ", ".join(data.get("tenants") or []) or "all not placed elsewhere"),
            ("State dir", data["state_dir"]),
            ("Model", model["name"]),
            ("Fingerprint", model["fingerprint"]),
            ("Architecture", f"{model['architecture']}, {_count(model['num_layers'])} layers"),
            ("Device / weights / KV", f"{model['device']} / {model['dtype']} / {model['kv_dtype']}"),
            ("Context window", f"{_count(model['context_window'])} tokens"),
            ("Attention", engine["attention_backend"]),
            ("Matrices", engine["matmul_backend"]),
            ("Requests", f"{_count(engine['running'])} running, {_count(engine['waiting'])} waiting"),
            ("Block size", f"{_count(engine['block_size'])} tokens"),
            ("Blocks", f"{_count(num_blocks)} total"),
            ("  used", _count_of(engine["used_blocks"], num_blocks)),
            ("  cached", _count_of(engine["cached_blocks"], num_blocks)),
            ("  free", _count_of(engine["free_blocks"], num_blocks)),
        ],
    )
    return table


def render_tiers(data: dict[str, Any]) -> Table:
    # Tiers as columns: there are at most four, so the table fits an 80-column terminal.
    tiers = data["tiers"]
    table = Table(title="KV-cache tiers", caption=None if tiers else "no tiers")
    table.add_column("")
    for tier in tiers:
        table.add_column(str(tier["name"]), justify="right", no_wrap=True)
    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("Capacity", lambda t: _bytes(t["capacity_bytes"])),
        ("Used", lambda t: _bytes(t["used_bytes"])),
        ("Use", lambda t: _pct(t["used_bytes"] / t["capacity_bytes"]) if t["capacity_bytes"] else "—"),
        ("Pages", lambda t: _count(t["pages_total"]) if "pages_total" in t else "—"),
        ("  used", lambda t: _count(t["pages_used"]) if "pages_used" in t else "—"),
        ("  cached", lambda t: _count(t["pages_cached"]) if "pages_cached" in t else "—"),
        ("  free", lambda t: _count(t["pages_free"]) if "pages_free" in t else "—"),
        ("Chunks", lambda t: _count(t["entries"]) if "entries" in t else "—"),
        ("Query tokens", lambda t: _count(t["query_tokens"])),
        ("Hit tokens", lambda t: _count(t["hit_tokens"])),
        ("Hit rate", lambda t: _pct(t["hit_rate"])),
        ("Codec", lambda t: t.get("codec") or "—"),
        # The disk's startup reconciliation with the SQL chunk catalog: values / rows it removed.
        ("Orphans removed", lambda t: "{orphan_values} / {orphan_rows}".format(**t["reconciled"])
         if t.get("reconciled") else "—"),
        # A lower tier that is off or failed says why instead (host and disk only).
        ("Health", lambda t: "ok" if t.get("healthy", True) else str(t.get("reason") or "down")),
    ]
    for label, cell in rows:
        _row(table, label, *(cell(tier) for tier in tiers))
    return table


def render_tenants(data: dict[str, Any]) -> Table:
    tenants = data.get("tenants", [])
    shares = "on" if data.get("cache_shares") else "off"
    table = Table(title=f"KV cache by tenant (shares {shares})", caption=None if tenants else "no tenant has cached pages")
    for label in ("Tenant", "Weight", "Device pages", "Share", "Hits", "Evictions", "Under share", "Host chunks",
                  "Disk chunks", "Disk", "Remote chunks", "Remote"):
        table.add_column(label, justify="left" if label == "Tenant" else "right", no_wrap=True)
    for t in tenants:
        _row(table, t["tenant"], f"{t['weight']:g}", _count(t["device_pages"]), f"{t['share_pages']:g}",
             _count(t["hits"]), _count(t["evictions"]), _count(t["evictions_under_share"]), _count(t["host_chunks"]),
             _count(t["disk_chunks"]), _bytes(t["disk_bytes"]), _count(t["remote_chunks"]), _bytes(t["remote_bytes"]))
    return table


def render_stats(data: dict[str, Any]) -> Table:
    table = _kv_table("kvtierd counters")
    prompt, cached = data["prompt_tokens"], data["cached_tokens"]
    _rows(
        table,
        [
            ("Requests", _count(data["requests"])),
            ("Prompt tokens", _count(prompt)),
            ("Cached tokens", _count(cached) + (f" ({_pct(cached / prompt)} of prompt)" if prompt else "")),
            ("Generated tokens", _count(data["generated_tokens"])),
            ("Preemptions", _count(data["preemptions"])),
            ("Errors 4xx", _count(data["errors_4xx"])),
            ("Errors 5xx", _count(data["errors_5xx"])),
            ("Active streams", _count(data["active_streams"])),
        ],
    )
    return table


def render_sessions(data: dict[str, Any]) -> Table:
    sessions = data["sessions"]
    table = Table(title="Sessions", caption=None if sessions else "no sessions", box=box.SIMPLE_HEAD)
    # Only ID and title may wrap on a narrow terminal; an ID folds but is never cut.
    table.add_column("ID", overflow="fold")
    table.add_column("Tenant", no_wrap=True)
    table.add_column("QoS", no_wrap=True)
    table.add_column("Title")
    table.add_column("Msgs", justify="right", no_wrap=True)
    table.add_column("Tokens", justify="right", no_wrap=True)
    table.add_column("Pin", no_wrap=True)
    table.add_column("Last used", no_wrap=True)
    now = datetime.now(timezone.utc)
    for s in sessions:
        _row(
            table,
            s["id"],
            s["tenant"],
            s["qos_class"],
            _clip(s.get("title") or "", 32),
            _count(s["num_messages"]),
            _count(s["token_count"]),
            "yes" if s["pinned"] else "",
            _ago_iso(s["last_used_at"], now),
        )
    return table


def render_session(data: dict[str, Any]) -> RenderableType:
    s = data["session"]
    now = datetime.now(timezone.utc)
    title = f"Session {s['id']}" + (f": {s['title']}" if s.get("title") else "")
    caption = " · ".join(
        [
            f"tenant {s['tenant']}",
            f"qos {s['qos_class']}",
            f"{_count(s['token_count'])} tokens",
            f"{_count(s['num_messages'])} messages",
            "pinned" if s["pinned"] else "not pinned",
            f"created {_timestamp(s['created_at'], now)}",
            f"last used {_timestamp(s['last_used_at'], now)}",
        ]
    )
    table = Table(title=Text(title), caption=Text(caption))
    table.add_column("#", justify="right")
    table.add_column("Role")
    table.add_column("Status")
    table.add_column("Prompt", justify="right")
    table.add_column("Completion", justify="right")
    table.add_column("Created")
    table.add_column("Content")
    for m in data["messages"]:
        _row(
            table,
            str(m["seq"]),
            m["role"],
            m["status"],
            _count(m.get("prompt_tokens")),
            _count(m.get("completion_tokens")),
            _ago_iso(m["created_at"], now),
            _clip(m.get("content") or "", 160),
        )
    return Group(table, render_session_kv(data.get("kv")))


def render_session_kv(kv: dict[str, Any] | None) -> RenderableType:
    """The session's context pool: its pages and where they are."""
    if kv is None:
        return Text("no KV kept for this session (never run here, expired, or invalidated)")
    caption = (f"{_count(kv['resident_tokens'])} of {_count(kv['num_tokens'])} tokens resident · "
               f"idle {_duration(kv['idle_s'])}")
    table = Table(title="Context pool", caption=caption, box=box.SIMPLE_HEAD)
    for name in ("#", "Page", "Tokens"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("Tier", no_wrap=True)
    table.add_column("Indexed", no_wrap=True)
    for i, p in enumerate(kv["pages"]):
        _row(table, str(i), str(p["page"]), _count(p["num_tokens"]), p["tier"] or "gone",
             "yes" if p["indexed"] else "")
    return table


def render_prefixes(data: dict[str, Any]) -> Table:
    prefixes = data["prefixes"]
    table = Table(title="Cached prefixes", caption=None if prefixes else "no cached prefixes", box=box.SIMPLE_HEAD)
    table.add_column("Hash", no_wrap=True)
    table.add_column("Tenant", overflow="fold")
    for name in ("Tokens", "Hits", "Head hits"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("Last hit", no_wrap=True)
    table.add_column("Tier", no_wrap=True)
    table.add_column("Pin", no_wrap=True)
    table.add_column("Tags")
    table.add_column("Preview")
    for p in prefixes:
        _row(
            table,
            _short_hash(p["hash"]),
            p["tenant"],
            _count(p["num_tokens"]),
            _count(p["hits"]),
            _count(p["first_page_hits"]),
            _duration(p["last_hit_s_ago"]) + " ago",
            p["tier"] + ("*" if p["in_use"] else ""),
            "yes" if p["pinned"] else "",
            ", ".join(p["tags"]),
            _clip(p.get("preview") or "", 48),
        )
    return table


# ---- plumbing --------------------------------------------------------------------------


def _run(
    ctx: typer.Context,
    method: str,
    path: str,
    params: dict[str, str | int | None] | None = None,
    *,
    render: Callable[[dict[str, Any]], RenderableType],
) -> None:
    data = _call(ctx, method, path, params)
    if ctx.obj.json:
        _print_json(data)
        return
    try:
        table = render(data)
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
        _fail(
            f"unexpected answer from kvtierd to {method} {path} (missing or malformed field: {e!s});"
            " are kvtierctl and kvtierd the same version?",
            EXIT_CONNECTION,
        )
    Console().print(table)


def _call(
    ctx: typer.Context, method: str, path: str, params: dict[str, str | int | None] | None = None, body: Any = None
) -> dict[str, Any]:
    opts: CtlOptions = ctx.obj
    try:
        with AdminClient(opts.socket_path, timeout=opts.timeout) as client:
            return client.request(method, path, params, body)
    except AdminError as e:
        _fail(e.message, e.exit_code)


def _fail(message: str, code: int) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def _kv_table(title: str) -> Table:
    table = Table(title=title, show_header=False)
    table.add_column("Field", style="bold")
    table.add_column("Value", overflow="fold")
    return table


def _rows(table: Table, rows: Iterable[tuple[str, str]]) -> None:
    for key, value in rows:
        _row(table, key, value)


def _row(table: Table, *cells: Any) -> None:
    # Text, not str: names, titles and previews come from users and must not be read as markup.
    table.add_row(*(Text(str(cell)) for cell in cells))


def _count(n: int | None) -> str:
    return "—" if n is None else f"{int(n):,}"


def _count_of(part: int, whole: int) -> str:
    return _count(part) + (f" ({_pct(part / whole)})" if whole else "")


def _pct(ratio: float) -> str:
    return f"{float(ratio) * 100:.1f}%"


def _bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _duration(seconds: float) -> str:
    s = max(float(seconds), 0.0)
    if s < 60:
        return f"{s:.1f}s" if s < 10 else f"{int(s)}s"
    whole = int(s)
    days, rest = divmod(whole, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {secs:02d}s"


def _parse_time(value: str) -> datetime:
    when = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def _ago_iso(value: str | None, now: datetime) -> str:
    """'3h 05m ago' for an ISO 8601 time; the raw text if it does not parse."""
    if not value:
        return "—"
    try:
        delta = (now - _parse_time(value)).total_seconds()
    except ValueError:
        return str(value)
    return f"{_duration(delta)} ago" if delta >= 0 else f"in {_duration(-delta)}"


def _timestamp(value: str | None, now: datetime) -> str:
    """'2025-01-02 10:00 (3h 05m ago)' in local time."""
    if not value:
        return "—"
    try:
        local = _parse_time(value).astimezone().strftime("%Y-%m-%d %H:%M")
    except ValueError:
        return str(value)
    return f"{local} ({_ago_iso(value, now)})"


def _short_hash(value: str) -> str:
    return value if len(value) <= 16 else value[:16] + "…"


def _clip(text: str, limit: int) -> str:
    flat = str(text).replace("\r", "").replace("\n", " \\n ").replace("\t", " ")
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"



from kvtierd.cli import pin_commands  # noqa: E402,F401  registers pin, unpin and pins on `app` (uses the helpers above)
from kvtierd.cli import compact_command  # noqa: E402,F401  registers compact on `app`
from kvtierd.cli import advise_command  # noqa: E402,F401  registers advise on `app`

if __name__ == "__main__":  # pragma: no cover - `python -m kvtierd.cli.ctl`
    # This file runs as __main__ here; the command modules above registered on kvtierd.cli.ctl's own `app`.
    from kvtierd.cli.ctl import app as registered

    registered()
