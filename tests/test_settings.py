"""Settings: defaults < TOML file < KVTIERD_* environment < flags, each value checked where it enters.

`load_settings` is given its environment, so nothing here reads or changes the real one.
A bad value or an unknown TOML key is a `SettingsError` naming the setting and where the
value came from; the daemon's CLI prints it as one line. README.md documents every setting.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtierd.server.tenant_limits import TenantLimits
from kvtierd.server.settings import SETTINGS, Setting, SettingsError, load_settings, parse_bytes

ROOT = Path(__file__).resolve().parents[1]
BY_NAME = {s.name: s for s in SETTINGS}

# For every setting, three different valid values as the TOML file, the environment and a
# flag would give them, and what each parses to: (toml, parsed), (env, parsed), (flag, parsed).
SAMPLES: dict[str, tuple[tuple[Any, Any], tuple[str, Any], tuple[Any, Any]]] = {
    "socket": (("/tmp/a/k.sock", Path("/tmp/a/k.sock")), ("/tmp/b/k.sock", Path("/tmp/b/k.sock")),
               ("/tmp/c/k.sock", Path("/tmp/c/k.sock"))),
    "socket_mode": ((0o600, 0o600), ("0640", 0o640), ("0666", 0o666)),
    "socket_group": (("front", "front"), ("web", "web"), ("chat", "chat")),
    "admin_group": (("ops", "ops"), ("wheel", "wheel"), ("adm", "adm")),
    "tenant_header": (("X-Tenant", "X-Tenant"), ("X-Org", "X-Org"), ("X-User", "X-User")),
    "max_body_bytes": (("1MiB", 1 << 20), ("512 KiB", 512 << 10), (123456, 123456)),
    "drain_timeout_s": ((1.5, 1.5), ("2", 2.0), (0.25, 0.25)),
    "log_level": (("debug", "debug"), ("warning", "warning"), ("error", "error")),
    "state_dir": (("/tmp/s1", Path("/tmp/s1")), ("/tmp/s2", Path("/tmp/s2")), ("/tmp/s3", Path("/tmp/s3"))),
    "model": (("/models/a.gguf", "/models/a.gguf"), ("/models/b", "/models/b"), ("/models/c.gguf", "/models/c.gguf")),
    "device": (("cpu", "cpu"), ("cuda", "cuda"), ("cuda:1", "cuda:1")),
    "dtype": (("int4", "int4"), ("BFloat16", "bfloat16"), ("float32", "float32")),
    "block_size": ((32, 32), ("64", 64), (8, 8)),
    "kv_cache_bytes": (("512MiB", 512 << 20), ("2GB", 2 * 10**9), ("1GiB", 1 << 30)),
    "kv_dtype": (("bfloat16", "bfloat16"), ("float32", "float32"), ("float16", "float16")),
    "eviction_policy": (("lfu", "lfu"), ("COST", "cost"), ("lru", "lru")),
    "prefix_ttl_s": ((600, 600.0), ("3600", 3600.0), (0.5, 0.5)),
    "hash_algorithm": (("sha256", "sha256"), ("xxh3-128", "xxh3-128"), ("md5", "md5")),
    "compact_threshold": ((0.25, 0.25), ("0", 0.0), (1, 1.0)),
    "prefix_min_hits_per_hour": ((2, 2.0), ("0.5", 0.5), (0, 0.0)),
    "session_idle_ttl_s": ((60, 60.0), ("86400", 86400.0), (0, 0.0)),
    "truncation": (("off", "off"), ("tokens", "tokens"), ("turns", "turns")),
    "truncation_keep_turns": ((1, 1), ("20", 20), (4, 4)),
    "remote_url": (("redis://127.0.0.1:6379", "redis://127.0.0.1:6379"), ("unix:///run/valkey.sock", "unix:///run/valkey.sock"),
                   ("redis+sentinel://10.0.0.1:26379/kv", "redis+sentinel://10.0.0.1:26379/kv")),
    "remote_fleet": (("prod", "prod"), ("eu-1", "eu-1"), ("default", "default")),
    "remote_secret_file": (("/etc/kvtierd/fleet.key", "/etc/kvtierd/fleet.key"), ("key", "key"), ("/k", "/k")),
    "remote_ttl_s": ((60, 60), ("3600", 3600), (86400, 86400)),
    "remote_op_timeout_ms": ((100, 100), ("250", 250), (500, 500)),
    "remote_admission": (("sessions", "sessions"), ("all", "all"), ("sessions", "sessions")),
    "remote_directory": ((False, False), ("yes", True), ("off", False)),
    "truncation_keep_tokens": ((0, 0), ("1024", 1024), (4096, 4096)),
    "session_create_on_first_use": ((False, False), ("yes", True), ("off", False)),
    "max_num_batched_tokens": ((1024, 1024), ("4096", 4096), (512, 512)),
    "max_num_seqs": ((8, 8), ("16", 16), (4, 4)),
    "prefill_share": ((0.25, 0.25), ("0.5", 0.5), (0, 0.0)),
    "prefill_chunk_beside_decodes": ((128, 128), ("512", 512), (0, 0)),
    "pin_compute_threads": ((False, False), ("on", True), ("false", False)),
    "max_model_len": ((2048, 2048), ("4096", 4096), (1024, 1024)),
    "default_max_tokens": ((64, 64), ("128", 128), (16, 16)),
    "host_bytes": (("512MiB", 512 << 20), ("0", 0), (1 << 30, 1 << 30)),
    "disk_bytes": (("64GiB", 64 << 30), ("0", 0), ("1TiB", 1 << 40)),
    "chunk_pages": ((8, 8), ("32", 32), (1, 1)),
    "disk_codec": (("raw", "raw"), ("zstd", "zstd"), ("zstd-planes", "zstd-planes")),
    "disk_admission": (("all", "all"), ("reused", "reused"), ("ALL", "all")),
    "flush_on_shutdown": ((False, False), ("yes", True), ("off", False)),
    "warm_sessions": ((0, 0), ("32", 32), (4, 4)),
    "store_defer_ms": ((0, 0), ("500", 500), (10_000, 10_000)),
    "lookup_wait_share": ((0, 0.0), ("0.5", 0.5), (100, 100.0)),
    "qos_weights": (("high=9,normal=3,low=1", {"high": 9.0, "normal": 3.0, "low": 1.0}),
                    ("low=2,high=4,normal=3", {"high": 4.0, "normal": 3.0, "low": 2.0}),
                    ("HIGH=1,normal=1,low=1", {"high": 1.0, "normal": 1.0, "low": 1.0})),
    "qos_max_queue_s": (("high=1,normal=2,low=3", {"high": 1.0, "normal": 2.0, "low": 3.0}),
                        ("high=0,normal=0,low=0", {"high": 0.0, "normal": 0.0, "low": 0.0}),
                        ("high=5, normal=60, low=0.5", {"high": 5.0, "normal": 60.0, "low": 0.5})),
    "qos_aging_s": ((5, 5.0), ("30", 30.0), (0.5, 0.5)),
    "shed_low_after_s": ((2, 2.0), ("0.5", 0.5), (0, 0.0)),
    "step_budget_ms": (("high=auto,normal=300", {"high": None, "normal": 300.0, "low": 0.0}),
                       ("", {"high": 0.0, "normal": 0.0, "low": 0.0}),
                       ("HIGH=120, normal=off, low=auto", {"high": 120.0, "normal": 0.0, "low": None})),
    "step_budget_hold_s": ((2, 2.0), ("0", 0.0), (10.5, 10.5)),
    "reserved_share": ((0.2, 0.2), ("0", 0.0), (0.5, 0.5)),
    "reserved_min_share": ((0.1, 0.1), ("0.01", 0.01), (0, 0.0)),
    "reserved_max_share": ((0.6, 0.6), ("1", 1.0), (0.3, 0.3)),
    "reserved_window_s": ((60, 60.0), ("300", 300.0), (0, 0.0)),
    "pin_share": ((0.1, 0.1), ("0.5", 0.5), (0, 0.0)),
    "tenant_classes": (("alice=high,batch=low", {"alice": "high", "batch": "low"}), ("", {}),
                       ("bob=NORMAL", {"bob": "normal"})),
    "tenant_max_classes": (("batch=low", {"batch": "low"}), ("a=normal,b=high", {"a": "normal", "b": "high"}),
                           ("", {})),
    "cache_shares": ((False, False), ("on", True), ("false", False)),
    "tenant_cache_weights": (("alice=2,batch=0.5", {"alice": 2.0, "batch": 0.5}), ("", {}), ("bob=3", {"bob": 3.0})),
    "tenant_limits": (("alice=sessions:2 host:1MiB", {"alice": TenantLimits(sessions=2, host=1 << 20)}), ("", {}),
                      ("*=inflight:4 disk:1GiB remote:2GiB", {"*": TenantLimits(inflight=4, disk=1 << 30, remote=2 << 30)})),
    "instance": (("gpu0", "gpu0"), ("gpu1", "gpu1"), ("", "")),
    "tenants": (("alice, bob", ("alice", "bob")), ("", ()), ("carol", ("carol",))),
    "placement": (("carol=gpu1", {"carol": "gpu1"}), ("", {}), ("a=gpu0,b=gpu1", {"a": "gpu0", "b": "gpu1"})),
    "model_cache_dir": (("/tmp/mc", Path("/tmp/mc")), ("off", None), ("/var/cache/kvtierd", Path("/var/cache/kvtierd"))),
    "store_url": (("sqlite:////tmp/a.db", "sqlite:////tmp/a.db"), ("sqlite:////tmp/b.db", "sqlite:////tmp/b.db"),
                  ("postgresql+psycopg://kv@/kvtierd", "postgresql+psycopg://kv@/kvtierd")),
}


def toml_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def write_toml(tmp_path: Path, entries: dict[Setting, Any] | str) -> Path:
    """A config file with these settings in their [section]s (or this text as is)."""
    if isinstance(entries, str):
        text = entries
    else:
        sections: dict[str, list[str]] = {}
        for s, value in entries.items():
            sections.setdefault(s.section, []).append(f"{s.key} = {toml_literal(value)}")
        text = "".join(f"[{section}]\n" + "\n".join(lines) + "\n\n" for section, lines in sections.items())
    path = tmp_path / "kvtierd.toml"
    path.write_text(text)
    return path


def test_samples_cover_every_setting():
    assert set(SAMPLES) == set(BY_NAME)


def test_defaults():
    s = load_settings(None, {}, None)
    assert s.socket == Path(f"/tmp/kvtierd-{os.getuid()}/kvtierd.sock")
    assert s.socket_mode == 0o660
    assert s.socket_group is None
    assert s.admin_group == "kvtierd-admin"
    assert s.tenant_header == "X-Kvtierd-Tenant"
    assert s.max_body_bytes == 4 << 20
    assert s.drain_timeout_s == 30.0
    assert s.log_level == "info"
    assert s.state_dir == Path.home() / ".local" / "state" / "kvtierd"
    assert s.model is None
    assert s.device == "auto"
    assert (s.block_size, s.kv_cache_bytes) == (16, 1 << 30)
    assert (s.eviction_policy, s.prefix_ttl_s) == ("lru", 0.0)
    assert (s.max_num_batched_tokens, s.max_num_seqs, s.max_model_len, s.default_max_tokens) == (2048, 64, 0, 512)
    assert (s.host_bytes, s.disk_bytes, s.chunk_pages) == (2 << 30, 16 << 30, 16)
    assert (s.disk_codec, s.disk_admission, s.flush_on_shutdown) == ("auto", "reused", True)
    assert s.store_url == f"sqlite:///{s.state_dir}/kvtierd.sqlite3"
    assert (s.model_cache_dir, s.warm_sessions) == (s.state_dir / "model-cache", 8)


@pytest.mark.parametrize("name", list(SAMPLES))
def test_each_layer_overrides_the_one_below(tmp_path, name):
    setting = BY_NAME[name]
    (toml, from_toml), (env, from_env), (flag, from_flag) = SAMPLES[name]
    config = write_toml(tmp_path, {setting: toml})
    environ = {setting.env: env}
    assert getattr(load_settings(config, {}, None), name) == from_toml
    assert getattr(load_settings(None, environ, None), name) == from_env
    assert getattr(load_settings(None, {}, {name: flag}), name) == from_flag
    assert getattr(load_settings(config, environ, None), name) == from_env
    assert getattr(load_settings(config, environ, {name: flag}), name) == from_flag
    assert getattr(load_settings(config, environ, {name: None}), name) == from_env  # a flag not given


def test_settings_are_independent(tmp_path):
    config = write_toml(tmp_path, {BY_NAME["block_size"]: 32, BY_NAME["max_num_seqs"]: 8})
    s = load_settings(config, {"KVTIERD_MAX_NUM_SEQS": "2", "KVTIERD_LOG_LEVEL": "debug"}, {"device": "cpu"})
    assert (s.block_size, s.max_num_seqs, s.log_level, s.device) == (32, 2, "debug", "cpu")
    assert s.max_body_bytes == 4 << 20  # untouched: the default


@pytest.mark.parametrize("text,size", [
    ("512MiB", 512 << 20), ("512 MiB", 512 << 20), ("1GiB", 1 << 30), ("1gib", 1 << 30), ("64KiB", 64 << 10),
    ("2GB", 2 * 10**9), ("10kb", 10_000), ("1TiB", 1 << 40), ("1.5KiB", 1536), ("4096", 4096), ("100B", 100),
    (1073741824, 1 << 30),
])
def test_sizes_parse(text, size):
    assert parse_bytes(text) == size


@pytest.mark.parametrize("text", ["lots", "-1MiB", "1PiB", "1 Mi", "", "MiB", True])
def test_bad_sizes_do_not_parse(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


BAD_VALUES = [
    ("qos_weights", "high=1"),
    ("qos_max_queue_s", "high=1,normal=2,low=-3"),
    ("shed_low_after_s", "-1"),
    ("step_budget_ms", "high=-5"),
    ("step_budget_ms", "top=auto"),
    ("step_budget_ms", "high=auto,high=5"),
    ("step_budget_hold_s", "-1"),
    ("reserved_share", "1.5"),
    ("tenant_classes", "alice=top"),
    ("tenant_cache_weights", "alice=0"),
    ("tenant_cache_weights", "alice"),
    ("tenant_limits", "alice=sessions:0"),
    ("tenant_limits", "alice=remote:0"),
    ("tenant_limits", "alice=disk:0"),
    ("tenant_limits", "alice"),
    ("placement", "carol"),
    ("max_body_bytes", "lots"),
    ("kv_cache_bytes", "1PiB"),
    ("block_size", "big"),
    ("block_size", "0"),
    ("block_size", "257"),
    ("max_num_seqs", "1.5"),
    ("prefill_share", "-0.1"),
    ("prefill_chunk_beside_decodes", "-1"),
    ("drain_timeout_s", "soon"),
    ("socket_mode", "rw"),
    ("socket_mode", "999"),
    ("socket_mode", "7777"),
    ("log_level", "verbose"),
    ("device", "gpu"),
    ("dtype", "int3"),
    ("kv_dtype", "int8"),
    ("eviction_policy", "fifo"),
    ("prefix_ttl_s", "-1"),
    ("hash_algorithm", "crc32"),
    ("compact_threshold", "1.5"),
    ("truncation", "middle"),
    ("truncation_keep_turns", "0"),
    ("session_idle_ttl_s", "-1"),
    ("prefix_ttl_s", "nan"),
    ("host_bytes", "lots"),
    ("chunk_pages", "0"),
    ("disk_codec", "lz4"),
    ("disk_admission", "never"),
    ("flush_on_shutdown", "maybe"),
    ("warm_sessions", "-1"),
    ("store_defer_ms", "-1"),
    ("lookup_wait_share", "-0.1"),
]


@pytest.mark.parametrize("name,value", BAD_VALUES, ids=[f"{n}={v}" for n, v in BAD_VALUES])
def test_bad_value_from_the_environment_names_setting_and_source(name, value):
    setting = BY_NAME[name]
    with pytest.raises(SettingsError) as e:
        load_settings(None, {setting.env: value}, None)
    assert name in str(e.value) and setting.env in str(e.value)


@pytest.mark.parametrize("name,value", BAD_VALUES, ids=[f"{n}={v}" for n, v in BAD_VALUES])
def test_bad_value_from_a_flag_names_setting_and_source(name, value):
    with pytest.raises(SettingsError) as e:
        load_settings(None, {}, {name: value})
    assert name in str(e.value) and f"--{name.replace('_', '-')}" in str(e.value)


@pytest.mark.parametrize("name,value", [
    ("block_size", "big"),
    ("block_size", 0),
    ("block_size", True),  # not 1
    ("max_num_seqs", 1.5),  # not 1
    ("max_body_bytes", -1.0),
    ("socket_mode", 660),  # decimal: 0o1224, not rw-rw----
    ("socket_mode", False),
    ("drain_timeout_s", True),
    ("log_level", "loud"),
    ("eviction_policy", "random"),
    ("prefix_ttl_s", -5),
    ("prefix_ttl_s", True),
])
def test_bad_value_in_the_toml_file_names_setting_file_and_key(tmp_path, name, value):
    setting = BY_NAME[name]
    config = write_toml(tmp_path, {setting: value})
    with pytest.raises(SettingsError) as e:
        load_settings(config, {}, None)
    message = str(e.value)
    assert name in message and str(config) in message and f"[{setting.section}] {setting.key}" in message


@pytest.mark.parametrize("text,says", [
    ("[server]\nsockett = \"/tmp/x.sock\"\n", "unknown setting [server] sockett"),
    ("[serverr]\nsocket = \"/tmp/x.sock\"\n", "unknown setting [serverr] socket"),
    ("[model]\nmodel = \"/m.gguf\"\n", "unknown setting [model] model"),  # the key is `path`
    ("socket = \"/tmp/x.sock\"\n", "'socket' must be a [section]"),
    ("[server\nsocket = 1\n", "is not valid TOML"),
])
def test_bad_toml_file_is_refused(tmp_path, text, says):
    config = write_toml(tmp_path, text)
    with pytest.raises(SettingsError) as e:
        load_settings(config, {}, None)
    assert says in str(e.value) and str(config) in str(e.value)


def test_missing_config_file_is_refused(tmp_path):
    with pytest.raises(SettingsError, match="cannot read config file"):
        load_settings(tmp_path / "nope.toml", {}, None)


def test_unrelated_kvtierd_variables_are_ignored():
    s = load_settings(None, {"KVTIERD_PG_BIN": "/usr/lib/postgresql/15/bin", "KVTIERD_SKIP_POSTGRES": "1"}, None)
    assert s == load_settings(None, {}, None)


# --- where the socket and the state live when nobody says -----------------------------------------------

@pytest.mark.parametrize("environ,socket", [
    ({"RUNTIME_DIRECTORY": "/run/kvtierd"}, "/run/kvtierd/kvtierd.sock"),
    ({"RUNTIME_DIRECTORY": "/run/kvtierd:/run/other"}, "/run/kvtierd/kvtierd.sock"),  # systemd's first entry
    ({"RUNTIME_DIRECTORY": "/run/kvtierd", "XDG_RUNTIME_DIR": "/run/user/1000"}, "/run/kvtierd/kvtierd.sock"),
    ({"XDG_RUNTIME_DIR": "/run/user/1000"}, "/run/user/1000/kvtierd/kvtierd.sock"),
    ({"RUNTIME_DIRECTORY": "", "XDG_RUNTIME_DIR": "/run/user/1000"}, "/run/user/1000/kvtierd/kvtierd.sock"),
    ({"XDG_RUNTIME_DIR": ""}, f"/tmp/kvtierd-{os.getuid()}/kvtierd.sock"),
    ({"RUNTIME_DIRECTORY": "/run/kvtierd", "KVTIERD_SOCKET": "/srv/k.sock"}, "/srv/k.sock"),  # asked beats default
])
def test_default_socket_follows_the_runtime_directory(environ, socket):
    assert load_settings(None, environ, None).socket == Path(socket)


@pytest.mark.parametrize("environ,state_dir", [
    ({"STATE_DIRECTORY": "/var/lib/kvtierd"}, "/var/lib/kvtierd"),
    ({"STATE_DIRECTORY": "/var/lib/kvtierd:/var/lib/other"}, "/var/lib/kvtierd"),
    ({"STATE_DIRECTORY": "/var/lib/kvtierd", "XDG_STATE_HOME": "/home/u/.state"}, "/var/lib/kvtierd"),
    ({"XDG_STATE_HOME": "/home/u/.state"}, "/home/u/.state/kvtierd"),
    ({"STATE_DIRECTORY": "", "XDG_STATE_HOME": ""}, str(Path.home() / ".local" / "state" / "kvtierd")),
    ({"STATE_DIRECTORY": "/var/lib/kvtierd", "KVTIERD_STATE_DIR": "/srv/state"}, "/srv/state"),
])
def test_default_state_dir_follows_the_state_directory(environ, state_dir):
    s = load_settings(None, environ, None)
    assert s.state_dir == Path(state_dir)
    assert s.store_url == f"sqlite:///{state_dir}/kvtierd.sqlite3"  # the store lives in the state dir


def test_store_url_follows_a_state_dir_flag_and_yields_to_its_own():
    assert load_settings(None, {}, {"state_dir": "/srv/s"}).store_url == "sqlite:////srv/s/kvtierd.sqlite3"
    pg = "postgresql+psycopg://kv@/kvtierd"
    assert load_settings(None, {"KVTIERD_STORE_URL": pg}, {"state_dir": "/srv/s"}).store_url == pg


def test_home_is_expanded_in_paths():
    s = load_settings(None, {"KVTIERD_SOCKET": "~/k.sock", "KVTIERD_STATE_DIR": "~/state"}, None)
    assert (s.socket, s.state_dir) == (Path.home() / "k.sock", Path.home() / "state")


def test_serve_prints_a_bad_setting_as_one_line(tmp_path):
    env = {**os.environ, "KVTIERD_LOG_LEVEL": "verbose"}
    done = subprocess.run([sys.executable, "-m", "kvtierd.cli.main", "serve", "--socket", str(tmp_path / "k.sock"),
                           "--state-dir", str(tmp_path / "state")], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: log_level from KVTIERD_LOG_LEVEL"), done.stderr
    assert not (tmp_path / "k.sock").exists()


# --- docs --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("setting", SETTINGS, ids=[s.name for s in SETTINGS])
def test_readme_documents_every_setting(setting):
    readme = (ROOT / "README.md").read_text()
    assert f"`{setting.env}`" in readme, f"README.md does not list {setting.env}"
    assert f"`[{setting.section}] {setting.key}`" in readme, f"README.md does not give {setting.env}'s TOML place"
