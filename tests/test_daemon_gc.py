"""The daemon freezes its startup heap: a full garbage collection later walks only what requests made."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import gc, json
import torch  # what a daemon holds for its life: torch's modules, and (here) a model's worth of objects
from kvtierd.server.daemon import freeze_startup_heap
kept = [{"layer": i, "params": [object() for _ in range(20)]} for i in range(2000)]
before = len(gc.get_objects())
freeze_startup_heap()
after_freeze = len(gc.get_objects())
later = [[i] for i in range(100)]  # what a request makes afterwards is tracked as ever
after_later = len(gc.get_objects())
print(json.dumps({"before": before, "after_freeze": after_freeze, "after_later": after_later,
                  "frozen": gc.get_freeze_count()}))
"""


def test_after_freezing_a_collection_walks_only_what_came_later():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    n = json.loads(done.stdout)
    assert n["frozen"] >= n["before"] - 1000  # (the probe's own frames and the collected garbage aside)
    assert n["after_freeze"] < n["before"] / 20
    assert n["after_later"] >= n["after_freeze"] + 100  # new objects are still collected
