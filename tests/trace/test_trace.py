"""`partrain --trace FILE` writes the executed timeline as Chrome trace JSON: at pipeline 2 (1F1B,
and interleaved with 2 chunks) every rank's row holds exactly one forward and one backward per
micro-batch and chunk of each traced step, in the schedule's order, every receive holds the wait
inside it, events on a row never overlap and run forward in time, each transfer's receive ends
after its send starts on the other rank (the clocks are aligned), and only --trace-steps steps are
kept; a data-parallel run traces its forward, backward and sync; under ZeRO-3 each rank's unit
gathers have a row of their own, in the order the units run; under context parallelism the ring's
key/value exchanges have a row of their own and run under the attention blocks; a restarted attempt writes a
trace of its own beside the first; a folder, a missing folder or a bad step count are refused with
a message naming them.
Usage: test_trace.py PATH/TO/partrain"""
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from checks import check, finish  # noqa: E402

BIN = os.path.abspath(sys.argv[1])
SCRIPT = "tests/trace/trace_run.lua"
SLACK_US = 1000.0  # one machine's ranks share the wall clock: rounding and the clock reads only
tmp = tempfile.mkdtemp(prefix="trace-test-")


def run(args, timeout=240):
    p = subprocess.run([BIN] + args, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def load(path):
    with open(path) as f:
        return json.load(f)


def rows(trace):
    """tid -> its complete events, sorted by start (the outer first when two start together)."""
    out = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            out.setdefault(e["tid"], []).append(e)
    for evs in out.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
    return out


def pipeline_case(name, extra, pp=2):
    path = os.path.join(tmp, name + ".json")
    rc, out, err = run(["--nproc-per-node", str(pp), "--threads", "1", "--trace", path, "--trace-steps", "2",
                        SCRIPT, "--pipeline", str(pp), "--steps", "3"] + extra)
    check(f"{name}: the run succeeds", rc == 0, err[-2000:])
    if rc != 0:
        return
    try:
        trace = load(path)
    except (OSError, ValueError) as e:
        check(f"{name}: the trace loads as JSON", False, e)
        return
    check(f"{name}: the trace loads as JSON with a traceEvents list", isinstance(trace.get("traceEvents"), list))
    order = {int(m.group(1)): m.group(2).split() for m in re.finditer(r"^order (\d+): (.*)$", out, re.M)}
    check(f"{name}: the script printed every rank's schedule", sorted(order) == list(range(pp)), out)
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    check(f"{name}: a named row a rank", sorted(names) == list(range(pp)) and
          all(names[r].startswith(f"rank {r}") for r in names), names)
    by_rank = rows(trace)
    check(f"{name}: events on every rank's row", sorted(by_rank) == list(range(pp)), sorted(by_rank))
    sends, recvs = {}, {}
    for r, evs in sorted(by_rank.items()):
        steps = sorted({e["args"]["step"] for e in evs})
        check(f"{name}: rank {r} recorded steps 1 and 2 only (--trace-steps 2 of 3)", steps == [1, 2], steps)
        bad = [e for e in evs if not (isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float))
                                      and e["ts"] >= 0 and e["dur"] >= 0 and e["pid"] == 0)]
        check(f"{name}: rank {r}'s events have ts >= 0, dur >= 0, pid 0", not bad, bad[:3])
        for step in steps:
            mine = [e for e in evs if e["args"]["step"] == step]
            compute = [e["name"] for e in mine if e["cat"] in ("forward", "backward")]
            check(f"{name}: rank {r} step {step}: forwards and backwards in the schedule's order",
                  compute == order.get(r), f"traced {compute}\nscheduled {order.get(r)}")
            counts = {}
            for e in mine:
                if e["cat"] in ("forward", "backward"):
                    key = (e["cat"], e["args"]["mb"], e["args"]["chunk"])
                    counts[key] = counts.get(key, 0) + 1
            chunks = 2 if "--chunks" in extra else 1
            m = int(extra[extra.index("--microbatches") + 1])
            want = {(c, mb, ch): 1 for c in ("forward", "backward") for mb in range(m) for ch in range(chunks)}
            check(f"{name}: rank {r} step {step}: exactly one F and one B a micro-batch and chunk", counts == want,
                  counts)
            # The actions and the step's sync follow one another without overlapping.
            top = [e for e in mine if e["cat"] in ("forward", "backward", "send", "recv", "sync")]
            overlaps = [(a["name"], b["name"]) for a, b in zip(top, top[1:]) if a["ts"] + a["dur"] > b["ts"] + 0.002]
            check(f"{name}: rank {r} step {step}: actions in time order, none overlapping", not overlaps, overlaps[:5])
            step_ev = [e for e in mine if e["cat"] == "step"]
            inside = step_ev and all(step_ev[0]["ts"] <= e["ts"] and e["ts"] + e["dur"] <= step_ev[0]["ts"] +
                                     step_ev[0]["dur"] + 0.002 for e in mine)
            check(f"{name}: rank {r} step {step}: one step event holding all the others", len(step_ev) == 1 and inside,
                  step_ev)
            waits = [e for e in mine if e["cat"] == "wait"]
            recv = [e for e in mine if e["cat"] == "recv"]
            held = all(sum(1 for w in waits if rv["ts"] <= w["ts"] and w["ts"] + w["dur"] <= rv["ts"] + rv["dur"] + 0.002)
                       == 1 for rv in recv)
            check(f"{name}: rank {r} step {step}: every receive holds one wait", len(waits) == len(recv) and held,
                  f"{len(waits)} waits, {len(recv)} receives")
            # A transfer's key: (from, to, step, micro-batch, F or B, the receiver's chunk).
            for e in mine:
                kind, a = e["name"][5:6], e["args"]  # SEND_F..., RECV_B...
                if e["cat"] == "send":
                    v = a["chunk"] * pp + r + (1 if kind == "F" else -1)  # the receiving virtual stage
                    sends[(r, a["peer"], step, a["mb"], kind, v // pp)] = e
                elif e["cat"] == "recv":
                    recvs[(a["peer"], r, step, a["mb"], kind, a["chunk"])] = e
        starts = [e["ts"] for e in evs if e["cat"] == "step"]
        check(f"{name}: rank {r}'s steps run forward in time", starts == sorted(starts), starts)
    check(f"{name}: every send has its receive on the other rank", sorted(sends) == sorted(recvs) and sends,
          f"{len(sends)} sends, {len(recvs)} receives")
    early = [(k, recvs[k]["ts"] + recvs[k]["dur"], s["ts"]) for k, s in sends.items()
             if k in recvs and recvs[k]["ts"] + recvs[k]["dur"] + SLACK_US < s["ts"]]
    check(f"{name}: no receive ends before its send starts (clocks aligned within {SLACK_US:.0f} us)", not early,
          early[:3])


pipeline_case("1f1b", ["--schedule", "1f1b", "--microbatches", "4"])
pipeline_case("interleaved", ["--schedule", "interleaved", "--microbatches", "4", "--chunks", "2"])

# Data parallelism (no pipeline): a forward, a backward and the gradients' sync a step.
path = os.path.join(tmp, "dp.json")
rc, out, err = run(["--nproc-per-node", "2", "--threads", "1", "--trace", path, SCRIPT, "--pipeline", "1",
                    "--steps", "2"])
check("data parallel: the run succeeds", rc == 0, err[-2000:])
if rc == 0:
    by_rank = rows(load(path))
    for r in (0, 1):
        got = [(e["args"]["step"], e["name"]) for e in by_rank.get(r, []) if e["cat"] != "step"]
        want = [(s, n) for s in (1, 2) for n in ("F0", "B0", "sync")]
        check(f"data parallel: rank {r} traces F0, B0 and sync in each of its 2 steps", got == want, got)

# ZeRO-3 at data 2: each rank's gathers on a row of its own (tid 2 + rank), in the order the units
# run: the root unit, each block in forward, then each block again in backward (freed after its
# forward), or only forward's when the units are kept to backward (--no-reshard).
for name, extra, want_units in [("zero3", [], [0, 1, 2, 3, 4, 4, 3, 2, 1]),
                                ("zero3 kept", ["--no-reshard"], [0, 1, 2, 3, 4])]:
    path = os.path.join(tmp, name.replace(" ", "_") + ".json")
    rc, out, err = run(["--nproc-per-node", "2", "--threads", "1", "--trace", path, SCRIPT, "--pipeline", "1",
                        "--steps", "2", "--zero3"] + extra)
    check(f"{name}: the run succeeds", rc == 0, err[-2000:])
    if rc != 0:
        continue
    trace = load(path)
    by_rank = rows(trace)
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    for r in (0, 1):
        check(f"{name}: rank {r}'s gathers have a row named for them", names.get(2 + r) == f"rank {r}: ZeRO-3 gathers",
              names)
        gathers = by_rank.get(2 + r, [])
        steps = [e for e in by_rank.get(r, []) if e["cat"] == "step"]
        for s in (1, 2):
            got = [int(e["name"].split("GATHER u")[1]) for e in gathers if e["args"]["step"] == s]
            check(f"{name}: rank {r} step {s}: the units gathered in order {want_units}", got == want_units, got)
            span = [e for e in steps if e["args"]["step"] == s]
            inside = span and all(span[0]["ts"] - SLACK_US <= e["ts"] and e["ts"] + e["dur"] <= span[0]["ts"] +
                                  span[0]["dur"] + SLACK_US for e in gathers if e["args"]["step"] == s)
            check(f"{name}: rank {r} step {s}: every gather within its step", bool(inside), span)

# Ring attention at context 2: each rank's key/value exchanges have a row of their own (tid 2 +
# rank), and each is started before the attention block it runs under: KVi starts no later than
# ATTNi in forward (the block computes while the next keys travel); backward passes the blocks
# again and each block's gradient (DKVi). Across the traced steps some exchange is still in flight
# when its block starts: the overlap the ring is for.
path = os.path.join(tmp, "ring.json")
rc, out, err = run(["--nproc-per-node", "2", "--threads", "1", "--trace", path, "--trace-steps", "2", SCRIPT,
                    "--pipeline", "1", "--context", "2", "--steps", "2", "--seq", "256", "--dim", "64"])
check("ring: the run succeeds", rc == 0, err[-2000:])
if rc == 0:
    trace = load(path)
    by_rank = rows(trace)
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    overlapped = 0
    for r in (0, 1):
        check(f"ring: rank {r}'s exchanges have a row named for them", names.get(2 + r) == f"rank {r}: ring exchanges",
              names)
        passes = by_rank.get(2 + r, [])
        blocks = [e for e in by_rank.get(r, []) if e["cat"] == "attention"]
        for s in (1, 2):
            kv = [e for e in passes if e["args"]["step"] == s and e["name"] == "KV0"]
            dkv = [e for e in passes if e["args"]["step"] == s and e["name"].startswith("DKV")]
            attn = [e for e in blocks if e["args"]["step"] == s]
            # 4 layers: forward passes one key/value block a layer (ring of 2), backward another,
            # and two gradient blocks; every layer computes two blocks each way.
            check(f"ring: rank {r} step {s}: 8 key/value passes, 8 gradient passes, 16 blocks",
                  len([e for e in passes if e["args"]["step"] == s and e["name"] == "KV0"]) == 8 and len(dkv) == 8
                  and len(attn) == 16, (len(kv), len(dkv), len(attn)))
            firsts = [e for e in attn if e["name"] == "ATTN0"]
            pairs = list(zip(kv, firsts))
            check(f"ring: rank {r} step {s}: each exchange starts before the block it runs under",
                  pairs and all(k["ts"] <= a["ts"] + SLACK_US for k, a in pairs), pairs[:2])
            overlapped += sum(1 for k, a in pairs if k["ts"] + k["dur"] > a["ts"])
    check("ring: some key/value exchange is still in flight when its block starts (overlap)", overlapped > 0,
          overlapped)

# A restarted attempt's first steps are not the run's: it writes PATH.restart1.json beside the
# first attempt's trace, which is kept, and each says which attempt it is.
path = os.path.join(tmp, "restarted.json")
rc, out, err = run(["--nproc-per-node", "2", "--threads", "1", "--max-restarts", "1", "--restart-backoff", "0",
                    "--trace", path, "--trace-steps", "1", SCRIPT, "--pipeline", "1", "--steps", "2", "--fail_first"])
again = os.path.join(tmp, "restarted.restart1.json")
check("after a restart, the first attempt's trace is kept and the second writes PATH.restart1.json",
      rc == 0 and os.path.exists(path) and os.path.exists(again), f"rc {rc}: {err[-1500:]}")
if rc == 0 and os.path.exists(path) and os.path.exists(again):
    check("... each trace names its attempt (otherData.restart 0 and 1)",
          load(path)["otherData"].get("restart") == 0 and load(again)["otherData"].get("restart") == 1,
          (load(path)["otherData"], load(again)["otherData"]))

# Refusals, before any rank starts: each names the value and says what was expected.
os.makedirs(os.path.join(tmp, "folder"), exist_ok=True)
for what, args, needle in [
    ("a folder", ["--trace", os.path.join(tmp, "folder")], "is a folder"),
    ("a missing folder", ["--trace", os.path.join(tmp, "none", "t.json")], "its folder does not exist"),
    ("a device", ["--trace", "/dev/null"], "not a regular file"),
    ("--trace-steps 0", ["--trace", os.path.join(tmp, "x.json"), "--trace-steps", "0"], "--trace-steps"),
    ("--trace-steps without --trace", ["--trace-steps", "2"], "needs --trace"),
]:
    rc, out, err = run(args + ["-e", "print(1)"], timeout=60)
    check(f"--trace refuses {what}: exit 1 naming it", rc == 1 and needle in err and
          (args[1] in err or "--trace-steps" in err), f"rc {rc}: {err}")

finish("trace")
