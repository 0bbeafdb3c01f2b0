"""kvtierd installed as an operator installs it: the wheel, a fresh virtual environment, the README's service
sequence.

The wheel is built by the README's own command from a copy of the checkout (so a stale build/ here cannot
leak into it) and must hold every module of the source tree and the kernels' and migrations' data. It is
installed into a virtual environment outside the checkout, whose daemon and kvtierctl are run from a
directory outside it with no PYTHONPATH. Those environments see this checkout's third-party packages (torch
and the rest) through a .pth file naming a folder of links to them, kvtierd's own left out, so nothing is
downloaded or reinstalled; the test checks kvtierd is imported from the new environment.

The "Install as a service" sequence runs line by line into a scratch root: /opt, /usr/bin and /etc become
folders under it, systemd-sysusers and systemd-tmpfiles get --root, and only `systemctl` is left out.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon_fixtures import Daemon, wait_ready

ROOT = Path(__file__).resolve().parents[1]
PYTHON_DIR = f"python{sys.version_info.major}.{sys.version_info.minor}"
# Where each source folder lands in the wheel (setup.py's package-dir).
SOURCE_ROOTS = {"kvtierd": "kvtierd", "kernels": "kvtierd/kernels", "storage": "kvtierd/storage",
                "migrations": "kvtierd/migrations"}
PACKAGE_DATA = ("kernels/cuda/*.cu", "kernels/cuda/*.cuh", "kernels/cpu/*.c", "kernels/cpu/*.h",
                "migrations/script.py.mako")
NOT_SOURCE = (".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis", "state",
              "bench-out")
# What a daemon must not inherit: a path that would let it import this checkout instead of the wheel.
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONDONTWRITEBYTECODE")}


def run(argv: list[str] | str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    done = subprocess.run(argv, cwd=cwd, env=env or CLEAN_ENV, capture_output=True, text=True, timeout=timeout,
                          shell=isinstance(argv, str), executable="/bin/bash" if isinstance(argv, str) else None)
    assert done.returncode == 0, f"{argv} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.stdout


def readme_block(heading: str) -> list[str]:
    """The command lines of the first indented block under a README heading."""
    text = (ROOT / "README.md").read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"\n\n((?:    \S.*\n)+)", section)
    assert block, f"no command block under {heading!r}"
    return [line[4:] for line in block.group(1).splitlines()]


SERVICE = readme_block("Install as a service")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    # A short path: the daemon's socket lives under it (sun_path holds ~107 bytes).
    return tmp_path_factory.mktemp("inst")


@pytest.fixture(scope="module")
def checkout(work: Path) -> Path:
    """A copy of the source tree, as a fresh clone has it."""
    copy = work / "src"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(*NOT_SOURCE), symlinks=True)
    return copy


@pytest.fixture(scope="module")
def wheel(checkout: Path) -> Path:
    """The wheel, built by the README's first service-install line."""
    build = SERVICE[0]
    assert build.startswith(".venv/bin/pip wheel "), build
    run(build.replace(".venv/bin/", f"{Path(sys.executable).parent}/", 1), cwd=checkout)
    (built,) = (checkout / "dist").glob("kvtierd-*.whl")
    assert any(str(Path("dist") / built.name) in line for line in SERVICE), f"the README installs another wheel"
    return built


@pytest.fixture(scope="module")
def deps_view(work: Path) -> Path:
    """Links to this environment's installed packages, kvtierd's own (its editable finder too) left out."""
    view = work / "deps"
    view.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not (entry.name.startswith(("kvtierd", "__editable__")) or entry.suffix == ".pth"):
            (view / entry.name).symlink_to(entry)
    return view


def new_venv(path: Path, deps: Path, *, with_pip: bool) -> Path:
    """A virtual environment made with the base interpreter (`python3 -m venv`), seeing `deps` as well."""
    base = Path(sys.base_prefix) / "bin" / "python3"
    run([str(base), "-m", "venv", *([] if with_pip else ["--without-pip"]), str(path)], cwd=path.parent)
    see_deps(path, deps)
    return path


def see_deps(venv: Path, deps: Path) -> None:
    (venv / "lib" / PYTHON_DIR / "site-packages" / "kvtierd-test-deps.pth").write_text(f"{deps}\n")


# --- the wheel ----------------------------------------------------------------------------------------------


def source_modules(checkout: Path) -> set[str]:
    return {f"{target}/{py.relative_to(checkout / folder).as_posix()}"
            for folder, target in SOURCE_ROOTS.items() for py in (checkout / folder).rglob("*.py")}


def test_the_wheel_holds_every_module_and_its_data(wheel: Path, checkout: Path):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    modules = {n for n in names if n.endswith(".py")}
    assert modules == source_modules(checkout)
    assert {"kvtierd/server/daemon.py", "kvtierd/tiers/tier_manager.py", "kvtierd/storage/session_store.py",
            "kvtierd/migrations/versions/0001_sessions_and_messages.py"} <= modules
    data = {f"{SOURCE_ROOTS[p.split('/')[0]]}/{p.split('/', 1)[1]}" for pattern in PACKAGE_DATA
            for p in (str(f.relative_to(checkout)) for f in checkout.glob(pattern))}
    assert len(data) >= 6 and data <= names
    assert not any(n.startswith(("tests/", "kernels/", "storage/", "migrations/")) for n in names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    with zipfile.ZipFile(wheel) as z:
        scripts = z.read(entry_points).decode()
    assert "kvtierd = kvtierd.cli.main:app" in scripts and "kvtierctl = kvtierd.cli.ctl:app" in scripts


def test_the_wheel_serves_from_a_fresh_environment(wheel: Path, work: Path, deps_view: Path):
    venv = new_venv(work / "venv", deps_view, with_pip=False)
    python = venv / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", "--no-compile",
         str(wheel)], cwd=work)
    site = venv / "lib" / PYTHON_DIR / "site-packages"
    where = json.loads(run([str(python), "-c", "import json, kvtierd, kvtierd.storage, kvtierd.migrations, "
                            "kvtierd.kernels; print(json.dumps([m.__file__ for m in (kvtierd, kvtierd.storage, "
                            "kvtierd.migrations, kvtierd.kernels)]))"], cwd=work))
    assert all(Path(f).is_relative_to(site) for f in where), where

    outside = work / "elsewhere"  # not the checkout: nothing there to import by accident
    outside.mkdir()
    sock, log = work / "k.sock", work / "daemon.log"
    env = {**CLEAN_ENV, "KVTIERD_KV_CACHE_BYTES": "256MiB"}
    process = subprocess.Popen([str(venv / "bin" / "kvtierd"), "serve", "--socket", str(sock), "--state-dir",
                                str(work / "state")], cwd=outside, env=env, stdout=log.open("wb"),
                               stderr=subprocess.STDOUT)
    daemon = Daemon(process, sock, work / "state", log)
    try:
        wait_ready(daemon)
        with daemon.openai() as client:
            reply = client.chat.completions.create(model="default", max_tokens=4, temperature=0,
                                                   messages=[{"role": "user", "content": "Say hi."}])
        assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
        status = json.loads(run([str(venv / "bin" / "kvtierctl"), "--socket", str(sock), "status", "--json"],
                                cwd=outside, env=env))
        assert status["engine"]["num_blocks"] > 0 and status["model"]["name"]
    finally:
        assert daemon.stop() == 0, daemon.log_text()
    # pip compiled nothing (--no-compile): the bytecode there was written by the daemon importing the
    # wheel's files, the renamed roots' and the migrations' among them.
    for package in ("server", "storage", "migrations/versions", "tiers"):
        assert list((site / "kvtierd" / package / "__pycache__").glob("*.pyc")), package


# --- the service install sequence ------------------------------------------------------------------------


def in_scratch(line: str, root: Path, venv_bin: Path) -> str:
    """A README line, moved under the scratch root."""
    line = line.replace(".venv/bin/", f"{venv_bin}/")
    for top in ("/opt/", "/usr/bin/", "/etc/"):
        line = re.sub(rf"(?<![\w.]){re.escape(top)}", f"{root}{top}", line)
    line = line.replace("systemd-sysusers ", f"systemd-sysusers --root={root} ")
    line = line.replace("systemd-tmpfiles ", f"systemd-tmpfiles --root={root} ")
    if " -g kvtierd " in line:  # the group exists in the scratch root's /etc/group, not this host's
        gid = next(fields[2] for fields in (g.split(":") for g in (root / "etc/group").read_text().splitlines())
                   if fields[0] == "kvtierd")
        line = line.replace(" -g kvtierd ", f" -g {gid} ")
    return line


@pytest.fixture(scope="module")
def scratch(work: Path, checkout: Path, wheel: Path, deps_view: Path) -> Iterator[tuple[Path, list[str]]]:
    """The README's sequence run into a scratch root: (the root, the systemctl lines left for a real host)."""
    if os.geteuid() != 0:
        pytest.skip("the service sequence gives files to the kvtierd user and group: root only")
    root = work / "root"
    for folder in ("opt", "usr/bin", "etc/systemd/system", "etc/sysusers.d", "etc/tmpfiles.d"):
        (root / folder).mkdir(parents=True)
    left = []
    # `python3` is this environment's base interpreter, whose version the linked packages were built for.
    env = {**CLEAN_ENV, "PATH": f"{Path(sys.base_prefix) / 'bin'}:{CLEAN_ENV['PATH']}"}
    for line in SERVICE[1:]:
        if line.startswith("systemctl "):
            left.append(line)
            continue
        run(in_scratch(line, root, Path(sys.executable).parent), cwd=checkout, env=env)
        if line.startswith("python3 -m venv "):
            see_deps(root / "opt" / "kvtierd", deps_view)
    yield root, left


def test_the_service_sequence_installs_and_links_kvtierd(scratch):
    root, left = scratch
    assert left == ["systemctl daemon-reload", "systemctl enable --now kvtierd.socket kvtierd.service",
                    "systemctl status kvtierd"]
    for name in ("kvtierd", "kvtierctl"):
        link = root / "usr/bin" / name
        assert link.is_symlink() and link.resolve() == (root / "opt/kvtierd/bin" / name).resolve()
    assert "kvtierctl" in run([str(root / "usr/bin/kvtierctl"), "--help"], cwd=root)
    site = root / "opt/kvtierd/lib" / PYTHON_DIR / "site-packages"
    where = run([str(root / "opt/kvtierd/bin/python"), "-c", "import kvtierd.cli.main as m; print(m.__file__)"],
                cwd=root)
    assert Path(where.strip()).is_relative_to(site)


def test_the_service_sequence_makes_users_directories_and_settings(scratch):
    root, _ = scratch
    users = {line.split(":")[0] for line in (root / "etc/passwd").read_text().splitlines()}
    groups = {line.split(":")[0]: line.split(":")[2] for line in (root / "etc/group").read_text().splitlines()}
    assert "kvtierd" in users and {"kvtierd", "kvtierd-clients", "kvtierd-admin"} <= set(groups)
    assert (root / "run/kvtierd").is_dir()
    settings = (root / "etc/kvtierd/kvtierd.toml").stat()
    assert stat.S_IMODE(settings.st_mode) == 0o640 and str(settings.st_gid) == groups["kvtierd"]
    assert (root / "etc/kvtierd/kvtierd.toml").read_text() == (ROOT / "systemd/kvtierd.toml.example").read_text()
    assert {p.name for p in (root / "etc/systemd/system").iterdir()} == {
        "kvtierd.service", "kvtierd.socket", "kvtierd@.service", "kvtierd@.socket"}


def test_the_installed_units_verify_with_the_installed_link(scratch, tmp_path):
    """systemd-analyze checks the units as installed, their ExecStart=/usr/bin/kvtierd being the scratch root's
    link (it checks the command is executable on this host's paths, so the copies name the link there)."""
    root, _ = scratch
    for name in ("kvtierd.service", "kvtierd.socket"):
        text = (root / "etc/systemd/system" / name).read_text()
        (tmp_path / name).write_text(text.replace("/usr/bin/kvtierd ", f"{root}/usr/bin/kvtierd "))
    done = subprocess.run(["systemd-analyze", "verify", "--man=no", "--generators=no", str(tmp_path / "kvtierd.service"),
                           str(tmp_path / "kvtierd.socket")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), done.stdout + done.stderr
