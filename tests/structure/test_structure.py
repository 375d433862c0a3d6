"""The code's shape, checked: the engine's layers point one way (engine/ knows nothing of Lua or the
command; engine/parallel, the composer, reports to the planner through step events and never
includes engine/plan; engine/util, the bottom, includes no other layer), no engine file is over
800 lines, and no function in engine/, bindings/ or app/ is over 150 lines (scripts/longest-functions).

Usage: test_structure.py (from the repository root)"""
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from checks import check, finish  # noqa: E402

INCLUDE = re.compile(r'^\s*#\s*include\s*["<]([^">]+)[">]', re.M)
FILE_BUDGET, FUNCTION_BUDGET = 800, 150


def sources(folder):
    for root, _, files in os.walk(folder):
        for name in sorted(files):
            if name.endswith((".cpp", ".hpp")):
                yield os.path.join(root, name)


def includes(path):
    with open(path, encoding="utf-8") as f:
        return INCLUDE.findall(f.read())


def offenders(folder, bad):
    """(file, include) pairs of `folder` whose include `bad` says is out of its layer."""
    return [(p, i) for p in sources(folder) for i in includes(p) if bad(i)]


def say(pairs):
    return "; ".join(f"{p} includes {i}" for p, i in pairs[:5]) or "none"


found = offenders("engine", lambda i: i.startswith(("bindings/", "app/")) or i in ("lua.hpp", "lua.h", "lauxlib.h"))
check("engine/ includes nothing of bindings/, app/ or Lua", not found, say(found))
found = offenders("engine/parallel", lambda i: i.startswith("engine/plan/"))
check("engine/parallel never includes engine/plan (the planner observes step events)", not found, say(found))
found = offenders("engine/util", lambda i: i.startswith("engine/") and not i.startswith("engine/util/")
                  and i != "engine/compat.hpp")
check("engine/util includes no other engine layer", not found, say(found))
# The check can fail: a parallel file that includes the planner, planted in a scratch folder, is seen.
with tempfile.TemporaryDirectory() as scratch:
    with open(os.path.join(scratch, "planted.cpp"), "w") as f:
        f.write('// A file out of its layer.\n#include <vector>\n  #  include "engine/plan/plan.hpp"\n')
    planted = offenders(scratch, lambda i: i.startswith("engine/plan/"))
check("the include check finds a planted include of engine/plan", len(planted) == 1, say(planted))

long_files = []
for path in sources("engine"):
    with open(path, encoding="utf-8") as f:
        n = sum(1 for _ in f)
    if n > FILE_BUDGET:
        long_files.append(f"{path} ({n} lines)")
check(f"no file in engine/ is over {FILE_BUDGET} lines", not long_files, ", ".join(long_files))

run = subprocess.run([sys.executable, "scripts/longest-functions", "--top", "5", "--over", str(FUNCTION_BUDGET),
                      "engine", "bindings", "app"], capture_output=True, text=True)
check(f"no function in engine/, bindings/ or app/ is over {FUNCTION_BUDGET} lines", run.returncode == 0,
      run.stdout + run.stderr)
# ... and the script does fail past its budget: with a budget of 10 lines something is longer.
strict = subprocess.run([sys.executable, "scripts/longest-functions", "--over", "10", "engine"],
                        capture_output=True, text=True)
check("scripts/longest-functions fails when a function is over --over", strict.returncode == 1,
      strict.stdout[-300:] + strict.stderr[-300:])
finish("structure")
