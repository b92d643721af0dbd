"""freeze_startup_heap, in a child interpreter: freezing is for a whole
service process, never for the test run's own heap."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

_CHILD = """
import gc
import weakref
from services.common.gc_heap import freeze_startup_heap

class Node:
    pass

gc.disable()  # nothing collects before the freeze but the freeze itself
garbage_a, garbage_b = Node(), Node()
garbage_a.other, garbage_b.other = garbage_b, garbage_a   # start-up garbage: a cycle
garbage = weakref.ref(garbage_a)
del garbage_a, garbage_b
live = Node()
frozen = freeze_startup_heap()
assert garbage() is None, "start-up garbage was frozen instead of collected"
assert not any(o is live for o in gc.get_objects()), "a live start-up object is still scanned"
assert frozen == gc.get_freeze_count() > 0
print(frozen)
"""


def test_freeze_collects_start_up_garbage_then_freezes_the_rest() -> None:
    out = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) > 0
