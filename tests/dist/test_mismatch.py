"""Ranks that disagree on a collective (tests/dist/mismatch.lua, 2 ranks through the launcher).

Without --check-collectives, pt.dist's blocking collectives refuse ranks that disagree on the
operation, dtype, shape or root, naming each rank's call; an async size mismatch that Gloo trips
over on one of its own threads must end the run with exit status 1 and a message naming the rank,
the collective and the script line, never SIGABRT. With --check-collectives every kind of disagreement (size, dtype, shape
with the same element count, reduce op, a call skipped and made up later, broadcast root, a
collective inside partrain's own Lua, a reduce-scatter against an all-reduce of its stacked
inputs) is refused before any data moves, naming each rank's call and
the user's line.

    python3 tests/dist/test_mismatch.py build/partrain
"""
import os
import re
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, ".."))
from checks import check, finish  # noqa: E402

binary = os.path.abspath(sys.argv[1])
root = os.path.dirname(os.path.dirname(here))
worker = "tests/dist/mismatch.lua"  # relative: messages name it as a user would see it


def run(mode, checked):
    cmd = [binary, "--nproc-per-node", "2", "--threads", "1", "--timeout", "20"]
    if checked:
        cmd.append("--check-collectives")
    p = subprocess.run(cmd + [worker, mode], capture_output=True, text=True, timeout=120, cwd=root,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    return p.returncode, p.stdout + p.stderr


# Unchecked, an async call: Gloo receives more bytes than the tensor holds on one rank's transport
# thread, and the run still ends with a clear error.
rc, out = run("size_async", checked=False)
check("unchecked async size: exit status 1, not a signal", rc == 1 and "SIG" not in out, out)
check("unchecked async size: names the rank, the collective and the line",
      re.search(r"partrain: rank \d: a collective failed because the ranks disagree on it", out) is not None
      and "at tests/dist/mismatch.lua:40 on group 'world'" in out, out)

# Checked: each rank's call listed, with its own line.
cases = {
    "size": ["all_reduce(sum) of float32 [4] at tests/dist/mismatch.lua:12", "all_reduce(sum) of float32 [1000] at tests/dist/mismatch.lua:12"],
    "dtype": ["of float32 [4] at tests/dist/mismatch.lua:15", "of float64 [4] at tests/dist/mismatch.lua:15"],
    "shape": ["of float32 [2, 3] at tests/dist/mismatch.lua:18", "of float32 [3, 2] at tests/dist/mismatch.lua:18"],
    "op": ["all_reduce(sum) of float32 [4] at tests/dist/mismatch.lua:21", "all_reduce(max) of float32 [4] at tests/dist/mismatch.lua:21"],
    "skip": ["rank 0: all_reduce(sum) of float32 [4] at tests/dist/mismatch.lua:24",
             "rank 1: all_reduce(sum) of float32 [4] at tests/dist/mismatch.lua:25"],
    "gather": ["all_gather of float32 [3] at tests/dist/mismatch.lua:29", "all_gather of float32 [5] at tests/dist/mismatch.lua:29"],
    "root": ["rank 0: broadcast from group rank 0 of", "rank 1: broadcast from group rank 1 of"],
    "library": ["rank 0: all_gather of float32 [4, 4] at tests/dist/mismatch.lua:37", "rank 1: barrier at tests/dist/mismatch.lua:37"],
    "flat_op": ["rank 0: reduce_scatter(sum) of float32 [4] at tests/dist/mismatch.lua:42",
                "rank 1: reduce_scatter(max) of float32 [4] at tests/dist/mismatch.lua:42"],
    # The reduce-scatter of a list is carried by an all-reduce of the stacked inputs, [2, 2] here.
    "scatter_vs_reduce": ["rank 0: reduce_scatter(sum) of float32 [2, 2] at tests/dist/mismatch.lua:44",
                          "rank 1: all_reduce(sum) of float32 [2, 2] at tests/dist/mismatch.lua:44"],
}
# Without --check-collectives, pt.dist's blocking collectives still check that the ranks agree on
# the operation, dtype, shape and root (not the line): every case but the skip is refused alike.
for mode, wants in cases.items():
    if mode in ("skip", "library"):  # the same call from other lines; a barrier inside partrain's Lua
        continue
    rc, out = run(mode, checked=False)
    check(f"unchecked {mode}: refused with exit status 1, not a signal", rc == 1 and "finished" not in out
          and "SIG" not in out, out)
    check(f"unchecked {mode}: each rank's call is named", "the ranks called different collectives" in out
          and all(w in out for w in wants) and "pt.dist's collectives check this" in out, out)

for mode, wants in cases.items():
    rc, out = run(mode, checked=True)
    check(f"checked {mode}: refused with exit status 1", rc == 1 and "finished" not in out, out)
    check(f"checked {mode}: each rank's call is named", "the ranks called different collectives" in out
          and all(w in out for w in wants), out)
    messages = "\n".join(line for line in out.splitlines() if "partrain: rank" in line)
    check(f"checked {mode}: the message names the user's line once, none inside partrain's own Lua",
          "init.lua" not in messages and re.search(r"(mismatch\.lua:\d+: ){2}", messages) is None, messages)

# The same script with agreeing ranks passes the check (no false alarm from the check itself).
p = subprocess.run([binary, "--nproc-per-node", "4", "--threads", "1", "--check-collectives",
                    os.path.join(here, "test_collectives.lua")], capture_output=True, text=True, timeout=300,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))
check("test_collectives.lua passes under --check-collectives", p.returncode == 0, p.stdout + p.stderr)

finish("collective-mismatch")
