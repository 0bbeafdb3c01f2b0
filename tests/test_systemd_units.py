"""systemd/: the units verify, sysusers and tmpfiles make what the units expect, and the daemon
runs under the units' system-call filter.

`systemd-analyze verify` checks the units as systemd would load them (a unit it
merely warns about counts as failed here, and a broken copy must fail); it
also checks that ExecStart's binary exists, so the copies verified run this
checkout's `kvtierd`. systemd-sysusers and systemd-tmpfiles run into a scratch
root. The daemon serving under SystemCallFilter= shows PyTorch survives it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_fixtures import wait_ready
from service_fixtures import spawn_daemon

ROOT = Path(__file__).resolve().parents[1]
SYSTEMD = ROOT / "systemd"
UNITS = ("kvtierd.service", "kvtierd.socket", "kvtierd@.service", "kvtierd@.socket")
CHECKED = ("kvtierd.service", "kvtierd.socket", "kvtierd@0.service", "kvtierd@0.socket")  # a template loads as an instance
INSTALLED = "/usr/bin/kvtierd"


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found: `make system-deps` installs it (Debian package systemd)")
    return path


def unit_copies(directory: Path) -> Path:
    """The units, with ExecStart running the kvtierd this checkout installed instead of /usr/bin/kvtierd."""
    entry_point = Path(sys.executable).with_name("kvtierd")
    assert entry_point.is_file(), f"{entry_point} is missing: run `make install`"
    directory.mkdir()
    for name in UNITS:
        text = (SYSTEMD / name).read_text()
        if name.endswith(".service"):
            assert f"ExecStart={INSTALLED} serve --config /etc/kvtierd/kvtierd.toml" in text, name
        (directory / name).write_text(text.replace(INSTALLED, str(entry_point)))
    return directory


def verify(directory: Path, *names: str) -> str:
    """What `systemd-analyze verify` says about these units; a clean pass says nothing."""
    done = subprocess.run([tool("systemd-analyze"), "verify", "--man=no", "--generators=no",
                           *(str(directory / n) for n in names)], check=False, capture_output=True, text=True, timeout=60)
    said = (done.stdout + done.stderr).strip()
    return said or ("" if done.returncode == 0 else f"exit status {done.returncode}")


def test_units_verify(tmp_path):
    assert verify(unit_copies(tmp_path / "units"), *CHECKED) == ""


@pytest.mark.parametrize("unit,old,new,says", [
    ("kvtierd.service", "ProtectSystem=strict", "ProtectSytem=strict", "Unknown key"),
    ("kvtierd.service", "Type=notify", "Type=notifyy", "Failed to parse service type"),
    ("kvtierd.service", "SystemCallFilter=@system-service", "SystemCallFilter=@system-servic", "Unknown system call group"),
    ("kvtierd@.service", "Requires=kvtierd@%i.socket", "Requires=kvtierd-gpu@%i.socket", "not found"),
    ("kvtierd.socket", "SocketMode=0660", "SocketMode=rw-rw----", "Failed to parse"),
])
def test_a_broken_unit_fails_verification(tmp_path, unit, old, new, says):
    directory = unit_copies(tmp_path / "units")
    text = (directory / unit).read_text()
    assert old in text
    (directory / unit).write_text(text.replace(old, new))
    assert says in verify(directory, *CHECKED)


def test_a_missing_binary_fails_verification(tmp_path):
    directory = unit_copies(tmp_path / "units")
    missing = tmp_path / "nowhere" / "kvtierd"
    service = directory / "kvtierd.service"
    service.write_text(re.sub(r"^ExecStart=\S+", f"ExecStart={missing}", service.read_text(), flags=re.MULTILINE))
    assert f"Command {missing} is not executable" in verify(directory, *CHECKED)


def directives(unit: str) -> set[str]:
    return {line for line in (SYSTEMD / unit).read_text().splitlines() if line and not line.startswith("#")}


def differ(unit: str, other: str) -> set[str]:
    """The keys whose lines are not the same in both units."""
    return {line.split("=")[0] for line in directives(unit) ^ directives(other)}


def test_the_per_gpu_units_differ_only_in_gpu_socket_and_state():
    assert differ("kvtierd.service", "kvtierd@.service") == {
        "Description", "Requires", "After", "ExecStart", "StateDirectory", "Environment", "EnvironmentFile"}
    # Placement: each instance is named by its GPU and may read its own settings (its tenants).
    assert "Environment=KVTIERD_INSTANCE=gpu%i" in directives("kvtierd@.service")
    assert "EnvironmentFile=-/etc/kvtierd/gpu%i.env" in directives("kvtierd@.service")
    assert differ("kvtierd.socket", "kvtierd@.socket") == {"Description", "ListenStream"}
    assert "ListenStream=/run/kvtierd/gpu%i.sock" in directives("kvtierd@.socket")
    assert ("ExecStart=/usr/bin/kvtierd serve --config /etc/kvtierd/kvtierd.toml --device cuda:%i "
            "--socket /run/kvtierd/gpu%i.sock --state-dir %S/kvtierd/gpu%i") in directives("kvtierd@.service")
    assert "StateDirectory=kvtierd/gpu%i" in directives("kvtierd@.service")


# --- sysusers and tmpfiles --------------------------------------------------------------------------------

def directive(unit: str, key: str) -> str:
    (value,) = re.findall(rf"^{key}=(.*)$", (SYSTEMD / unit).read_text(), re.MULTILINE)
    return value


def test_sysusers_and_tmpfiles_make_the_user_groups_and_directories(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("systemd-tmpfiles gives the directories their owners: root only")
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    for name, folder in (("kvtierd.sysusers", "sysusers.d"), ("kvtierd.tmpfiles", "tmpfiles.d")):
        (root / "usr/lib" / folder).mkdir(parents=True)
        shutil.copy(SYSTEMD / name, root / "usr/lib" / folder / "kvtierd.conf")
    for command in ([tool("systemd-sysusers"), f"--root={root}"], [tool("systemd-tmpfiles"), f"--root={root}", "--create"]):
        done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "Failed" not in done.stderr, done.stderr

    users = {e[0]: e for e in (line.split(":") for line in (root / "etc/passwd").read_text().splitlines())}
    groups = {e[0]: int(e[2]) for e in (line.split(":") for line in (root / "etc/group").read_text().splitlines())}
    user = users[directive("kvtierd.service", "User")]
    assert user[5] == "/var/lib/kvtierd" and user[6].endswith("nologin")
    assert int(user[3]) == groups[directive("kvtierd.service", "Group")]
    assert directive("kvtierd.socket", "SocketGroup") in groups
    assert "kvtierd-admin" in groups  # [server] admin_group's default

    sockets = root / Path(directive("kvtierd.socket", "ListenStream")).parent.relative_to("/")
    assert sockets == root / Path(directive("kvtierd@.socket", "ListenStream")).parent.relative_to("/")
    st = sockets.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (int(user[2]), 0o755)
    config = (root / "etc/kvtierd").stat()
    assert (config.st_uid, config.st_gid, config.st_mode & 0o777) == (0, groups["kvtierd"], 0o750)


# --- the system-call filter ---------------------------------------------------------------------------------

def syscall_groups() -> dict[str, list[str]]:
    """systemd's @groups and their members (system calls and nested @groups), as this systemd defines them."""
    listing = subprocess.run([tool("systemd-analyze"), "syscall-filter"], capture_output=True, text=True,
                             check=True, timeout=60).stdout
    groups: dict[str, list[str]] = {}
    for line in listing.splitlines():
        if line.startswith("@"):
            current = groups.setdefault(line.strip(), [])
        elif line.startswith("    ") and not line.strip().startswith("#"):
            current.append(line.strip())
    return groups


def allowed_syscalls(unit: str) -> set[str]:
    """Every system call the unit's SystemCallFilter= allow-list lets through."""
    groups = syscall_groups()
    names = set()
    entries = [e for value in re.findall(r"^SystemCallFilter=(.*)$", (SYSTEMD / unit).read_text(), re.MULTILINE)
               for e in value.split()]
    assert entries and not any(e.startswith("~") for e in entries), entries  # an allow-list only
    while entries:
        entry = entries.pop()
        if entry.startswith("@"):
            entries.extend(groups[entry])
        else:
            names.add(entry)
    return names


def test_daemon_serves_under_the_units_system_call_filter(tmp_path):
    allowed = allowed_syscalls("kvtierd.service")
    assert allowed == allowed_syscalls("kvtierd@.service")
    seccomp = [sys.executable, str(Path(__file__).with_name("seccomp_exec.py")), ",".join(sorted(allowed)), "--"]
    d = spawn_daemon(tmp_path, seccomp)
    try:
        wait_ready(d)
        with d.client() as c:
            session = c.post("/v1/sessions", json={"title": "seccomp"}).json()["id"]  # the SQLite store writes
            r = c.post(f"/v1/sessions/{session}/messages", json={"content": "Say hi.", "max_tokens": 4})
            assert r.status_code == 200, r.text
        assert d.stop() == 0, d.log_text()  # a refused call would have killed it: -SIGSYS
    finally:
        if d.process.poll() is None:
            d.process.kill()
            d.process.wait()
