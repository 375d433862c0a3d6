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
- Zero groups that do not fit the data group are refused at the script's line,
  and none are printed without ZeRO.
- Pipeline 4 (1F1B and GPipe): each rank's planned model-state bytes match a real 4-rank run's
  within 2 % and its planned peak activations (a micro-batch's activations times the schedule's
  peak in flight, plus a received gradient) the CPU allocator's peak during a real step within
  25 %; the stages, bubble, in-flight counts and point-to-point traffic are as the schedule says;
  GPipe's activations double with twice the micro-batches while 1F1B's stay flat; a saved
  pipelined plan matches a real run; 64 ranks of GPT-2 small at pipeline 4 plan in seconds; a
  world the pipeline does not divide and chunks that do not fit the blocks are refused.
- ZeRO-1, ZeRO-2 (float32 and bfloat16) and a plain bfloat16 run at data 4: each rank's planned
  optimizer-state, master-weight, gradient and parameter bytes match a real 4-rank run's tensors
  within 2 %; the zero stage and group are in the JSON and the text; ZeRO's optimizer state is a
  quarter of the unsharded one's (plus padding: a tied tensor has one slot in the flat buffer).
- ZeRO-3 (prefetch 1 float32, prefetch 2 bfloat16) at data 4: the planned parameter shards, the units
  gathered at once (root + (1 + prefetch) blocks), gradients, optimizer state, masters and
  activations match the real run's (its peak gathered bytes) within 2 %; under a pipeline every
  unit of a stage is planned as gathered, and pipeline 2 x zero 2's planned activations (each
  chunk's and the schedule's peak) are ZeRO-2's within 2 % (the units gathered and the gradient
  scratch are model state, not activations) and the real step's allocator peak within 25 %.
- Context parallelism (context 2 and 4, GPT-2 and LLaMA, ring and all_to_all): the plan records
  the context size and coordinates; each rank's activations are about 1/c of the unsplit model's
  and match a real 2-rank run's within 10 %; the predicted traffic of either mode is the formula's
  and what the planned step and a real run's context group move, to the byte; the text compares
  the two modes (and says when all_to_all cannot split the heads); ZeRO-2 is suggested over data
  x context; a saved context plan matches a real run.
- A plan saved in format version 1 (before pipeline stages) still loads; a later version is
  refused by name.

Usage: test_plan.py PARTRAIN
"""
import json
import re
import os
import resource
import struct
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
        state = m["params"] + m["grads"] + m["optimizer"] + m["master"]
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

# ---- Sequence parallelism: the first step's activations, as the engine counts them ---------------
# The policy's sequence-parallel forward runs in Lua: the probe's pass through it must not begin
# the first step, and garbage freed during the forward (the serial model pt.parallelize replaced)
# must not count against it. Both had made pt.plan.first_step().activations wrong (even negative).
planned = plan(4, "--tensor", "2", "--sequence_parallel")
measured = real(4, "--tensor", "2", "--sequence_parallel")
engine_off = max(abs(m["engine_activations"] - m["activations"]) / m["activations"] for m in measured)
plan_off = max(abs(r["activation_bytes"] - m["activations"]) / m["activations"]
               for r, m in zip(planned["ranks"], measured))
check(f"sequence parallel: pt.plan.first_step().activations matches the bytes the forward left allocated "
      f"within 2 % (worst {engine_off:.4%})", engine_off <= 0.02, measured[0])
check(f"sequence parallel: the planned activations match the real forward's within 2 % (worst {plan_off:.4%})",
      plan_off <= 0.02, (planned["ranks"][0]["activation_bytes"], measured[0]))

# ---- ZeRO and bfloat16: each column against a real run ------------------------------------------
# At data 4, ZeRO-1 and ZeRO-2 (float32 and bfloat16) and a plain bfloat16 run: the planned
# optimizer-state, master-weight and gradient bytes of every rank against what a real run's tensors
# hold after its first step (pt.memory_report: each storage once), within 2 %.
for extra in (["--zero-stage", "1"], ["--zero-stage", "2"], ["--zero-stage", "2", "--dtype", "bfloat16"],
              ["--dtype", "bfloat16"]):
    name = " ".join(extra)
    planned = plan(4, *extra)
    measured = real(4, *extra)
    worst = {}
    for r, m in zip(planned["ranks"], measured):
        for column, key in (("optimizer_bytes", "optimizer"), ("master_bytes", "master"), ("grad_bytes", "grads"),
                            ("param_bytes", "params")):
            worst[key] = max(worst.get(key, 0.0), abs(r[column] - m[key]) / max(m[key], 1))
    check(f"{name} at data 4: planned optimizer-state, master, gradient and parameter bytes match the real run's "
          "within 2 % (worst " + ", ".join(f"{k} {v:.3%}" for k, v in worst.items()) + ")",
          max(worst.values()) <= 0.02 and all(m["master"] > 0 for m in measured),
          [(r["optimizer_bytes"], r["master_bytes"], r["grad_bytes"], m) for r, m in zip(planned["ranks"], measured)][:2])
    stage = int(extra[1]) if extra[0] == "--zero-stage" else 0
    check(f"{name}: the plan's JSON shows the zero stage and group",
          all(r["zero"] == {"stage": stage, "group": 4 if stage else 1} for r in planned["ranks"])
          and all(m["zero_stage"] == stage for m in measured), planned["ranks"][0]["zero"])
    if stage:
        plain = plan(4, *[a for a in extra if a not in ("--zero-stage", "1", "2")])["ranks"][0]
        ratio = planned["ranks"][0]["optimizer_bytes"] / plain["optimizer_bytes"]
        check(f"{name}: each rank's optimizer state is a quarter of the unsharded one's, plus padding ({ratio:.4f})",
              0.25 <= ratio <= 0.2525, (planned["ranks"][0]["optimizer_bytes"], plain["optimizer_bytes"]))
# ZeRO-3 at data 4, 6 blocks: parameters are the shards plus the units gathered at once (the root
# unit and 1 + prefetch blocks), equal to the most a real run gathered during its first step;
# gradients, optimizer state and masters (none for float32: the shard is the master) as measured,
# and the activations without the units the forward left gathered.
for extra in (["--prefetch", "1"], ["--prefetch", "2", "--dtype", "bfloat16"]):
    args = ["--zero-stage", "3", "--layers", "6", *extra]
    name = " ".join(args)
    planned = plan(4, *args)
    measured = real(4, *args)
    worst = {}
    for r, m in zip(planned["ranks"], measured):
        z3 = r["zero3"]
        for key, p, q in (("shard", z3["param_shard_bytes"], m["param_shard"]),
                          ("gathered", z3["gather_bytes"], m["peak_gathered"]),
                          ("grads", r["grad_bytes"], m["grads"]), ("optimizer", r["optimizer_bytes"], m["optimizer"]),
                          ("master", r["master_bytes"], m["master"]),
                          ("activations", r["activation_bytes"], m["engine_activations"])):
            worst[key] = max(worst.get(key, 0.0), abs(p - q) / max(q, 1))
    check(f"{name} at data 4: planned shards, units gathered at once, gradients, optimizer state, masters and "
          "activations match the real run within 2 % (worst " + ", ".join(f"{k} {v:.3%}" for k, v in worst.items()) + ")",
          max(worst.values()) <= 0.02, [(r["zero3"], r["activation_bytes"], m) for r, m in zip(planned["ranks"], measured)][:1])
    m, r = measured[0], planned["ranks"][0]
    check(f"{name}: parameters are the shards plus root + (1 + prefetch) blocks, a quarter of the model's and less",
          r["param_bytes"] == r["zero3"]["param_shard_bytes"] + r["zero3"]["gather_bytes"]
          and r["zero3"]["gather_bytes"] == m["root_unit"] + (1 + int(extra[1])) * m["largest_unit"]
          and r["zero"] == {"stage": 3, "group": 4} and m["params"] == m["param_shard"], (r["zero3"], m))
r = run(["plan", "--world", "4", SCRIPT, "--zero-stage", "3", "--layers", "4", "--pipeline", "2", "--steps", "2"])
check("a pipelined ZeRO-3 plan says every unit of a stage stays gathered",
      r.returncode == 0 and "ZeRO-3 over 2 rank(s)" in r.stdout and "every unit (reshard_after_forward off, a "
      "pipeline's default" in r.stdout and "the shard (and any parameter kept whole) + the units gathered" in r.stdout,
      r.stdout + r.stderr)
# Pipeline 2 x zero 2: the units a stage gathers at their first use (held for the step) and the
# gradient scratch its first backward takes are parameters and gradients, not activations, so the
# planned activations are ZeRO-2's (they had counted the gathered units twice: 9.06 MiB against
# 6.82 MiB, and ZeRO-2's its scratch twice) and the real step's.
PIPE_Z = ["--layers", "4", "--pipeline", "2", "--steps", "2"]
by_stage = {z: plan(4, "--zero-stage", z, *PIPE_Z)["ranks"] for z in ("2", "3")}
off = max(max(abs(a["activation_bytes"] - b["activation_bytes"]) / b["activation_bytes"],
              *(abs(p["activation_bytes"] - q["activation_bytes"]) / q["activation_bytes"]
                for p, q in zip(a["pipeline"]["chunks"], b["pipeline"]["chunks"])))
          for a, b in zip(by_stage["3"], by_stage["2"]))
check(f"pipeline 2 x zero 2: ZeRO-3's planned activations (chunks and peak) are ZeRO-2's within 2 % (worst {off:.4%})",
      off <= 0.02, [(a["activation_bytes"], b["activation_bytes"]) for a, b in zip(by_stage["3"], by_stage["2"])])
measured = real(4, "--zero-stage", "3", *PIPE_Z)
worst_act = max(abs(r["activation_bytes"] - m["activations"]) / m["activations"] for r, m in zip(by_stage["3"], measured))
check(f"pipeline 2 x zero 2, ZeRO-3: planned peak activations match the real step's allocator peak within 25 % "
      f"(worst {worst_act:.4%})", worst_act <= 0.25,
      [(r["activation_bytes"], m["activations"]) for r, m in zip(by_stage["3"], measured)])
r = run(["plan", "--world", "4", SCRIPT, "--zero-stage", "2"])
check("the text plan of a ZeRO-2 run names the stage, the group and the masters column, and says what stage 2 holds",
      r.returncode == 0 and "ZeRO-2 over 4 rank(s)" in r.stdout and "masters" in r.stdout
      and "gradients are the shard (what the update reads) plus the scratch" in r.stdout, r.stdout + r.stderr)

# ---- The text form ----------------------------------------------------------------------------
r = run(["plan", "--world", "4", "-v", SCRIPT, "--tensor", "2"])
check("the text plan with -v shows the shard map, memory per rank and collectives",
      r.returncode == 0 and "ranks 0,2 [0:128]; ranks 1,3 [128:256]" in r.stdout
      and "memory per rank" in r.stdout and "tensor all_reduce" in r.stdout, r.stdout + r.stderr)
r = run(["plan", "--world", "4", SCRIPT, "--tensor", "2"])
check("without -v the shard map is one line saying how to see it",
      r.returncode == 0 and "[128:256]" not in r.stdout and "logical tensors (partrain plan -v lists" in r.stdout,
      r.stdout)

# ---- Does it fit? -----------------------------------------------------------------------------
def peaks(text):
    """Each memory row's peak column, in bytes."""
    units = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
    rows = text.split("memory per rank")[1].split("\n\n")[0].splitlines()[2:]
    out = []
    for row in rows:
        f = row.split()
        out.append(float(f[11]) * units[f[12]])  # ranks, then 5 sizes of 2 fields: the 6th is the peak
    return out

r = run(["plan", "--world", "4", "--device-memory", "1GiB", SCRIPT, "--tensor", "2"])
lines = r.stdout.splitlines()
check("--device-memory opens the plan with 'fits', the peak and the ranks",
      r.returncode == 0 and len(lines) > 2 and lines[2].startswith("fits: peak ")
      and "of 1.00 GiB (--device-memory) on ranks 0-3" in lines[2], r.stdout + r.stderr)
top = max(peaks(r.stdout))
check("the verdict's peak is the largest row's peak (model state + activations)",
      f"fits: peak {top / (1 << 20):.2f} MiB" in lines[2], (lines[2], top))
small = int(top * 0.9)
r = run(["plan", "--world", "4", "--device-memory", str(small), SCRIPT, "--tensor", "2"])
lines = r.stdout.splitlines()
check("a device smaller than the peak: 'does not fit', what the rank needs and what to try",
      r.returncode == 0 and len(lines) > 2 and lines[2].startswith("does not fit: ranks 0-3 need up to ")
      and "model state" in lines[2] and "try ZeRO-2 over the 2 data ranks" in lines[2], r.stdout + r.stderr)
for bad, why in [("80XB", "unknown unit 'XB'"), ("lots", "is not a size"), ("80", "out of range: 1 MiB"),
                 ("-5GiB", "out of range"), ("nan", "is not a size")]:
    r = run(["plan", "--world", "2", "--device-memory", bad, SCRIPT])
    check(f"--device-memory {bad} is refused: {why}", r.returncode != 0 and why in r.stderr, r.stderr)
r = run(["plan", "--world", "2", "--device-memory", "80GiB", "examples/gpt/train.lua", "--vocab", "50257"])
check("the GPT example plans GPT-2's vocabulary from the command line",
      r.returncode == 0 and "fits: peak" in r.stdout, r.stdout + r.stderr)

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

# ---- Zero groups ------------------------------------------------------------------------------
r = run(["plan", "--world", "4", SCRIPT, "--tensor", "2"])
check("a plan prints no zero groups without ZeRO",
      r.returncode == 0 and "zero" not in r.stdout.split("\n")[0], r.stdout[:400])
with tempfile.TemporaryDirectory() as d:
    script = os.path.join(d, "zero.lua")
    with open(script, "w") as f:
        f.write('local pt = require "partrain"\n\nlocal mesh = pt.mesh { zero = 3 }\n')
    r = run(["plan", "--world", "4", script])
    check("partrain plan refuses zero groups that do not divide data at the script's line",
          r.returncode != 0 and "zero=3 does not divide the data size 4" in r.stderr and "zero.lua:3" in r.stderr,
          r.stderr)

# ---- Pipeline parallelism ---------------------------------------------------------------------
# Pipeline 4 of a 4-layer GPT-2 (one block a stage), 4 micro-batches of 2 sequences.
PIPE = ["--pipeline", "4", "--layers", "4", "--batch", "8", "--microbatches", "4"]
for schedule in ("1f1b", "gpipe"):
    layout = [*PIPE, "--schedule", schedule]
    planned = plan(4, *layout)
    measured = real(4, *layout, "--steps", "2")
    worst_state, worst_act = 0.0, 0.0
    for r, m in zip(planned["ranks"], measured):
        state = m["params"] + m["grads"] + m["optimizer"] + m["master"]
        worst_state = max(worst_state, abs(r["model_state_bytes"] - state) / state)
        worst_act = max(worst_act, abs(r["activation_bytes"] - m["activations"]) / m["activations"])
    check(f"pipeline 4, {schedule}: planned model-state bytes match the real run's stages within 2 % "
          f"(worst {worst_state:.4%})", worst_state <= 0.02,
          [(r["model_state_bytes"], m["params"] + m["grads"] + m["optimizer"] + m["master"]) for r, m in zip(planned["ranks"], measured)])
    check(f"pipeline 4, {schedule}: planned peak activations match the real step's allocator peak within 25 % "
          f"(worst {worst_act:.4%})", worst_act <= 0.25,
          [(r["activation_bytes"], m["activations"]) for r, m in zip(planned["ranks"], measured)])
    stages = [r["pipeline"] for r in planned["ranks"]]
    check(f"pipeline 4, {schedule}: every rank shows its stage, one block each, embeddings first, head last",
          [s["pipeline_rank"] for s in stages] == [0, 1, 2, 3]
          and [s["chunks"][0]["blocks"] for s in stages] == [[0, 1], [1, 2], [2, 3], [3, 4]]
          and stages[0]["chunks"][0]["first"] and stages[3]["chunks"][0]["last"]
          and not stages[1]["chunks"][0]["first"] and not stages[1]["chunks"][0]["last"], stages)
    names = [{s["name"] for s in r["shards"]} for r in planned["ranks"]]
    check(f"pipeline 4, {schedule}: a rank's shards are its stage's, the tied embedding on the first and the last",
          "wte.weight" in names[0] and "h.0.attn.c_attn.weight" in names[0] and "h.1.attn.c_attn.weight" not in names[0]
          and "lm_head.weight" in names[3] and "h.3.mlp.c_fc.weight" in names[3] and "wpe.weight" not in names[3]
          and all("ln_f.weight" not in n for n in names[:3]), names)
    check(f"pipeline 4, {schedule}: the predicted bubble is (p-1)/(m+p-1) = 3/7",
          all(abs(s["bubble"] - 3 / 7) < 1e-9 for s in stages), [s["bubble"] for s in stages])
    in_flight = [s["in_flight"] for s in stages]
    check(f"pipeline 4, {schedule}: peak in-flight micro-batches per rank ({in_flight})",
          in_flight == ([4, 3, 2, 1] if schedule == "1f1b" else [4, 4, 4, 4]), in_flight)
    # Each micro-batch's activation (2 x 64 x 128 floats) goes forward as an 88-byte header and the
    # tensor; its gradient comes back as the tensor alone (its shape is the activation's).
    grad_msg = 2 * 64 * 128 * 4
    act_msg = 88 + grad_msg
    p2p = [{p["pipeline_peer"]: p for p in s["p2p"]} for s in stages]

    def traffic(rank, peer):  # (bytes sent, bytes received): activations go up the pipeline
        return (4 * act_msg, 4 * grad_msg) if peer > rank else (4 * grad_msg, 4 * act_msg)
    check(f"pipeline 4, {schedule}: point-to-point traffic per peer: 4 activations of {act_msg} bytes up, "
          f"4 gradients of {grad_msg} bytes down",
          sorted(p2p[0]) == [1] and sorted(p2p[1]) == [0, 2] and sorted(p2p[3]) == [2]
          and all(t["sends"] == 4 and t["recvs"] == 4 and (t["send_bytes"], t["recv_bytes"]) == traffic(r, peer)
                  for r, peers in enumerate(p2p) for peer, t in peers.items()), p2p)
    ops = {(c["group"].split("[")[0], c["op"]): c for c in planned["ranks"][1]["collectives"]}
    check(f"pipeline 4, {schedule}: the collectives list the pipeline's sends and receives (an activation "
          "is a header and a tensor, a gradient a tensor)", ops.get(("pipeline", "send"), {}).get("calls") == 12
          and ops.get(("pipeline", "recv"), {}).get("bytes") == 4 * act_msg + 4 * grad_msg,
          planned["ranks"][1]["collectives"])

# Growing the micro-batches (of the same size) from 4 to 8: GPipe holds every one, so its peak
# grows by at least 4 micro-batches' activations; 1F1B holds at most p - rank, so its peak grows
# only by the tensors the executor keeps until the step's sends complete (4 more outputs and 4
# more input gradients at most, 2 x 64 x 128 floats each).
grown = {}
for schedule in ("1f1b", "gpipe"):
    for m in (4, 8):
        grown[schedule, m] = plan(4, "--pipeline", "4", "--layers", "4", "--batch", str(2 * m), "--microbatches",
                                  str(m), "--schedule", schedule)["ranks"]
kept = 8 * 2 * 64 * 128 * 4
growth = {s: [b["activation_bytes"] - a["activation_bytes"] for a, b in zip(grown[s, 4], grown[s, 8])]
          for s in ("1f1b", "gpipe")}
check(f"GPipe's planned peak grows with the micro-batches by at least 4 micro-batches' activations "
      f"({growth['gpipe']}), its in-flight count with them",
      all(g >= 4 * r["pipeline"]["chunks"][0]["activation_bytes"] for g, r in zip(growth["gpipe"], grown["gpipe", 4]))
      and [r["pipeline"]["in_flight"] for r in grown["gpipe", 8]] == [8] * 4, growth)
check(f"1F1B's in-flight micro-batches stay p - rank and its planned peak grows only by the kept sends "
      f"({growth['1f1b']} <= {kept})",
      all(0 <= g <= kept for g in growth["1f1b"])
      and [r["pipeline"]["in_flight"] for r in grown["1f1b", 8]] == [4, 3, 2, 1], growth)

# The text form, and a saved pipelined plan that a real run matches.
r = run(["plan", "--world", "4", SCRIPT, *PIPE])
check("the text plan shows the stages, the bubble, peak activations and point-to-point traffic",
      r.returncode == 0 and "predicted bubble 0.4286" in r.stdout and "stage 0: wte,wpe + h.0" in r.stdout
      and "stage 3: h.3 + ln_f,lm_head" in r.stdout and "pipeline rank 1: send x4" in r.stdout
      and "pipeline send x12" in r.stdout and "activations (peak under the schedule)" in r.stdout, r.stdout + r.stderr)
with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "pipe.bin")
    r = run(["plan", "--world", "4", "--save", path, SCRIPT, *PIPE])
    check("plan --save writes a pipelined plan", r.returncode == 0 and os.path.getsize(path) > 0, r.stderr)
    r = run(["--nproc-per-node", "4", "--threads", "1", "--plan", path, SCRIPT, *PIPE, "--steps", "2"])
    check("a real pipelined run matches its saved plan (stages' shards, bytes, the step's transfers)",
          r.returncode == 0 and "matches the plan" in r.stderr, r.stderr)

# A plan saved in format version 1 (before pipeline stages) still loads: a one-rank plan that
# holds no tensor, written here byte by byte as cereal's binary archive lays it out, is read and
# compared (every tensor of the run is "not in the plan"), not refused as damaged.
def cereal_string(text):
    return struct.pack("<Q", len(text)) + text.encode()


def old_plan(version):
    ranks = struct.pack("<Q", 1) + struct.pack("<4i", 0, 0, 0, 0) + struct.pack("<Q", 0) \
        + struct.pack("<4q", 0, 0, 0, -1) + struct.pack("<Q", 0)
    return cereal_string("partrain-plan") + struct.pack("<I", version) + cereal_string(SCRIPT) \
        + struct.pack("<6i", 1, 1, 1, 1, 1, 1) + struct.pack("<qd", 0, 0.0) + ranks


with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "v1.bin")
    open(path, "wb").write(old_plan(1))
    r = run(["--threads", "1", "--plan", path, SCRIPT])
    check("a version 1 plan still loads and is compared with the run",
          r.returncode != 0 and "does not match the plan" in r.stderr and "h.0.attn.c_attn.weight: not in the plan" in r.stderr,
          r.stderr)
    open(path, "wb").write(old_plan(8))
    r = run(["--threads", "1", "--plan", path, SCRIPT])
    check("a plan of a later format version is refused, naming the versions read",
          r.returncode != 0 and "format version 8; this partrain reads 1 to 7" in r.stderr, r.stderr)

# 64 ranks of GPT-2 small (124 M) as data 16 x pipeline 4 (pipeline with tensor parallelism is not
# built yet): quick, and four stages of three blocks.
start = time.time()
small = plan(64, "--vocab", "50257", "--seq", "1024", "--dim", "768", "--heads", "12", "--layers", "12",
             "--batch", "64", "--pipeline", "4", "--microbatches", "4")
seconds = time.time() - start
stages = {r["pipeline"]["pipeline_rank"]: r["pipeline"]["chunks"][0]["blocks"] for r in small["ranks"]}
check(f"a 64-rank plan of GPT-2 small at data 16 x pipeline 4 takes seconds ({seconds:.1f} s) and shows 4 stages",
      seconds < 60 and len(small["ranks"]) == 64 and stages == {0: [0, 3], 1: [3, 6], 2: [6, 9], 3: [9, 12]}
      and small["mesh"]["data"] == 16 and small["ranks"][17]["pipeline"]["pipeline_rank"] == 1, stages)
check("... rank 0 and rank 48 each count the tied embedding (each stage holds a copy)",
      small["ranks"][0]["param_bytes"] > 50257 * 768 * 4 and small["ranks"][48]["param_bytes"] > 50257 * 768 * 4
      and small["ranks"][16]["param_bytes"] < 50257 * 768 * 4, [small["ranks"][i]["param_bytes"] for i in (0, 16, 48)])

# Bad combinations, refused at the script's line.
r = run(["plan", "--world", "6", SCRIPT, *PIPE])
check("a world the pipeline does not divide is refused, naming both",
      r.returncode != 0 and "6" in r.stderr and "pipeline" in r.stderr and "gpt2_step.lua:" in r.stderr, r.stderr)
r = run(["plan", "--world", "4", SCRIPT, *PIPE, "--schedule", "interleaved", "--chunks", "2"])
check("chunks that do not fit the blocks are refused at the script's line",
      r.returncode != 0 and "4 blocks cannot fill 8 stages" in r.stderr and "gpt2_step.lua:" in r.stderr, r.stderr)

# Checkpoints under plan: meta tensors hold no values. A save had written garbage sizes (and left a
# scratch folder in the user's checkpoint folder); now save, load and resume leave files alone.
with tempfile.TemporaryDirectory() as work:
    script = os.path.join(work, "saves.lua")
    folder = os.path.join(work, "ckpt")
    with open(script, "w") as f:
        f.write('local pt = require "partrain"\n'
                'local m = pt.parallelize(pt.models.mlp { sizes = { 4, 8, 2 } }, nil, pt.mesh {})\n'
                'local opt = pt.optim.sgd(m, { lr = 0.1 })\n'
                f'assert(pt.ckpt.save("{folder}", {{ model = m, optim = opt, step = 0 }}) == nil)\n'
                f'assert(pt.ckpt.load("{folder}", {{ model = m }}) == nil)\n'
                'm:train_step(pt.randn(4, 4), pt.randint(0, 2, { 4 }))\n'
                'opt:step()\n')
    r = run(["plan", "--world", "2", script])
    check("under plan, pt.ckpt.save and load return nil and leave the checkpoint folder alone",
          r.returncode == 0 and not os.path.exists(folder), r.stdout[-1000:] + r.stderr[-2000:])

# ---- Context parallelism ----------------------------------------------------------------------
# Each sequence split over c context ranks; gpt2_step.lua's sizes: batch 8 (data 1: every rank has
# all 8 sequences), 64 positions, 4 heads of 32, 2 layers. A rank computes over its 64/c positions.
# A step's traffic over the context group, per attention layer: ring, (3c - 2) blocks of
# 2 x batch x kv_heads x (64/c) x 32 float32s (c - 1 key/value blocks forward, c - 1 again and c
# gradient blocks backward); all_to_all, q, k, v and the output whole through an all-to-all
# forward and again backward (key/value heads fewer than c repeated to c).
B, T, HD, LAYERS = 8, 64, 32, 2


def ring_bytes(c, kv_heads=4):
    return LAYERS * (3 * c - 2) * 2 * B * kv_heads * (T // c) * HD * 4


def all_to_all_bytes(c, heads=4, kv_heads=4):
    return LAYERS * 2 * 2 * (heads + max(kv_heads, c)) * B * (T // c) * HD * 4


def context_moved(rank_plan, op):
    """The bytes the planned step moved over the context group by `op`."""
    return sum(c["bytes"] for c in rank_plan["collectives"] if c["group"].startswith("context[") and c["op"] == op)


unsplit = plan(1)["ranks"][0]["activation_bytes"]
for c in (2, 4):
    planned = plan(c, "--context", str(c))
    ranks = planned["ranks"]
    check(f"context {c}: the plan records the context size and each rank's context coordinate",
          planned["mesh"]["context"] == c and planned["mesh"]["data"] == 1
          and [r["coord"]["context"] for r in ranks] == list(range(c)), (planned["mesh"], [r["coord"] for r in ranks]))
    cp = ranks[0]["context"]
    check(f"context {c}: every rank notes the step's 2 attention calls, q of 8 x 4 heads x {T // c} positions x 32",
          all(r["context"] == cp for r in ranks) and (cp["mode"], cp["calls"], cp["batch"], cp["heads"], cp["kv_heads"],
                                                       cp["rows"], cp["head_size"]) == ("ring", 2, 8, 4, 4, T // c, 32), cp)
    check(f"context {c}: the predicted ring traffic, (3c - 2) blocks a layer ({ring_bytes(c)} bytes), is what the "
          "planned step's context group sent", cp["ring_bytes"] == ring_bytes(c) == context_moved(ranks[0], "send_recv"),
          (cp, ranks[0]["collectives"]))
    check(f"context {c}: all_to_all's predicted bytes ({all_to_all_bytes(c)}), {c - 1}/{c} of them sent",
          cp["all_to_all_bytes"] == all_to_all_bytes(c) and cp["all_to_all_sent_bytes"] == all_to_all_bytes(c) * (c - 1) // c
          and cp["all_to_all_refusal"] is None, cp)
    ratio = ranks[0]["activation_bytes"] / unsplit
    check(f"context {c}: a rank's planned activations are about 1/{c} of the unsplit model's ({ratio:.4f}: its "
          f"{T // c} positions, and no {T} x {T} attention scores)", 0.85 / c <= ratio <= 1 / c,
          (ranks[0]["activation_bytes"], unsplit))
    a2a = plan(c, "--context", str(c), "--context-mode", "all_to_all")["ranks"][0]
    check(f"context {c}, all_to_all: the predicted bytes are what the planned step's all-to-alls took",
          a2a["context"]["all_to_all_bytes"] == all_to_all_bytes(c) == context_moved(a2a, "all_to_all")
          and context_moved(a2a, "send_recv") == 0, (a2a["context"], a2a["collectives"]))

# The key/value blocks travel in the model's dtype, their gradients in float32 (float64 stays).
for dtype, size, grad in (("bfloat16", 2, 4), ("float64", 8, 8)):
    ranks = plan(2, "--context", "2", "--dtype", dtype)["ranks"]
    block = 2 * B * 4 * (T // 2) * HD
    want = LAYERS * (2 * block * size + 2 * block * grad)
    check(f"context 2, {dtype}: ring traffic is 2 key/value blocks of {size}-byte elements and 2 gradient blocks of "
          f"{grad}-byte ones a layer ({want} bytes), as planned and predicted",
          ranks[0]["context"]["ring_bytes"] == want == context_moved(ranks[0], "send_recv"), ranks[0]["context"])

# Against real 2-rank runs: the traffic to the byte (group:traffic() over the first step), the
# model state exactly, the activations within 10 % (on the CPU the flash kernel's output is laid
# out so that the heads' merge is a view; the meta run's plain blocks copy it: about 5 % more).
for extra in ([], ["--context-mode", "all_to_all"], ["--model", "llama", "--kv-heads", "2"],
              ["--model", "llama", "--kv-heads", "2", "--context-mode", "all_to_all"]):
    args = ["--context", "2", *extra]
    name = " ".join(args)
    planned = plan(2, *args)["ranks"]
    measured = real(2, *args)
    op, key = ("all_to_all", "all_to_all_bytes") if "all_to_all" in extra else ("send_recv", "ring_bytes")
    kv = 2 if "llama" in extra else 4
    want = all_to_all_bytes(2, 4, kv) if op == "all_to_all" else ring_bytes(2, kv)
    check(f"{name}: the predicted {op} traffic ({want} bytes) is what a real run's context group moved in its first "
          "step, on every rank", all(r["context"][key] == want == context_moved(r, op) == m["context_" + op]
                                      for r, m in zip(planned, measured)),
          [(r["context"], m) for r, m in zip(planned, measured)])
    state = max(abs(r["model_state_bytes"] - (m["params"] + m["grads"] + m["optimizer"] + m["master"])) for r, m in
                zip(planned, measured))
    act = max(abs(r["activation_bytes"] - m["activations"]) / m["activations"] for r, m in zip(planned, measured))
    check(f"{name}: planned model state matches the real run's exactly, activations within 10 % (worst {act:.2%})",
          state == 0 and act <= 0.10, [(r["activation_bytes"], m) for r, m in zip(planned, measured)])

r = run(["plan", "--world", "2", SCRIPT, "--context", "2"])
check("the text plan names context in the layout, compares the modes and shows the context traffic",
      r.returncode == 0 and "tensor 1 x context 2 x data 1 x pipeline 1" in r.stdout
      and "context rank r holding chunks r and 3-r of 4" in r.stdout
      and "context 2: ring moves 2.00 MiB a step, all_to_all 1.00 MiB (it splits the 4 query heads 2 ways); "
          "all_to_all moves less" in r.stdout
      and "context send_recv x8 2.00 MiB" in r.stdout and "data_context all_reduce" in r.stdout, r.stdout + r.stderr)
r = run(["plan", "--world", "2", SCRIPT, "--context", "2", "--model", "llama", "--kv-heads", "1"])
check("with one key/value head the ring moves less (all_to_all repeats it for every rank)",
      r.returncode == 0 and "context 2: ring moves 512.00 KiB a step, all_to_all 768.00 KiB" in r.stdout
      and "ring moves less" in r.stdout, r.stdout + r.stderr)
r = run(["plan", "--world", "4", "--json", SCRIPT, "--context", "4", "--heads", "6", "--dim", "96"])
six = json.loads(r.stdout)["ranks"][0]["context"] if r.returncode == 0 else {}
check("heads that all_to_all cannot split are planned at ring and reported, not refused",
      six.get("all_to_all_refusal", "") and "6 query heads do not divide by 4" in six["all_to_all_refusal"]
      and six["all_to_all_bytes"] is None and six["ring_bytes"] > 0, r.stdout[-2000:] + r.stderr)
r = run(["plan", "--world", "4", SCRIPT, "--context", "4", "--heads", "6", "--dim", "96"])
check("... and the text says why", r.returncode == 0 and "all_to_all cannot run: all_to_all attention scatters the "
      "heads over context=4, but 6 query heads do not divide by 4" in r.stdout, r.stdout + r.stderr)
r = run(["plan", "--world", "4", "--device-memory", "1MiB", SCRIPT, "--context", "2"])
check("a context 2 x data 2 layout that does not fit suggests ZeRO-2 over the 4 data x context ranks",
      r.returncode == 0 and "try ZeRO-2 over the 4 data x context ranks" in r.stdout, r.stdout + r.stderr)
with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "context.bin")
    r = run(["plan", "--world", "2", "--save", path, SCRIPT, "--context", "2"])
    r = run(["--nproc-per-node", "2", "--threads", "1", "--plan", path, SCRIPT, "--context", "2"])
    check("a real context 2 run matches its saved plan (layout, coordinates, shards, bytes, the step's exchanges)",
          r.returncode == 0 and "matches the plan" in r.stderr, r.stderr)
    r = run(["--nproc-per-node", "2", "--threads", "1", "--plan", path, SCRIPT])
    check("... and a data 2 run does not, naming the planned context",
          r.returncode != 0 and "tensor 1 x context 2 x data 1 x pipeline 1" in r.stderr, r.stderr)

# --pipeline-search: the planned stages' bytes weigh the schedules; what it picks is the fastest
# that fits, printed as a plan a real run takes back as its schedule.
r = run(["plan", "--world", "2", "--pipeline-search", "--pipeline-memory", "100GiB", SCRIPT, "--pipeline", "2",
         "--layers", "4", "--microbatches", "4", "--schedule", "zbh1"])
picked = re.search(r"picked: (\S+) \((\d) chunks? a rank\): step ([0-9.]+) units", r.stdout)
check("plan --pipeline-search lists the candidates and picks the fastest, with its plan as Lua",
      r.returncode == 0 and picked is not None and "return {" in r.stdout and "(measured)" in r.stdout
      and all(float(m) >= float(picked.group(3)) for m in re.findall(r"^  \S+\s+\d\s+([0-9.]+)\s+[0-9.]+\s+.*\byes$",
                                                                   r.stdout, re.M)), r.stdout[-3000:] + r.stderr)
if picked:
    with tempfile.TemporaryDirectory() as d:
        source = r.stdout[r.stdout.index("return {"):]
        kept = os.path.join(d, "plan.lua")
        open(kept, "w").write(source)
        script = os.path.join(d, "check.lua")
        open(script, "w").write(
            "local P = require 'partrain.pipeline'\n"
            f"local plan = dofile({json.dumps(kept)})\n"
            f"local _, report = P.build(function() return plan end, 2, 4, {picked.group(2)})\n"
            "print('built', report.makespan)\n")
        b = run(["--threads", "1", script])
        check("... and the printed plan passes the pre-flight check as a schedule",
              b.returncode == 0 and "built" in b.stdout, b.stdout + b.stderr)
r = run(["plan", "--world", "2", "--pipeline-search", "--pipeline-memory", "1MiB", SCRIPT, "--pipeline", "2",
         "--layers", "4", "--microbatches", "4", "--batch", "64"])
check("... a cap no schedule fits is refused, naming the least any needs",
      r.returncode != 0 and "no schedule fits" in r.stdout + r.stderr and "least" in r.stdout + r.stderr,
      r.stdout[-1500:] + r.stderr)
r = run(["plan", "--world", "2", "--pipeline-memory", "1GiB", SCRIPT, "--pipeline", "2"])
check("--pipeline-memory without --pipeline-search is refused",
      r.returncode != 0 and "--pipeline-memory is the cap of --pipeline-search" in r.stderr, r.stderr)
r = run(["plan", "--world", "2", "--pipeline-search", "--pipeline-memory", "1GiB", SCRIPT])
check("--pipeline-search of a model that is not pipelined is refused",
      r.returncode != 0 and "not pipelined" in r.stderr, r.stderr)

finish("plan")
