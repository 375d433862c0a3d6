"""Context parallelism trains a sequence whose activations do not fit one process, under a real limit.

A GPT-2 of 24 blocks of width 64 on one sequence of 2048 tokens (tests/dist/cp_fits.lua): whole,
its step's activations are about 210 MB; at context 4 each rank holds a quarter of the sequence
and about a quarter of them. Every process gets the same address-space limit (prlimit's
RLIMIT_AS): what the same launches take with a tiny model, plus BUDGET (140 MiB) for the model's
state and activations. The sequence whole, in one process, fails under it; at context 4 (4
processes), ring and all-to-all, it trains two steps inside it.

The address space holds more than tensors, so the launches are made alike: glibc maps blocks of
64 KiB and up on their own (MALLOC_MMAP_THRESHOLD_, so that freed tensors leave the address
space) and keeps one arena (MALLOC_ARENA_MAX=1: a thread's arena reserves 64 MiB), and threads
get stacks of 1 MiB (RLIMIT_STACK), so that the 4-rank launch's extra communication threads do
not outweigh what context parallelism saves. A tiny model's 1-rank and 4-rank processes then
differ by about 10 MiB; the budget leaves about 70 MiB both ways.

Usage: test_cp_fits.py PARTRAIN [BUDGET_MIB]   (a smaller budget shows the context-4 run failing)
"""
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from checks import check, finish  # noqa: E402

BIN = sys.argv[1]
BUDGET = int(sys.argv[2] if len(sys.argv) > 2 else 140) << 20
SCRIPT = "tests/dist/cp_fits.lua"
TINY = ["--seq", "16", "--layers", "1"]
STACK = 1 << 20
ENV = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_ARENA_MAX="1")
MB = 1e6


def run(ranks, args, limit=None):
    """The ranks' reports (None when the run failed) and the run."""
    with tempfile.TemporaryDirectory() as d:
        cmd = ["prlimit", f"--stack={STACK}"]
        if limit:
            cmd.append(f"--as={limit}")
        cmd += ["--", BIN, "--nproc-per-node", str(ranks), "--threads", "1", SCRIPT, *args, "--report", d]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=ENV)
        if r.returncode != 0:
            return None, r
        return [json.load(open(os.path.join(d, f"rank{i}.json"))) for i in range(ranks)], r


def describe(reports):
    return "activations %.1f MB a rank, address space at most %d MiB" % (
        max(m["activations"] for m in reports) / MB, max(m["vm_peak"] for m in reports) >> 20)


# What a process takes besides the model: tiny runs of each launch.
bases = {}
for ranks in (1, 4):
    tiny, r = run(ranks, TINY)
    check(f"a tiny model's {ranks}-rank run reports its address space", tiny is not None, r.stderr[-2000:])
    if tiny is not None:
        bases[ranks] = max(m["vm_peak"] for m in tiny)

whole, r = run(1, [])
check("the whole sequence trains in one process without a limit" + (f" ({describe(whole)})" if whole else ""),
      whole is not None, r.stderr[-2000:])
if whole is not None and len(bases) == 2:
    serial = whole[0]["activations"]
    check(f"its activations ({serial / MB:.1f} MB) are more than the budget ({BUDGET >> 20} MiB) holds",
          serial > BUDGET, serial)
    limit = max(bases.values()) + BUDGET
    what = (f"RLIMIT_AS = {limit >> 20} MiB a process (tiny runs' {bases[1] >> 20} and {bases[4] >> 20} MiB, "
            f"+ {BUDGET >> 20} MiB)")
    failed, r = run(1, [], limit)
    check(f"the whole sequence in one process fails under {what}",
          failed is None and "can't allocate memory" in r.stderr, r.stderr[-2000:])
    for mode in ("ring", "all_to_all"):
        split, r = run(4, ["--mode", mode], limit)
        check(f"at context 4 ({mode}) it trains 2 steps under the same limit"
              + (f" ({describe(split)})" if split else ""), split is not None, r.stderr[-3000:])
        if split is not None:
            most = max(m["activations"] for m in split)
            check(f"a context-4 rank's activations are within 10 % of a quarter of the whole's "
                  f"({most / MB:.1f} MB against {serial / 4 / MB:.1f} MB)", abs(most * 4 / serial - 1) < 0.1,
                  [m["activations"] for m in split])
finish("context-parallel fit")
