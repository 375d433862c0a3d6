#!/usr/bin/env python3
"""Plan files (`partrain plan --save`) damaged and given to a run's --plan, in each plan mode:
every outcome is compared with tests/fuzz/plan_format.py, which reads a plan as partrain's
bounded archive does and compares it with the run as plan::check does.

Usage: fuzz_plan.py PATH/TO/partrain [--seed N] [--cases N]

Three plans are made once of tests/plan/gpt2_step.lua (a 2-block GPT-2, one step): serial, at
tensor 2 (2 ranks), and at pipeline 2 x data 2 with ZeRO-1 and bfloat16 parameters (4 ranks).
Each case damages one, and runs the layout it was planned for (or, for "foreign plan",
another) with `--plan FILE --plan-mode match|moo|override`, its own job bounded to 60 s and
to common.MEMORY_LIMIT bytes of address space a process. Classes:
  unchanged         the plan as saved: it matches
  bits flipped      1 to 8 bits anywhere
  cut short         truncated anywhere
  bytes appended    1 to 64 random bytes after the end
  count inflated    a container's count (a string's length, a list's size) made larger,
                    huge, or smaller
  version           the format version set to 0, 7 or 2^32-1, or the plan written properly
                    in format 1, 2, 3, 4 or 5 (no stages, no masters or ZeRO, no ZeRO-3 bytes, no
                    context, no experts)
  magic             the magic string altered
  compared field    a field the check compares changed and the file written again: the
                    layout, a rank's coordinates, bytes or ZeRO stage, a shard's name, dtype,
                    shapes, split, slices, group or bytes, a collective
  free field        a field it does not compare changed: the script, cpu peak, seconds (NaN,
                    infinite), activation bytes, the pipeline stage description, the context
                    attention's prediction, the experts' prediction
  entries           shards, ranks or collectives removed, repeated, reordered, or a rank
                    that does not exist added
  strings           a name made empty, 100 KB long, or of binary bytes
  foreign plan      another layout's plan, valid
  special files     a FIFO, /dev/zero, a folder, a missing path, an empty file, a link to
                    itself
In match mode a case passes when the run is refused exactly when the reference says the file
is damaged or differs from the run, naming the file, and goes on otherwise. In override mode
(and in moo mode where the file is damaged or differs) the file must afterwards hold the run's
plan; in moo mode a matching file must be left as it was. A file that is not a plan (no magic,
a FIFO, a folder) is refused in every mode, naming it.
"""
import copy
import math
import os
import random
import re
import shutil
import stat
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import plan_format as pf  # noqa: E402

BIN = os.path.realpath(sys.argv[1])
SEED = common.seed_from_argv()
CASES = common.int_flag("--cases", 240)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = ["tests/plan/gpt2_step.lua", "--vocab", "32", "--seq", "8", "--dim", "16", "--heads", "2", "--layers", "2",
          "--batch", "4"]
LAYOUTS = {  # name: (ranks, the script's flags)
    "serial": (1, []),
    "tensor 2": (2, ["--tensor", "2"]),
    "pipeline 2 x ZeRO-1, bf16": (4, ["--pipeline", "2", "--zero-stage", "1", "--dtype", "bfloat16"]),
}


def command(layout, plan, mode):
    ranks, flags = LAYOUTS[layout]
    launch = ["--nproc-per-node", str(ranks), "--timeout", "60"] if ranks > 1 else []
    return [BIN, "--threads", "1", *launch, "--plan", plan, "--plan-mode", mode, *SCRIPT, *flags]


# ---- damage -----------------------------------------------------------------------------

def size_tags(plan_bytes):
    """Offsets of every container count (u64) in a plan file, found by reading it."""
    offsets = []
    r = pf.Reader(plan_bytes)
    size = r.size

    def recording():
        offsets.append(r.at)
        return size()
    r.size = recording
    r.string()
    version = r.num("I")
    pf.read_struct(r, "Plan", version)
    return offsets


def some_rank(plan, rng):
    return rng.choice(plan["ranks"])


def mutate_compared(plan, rng):
    p = copy.deepcopy(plan)
    kind = rng.randrange(4)
    if kind == 0:
        key = rng.choice(pf.LAYOUT_KEYS)
        p[key] = rng.choice([p[key] + 1, p[key] - 1, 0, -1, 2 ** 31 - 1])
        return p, f"layout {key} = {p[key]}"
    r = some_rank(p, rng)
    if kind == 1:
        key = rng.choice(pf.RANK_KEYS + ["rank"])
        r[key] = rng.choice([r[key] + 1, 0, -1, 2 ** 31 - 1])
        return p, f"rank entry {key} = {r[key]}"
    if kind == 2 and r["shards"]:
        s = rng.choice(r["shards"])
        key = rng.choice(pf.SHARD_KEYS)
        v = s[key]
        if key in ("name", "dtype"):
            s[key] = rng.choice([b"", v + b"x", b"float64", v[:-1]])
        elif key in ("shape", "local_shape", "group"):
            s[key] = rng.choice([v + [1], v[:-1], [x + 1 for x in v], []])
        elif key == "slices":
            s[key] = rng.choice([v + [(0, 1)], v[:-1], [(a, b + 1) for a, b in v], [(0, 2 ** 62)]])
        else:
            s[key] = rng.choice([v + 1, v - 1, 0, -1, 2 ** 31 - 1])
        return p, f"shard {s['name'][:20]!r} {key}"
    if r["collectives"]:
        c = rng.choice(r["collectives"])
        key = rng.choice(["group", "op", "calls", "bytes"])
        c[key] = c[key] + b"x" if isinstance(c[key], bytes) else c[key] + rng.choice([1, -1, 2 ** 40])
        return p, f"collective {key}"
    r["param_bytes"] += 1
    return p, "param_bytes + 1"


def mutate_free(plan, rng):
    p = copy.deepcopy(plan)
    kind = rng.randrange(7)
    if kind == 0:
        p["script"] = rng.choice([b"", b"x" * 100000, bytes(range(256)), b"other.lua"])
        return p, "script"
    if kind == 1:
        key = rng.choice(["nproc_per_node", "cpu_peak_bytes"])
        p[key] = rng.choice([0, -1, 2 ** 31 - 1])
        return p, key
    if kind == 2:
        p["seconds"] = rng.choice([math.nan, math.inf, -1.0, 1e308])
        return p, f"seconds {p['seconds']}"
    r = some_rank(p, rng)
    if kind == 3:
        r["activation_bytes"] = rng.choice([-1, 0, 2 ** 62])
        return p, "activation bytes"
    if kind == 4 and rng.random() < 0.5:  # a prediction, not compared: a real run notes no attention calls
        context = r["context_plan"] or pf.empty_context()
        r["context_plan"] = context
        what = rng.choice(["mode", "calls", "ring_bytes", "all_to_all_refusal"])
        context[what] = rng.choice([b"", b"ring", b"\xff" * 300]) if what in ("mode", "all_to_all_refusal") \
            else rng.choice([-1, 2 ** 62, 12])
        return p, f"context {what}"
    if kind == 4:  # nor the experts' prediction (their parameters are compared as shards)
        expert = r["expert_plan"] or pf.empty_expert()
        r["expert_plan"] = expert
        what = rng.choice(["experts", "forwards", "balanced_bytes", "worst_sent", "param_bytes"])
        expert[what] = rng.choice([-1, 2 ** 62, 12])
        return p, f"expert {what}"
    stage = r["stage"] or pf.empty_stage()
    r["stage"] = stage
    what = rng.choice(["schedule", "present", "chunks", "bubble", "peers", "microbatches"])
    if what == "schedule":
        stage["schedule"] = rng.choice([b"", b"gpipe", b"\xff" * 300])
    elif what == "present":
        stage["present"] = rng.choice([0, 1, 255])
    elif what == "chunks":
        stage["chunks"] = stage["chunks"][:1] * rng.choice([0, 2, 50])
    elif what == "bubble":
        stage["bubble"] = rng.choice([math.nan, -math.inf, 2.0])
    elif what == "peers":
        stage["peers"] = stage["peers"] + [{"peer": -5, "pipeline_peer": 99, "sends": -1, "send_bytes": 2 ** 62,
                                            "recvs": 0, "recv_bytes": 0}]
    else:
        stage["microbatches"] = rng.choice([0, -1, 2 ** 31 - 1])
    return p, f"stage {what}"


def mutate_entries(plan, rng):
    p = copy.deepcopy(plan)
    r = some_rank(p, rng)
    what = rng.choice(["shard removed", "shard repeated", "shards reordered", "rank removed", "rank repeated",
                       "ranks reordered", "rank added", "collective removed", "collectives reordered"])
    if what == "shard removed" and r["shards"]:
        r["shards"].pop(rng.randrange(len(r["shards"])))
    elif what == "shard repeated" and r["shards"]:
        r["shards"].insert(rng.randrange(len(r["shards"]) + 1), copy.deepcopy(rng.choice(r["shards"])))
    elif what == "shards reordered":
        rng.shuffle(r["shards"])
    elif what == "rank removed":
        p["ranks"].remove(r)
    elif what == "rank repeated":
        p["ranks"].insert(rng.randrange(len(p["ranks"]) + 1), copy.deepcopy(r))
    elif what == "ranks reordered":
        rng.shuffle(p["ranks"])
    elif what == "rank added":
        extra = copy.deepcopy(r)
        extra["rank"] = rng.choice([99, -1, len(p["ranks"])])
        p["ranks"].append(extra)
    elif what == "collective removed" and r["collectives"]:
        r["collectives"].pop()
    elif what == "collectives reordered":
        r["collectives"].reverse()
    return p, what


def mutate_strings(plan, rng):
    p = copy.deepcopy(plan)
    r = some_rank(p, rng)
    new = rng.choice([b"", b"n" * 100000, bytes(rng.randrange(256) for _ in range(40)), b"wte.weight"])
    target = rng.choice(["shard", "collective", "dtype"])
    if target == "collective" and r["collectives"]:
        rng.choice(r["collectives"])["group"] = new
    elif r["shards"]:
        rng.choice(r["shards"])["name" if target != "dtype" else "dtype"] = new
    return p, f"{target} name of {len(new)} bytes"


def damage(cls, pristine_bytes, plans, layout, rng):
    """(bytes, what) of a damaged copy of `layout`'s plan."""
    data = bytearray(pristine_bytes)
    _, plan = pf.read(pristine_bytes)
    if cls == "unchanged":
        return bytes(data), "as saved"
    if cls == "bits flipped":
        flips = [rng.randrange(len(data) * 8) for _ in range(rng.randint(1, 8))]
        for bit in flips:
            data[bit // 8] ^= 1 << (bit % 8)
        return bytes(data), f"bits {flips[:4]}"
    if cls == "cut short":
        n = rng.randrange(len(data))
        return bytes(data[:n]), f"{n} of {len(data)} bytes"
    if cls == "bytes appended":
        return bytes(data) + bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))), "appended"
    if cls == "count inflated":
        at = rng.choice(size_tags(pristine_bytes))
        old = struct.unpack_from("<Q", data, at)[0]
        new = rng.choice([old + 1, old + 7, max(0, old - 1), 2 ** 64 - 1, 2 ** 40, len(data)])
        struct.pack_into("<Q", data, at, new)
        return bytes(data), f"count at {at}: {old} -> {new}"
    if cls == "version":
        v = rng.choice([0, 7, 2 ** 32 - 1, 1, 2, 3, 4, 5])
        if v in (1, 2, 3, 4, 5):
            return pf.write(plan, version=v), f"written as format {v}"
        struct.pack_into("<I", data, 8 + len(pf.MAGIC), v)
        return bytes(data), f"version {v}"
    if cls == "magic":
        what = rng.choice(["length", "text", "empty"])
        if what == "length":
            struct.pack_into("<Q", data, 0, rng.choice([12, 14, 2 ** 63]))
        elif what == "text":
            data[8 + rng.randrange(len(pf.MAGIC))] ^= 0x20
        else:
            return pf.write(plan, magic=b""), "magic empty"
        return bytes(data), f"magic {what}"
    if cls == "compared field":
        p, what = mutate_compared(plan, rng)
        return pf.write(p), what
    if cls == "free field":
        p, what = mutate_free(plan, rng)
        return pf.write(p), what
    if cls == "entries":
        p, what = mutate_entries(plan, rng)
        return pf.write(p), what
    if cls == "strings":
        p, what = mutate_strings(plan, rng)
        return pf.write(p), what
    if cls == "foreign plan":
        other = rng.choice([k for k in plans if k != layout])
        return plans[other], f"the plan of {other}"
    raise ValueError(cls)


SPECIAL = ["fifo", "devzero", "folder", "missing", "empty", "link to itself"]


# ---- judging ----------------------------------------------------------------------------

def refused_naming(o, path):
    if o.kind != "refused":
        return False
    text = o.err
    return path in text and len(text) < 20000 and common.INTERNAL_LOCATION.search(text.split("stack traceback")[0]) is None


def judge(o, path, mode, special, data, pristine_plan):
    """(kind, ok, detail)."""
    if o.kind in ("crash", "hang"):
        return o.kind, False, repr(o)
    after = open(path, "rb").read() if os.path.isfile(path) and not os.path.islink(path) else None

    def refusal(why):
        return ("refused", True, "") if refused_naming(o, path) else ("unclear", False, f"{why}: {o!r}")
    # What is not a plan is refused in every mode; nothing there is refused in match mode, and
    # written in the others (a link to itself: written over, or refused naming it).
    if special in ("fifo", "devzero", "folder", "empty"):
        return refusal("expected a refusal naming the file")
    if special in ("missing", "link to itself") and (mode == "match" or o.kind == "refused"):
        return refusal("expected a refusal naming the file")
    if special is None and mode != "match" and not data.startswith(struct.pack("<Q", len(pf.MAGIC)) + pf.MAGIC):
        return refusal(f"a file that is not a plan, in {mode}")
    try:
        saved = pf.read(data)[1] if special is None else None
        same = saved is not None and pf.matches(saved, pristine_plan)
    except pf.Damaged:
        same = False
    if mode == "match":
        if same:
            return ("accepted", True, "") if o.kind == "accepted" else ("wrong", False, f"a matching plan refused: {o!r}")
        if o.kind == "accepted":
            return "wrong", False, "a damaged or differing plan was accepted"
        return refusal("the refusal")
    # override, and moo: the run goes on; the file holds this run's plan, or (moo, matching) what it held.
    if o.kind != "accepted":
        return "wrong", False, f"{mode} refused: {o.err[-1500:]}"
    if mode == "moo" and same:
        return ("accepted", True, "") if after == data else ("wrong", False, "moo rewrote a matching plan")
    try:
        _, written = pf.read(after or b"")
    except pf.Damaged as e:
        return "wrong", False, f"{mode} left a file that is not a plan: {e}"
    if not (pf.matches(written, pristine_plan) and pf.matches(pristine_plan, written)):
        return "wrong", False, f"{mode} wrote a plan that is not this run's"
    return "accepted", True, ""


CLASSES = ["unchanged", "bits flipped", "cut short", "bytes appended", "count inflated", "version", "magic",
           "compared field", "free field", "entries", "strings", "foreign plan", "special files"]


def main():
    tally = common.Tally(f"Plan files (seed {SEED})", kinds=["refused", "accepted", "wrong", "unclear", "crash", "hang"])
    rng = random.Random(SEED)
    work = common.scratch_dir("fuzz-plan-")
    try:
        plans = {}
        for name, (ranks, flags) in LAYOUTS.items():
            path = os.path.join(work, name.replace(" ", "_").replace(",", "") + ".plan")
            o = common.run([BIN, "plan", "--world", str(ranks), "--save", path, *SCRIPT, *flags], timeout=120, cwd=ROOT)
            if o.kind != "accepted":
                raise SystemExit(f"cannot plan {name}: {o!r}")
            plans[name] = open(path, "rb").read()
        cases = []
        for i in range(CASES):
            cls = CLASSES[i % len(CLASSES)]
            layout = rng.choices(list(LAYOUTS), weights=[6, 3, 1])[0]
            mode = "match" if cls == "unchanged" else rng.choices(["match", "moo", "override"], weights=[6, 1, 1])[0]
            path = os.path.join(work, f"case-{i}.plan")
            special, data = None, None
            if cls == "special files":
                special = rng.choice(SPECIAL)
                common.make_special(path, special)
                what = special
            else:
                data, what = damage(cls, plans[layout], plans, layout, rng)
                open(path, "wb").write(data)
            cases.append((i, cls, layout, mode, path, special, data, what))

        def one(case):
            i, cls, layout, mode, path, special, data, what = case
            return case, common.run(command(layout, path, mode), timeout=90, cwd=ROOT, memory=common.MEMORY_LIMIT)

        # Two at a time, but the 4-rank jobs one at a time (they would slow each other past bounds).
        few = [c for c in cases if LAYOUTS[c[2]][0] <= 2]
        many = [c for c in cases if LAYOUTS[c[2]][0] > 2]
        began = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            outcomes = list(pool.map(one, few))
        print(f"{len(few)} cases of 1 and 2 ranks in {time.monotonic() - began:.0f} s", flush=True)
        began = time.monotonic()
        outcomes += [one(c) for c in many]
        print(f"{len(many)} cases of 4 ranks in {time.monotonic() - began:.0f} s", flush=True)
        for (i, cls, layout, mode, path, special, data, what), o in sorted(outcomes, key=lambda x: x[0][0]):
            _, pristine = pf.read(plans[layout])
            kind, ok, detail = judge(o, path, mode, special, data, pristine)
            tally.add(cls, kind, ok, f"case {i} ({layout}, {mode}: {what}): {detail}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tally.finish()


if __name__ == "__main__":
    sys.exit(main())
