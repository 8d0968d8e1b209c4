"""The garbage-collector watch: freeze after ready, pauses counted (in a child process, so the
test process's own objects are never frozen)."""

import json
import subprocess
import sys

CHILD = """
import gc, json
from breakgraph.common import gc_watch
before = gc_watch.report()
keep = [[i] for i in range(50_000)]  # start-up objects: frozen, never walked again
frozen = gc_watch.freeze()
for _ in range(3):  # cyclic garbage made while serving
    a = []; a.append(a)
    gc.collect()
print(json.dumps({"before": before, "frozen": frozen, "after": gc_watch.report(),
                  "count": gc.get_freeze_count()}))
"""


def test_freeze_moves_startup_objects_out_and_counts_pauses():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         check=True, timeout=120)  # fmt: skip
    r = json.loads(out.stdout)
    assert r["before"]["gc_collections_after_ready"] == 0  # not ready: nothing counted
    assert r["frozen"] >= 50_000 and r["count"] == r["frozen"]
    after = r["after"]
    assert after["gc_frozen_objects"] == r["frozen"]
    assert after["gc_collections_after_ready"] == 3
    assert 0 < after["gc_max_pause_seconds_after_ready"] <= after["gc_pause_seconds_after_ready"]
