"""partrain plan of expert parallelism against real runs (tests/plan/moe_step.lua: a LLaMA of 2
blocks of 4 SwiGLU experts, top 2, at expert 2 on 2 ranks).

- The plan records the expert size and each rank's expert coordinate; the stacked experts are
  shards split along dimension 0 over the expert group, and a rank's expert tensors are half the
  stacks (the whole stacks at expert 1), their gradients and optimizer state with them.
- The all-to-alls over the expert group: 5 calls a block a step (the counts, the rows, the results
  and the two gradients back), as the planned step made them and as a real run's
  group:traffic() counts them for one train_step, whatever its routing.
- Their bytes, predicted for a balanced routing, are what the planned step's group moved and what
  a real run whose router sends token t to experts t mod 4 and t + 1 mod 4 moves, to the byte;
  the bytes that leave a rank are (e - 1)/e of them, and every row in the worst case.
- A real run with Mixtral's router matches its saved plan (its all-to-alls compared by calls,
  their bytes not; the router's load-balancing all-reduce planned); the text shows the experts'
  section; a format 5 plan (before experts) still loads and matches.
- Refused by name, at the script's line: experts that expert does not divide, an expert size that
  does not divide data x context, a mesh with expert ranks and no MoE block.

Usage: test_plan_experts.py PARTRAIN
"""
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fuzz"))
from checks import check, finish  # noqa: E402
import plan_format as pf  # noqa: E402

BIN = sys.argv[1]
SCRIPT = "tests/plan/moe_step.lua"
# moe_step.lua's sizes: 2 blocks of E = 4 experts of width 16, hidden 24, top 2, float32; a global
# batch of 8 sequences of 16, so each of 2 data ranks routes N = 64 tokens, T = 128 rows.
BLOCKS, E, DIM, HIDDEN, K, N = 2, 4, 16, 24, 2, 64
STACKED = BLOCKS * 3 * E * HIDDEN * DIM * 4  # w1, w3, w2 of every block, whole


def run(args, **kw):
    return subprocess.run([BIN] + args, capture_output=True, text=True, timeout=600, **kw)


def plan(world, *script_args):
    r = run(["plan", "--world", str(world), "--json", SCRIPT, *script_args])
    if r.returncode != 0:
        raise SystemExit("partrain plan failed:\n" + r.stderr)
    return json.loads(r.stdout)


def real(nproc, *script_args):
    with tempfile.TemporaryDirectory() as d:
        r = run(["--nproc-per-node", str(nproc), "--threads", "1", SCRIPT, *script_args, "--report", d])
        if r.returncode != 0:
            raise SystemExit("the real run failed:\n" + r.stderr)
        return [json.load(open(os.path.join(d, f"rank{i}.json"))) for i in range(nproc)]


def moved(rank_plan, group, op):
    """The planned step's calls and bytes of `op` on the group of kind `group`."""
    cs = [c for c in rank_plan["collectives"] if c["group"].split("[")[0] == group and c["op"] == op]
    return sum(c["calls"] for c in cs), sum(c["bytes"] for c in cs)


# ---- The experts' shards and memory --------------------------------------------------------------
planned = plan(2, "--expert", "2")
ranks = planned["ranks"]
check("expert 2: the plan records the expert size and each rank's expert coordinate",
      planned["mesh"]["expert"] == 2 and planned["mesh"]["data"] == 2 and [r["coord"]["expert"] for r in ranks] == [0, 1],
      (planned["mesh"], [r["coord"] for r in ranks]))
stacks = [(r["rank"], s) for r in ranks for s in r["shards"] if ".experts.w" in s["name"]]
check("the stacked experts are shards split along dimension 0 over the expert group, 2 of 4 experts a rank",
      len(stacks) == 2 * 3 * BLOCKS and all(s["dim"] == 0 and s["group"] == [0, 1] and s["shape"][0] == E
                                             and s["local_shape"][0] == E // 2 and s["slices"] == [[2 * rank, 2]]
                                             for rank, s in stacks), stacks[:3])
ep = [r["expert"] for r in ranks]
check(f"a rank's expert tensors are half the stacks ({STACKED // 2} of {STACKED} bytes), with as many gradient "
      "bytes and Adam's two moments", all(e["param_bytes"] * 2 == e["stacked_bytes"] == STACKED
                                          and e["param_bytes"] == sum(s["bytes"] for rk, s in stacks if rk == r["rank"])
                                          and e["grad_bytes"] == e["param_bytes"]
                                          and e["optimizer_bytes"] == 2 * e["param_bytes"]
                                          and (e["experts"], e["local"], e["blocks"]) == (E, 2, BLOCKS)
                                          for e, r in zip(ep, ranks)), ep)
whole = plan(2)["ranks"][0]
check("at expert 1 every rank holds the whole stacks: half of them more parameter bytes",
      whole["param_bytes"] - ranks[0]["param_bytes"] == STACKED // 2 and whole["expert"]["forwards"] == 0,
      (whole["param_bytes"], ranks[0]["param_bytes"], whole["expert"]))

# ---- The all-to-alls: calls, and the balanced bytes ----------------------------------------------
T = N * K
rows = T * DIM * 4  # one exchange of a rank's routed rows, float32
want_rows = BLOCKS * 2 * 2 * rows  # a block: the rows and the results, forward and backward
check(f"each of the 2 MoE forwards notes {N} tokens, {T} rows of {DIM}; 5 all-to-alls a block a step",
      all((e["forwards"], e["tokens"], e["slots"], e["dim"], e["element_size"], e["top_k"], e["all_to_all_calls"])
          == (BLOCKS, N, T, DIM, 4, K, 5 * BLOCKS) for e in ep), ep[0])
check(f"balanced: {want_rows} bytes of rows through the all-to-alls a step, half of them sent, every row in the worst "
      f"case; the counts {BLOCKS} x {E} int64", all(e["balanced_bytes"] == want_rows and e["balanced_sent_bytes"] == want_rows // 2
                                                   and e["worst_sent_bytes"] == want_rows and e["count_bytes"] == BLOCKS * E * 8
                                                   for e in ep), ep[0])
check("the prediction is what the planned step's expert group recorded (calls, and bytes at a balanced routing)",
      all(moved(r, "expert", "all_to_all") == (e["all_to_all_calls"], e["balanced_bytes"] + e["count_bytes"])
          for r, e in zip(ranks, ep)), ranks[0]["collectives"])

mixtral = real(2, "--expert", "2")
check(f"the all-to-all calls ({5 * BLOCKS}) are a real run's for one train_step (Mixtral's router), on every rank",
      all(m["all_to_all_calls"] == e["all_to_all_calls"] for m, e in zip(mixtral, ep)),
      [(m["all_to_all_calls"], m["all_to_all_bytes"]) for m in mixtral])
balanced = real(2, "--expert", "2", "--router", "balanced")
check("the balanced bytes are what a real run routing token t to experts t mod 4 and t + 1 mod 4 moved, to the byte",
      all(m["all_to_all_calls"] == e["all_to_all_calls"] and m["all_to_all_bytes"] == e["balanced_bytes"] + e["count_bytes"]
          for m, e in zip(balanced, ep)), [(m, e["balanced_bytes"] + e["count_bytes"]) for m, e in zip(balanced, ep)])
check("the planned expert tensors and model state are the real run's exactly",
      all(m["expert_param_bytes"] == e["param_bytes"]
          and m["params"] + m["grads"] + m["optimizer"] + m["master"] == r["model_state_bytes"]
          for m, e, r in zip(balanced, ep, ranks)), [(m, r["model_state_bytes"]) for m, r in zip(balanced, ranks)])
routed = plan(2, "--expert", "2", "--router", "balanced")["ranks"][0]
check("a router written in Lua plans as the model's own (the planner routes meta tensors evenly)",
      routed["expert"] == ep[0] and routed["collectives"] == ranks[0]["collectives"], routed["expert"])

# ---- The text, a saved plan against real runs, older formats --------------------------------------
r = run(["plan", "--world", "2", SCRIPT, "--expert", "2"])
check("the text names the expert size and shows each rank's experts and the all-to-alls, balanced and worst",
      r.returncode == 0 and "tensor 1 x data 2 x pipeline 1, expert 2" in r.stdout
      and "each block's experts split over expert groups of 2 ranks" in r.stdout
      and "experts 0-1 of 4 in each of 2 block(s): 18.00 KiB of the 36.00 KiB stacked" in r.stdout
      and "experts 2-3 of 4" in r.stdout and "all_to_all x10 a step: counts x2 64 B, rows x8 64.00 KiB balanced" in r.stdout
      and "a forward and its backward: balanced moves 16.00 KiB, worst 32.00 KiB" in r.stdout
      and "expert all_to_all x10 64.06 KiB (balanced routing)" in r.stdout, r.stdout + r.stderr)
with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "experts.bin")
    r = run(["plan", "--world", "2", "--save", path, SCRIPT, "--expert", "2"])
    version, saved = pf.read(open(path, "rb").read())
    check("a saved plan is format 7, with the expert size, coordinates and predictions",
          r.returncode == 0 and version == 7 and saved["expert"] == 2 and [x["expert"] for x in saved["ranks"]] == [0, 1]
          and saved["ranks"][0]["expert_plan"]["balanced_bytes"] == want_rows, (version, saved.get("expert")))
    r = run(["--nproc-per-node", "2", "--threads", "1", "--plan", path, SCRIPT, "--expert", "2"])
    check("a real expert 2 run with Mixtral's router matches its saved plan (all-to-alls by calls; the router's "
          f"all-reduce planned) though it moved {mixtral[0]['all_to_all_bytes']} bytes, not the balanced "
          f"{want_rows + BLOCKS * E * 8}", r.returncode == 0 and "matches the plan" in r.stderr, r.stderr)
    r = run(["--nproc-per-node", "2", "--threads", "1", "--plan", path, SCRIPT])
    check("... and an expert 1 run does not, naming the planned expert size",
          r.returncode != 0 and "tensor 1 x data 2 x pipeline 1, expert 2" in r.stderr, r.stderr)
    path = os.path.join(d, "v5.bin")
    r = run(["plan", "--world", "2", "--save", path, SCRIPT])
    _, saved = pf.read(open(path, "rb").read())
    open(path, "wb").write(pf.write(saved, version=5))
    r = run(["--nproc-per-node", "2", "--threads", "1", "--plan", path, SCRIPT])
    check("a format 5 plan (no experts) of a data 2 run still loads, and the run matches it",
          r.returncode == 0 and "matches the plan" in r.stderr, r.stderr)

# ---- Refusals --------------------------------------------------------------------------------
for world, args, want in ((4, ["--expert", "4", "--experts", "6"], "experts=6 is not divisible by the mesh's expert=4"),
                          (2, ["--expert", "4"], "expert=4 does not divide data x context = 2"),
                          (2, ["--expert", "2", "--experts", "0"], "has no mixture-of-experts block")):
    r = run(["plan", "--world", str(world), SCRIPT, *args])
    check(f"plan refuses {' '.join(args)} at {world} ranks at the script's line: {want}",
          r.returncode != 0 and want in r.stderr and "moe_step.lua:" in r.stderr, r.stderr)

finish("plan.experts")
