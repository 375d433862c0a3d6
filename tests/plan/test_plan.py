"""partrain plan against real runs.

- For GPT-2 at tensor 2 x data 2 and at tensor 4, the planned model-state bytes of every rank
  (parameters + gradients + optimizer state) match what pt.memory_report() says after a real
  step within 2 %, and the planned activations match the bytes the real forward left allocated
  within 25 %.
- A saved plan checks a real run: match passes on the same layout and fails, naming tensors, on
  another; override rewrites the file; moo writes a missing one; a damaged file is an error.
- A 64-rank plan of a GPT-2 with 1.5 B parameters (GPT-2 XL's sizes) takes seconds and
  allocates no tensor memory.
- Bad input: a layout the script cannot take, a --nproc-per-node that does not divide --world.
- What is not built yet (pipeline, ZeRO) is refused at the script's line, and no zero groups are
  printed.

Usage: test_plan.py PARTRAIN
"""
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from checks import check, finish  # noqa: E402

BIN = sys.argv[1]
SCRIPT = "tests/plan/gpt2_step.lua"


def run(args, **kw):
    return subprocess.run([BIN] + args, capture_output=True, text=True, timeout=600, **kw)


def plan(world, *script_args, extra=()):
    r = run(["plan", "--world", str(world), "--json", *extra, SCRIPT, *script_args])
    if r.returncode != 0:
        raise SystemExit("partrain plan failed:\n" + r.stderr)
    return json.loads(r.stdout)


def real(nproc, *script_args):
    with tempfile.TemporaryDirectory() as d:
        r = run(["--nproc-per-node", str(nproc), "--threads", "1", SCRIPT, *script_args, "--report", d])
        if r.returncode != 0:
            raise SystemExit("the real run failed:\n" + r.stderr)
        return [json.load(open(os.path.join(d, f"rank{i}.json"))) for i in range(nproc)]


# ---- Planned bytes against a real run's -------------------------------------------------------
for layout in (["--tensor", "2"], ["--tensor", "4"]):
    name = "tensor %s x data %d" % (layout[1], 4 // int(layout[1]))
    planned = plan(4, *layout)
    measured = real(4, *layout)
    worst_state, worst_act = 0.0, 0.0
    for r, m in zip(planned["ranks"], measured):
        state = m["params"] + m["grads"] + m["optimizer"]
        worst_state = max(worst_state, abs(r["model_state_bytes"] - state) / state)
        worst_act = max(worst_act, abs(r["activation_bytes"] - m["activations"]) / m["activations"])
    check(f"{name}: planned model-state bytes match the real run's within 2 % (worst {worst_state:.4%})",
          worst_state <= 0.02, (planned["ranks"][0], measured[0]))
    check(f"{name}: planned activations match the real forward's within 25 % (worst {worst_act:.4%})",
          worst_act <= 0.25, (planned["ranks"][0]["activation_bytes"], measured[0]["activations"]))
    check(f"{name}: the plan's mesh and shards describe the layout",
          planned["mesh"]["tensor"] == int(layout[1]) and planned["world"] == 4
          and any(s["dim"] == 0 and s["name"] == "wte.weight" for s in planned["ranks"][0]["shards"]),
          planned["mesh"])
    kinds = {c["group"].split("[")[0] for c in planned["ranks"][0]["collectives"]}
    check(f"{name}: the plan lists the step's collectives by group", "tensor" in kinds
          and ("data" in kinds) == (layout[1] == "2"), planned["ranks"][0]["collectives"])

# ---- The text form ----------------------------------------------------------------------------
r = run(["plan", "--world", "4", SCRIPT, "--tensor", "2"])
check("the text plan shows the shard map, memory per rank and collectives",
      r.returncode == 0 and "ranks 0,2 [0:128]; ranks 1,3 [128:256]" in r.stdout
      and "memory per rank" in r.stdout and "tensor all_reduce" in r.stdout, r.stdout + r.stderr)

# ---- Saved plans checked by real runs ---------------------------------------------------------
with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "plan.bin")
    r = run(["plan", "--world", "4", "--save", path, SCRIPT, "--tensor", "2"])
    check("plan --save writes the plan", r.returncode == 0 and os.path.getsize(path) > 0, r.stderr)
    r = run(["--nproc-per-node", "4", "--threads", "1", "--plan", path, SCRIPT, "--tensor", "2", "--steps", "2"])
    check("a run on the planned layout matches its plan (match)",
          r.returncode == 0 and "matches the plan" in r.stderr, r.stderr)
    r = run(["--nproc-per-node", "4", "--threads", "1", "--plan", path, SCRIPT, "--tensor", "4"])
    check("a run on another layout fails the match, naming the layout and a tensor",
          r.returncode != 0 and "does not match the plan" in r.stderr and "layout: planned world 4 (tensor 2"
          in r.stderr and "wte.weight: planned" in r.stderr, r.stderr)
    r = run(["--nproc-per-node", "4", "--threads", "1", "--plan", path, "--plan-mode", "override", SCRIPT,
             "--tensor", "4"])
    check("override writes the run's plan over the file", r.returncode == 0 and "wrote this run's plan" in r.stderr,
          r.stderr)
    r = run(["--nproc-per-node", "4", "--threads", "1", "--plan", path, SCRIPT, "--tensor", "4"])
    check("... and a run on that layout then matches it", r.returncode == 0 and "matches the plan" in r.stderr,
          r.stderr)
    fresh = os.path.join(d, "fresh.bin")
    r = run(["--nproc-per-node", "2", "--threads", "1", "--plan", fresh, "--plan-mode", "moo", SCRIPT])
    check("moo writes a plan that is missing", r.returncode == 0 and os.path.exists(fresh), r.stderr)
    r = run(["--nproc-per-node", "2", "--threads", "1", "--plan", fresh, "--plan-mode", "moo", SCRIPT])
    check("moo matches a plan that agrees", r.returncode == 0 and "matches the plan" in r.stderr, r.stderr)
    r = run(["--threads", "1", "--plan", os.path.join(d, "missing.bin"), SCRIPT])
    check("match against a missing plan is an error naming it",
          r.returncode != 0 and "there is no plan at" in r.stderr and "missing.bin" in r.stderr, r.stderr)
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    r = run(["--nproc-per-node", "4", "--threads", "1", "--plan", path, SCRIPT, "--tensor", "4"])
    check("a truncated plan is an error naming the file",
          r.returncode != 0 and "damaged or truncated" in r.stderr and path in r.stderr, r.stderr)
    open(path, "wb").write(b"not a plan at all, just some bytes")
    r = run(["--threads", "1", "--plan", path, SCRIPT])
    check("a foreign file is an error naming it", r.returncode != 0 and "not a partrain plan" in r.stderr, r.stderr)

# ---- Planning a 64-rank layout of GPT-2 with 1.5 B parameters -----------------------------------
# GPT-2 XL's sizes (48 layers of 1600, vocabulary 50257, 1024 positions) with 32 heads of 50, so
# that tensor 8 divides them (XL's 25 heads do not).
xl = ["--vocab", "50257", "--seq", "1024", "--dim", "1600", "--heads", "32", "--layers", "48", "--batch", "64",
      "--tensor", "8"]
start = time.time()
before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
big = plan(64, *xl)
seconds = time.time() - start
rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
logical = {}
for r in big["ranks"]:
    for s in r["shards"]:
        n = 1
        for x in s["shape"]:
            n *= x
        logical[s["name"]] = n
total = sum(logical.values())
check(f"the XL layout has 1.5 B parameters ({total / 1e9:.3f} B) over 64 ranks, tensor 8 x data 8",
      1.5e9 < total < 1.6e9 and len(big["ranks"]) == 64 and big["mesh"]["data"] == 8, big["mesh"])
per_rank = big["ranks"][5]["param_bytes"]
check(f"an XL rank holds about an eighth of the weights ({per_rank / (4 * total):.4f})",
      0.12 < per_rank / (4 * total) < 0.14, per_rank)
check(f"planning 64 ranks of it finishes in seconds ({seconds:.1f} s)", seconds < 60, seconds)
check(f"... and allocates no tensor memory (CPU tensors peak {big['cpu_peak_bytes']} B, "
      f"process peak {rss / 2**20:.0f} MiB against {4 * total / 2**30:.1f} GiB of weights)",
      big["cpu_peak_bytes"] < 2**20 and rss < 2**30, (big["cpu_peak_bytes"], rss))

# ---- Bad input --------------------------------------------------------------------------------
r = run(["plan", "--world", "4", SCRIPT, "--tensor", "3"])
check("a layout the script cannot take names the rank and the sizes",
      r.returncode != 0 and "plan: rank 0 of 4" in r.stderr and "3" in r.stderr, r.stderr)
r = run(["plan", "--world", "6", "--nproc-per-node", "4", SCRIPT])
check("--nproc-per-node must divide --world", r.returncode != 0 and "does not divide --world 6" in r.stderr, r.stderr)
r = run(["plan", SCRIPT])
check("--world is required", r.returncode != 0 and "--world" in r.stderr, r.stderr)
r = run(["--plan-mode", "moo", SCRIPT])
check("--plan-mode needs --plan", r.returncode != 0 and "--plan-mode needs --plan" in r.stderr, r.stderr)

# ---- What is not built yet is refused, not planned -----------------------------------------------
r = run(["plan", "--world", "4", SCRIPT, "--tensor", "2"])
check("a plan prints no zero groups while ZeRO is not built",
      r.returncode == 0 and "zero" not in r.stdout.split("\n")[0], r.stdout[:400])
with tempfile.TemporaryDirectory() as d:
    for option, words in (("zero = 2", "zero=2: ZeRO (optimizer state split over the data group) is not implemented yet"),):
        script = os.path.join(d, "unbuilt.lua")
        with open(script, "w") as f:
            f.write('local pt = require "partrain"\n\nlocal mesh = pt.mesh { %s }\n' % option)
        r = run(["plan", "--world", "4", script])
        check(f"partrain plan refuses {option} at the script's line",
              r.returncode != 0 and words in r.stderr and "unbuilt.lua:3" in r.stderr, r.stderr)
    script = os.path.join(d, "pipelined.lua")
    with open(script, "w") as f:
        f.write('local pt = require "partrain"\nlocal mesh = pt.mesh { pipeline = 2 }\n'
                'pt.parallelize(pt.models.gpt2 { vocab = 64, seq = 8, dim = 16, heads = 4, layers = 2 }, '
                '"policies.gpt2", mesh)\n')
    r = run(["plan", "--world", "2", script])
    check("partrain plan refuses a pipelined model at the script's line",
          r.returncode != 0 and "partrain plan does not plan pipeline parallelism yet" in r.stderr
          and "pipelined.lua:3" in r.stderr, r.stderr)

finish("plan")
