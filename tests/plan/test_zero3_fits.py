"""ZeRO-3 makes a model fit that ZeRO-2 cannot hold, as the planner says and a memory limit proves.

A GPT-2 of 85 M parameters (12 blocks of 768): its parameters (341 MB) and AdamW's two moments
(682 MB) are 1 GB whole. Given 600 MiB a rank (--device-memory), `partrain plan` at 4 ranks says
ZeRO-2 does not fit (each rank keeps every parameter whole) and suggests ZeRO-3, and says ZeRO-3
fits. Then 4 real ranks train it at ZeRO-3 two steps under an address-space limit (prlimit's
RLIMIT_AS) of that budget above what the same ranks take with a tiny model, and ZeRO-2 under the
same limit fails: the limit is real and ZeRO-3 stays inside it. glibc is told to map large
blocks (MALLOC_MMAP_THRESHOLD_), so that freed tensors leave the address space.

Usage: test_zero3_fits.py PARTRAIN
"""
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from checks import check, finish  # noqa: E402

BIN = sys.argv[1]
SCRIPT = "tests/plan/gpt2_step.lua"
MODEL = ["--dim", "768", "--layers", "12", "--heads", "12", "--seq", "32", "--batch", "4", "--vocab", "256"]
TINY = ["--dim", "64", "--layers", "1", "--heads", "2", "--seq", "32", "--batch", "4", "--vocab", "256"]
BUDGET = 600 << 20
ENV = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_ARENA_MAX="2")


def verdict(stage):
    r = subprocess.run([BIN, "plan", "--world", "4", "--device-memory", str(BUDGET), SCRIPT, "--zero-stage",
                        str(stage), *MODEL], capture_output=True, text=True, timeout=120)
    lines = r.stdout.splitlines()
    return r, lines[2] if len(lines) > 2 else ""


def real(args, limit=None):
    """The 4 ranks' reports (None when the run failed) and the run."""
    with tempfile.TemporaryDirectory() as d:
        cmd = [BIN, "--nproc-per-node", "4", "--threads", "1", SCRIPT, *args, "--steps", "2", "--report", d]
        if limit:
            cmd = ["prlimit", f"--as={limit}", "--"] + cmd
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=ENV)
        if r.returncode != 0:
            return None, r
        return [json.load(open(os.path.join(d, f"rank{i}.json"))) for i in range(4)], r


r, line = verdict(2)
check("ZeRO-2 at 4 ranks: the planner says the model does not fit in 600 MiB and suggests ZeRO-3 (" + line + ")",
      r.returncode == 0 and line.startswith("does not fit: ranks 0-3") and "try ZeRO-3 over the 4 zero ranks" in line,
      r.stdout + r.stderr)
r, line = verdict(3)
check("ZeRO-3 at 4 ranks: the planner says it fits (" + line + ")",
      r.returncode == 0 and line.startswith("fits: peak") and "ZeRO-3 over 4 rank(s)" in r.stdout, r.stdout + r.stderr)

tiny, r = real(["--zero-stage", "3", *TINY])
check("a tiny model's run reports its address space", tiny is not None, r.stderr[-2000:])
if tiny is not None:
    limit = max(m["vm_peak"] for m in tiny) + BUDGET
    trained, r = real(["--zero-stage", "3", *MODEL], limit)
    check(f"ZeRO-3 trains 2 steps on 4 ranks under RLIMIT_AS = the tiny run's {max(m['vm_peak'] for m in tiny) >> 20} "
          f"MiB + 600 MiB" + (f" (the most: {max(m['vm_peak'] for m in trained) >> 20} MiB)" if trained else ""),
          trained is not None, r.stderr[-3000:])
    whole, r = real(["--zero-stage", "2", *MODEL], limit)
    check("ZeRO-2 under the same limit fails: the limit is one the whole parameters do not fit",
          whole is None and "can't allocate memory" in r.stderr, r.stderr[-2000:])
finish("ZeRO-3 fit")
