"""The daemon's settings: one table, read from a TOML file < KVTIERD_* env < flags.

Every setting has a name, a TOML place (`[section] key`), an environment
variable (`KVTIERD_<NAME>`), a default and a line of help. README.md lists
them all (a test checks), and so does systemd/kvtierd.toml.example.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvtierd.cache.block_hash import HASH_FUNCTIONS
from kvtierd.cache.eviction import EVICTION_POLICIES
from kvtierd.engine.config import QOS_CLASSES
from kvtierd.model.weight_modes import KV_DTYPES, WEIGHT_MODES
from kvtierd.server.paths import default_socket_path, default_state_dir
from kvtierd.server.placement import parse_placement, parse_tenant_list
from kvtierd.server.tenant_limits import TenantLimits, parse_tenant_limits
from kvtierd.server.truncation import TRUNCATION_POLICIES
from kvtierd.tiers.config import DISK_ADMISSIONS, LOOKUP_WAIT_SHARE, REMOTE_ADMISSIONS, TIER_CODECS


class SettingsError(ValueError):
    """A setting with a bad value or name; the message says which and where from."""


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: Any) -> int:
    """`1073741824`, `"1GiB"`, `"512 MiB"`, `"2GB"` -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise ValueError(f"{value!r} is not a size (e.g. 1GiB, 512MiB, 1073741824)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])


def parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{value!r} is not a boolean (true/false)")


def parse_optional_str(value: Any) -> str | None:
    text = str(value)
    return text or None


def parse_mode(value: Any) -> int:
    """Permission bits: `0o660` in TOML, `"0660"` as text (octal); a decimal `660` is refused, not misread."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not permission bits")
    mode = value if isinstance(value, int) else int(str(value), 8)
    if not 0 <= mode <= 0o777:
        raise ValueError(f"{value!r} is not permission bits (octal, 0 to 0777)")
    return mode


def parse_int(value: Any) -> int:
    """`16` or `"16"`; not `true` or `1.5`, which int() would quietly take as 1."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{value!r} is not an integer")
    return int(value)


def parse_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{value!r} is not a number")
    return float(value)


def int_between(low: int, high: int | None = None) -> Callable[[Any], int]:
    bounds = f"at least {low}" if high is None else f"between {low} and {high}"

    def parse(value: Any) -> int:
        n = parse_int(value)
        if n < low or (high is not None and n > high):
            raise ValueError(f"must be {bounds}, got {n}")
        return n
    return parse


def float_at_least(low: float) -> Callable[[Any], float]:
    def parse(value: Any) -> float:
        x = parse_float(value)
        if not x >= low:  # also refuses nan
            raise ValueError(f"must be at least {low}, got {x}")
        return x
    return parse


def one_of(*choices: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = str(value).strip().lower()
        if text not in choices:
            raise ValueError(f"{value!r} is not one of {', '.join(choices)}")
        return text
    return parse


_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def parse_device(value: Any) -> str:
    text = str(value).strip()
    if not _DEVICE.match(text):
        raise ValueError(f"{value!r} is not a device (auto, cpu, cuda or cuda:N)")
    return text


def parse_class_map(value: Any) -> dict[str, float]:
    """`"high=8,normal=4,low=1"` -> a number >= 0 for each QoS class (all three named)."""
    out = {}
    for item in str(value).split(","):
        cls, _, number = item.partition("=")
        cls = cls.strip().lower()
        if cls not in QOS_CLASSES or cls in out:
            raise ValueError(f"{value!r}: name each of {', '.join(QOS_CLASSES)} once, as class=number")
        x = parse_float(number.strip())
        if not x >= 0:
            raise ValueError(f"{value!r}: {cls} must be a number >= 0")
        out[cls] = x
    if set(out) != set(QOS_CLASSES):
        raise ValueError(f"{value!r}: name each of {', '.join(QOS_CLASSES)}")
    return out


def parse_step_budgets(value: Any) -> dict[str, float | None]:
    """`"high=auto,normal=250"` -> ms per QoS class: a number >= 0, auto (None) or off (0); a class not named is off."""
    out: dict[str, float | None] = dict.fromkeys(QOS_CLASSES, 0.0)
    named: set[str] = set()
    for item in filter(None, (i.strip() for i in str(value).split(","))):
        cls, _, budget = item.partition("=")
        cls, budget = cls.strip().lower(), budget.strip().lower()
        if cls not in QOS_CLASSES or cls in named:
            raise ValueError(f"{value!r}: name each class ({', '.join(QOS_CLASSES)}) at most once, as class=ms")
        named.add(cls)
        if budget != "auto":
            x = 0.0 if budget == "off" else parse_float(budget)
            if not x >= 0:
                raise ValueError(f"{value!r}: {cls} must be auto, off or a number of ms >= 0")
            out[cls] = x
        else:
            out[cls] = None
    return out


def parse_tenant_classes(value: Any) -> dict[str, str]:
    """`"alice=high,batch=low"` -> tenant -> QoS class ("" -> none)."""
    out = {}
    for item in filter(None, (i.strip() for i in str(value).split(","))):
        tenant, _, cls = item.partition("=")
        if not tenant.strip() or cls.strip().lower() not in QOS_CLASSES:
            raise ValueError(f"{item!r} is not tenant=class (class: {', '.join(QOS_CLASSES)})")
        out[tenant.strip()] = cls.strip().lower()
    return out


def parse_tenant_weights(value: Any) -> dict[str, float]:
    """`"alice=2,batch=0.5"` -> tenant -> a weight > 0 ("" -> none: every tenant weighs 1)."""
    out = {}
    for item in filter(None, (i.strip() for i in str(value).split(","))):
        tenant, _, number = item.partition("=")
        x = parse_float(number.strip()) if number.strip() else 0.0
        if not tenant.strip() or not x > 0:
            raise ValueError(f"{item!r} is not tenant=weight (a number > 0)")
        out[tenant.strip()] = x
    return out


def share(value: Any) -> float:
    x = parse_float(value)
    if not 0 <= x <= 1:
        raise ValueError(f"must be a share between 0 and 1, got {x}")
    return x


@dataclass(frozen=True, slots=True)
class Setting:
    name: str
    section: str
    key: str
    default: Any
    parse: Callable[[Any], Any]
    help: str

    @property
    def env(self) -> str:
        return "KVTIERD_" + self.name.upper()


SETTINGS: tuple[Setting, ...] = (
    Setting("socket", "server", "socket", None, parse_optional_str,
            "Unix socket path (default: $RUNTIME_DIRECTORY/kvtierd.sock, else $XDG_RUNTIME_DIR/kvtierd/kvtierd.sock, else /tmp/kvtierd-UID/kvtierd.sock)"),
    Setting("socket_mode", "server", "socket_mode", 0o660, parse_mode, "permission bits of the socket (octal)"),
    Setting("socket_group", "server", "socket_group", None, parse_optional_str, "group that owns the socket: frontends in it may connect"),
    Setting("admin_group", "server", "admin_group", "kvtierd-admin", parse_optional_str,
            "group whose members (and root) may use /admin and name a tenant per request"),
    Setting("tenant_header", "server", "tenant_header", "X-Kvtierd-Tenant", str, "header a trusted (admin-group) frontend names the tenant in"),
    Setting("instance", "server", "instance", "", str,
            "this instance's name (e.g. gpu0 for kvtierd@0): errors name it, and responses carry it in X-Kvtierd-Instance"),
    Setting("tenants", "server", "tenants", "", parse_tenant_list,
            "this instance's allow-list (empty: every tenant not placed elsewhere); others get 421 naming where they belong, e.g. alice,bob"),
    Setting("placement", "server", "placement", "", parse_placement,
            "which instance each placed tenant belongs to (one list for every instance); elsewhere it gets 421 naming it: tenant=instance, e.g. alice=gpu0,bob=gpu1"),
    Setting("max_body_bytes", "server", "max_body_bytes", 4 << 20, parse_bytes, "largest request body; larger gets 413"),
    Setting("drain_timeout_s", "server", "drain_timeout_s", 30.0, parse_float, "on SIGTERM, how long in-flight requests may take to finish"),
    Setting("log_level", "server", "log_level", "info", one_of("debug", "info", "warning", "error"), "debug, info, warning or error"),
    Setting("state_dir", "paths", "state_dir", None, parse_optional_str,
            "state directory: SQLite store, LMDB (default: $STATE_DIRECTORY, else $XDG_STATE_HOME/kvtierd)"),
    Setting("model", "model", "path", None, parse_optional_str, "a .gguf file or a Hugging Face directory (default: bundled SmolLM2-135M-Instruct)"),
    Setting("device", "model", "device", "auto", parse_device, "auto, cpu, cuda or cuda:N"),
    Setting("dtype", "model", "dtype", "auto", one_of("auto", *WEIGHT_MODES),
            "weights: auto (int4 on CPU, bfloat16 or float16 on CUDA), float32 (exact), bfloat16, float16, int8 "
            "or int4 (weight-only, CPU)"),
    Setting("model_cache_dir", "model", "cache_dir", None, parse_optional_str,
            "where a GGUF model's conversion is kept for fast restarts (default: <state_dir>/model-cache; off: none)"),
    Setting("block_size", "cache", "block_size", 16, int_between(1, 256), "tokens per KV page (1 to 256)"),
    Setting("kv_cache_bytes", "cache", "kv_cache_bytes", 1 << 30, parse_bytes, "device KV pool size"),
    Setting("kv_dtype", "cache", "kv_dtype", "auto", one_of("auto", *KV_DTYPES),
            "dtype of the KV cache in every tier: auto (the weights' compute dtype), float32, bfloat16 or float16"),
    Setting("eviction_policy", "cache", "eviction_policy", "lru", one_of(*EVICTION_POLICIES),
            "which idle cached page is reused first: lru, lfu (fewest hits) or cost (hits x (1 + depth in its chain))"),
    Setting("prefix_ttl_s", "cache", "prefix_ttl_s", 0.0, float_at_least(0.0),
            "seconds an idle cached page may go unused before it expires (0: never)"),
    Setting("prefix_min_hits_per_hour", "cache", "prefix_min_hits_per_hour", 0.0, float_at_least(0.0),
            "an idle cached page hit fewer times an hour than this, after its first hour, expires (0: off)"),
    Setting("hash_algorithm", "cache", "hash_algorithm", "md5", one_of(*HASH_FUNCTIONS),
            "chained block hash: md5, sha256 or xxh3-128 (hits are confirmed by their tokens either way)"),
    Setting("compact_threshold", "cache", "compact_threshold", 0.5, share,
            "when the engine goes idle with a free-space or sequence fragmentation ratio at least this, move the "
            "live KV pages together (0: never; kvtierctl compact does it on demand)"),
    Setting("session_idle_ttl_s", "sessions", "idle_ttl_s", 3600.0, float_at_least(0.0),
            "a session idle this long loses its KV (its messages stay in the store; 0: never)"),
    Setting("truncation", "sessions", "truncation", "turns", one_of(*TRUNCATION_POLICIES),
            "when a session outgrows the context window: off (refuse), turns (keep the last N) or tokens (keep the last T)"),
    Setting("truncation_keep_turns", "sessions", "truncation_keep_turns", 8, int_between(1),
            "turns the 'turns' policy keeps after the system prompt"),
    Setting("truncation_keep_tokens", "sessions", "truncation_keep_tokens", 0, int_between(0),
            "tokens the 'tokens' policy keeps (0: the context window less max_tokens)"),
    Setting("session_create_on_first_use", "sessions", "create_on_first_use", True, parse_bool,
            "a chat request naming an unknown session_id creates it (its system message becomes the session's "
            "system prompt); off: 404"),
    Setting("max_num_batched_tokens", "engine", "max_num_batched_tokens", 2048, int_between(1), "tokens per engine step (chunked prefill budget)"),
    Setting("max_num_seqs", "engine", "max_num_seqs", 64, int_between(1), "requests running at once"),
    Setting("prefill_share", "engine", "prefill_share", 0.0, float_at_least(0.0),
            "while requests decode, a prefill beside them adds at most this share to their step's cost (its "
            "chunks cut to fit: smooth streams, slower first tokens for long prompts); 0: off"),
    Setting("prefill_chunk_beside_decodes", "engine", "prefill_chunk_beside_decodes", 256, int_between(0),
            "while requests decode, a prompt's prefill beside them goes in chunks of at most this many tokens, so "
            "their longest gap is one such chunk's step, not a whole token budget's (a prompt alone still takes "
            "max_num_batched_tokens a step); 0: the token budget"),
    Setting("pin_compute_threads", "engine", "pin_compute_threads", True, parse_bool,
            "CPU backend: bind the step thread and torch's worker threads one to a core (of those the daemon may "
            "use), so two never share a core while another idles; off: the kernel places them"),
    Setting("max_model_len", "engine", "max_model_len", 0, int_between(0), "context window in tokens (0: the model's)"),
    Setting("default_max_tokens", "engine", "default_max_tokens", 512, int_between(1), "max_tokens when a request gives none"),
    Setting("host_bytes", "tiers", "host_bytes", 2 << 30, parse_bytes,
            "host tier: memory for KV chunks evicted from the device, pinned with CUDA (0: off)"),
    Setting("disk_bytes", "tiers", "disk_bytes", 16 << 30, parse_bytes,
            "disk tier: LMDB map size under <state_dir>/kv; the file grows as it fills (0: off)"),
    Setting("chunk_pages", "tiers", "chunk_pages", 16, int_between(1, 1024), "KV pages per chunk stored below the device"),
    Setting("disk_codec", "tiers", "disk_codec", "auto", one_of(*TIER_CODECS),
            "codec of disk and remote chunks: raw, zstd, zstd-planes (zstd over byte planes) or auto (disk: raw; "
            "remote: zstd-planes)"),
    Setting("disk_admission", "tiers", "disk_admission", "reused", one_of(*DISK_ADMISSIONS),
            "evicted chunks also written to disk: reused (hit at least once) or all; sessions' turns always are"),
    Setting("flush_on_shutdown", "tiers", "flush_on_shutdown", True, parse_bool,
            "on SIGTERM, write the device's session pages and reused prefixes to disk for the next start"),
    Setting("warm_sessions", "tiers", "warm_sessions", 8, int_between(0, 1_000_000),
            "at startup, copy the disk chunks of this many most recently used sessions to the host tier (0: none)"),
    Setting("store_defer_ms", "tiers", "store_defer_ms", 2000, int_between(0, 3_600_000),
            "disk and remote writes, and a finished session turn's copy out of the device for them, wait while the "
            "engine has steps to run, and start once it has been idle for 100 ms or this many ms after they were "
            "queued (0: never wait)"),
    Setting("lookup_wait_share", "tiers", "lookup_wait_share", LOOKUP_WAIT_SHARE, float_at_least(0.0),
            "a new request waits for the lower tiers to say what they hold of its prompt this share of the estimated "
            "time to recompute it, at most, then recomputes (0: uses only an answer already there; a remote tier "
            "with its directory answers without a round trip; without it, a far or slow Redis: 0.3 lets a long "
            "prompt wait out a round trip and load, and a miss then waits it too)"),
    Setting("remote_url", "remote", "url", None, parse_optional_str,
            "the fleet's shared KV tier: redis://, rediss://, unix://, redis+sentinel://HOST:PORT/SERVICE or "
            "redis+cluster:// (empty: none)"),
    Setting("remote_fleet", "remote", "fleet", "default", str,
            "hosts share what they store in the remote tier under one fleet name"),
    Setting("remote_secret_file", "remote", "secret_file", None, parse_optional_str,
            "a file holding the fleet's secret (16 bytes or more), which seals every remote value; required with url"),
    Setting("remote_ttl_s", "remote", "ttl_s", 86400, int_between(1), "seconds a remote chunk lives unless hit again"),
    Setting("remote_op_timeout_ms", "remote", "op_timeout_ms", 500, int_between(1),
            "longest wait for Redis on one call; past it the call is a miss (and failures open a circuit breaker)"),
    Setting("remote_admission", "remote", "admission", "all", one_of(*REMOTE_ADMISSIONS),
            "what goes to the remote tier besides evicted reused chunks and session turns: all (every finished "
            "request's full chunks) or sessions"),
    Setting("remote_directory", "remote", "directory", True, parse_bool,
            "know which chunks the fleet holds without asking Redis (one SCAN, then the names every host announces "
            "as it stores): a lookup waits no round trip, hit or miss; false: every lookup asks the server"),
    Setting("qos_weights", "qos", "weights", "high=8,normal=4,low=1", parse_class_map,
            "admission weight of each priority class; a waiting request's weight grows by 1 every aging_s"),
    Setting("qos_max_queue_s", "qos", "max_queue_s", "high=10,normal=60,low=120", parse_class_map,
            "latency target per class: the longest a request waits for admission before a 503 with Retry-After (0: no limit)"),
    Setting("qos_aging_s", "qos", "aging_s", 10.0, float_at_least(0.001),
            "seconds of waiting that add 1 to a request's weight (so low never starves)"),
    Setting("shed_low_after_s", "qos", "shed_low_after_s", 0.0, float_at_least(0.0),
            "load shedding: while a high request has waited this long unadmitted, queued low requests get 503 "
            "with Retry-After (0: off; set it below high's max_queue_s)"),
    Setting("step_budget_ms", "qos", "step_budget_ms", "high=auto,normal=auto", parse_step_budgets,
            "while a request of a class is present, lower classes' work in a step is cut so the step's planned cost "
            "(from measured step times) stays within this many ms: a number, auto (the class's own work plus a "
            "one-decode step in one of its steps in four, nothing in the others; a few lone decodes while it is "
            "present by its hold only) or off; a class not named is off"),
    Setting("step_budget_hold_s", "qos", "step_budget_hold_s", 5.0, float_at_least(0.0),
            "a class counts as present for step_budget_ms this long after its last request left (a request arriving "
            "mid-step waits for the step in flight)"),
    Setting("reserved_share", "qos", "reserved_share", 0.1, share,
            "share of device pages only high priority may take (the start size when it resizes)"),
    Setting("reserved_min_share", "qos", "reserved_min_share", 0.05, share, "floor of the resizing reserved region"),
    Setting("reserved_max_share", "qos", "reserved_max_share", 0.5, share, "ceiling of the resizing reserved region"),
    Setting("reserved_window_s", "qos", "reserved_window_s", 0.0, float_at_least(0.0),
            "resize the reserved region to 1.5 x the p99 of high's page use over this window (0: fixed size)"),
    Setting("pin_share", "qos", "pin_share", 0.25, share,
            "share of each tier (device pages, host and disk bytes) pins may hold; a pin past it is refused"),
    Setting("tenant_classes", "qos", "tenant_classes", "", parse_tenant_classes,
            "default class of a tenant's requests without a priority or session class, e.g. alice=high,batch=low"),
    Setting("tenant_max_classes", "qos", "tenant_max_classes", "", parse_tenant_classes,
            "the highest class a tenant may use: a request above it is lowered to it, e.g. batch=low"),
    Setting("cache_shares", "qos", "cache_shares", True, parse_bool,
            "eviction takes first from tenants above their weighted share of the cached pages (device, host and disk); "
            "off: one policy orders every tenant's pages"),
    Setting("tenant_cache_weights", "qos", "tenant_cache_weights", "", parse_tenant_weights,
            "a tenant's weight for its share of the cached pages (not named: 1), e.g. alice=2,batch=0.5"),
    Setting("tenant_limits", "qos", "tenant_limits", "", lambda v: parse_tenant_limits(v, parse_bytes),
            "per-tenant limits (* for tenants not named): sessions (stored) and inflight (requests) answer 429 "
            "past them; host, disk and remote (bytes of KV in that tier; remote: fleet-wide, one Redis master) "
            "evict the tenant's own chunks first, e.g. alice=sessions:100 inflight:4 host:256MiB disk:4GiB "
            "remote:1GiB, *=inflight:16"),
    Setting("store_url", "store", "url", None, parse_optional_str,
            "SQLAlchemy URL of the session store (default: sqlite under the state dir; postgresql+psycopg://... for fleets)"),
)

BY_NAME = {s.name: s for s in SETTINGS}


@dataclass(frozen=True, slots=True)
class Settings:
    socket: Path
    socket_mode: int
    socket_group: str | None
    admin_group: str | None
    tenant_header: str
    instance: str
    tenants: tuple[str, ...]
    placement: dict[str, str]
    max_body_bytes: int
    drain_timeout_s: float
    log_level: str
    state_dir: Path
    model: str | None
    model_cache_dir: Path | None
    device: str
    dtype: str
    block_size: int
    kv_cache_bytes: int
    kv_dtype: str
    eviction_policy: str
    prefix_ttl_s: float
    prefix_min_hits_per_hour: float
    hash_algorithm: str
    compact_threshold: float
    session_idle_ttl_s: float
    truncation: str
    truncation_keep_turns: int
    truncation_keep_tokens: int
    session_create_on_first_use: bool
    max_num_batched_tokens: int
    max_num_seqs: int
    prefill_share: float
    prefill_chunk_beside_decodes: int
    pin_compute_threads: bool
    max_model_len: int
    default_max_tokens: int
    host_bytes: int
    disk_bytes: int
    chunk_pages: int
    disk_codec: str
    disk_admission: str
    flush_on_shutdown: bool
    warm_sessions: int
    store_defer_ms: int
    lookup_wait_share: float
    remote_url: str | None
    remote_fleet: str
    remote_secret_file: str | None
    remote_ttl_s: int
    remote_op_timeout_ms: int
    remote_admission: str
    remote_directory: bool
    qos_weights: dict[str, float]
    qos_max_queue_s: dict[str, float]
    qos_aging_s: float
    shed_low_after_s: float
    step_budget_ms: dict[str, float | None]
    step_budget_hold_s: float
    reserved_share: float
    reserved_min_share: float
    reserved_max_share: float
    reserved_window_s: float
    pin_share: float
    tenant_classes: dict[str, str]
    tenant_max_classes: dict[str, str]
    cache_shares: bool
    tenant_cache_weights: dict[str, float]
    tenant_limits: dict[str, TenantLimits]
    store_url: str


def _from_toml(path: Path) -> dict[str, tuple[Any, str]]:
    try:
        doc = tomllib.loads(path.read_text())
    except OSError as e:
        raise SettingsError(f"cannot read config file {path}: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise SettingsError(f"{path} is not valid TOML: {e}") from e
    except UnicodeDecodeError as e:  # TOML is UTF-8
        raise SettingsError(f"{path} is not valid TOML: not UTF-8 text (byte {e.start})") from e
    by_place = {(s.section, s.key): s for s in SETTINGS}
    out = {}
    for section, table in doc.items():
        if not isinstance(table, dict):
            raise SettingsError(f"{path}: {section!r} must be a [section]")
        for key, value in table.items():
            setting = by_place.get((section, key))
            if setting is None:
                raise SettingsError(f"{path}: unknown setting [{section}] {key}")
            out[setting.name] = (value, f"{path} [{section}] {key}")
    return out


def load_settings(
    config_file: Path | None = None, environ: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None
) -> Settings:
    """Merges defaults < TOML file < KVTIERD_* environment < flags (`overrides`, None = unset)."""

    env = os.environ if environ is None else environ
    raw: dict[str, tuple[Any, str]] = {}
    if config_file is not None:
        raw.update(_from_toml(config_file))
    for s in SETTINGS:
        if s.env in env:
            raw[s.name] = (env[s.env], s.env)
    for name, value in (overrides or {}).items():
        if value is not None:
            raw[name] = (value, f"--{name.replace('_', '-')}")
    values: dict[str, Any] = {}
    for s in SETTINGS:
        value, source = raw.get(s.name, (s.default, "default"))
        try:
            values[s.name] = s.parse(value) if value is not None else None
        except (TypeError, ValueError) as e:
            raise SettingsError(f"{s.name} from {source}: {e}") from e
    state_dir = Path(values["state_dir"]).expanduser() if values["state_dir"] else default_state_dir(env)
    if state_dir.exists() and not state_dir.is_dir():
        raise SettingsError(f"state_dir from {raw.get('state_dir', (None, 'default'))[1]}: {state_dir} exists and "
                            "is not a directory")
    values["state_dir"] = state_dir
    values["socket"] = Path(values["socket"]).expanduser() if values["socket"] else default_socket_path(env)
    values["store_url"] = values["store_url"] or f"sqlite:///{state_dir / 'kvtierd.sqlite3'}"
    cache_dir = values["model_cache_dir"]
    values["model_cache_dir"] = None if cache_dir == "off" else \
        Path(cache_dir).expanduser() if cache_dir else state_dir / "model-cache"
    return Settings(**{f.name: values[f.name] for f in fields(Settings)})
