"""partrain plan --auto from the command line: the search, its outputs and its refusals.

- At world 4 (a small GPT-2, the shipped cpu device) the search plans every layout the example
  can take; the JSON's winner is the first fitting candidate, predicted no slower than any other
  fitting one, and its flags are the example's; each fitting candidate's peak is at most the
  device memory; the winner planned alone by the plan command has the step's peak the search
  printed, or a little less (the search weighs the whole run: a backward's transients too).
- Under a device memory below the unsharded layouts' peaks, the ZeRO tiers are tried.
- --save-config writes the winner's values as a config file that the script takes (--config).
- --verify trains the winner and the runner-up at world 2 against the serial run (parity).
- Bad input: an unknown device, a device file that is not a table, one that runs forever, a FIFO, --device-memory 0, --device
  without --auto, --verify with --json, and a memory no layout fits (the message names the least any layout needs, and
  that layout) are refused with status 1 and a message naming the value.

Usage: test_auto.py PARTRAIN   (from the source folder)
"""
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from checks import check, finish  # noqa: E402

BIN = sys.argv[1]
SCRIPT = "examples/gpt/train.lua"
MODEL = ["--dim", "64", "--heads", "4", "--layers", "4", "--seq", "32", "--batch", "8"]
tmp = tempfile.mkdtemp(prefix="test-auto-")


def run(*words, timeout=600):
    return subprocess.run([BIN, *words], capture_output=True, text=True, timeout=timeout)


# The search at world 4, as JSON.
r = run("plan", "--auto", "--world", "4", "--device", "cpu", "--json", "--top", "100", SCRIPT, *MODEL)
check("plan --auto --json at world 4 succeeds", r.returncode == 0, r.stderr)
found = json.loads(r.stdout) if r.returncode == 0 else {"candidates": []}
fitting = [c for c in found["candidates"] if c.get("fits")]
check("it weighs tensor, pipeline, context and schedule layouts",
      all(any(k in c["text"] for c in found["candidates"]) for k in ("tensor 2", "pipeline 4", "context 2", "zbv", "1f1b")),
      [c["text"] for c in found["candidates"]][:40])
best = min(fitting, key=lambda c: c["step"]) if fitting else None
check("the winner is the fitting layout predicted fastest", best is not None and found["best"] == best["text"],
      (found.get("best"), best and best["text"]))
memory = 16 * 2**30
check("every fitting layout's peak is within the device's memory",
      all(0 < c["peak_bytes"] <= memory for c in fitting), [(c["text"], c["peak_bytes"]) for c in fitting][:5])

# The winner's peak against the plan command's own plan of it.
if best:
    flags = best["flags"] if isinstance(best["flags"], list) else []
    r = run("plan", "--world", "4", "--json", SCRIPT, *MODEL, *flags)
    plan = json.loads(r.stdout) if r.returncode == 0 else {"ranks": []}
    peak = max((x["model_state_bytes"] + max(x["activation_bytes"], 0) for x in plan["ranks"]), default=-1)
    # (the search's is the whole run's: the step's, or more when the first backward's transients or
    # the setup held more with the optimizer state added; never less)
    check("the winner's peak is the plan command's, or its whole run's within 5 % above",
          best["exact"] and peak <= best["peak_bytes"] <= peak * 1.05,
          (peak, best["peak_bytes"], best["exact"], flags))

# A memory below the unsharded layouts' peaks: the ZeRO tiers are tried, and what is picked fits.
cap = int(min(c["peak_bytes"] for c in fitting if "pipeline" not in c["text"] and "context" not in c["text"]) * 0.9)
r = run("plan", "--auto", "--world", "4", "--device", "cpu", "--device-memory", str(cap), "--json", "--top", "100",
        SCRIPT, *MODEL)
tight = json.loads(r.stdout) if r.returncode == 0 else {"candidates": []}
check("under a tighter memory the ZeRO tiers are tried and the pick fits",
      any("ZeRO" in c["text"] for c in tight["candidates"])
      and all(c["peak_bytes"] <= cap for c in tight["candidates"] if c.get("fits")), r.stderr[-500:])

# --save-config: a config file the script takes.
config = os.path.join(tmp, "best.lua")
r = run("plan", "--auto", "--world", "4", "--device", "cpu", "--save-config", config, SCRIPT, *MODEL)
check("--save-config writes the winner", r.returncode == 0 and os.path.isfile(config), r.stderr)
if os.path.isfile(config):
    r = run("plan", "--world", "4", SCRIPT, *MODEL, "--config", config)
    check("the script takes the config file", r.returncode == 0, r.stderr)

# --verify: the winner and the runner-up against the serial run, at world 2.
r = run("plan", "--auto", "--world", "2", "--device", "cpu", "--verify", "--verify-steps", "3", SCRIPT, *MODEL,
        "--log-every", "1", "--sample", "0")
verdicts = r.stdout.count("within tolerance")
check("--verify trains the winner and the runner-up equal to the serial run", r.returncode == 0 and verdicts == 2,
      r.stdout[-2000:] + r.stderr[-2000:])

# Bad input.
r = run("plan", "--auto", "--world", "4", "--device", "tpu9", SCRIPT, *MODEL)
check("an unknown device is refused, naming it and the shipped ones",
      r.returncode == 1 and "tpu9" in r.stderr and "h100" in r.stderr, r.stderr)
bad = os.path.join(tmp, "bad.lua")
with open(bad, "w") as f:
    f.write("return 42\n")
r = run("plan", "--auto", "--world", "4", "--device", bad, SCRIPT, *MODEL)
check("a device file that is not a table is refused, naming the file", r.returncode == 1 and "bad.lua" in r.stderr,
      r.stderr)
loop = os.path.join(tmp, "loop.lua")
with open(loop, "w") as f:
    f.write("while true do end\n")
r = run("plan", "--auto", "--world", "4", "--device", loop, SCRIPT, *MODEL, timeout=120)
check("a device file that runs forever is stopped, naming the file", r.returncode == 1 and "loop.lua" in r.stderr
      and "too long" in r.stderr, r.stderr)
fifo = os.path.join(tmp, "fifo.lua")
os.mkfifo(fifo)
r = run("plan", "--auto", "--world", "4", "--device", fifo, SCRIPT, *MODEL, timeout=60)
check("a device 'file' that is a FIFO is refused, never waited on", r.returncode == 1 and "fifo.lua" in r.stderr,
      r.stderr)
r = run("plan", "--auto", "--world", "4", "--device-memory", "0", SCRIPT, *MODEL)
check("--device-memory 0 is refused with its range", r.returncode == 1 and "--device-memory 0" in r.stderr, r.stderr)
r = run("plan", "--world", "4", "--device", "h100", SCRIPT, *MODEL)
check("--device without --auto is refused", r.returncode == 1 and "--auto" in r.stderr, r.stderr)
r = run("plan", "--auto", "--world", "4", "--device", "cpu", "--json", "--verify", SCRIPT, *MODEL)
check("--verify with --json is refused (its verdicts are not JSON)",
      r.returncode == 1 and "--verify" in r.stderr and "--json" in r.stderr, r.stderr)
r = run("plan", "--auto", "--world", "4", "--device", "cpu", "--device-memory", "1MiB", SCRIPT, *MODEL)
check("a memory no layout fits names the least any layout needs and which",
      r.returncode == 1 and "no layout fits 1.00 MiB a rank" in r.stderr and "the least any needs is" in r.stderr
      and "(" in r.stderr.split("the least any needs is")[-1], r.stderr)

finish("plan --auto")
