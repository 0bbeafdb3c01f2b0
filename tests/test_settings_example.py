"""systemd/kvtierd.toml.example: every setting, rendered from the SETTINGS table, loadable as is.

The committed file must equal what `kvtierd config example` prints, so a new
setting fails here until the file is regenerated. As shipped (all commented
out) and with every setting uncommented, it loads to the defaults.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from kvtierd.server.settings import SETTINGS, load_settings
from kvtierd.server.settings_example import render_example

EXAMPLE = Path(__file__).resolve().parents[1] / "systemd" / "kvtierd.toml.example"
REGENERATE = "regenerate it: .venv/bin/kvtierd config example > systemd/kvtierd.toml.example"
SETTING_LINE = re.compile(r"^#(\w+ = .*)$", re.MULTILINE)


def test_committed_example_is_the_rendered_one():
    assert EXAMPLE.read_text() == render_example(), f"{EXAMPLE} is out of date with kvtierd/server/settings.py; {REGENERATE}"


def test_kvtierd_config_example_prints_it():
    done = subprocess.run([sys.executable, "-m", "kvtierd.cli.main", "config", "example"], capture_output=True,
                          text=True, timeout=60, check=True)
    assert done.stdout == render_example()


def test_example_lists_every_setting_in_its_section():
    doc = tomllib.loads(SETTING_LINE.sub(r"\1", render_example()))
    assert {(section, key) for section, table in doc.items() for key in table} == {(s.section, s.key) for s in SETTINGS}
    for s in SETTINGS:
        assert f"# {s.help}\n# env: {s.env}\n#{s.key} = " in render_example(), s.name


def test_example_loads_to_the_defaults_as_shipped_and_uncommented(tmp_path):
    defaults = load_settings(None, {}, None)
    shipped = tmp_path / "shipped.toml"
    shipped.write_text(render_example())
    tomllib.loads(shipped.read_text())
    assert load_settings(shipped, {}, None) == defaults
    uncommented = tmp_path / "uncommented.toml"
    uncommented.write_text(SETTING_LINE.sub(r"\1", render_example()))
    assert load_settings(uncommented, {}, None) == defaults
