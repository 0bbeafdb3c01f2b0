"""Faults at start: each stops the daemon at once with one clear line, a non-zero exit and no traceback,
before the model loads where the fault is not in the model (tests/test_daemon_errors.py covers a live
daemon's socket and a path that is not a socket; tests/test_settings.py a bad value from the environment).

The cases run side by side (each process spends its few seconds importing), one test each.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fault_fixtures import remove_root, report, short_root
from kvtierd.model.bundled import bundled_gguf_path
from service_fixtures import spawn_daemon


@dataclass(frozen=True)
class Case:
    # Makes the fault under a fresh root; returns (wrapper command, serve args, the line expected).
    make: Callable[[Path], tuple[list[str], list[str], str]]
    exit_code: int


def _config(root: Path, data: bytes) -> Path:
    path = root / "kvtierd.toml"
    path.write_bytes(data)
    return path


def config_not_utf8(root: Path):
    path = _config(root, b'[server]\nlog_level = "info"\n# caf\xe9\n')
    return [], ["--config", str(path)], f"error: {path} is not valid TOML: not UTF-8 text"


def config_unreadable(root: Path):
    path = _config(root, b'[server]\nlog_level = "info"\n')
    path.chmod(0)
    wrapper = []
    if os.geteuid() == 0:  # root reads anything: run it without the capabilities that let it
        if not shutil.which("setpriv"):
            pytest.skip("running as root without setpriv (util-linux): cannot make a file unreadable")
        wrapper = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"]
    return wrapper, ["--config", str(path)], f"error: cannot read config file {path}: Permission denied"


def config_bad_value(root: Path):
    path = _config(root, b"[cache]\nblock_size = 0\n")
    return [], ["--config", str(path)], (f"error: block_size from {path} [cache] block_size: must be between 1 and "
                                         "256, got 0")


def socket_dir_cannot_be_made(root: Path):
    (root / "a-file").write_text("")
    path = root / "a-file" / "run" / "kvtierd.sock"
    return [], ["--socket", str(path)], f"error: cannot make the socket's directory {path.parent}: Not a directory"


def socket_path_too_long(root: Path):
    path = root / ("d" * 100) / "kvtierd.sock"
    return [], ["--socket", str(path)], (f"error: socket path {path} is too long: a Unix socket path has at most "
                                         "107 bytes")


def model_a_text_file(root: Path):
    path = root / "model.gguf"
    path.write_text("not a model\n")
    return [], ["--model", str(path)], f"error: {path} is not a readable GGUF file: GGUF magic invalid"


def model_a_cut_gguf(root: Path):
    path = root / "cut.gguf"
    with open(bundled_gguf_path(), "rb") as f:
        path.write_bytes(f.read(1 << 20))  # the header and part of the metadata
    return [], ["--model", str(path)], f"error: {path} is not a readable GGUF file"


def state_dir_a_file(root: Path):
    path = root / "state-file"
    path.write_text("")
    return [], ["--state-dir", str(path)], f"error: state_dir from --state-dir: {path} exists and is not a directory"


CASES = {
    "config not UTF-8": Case(config_not_utf8, 2),
    "config unreadable": Case(config_unreadable, 2),
    "config with a bad value": Case(config_bad_value, 2),
    "socket directory cannot be made": Case(socket_dir_cannot_be_made, 1),
    "socket path too long": Case(socket_path_too_long, 1),
    "model a text file": Case(model_a_text_file, 1),
    "model a cut GGUF file": Case(model_a_cut_gguf, 1),
    "state dir a file": Case(state_dir_a_file, 2),
}


@dataclass
class Outcome:
    exit_code: int
    lines: list[str]
    expected: str


@pytest.fixture(scope="module")
def outcomes() -> Iterator[dict[str, Outcome | pytest.skip.Exception]]:
    roots = {name: short_root() for name in CASES}
    try:
        started = {}
        for name, case in CASES.items():
            try:
                wrapper, args, expected = case.make(roots[name])
            except pytest.skip.Exception as e:
                started[name] = e
                continue
            started[name] = (spawn_daemon(roots[name], wrapper, *args), expected)
        results: dict[str, Outcome | pytest.skip.Exception] = {}
        for name, item in started.items():
            if isinstance(item, pytest.skip.Exception):
                results[name] = item
                continue
            d, expected = item
            try:
                code = d.process.wait(120)
            finally:
                if d.process.poll() is None:
                    d.process.kill()
                    d.process.wait()
            results[name] = Outcome(code, d.log_text().splitlines(), expected)
        yield results
    finally:
        for root in roots.values():
            remove_root(root)


@pytest.mark.parametrize("name", CASES)
def test_a_startup_fault_is_one_clear_line(outcomes, name):
    outcome = outcomes[name]
    if isinstance(outcome, pytest.skip.Exception):
        pytest.skip(str(outcome))
    assert outcome.exit_code == CASES[name].exit_code, outcome
    assert len(outcome.lines) == 1, outcome.lines  # no traceback, not even a "model loaded" line
    assert outcome.lines[0].startswith(outcome.expected), outcome.lines


def test_the_startup_faults_figures(outcomes, capsys):
    """The suite's summary line, asserted: every case that ran failed clearly and none printed a traceback."""
    done = [o for o in outcomes.values() if isinstance(o, Outcome)]
    clear = sum(o.exit_code != 0 and len(o.lines) == 1 and o.lines[0].startswith(o.expected) for o in done)
    tracebacks = sum("Traceback" in "\n".join(o.lines) or len(o.lines) > 1 for o in done)
    report(capsys, "startup faults", cases=len(done), one_clear_line_and_non_zero_exit=clear, tracebacks=tracebacks,
           skipped=len(outcomes) - len(done))
    assert done, "no startup fault ran"
    assert (clear, tracebacks) == (len(done), 0)
