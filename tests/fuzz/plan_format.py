"""partrain's plan files (engine/plan/plan.cpp: cereal's binary archive behind a magic string
and a format version) read and written in Python, for tests/fuzz/fuzz_plan.py: read() takes the
bytes as util::BoundedInputArchive does (every count checked against the bytes left, nothing
after the end), write() makes a file of any format version, and matches() says whether a run
whose own plan is `run` matches a saved plan as plan::check compares them."""
import struct

MAGIC = b"partrain-plan"
VERSION = 7


class Damaged(Exception):
    """What partrain refuses as "damaged or truncated" (or as not a plan, `foreign` set)."""

    def __init__(self, why, foreign=False):
        super().__init__(why)
        self.foreign = foreign


class Reader:
    def __init__(self, data):
        self.data, self.at = data, 0

    def left(self):
        return len(self.data) - self.at

    def take(self, n):
        if n > self.left():
            raise Damaged(f"needs {n} bytes where {self.left()} are left")
        out = self.data[self.at:self.at + n]
        self.at += n
        return out

    def num(self, fmt):
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def size(self):
        n = self.num("Q")
        if n > self.left():
            raise Damaged(f"a container of {n} elements where {self.left()} bytes are left")
        return n

    def string(self):
        return self.take(self.size())

    def numbers(self, fmt):
        n = self.size()
        width = struct.calcsize(fmt)
        return list(struct.unpack("<" + fmt * n, self.take(n * width))) if n else []

    def items(self, read_one):
        return [read_one(self) for _ in range(self.size())]


class Writer:
    def __init__(self):
        self.parts = []

    def num(self, fmt, v):
        self.parts.append(struct.pack("<" + fmt, v))

    def string(self, s):
        self.num("Q", len(s))
        self.parts.append(s)

    def numbers(self, fmt, values):
        self.num("Q", len(values))
        self.parts.append(struct.pack("<" + fmt * len(values), *values))

    def items(self, values, write_one):
        self.num("Q", len(values))
        for v in values:
            write_one(self, v)

    def bytes(self):
        return b"".join(self.parts)


# Each structure: its fields in cereal's order, as (name, kind); kinds: i (int32), q (int64),
# d (double), ? (bool, a byte), s (string), [q] [i] (vectors of numbers), [s] (of strings),
# [p] (of int64 pairs), or a structure's name for a vector of it.
SCHEMA = {
    "Shard": [("name", "s"), ("dtype", "s"), ("shape", "[q]"), ("local_shape", "[q]"), ("dim", "i"),
              ("slices", "[p]"), ("group", "[i]"), ("bytes", "q")],
    "Collective": [("group", "s"), ("op", "s"), ("calls", "q"), ("bytes", "q")],
    "StageChunk": [("stage", "i"), ("first_block", "q"), ("end_block", "q"), ("first", "?"), ("last", "?"),
                   ("activation_bytes", "q"), ("gradient_bytes", "q"), ("backward_bytes", "q"), ("pending_bytes", "q")],
    "PeerTraffic": [("peer", "i"), ("pipeline_peer", "i"), ("sends", "q"), ("send_bytes", "q"), ("recvs", "q"),
                    ("recv_bytes", "q")],
    "StagePlan": [("present", "?"), ("schedule", "s"), ("blocks", "s"), ("first", "[s]"), ("last", "[s]"),
                  ("microbatches", "i"), ("stages", "i"), ("chunks", "[StageChunk]"), ("in_flight", "q"),
                  ("activation_peak", "q"), ("bubble", "d"), ("peers", "[PeerTraffic]")],
    "ContextPlan": [("mode", "s"), ("calls", "q"), ("batch", "q"), ("heads", "q"), ("kv_heads", "q"), ("rows", "q"),
                    ("head_size", "q"), ("element_size", "q"), ("ring_bytes", "q"), ("all_to_all_bytes", "q"),
                    ("all_to_all_refusal", "s")],
    "ExpertPlan": [("experts", "q"), ("local", "q"), ("blocks", "q"), ("top_k", "q"), ("forwards", "q"),
                   ("tokens", "q"), ("slots", "q"), ("dim", "q"), ("element_size", "q"), ("all_to_alls", "q"),
                   ("count_bytes", "q"), ("balanced_bytes", "q"), ("balanced_sent", "q"), ("worst_sent", "q"),
                   ("param_bytes", "q"), ("stacked_bytes", "q"), ("grad_bytes", "q"), ("optimizer_bytes", "q")],
    "RankPlan": [("rank", "i"), ("tensor", "i"), ("data", "i"), ("pipeline", "i"), ("shards", "[Shard]"),
                 ("param_bytes", "q"), ("grad_bytes", "q"), ("optimizer_bytes", "q"), ("activation_bytes", "q"),
                 ("collectives", "[Collective]"), ("stage", "StagePlan"), ("master_bytes", "q"), ("zero_stage", "i"),
                 ("zero_group", "i"), ("param_shard_bytes", "q"), ("gather_bytes", "q"), ("gathers_all", "?"),
                 ("context", "i"), ("context_plan", "ContextPlan"), ("expert", "i"), ("expert_plan", "ExpertPlan")],
    "Plan": [("script", "s"), ("world", "i"), ("nproc_per_node", "i"), ("tensor", "i"), ("data", "i"),
             ("pipeline", "i"), ("zero", "i"), ("context", "i"), ("expert", "i"), ("cpu_peak_bytes", "q"), ("seconds", "d"),
             ("ranks", "[RankPlan]")],
}
# What RankPlan and Plan hold from which format version on (1: none of these), and their values
# in a plan of an earlier version.
SINCE = {("RankPlan", "stage"): 2, ("RankPlan", "master_bytes"): 3, ("RankPlan", "zero_stage"): 3,
         ("RankPlan", "zero_group"): 3, ("RankPlan", "param_shard_bytes"): 4, ("RankPlan", "gather_bytes"): 4,
         ("RankPlan", "gathers_all"): 4, ("RankPlan", "context"): 5, ("RankPlan", "context_plan"): 5,
         ("RankPlan", "expert"): 6, ("RankPlan", "expert_plan"): 6, ("Plan", "context"): 5, ("Plan", "expert"): 6,
         ("StageChunk", "pending_bytes"): 7}
DEFAULTS = {"stage": None, "master_bytes": 0, "zero_stage": 0, "zero_group": 1, "param_shard_bytes": 0,
            "gather_bytes": 0, "gathers_all": False, "context": 0, "context_plan": None, "expert": 0,
            "expert_plan": None}
PLAN_DEFAULTS = {"context": 1, "expert": 1}
NUMBER_FORMATS = {"i": "i", "q": "q", "d": "d", "?": "B"}


def fields(kind, version):
    return [(n, k) for n, k in SCHEMA[kind] if SINCE.get((kind, n), 1) <= version]


def read_struct(r, kind, version):
    out = {}
    for name, k in fields(kind, version):
        if k in NUMBER_FORMATS:
            out[name] = r.num(NUMBER_FORMATS[k])
        elif k == "s":
            out[name] = r.string()
        elif k in ("[q]", "[i]"):
            out[name] = r.numbers(k[1])
        elif k == "[s]":
            out[name] = r.items(lambda rr: rr.string())
        elif k == "[p]":
            out[name] = r.items(lambda rr: (rr.num("q"), rr.num("q")))
        elif k.startswith("["):
            out[name] = r.items(lambda rr, sub=k[1:-1]: read_struct(rr, sub, version))
        else:
            out[name] = read_struct(r, k, version)
    if kind == "RankPlan":
        for (owner, name) in SINCE:
            if owner == "RankPlan":
                out.setdefault(name, DEFAULTS[name])
    if kind == "StageChunk":
        out.setdefault("pending_bytes", 0)
    if kind == "Plan":
        for name, value in PLAN_DEFAULTS.items():
            out.setdefault(name, value)
    return out


def write_struct(w, kind, value, version):
    for name, k in fields(kind, version):
        v = value[name]
        if k in NUMBER_FORMATS:
            w.num(NUMBER_FORMATS[k], v)
        elif k == "s":
            w.string(v)
        elif k in ("[q]", "[i]"):
            w.numbers(k[1], v)
        elif k == "[s]":
            w.items(v, lambda ww, s: ww.string(s))
        elif k == "[p]":
            w.items(v, lambda ww, p: (ww.num("q", p[0]), ww.num("q", p[1])))
        elif k.startswith("["):
            w.items(v, lambda ww, x, sub=k[1:-1]: write_struct(ww, sub, x, version))
        else:
            write_struct(w, k, v if v is not None else EMPTY[k](), version)


def empty_context():
    return {"mode": b"", "calls": 0, "batch": 0, "heads": 0, "kv_heads": 0, "rows": 0, "head_size": 0,
            "element_size": 0, "ring_bytes": 0, "all_to_all_bytes": 0, "all_to_all_refusal": b""}


def empty_expert():
    return {name: 0 for name, _ in SCHEMA["ExpertPlan"]}


def empty_stage():
    return {"present": 0, "schedule": b"", "blocks": b"", "first": [], "last": [], "microbatches": 0, "stages": 0,
            "chunks": [], "in_flight": -1, "activation_peak": -1, "bubble": -1.0, "peers": []}


EMPTY = {"StagePlan": empty_stage, "ContextPlan": empty_context, "ExpertPlan": empty_expert}


def read(data):
    """The plan `data` holds, as partrain reads it: (version, plan dict); raises Damaged."""
    if len(data) < 8 + len(MAGIC) or struct.unpack("<Q", data[:8])[0] != len(MAGIC) or data[8:8 + len(MAGIC)] != MAGIC:
        raise Damaged("not a partrain plan", foreign=True)
    r = Reader(data)
    r.string()
    version = r.num("I")
    if not 1 <= version <= VERSION:
        raise Damaged(f"format version {version}")
    plan = read_struct(r, "Plan", version)
    if r.left():
        raise Damaged(f"{r.left()} bytes follow the end of the plan")
    return version, plan


def write(plan, version=VERSION, magic=MAGIC):
    w = Writer()
    w.string(magic)
    w.num("I", version)
    write_struct(w, "Plan", plan, version)
    return w.bytes()


# ---- what a run compares ----------------------------------------------------------------

SHARD_KEYS = ["name", "dtype", "shape", "local_shape", "dim", "slices", "group", "bytes"]
RANK_KEYS = ["tensor", "context", "data", "pipeline", "expert", "param_bytes", "grad_bytes", "optimizer_bytes", "master_bytes", "zero_stage",
             "zero_group"]
LAYOUT_KEYS = ["world", "tensor", "context", "data", "pipeline", "zero", "expert"]


def same_shards(planned, actual):
    """plan::differences' rule: every planned shard found by name among the run's (each taken
    once) and equal to it, and none of the run's left over."""
    mine = {s["name"]: s for s in actual}
    for s in planned:
        found = mine.pop(s["name"], None)
        if found is None or any(s[k] != found[k] for k in SHARD_KEYS):
            return False
    return not mine


def compared(collective):
    """What the check compares of a collective: group, op, calls and bytes, but for the expert
    group's all-to-alls, whose bytes the routing decides, the calls alone."""
    routed = collective["group"].startswith(b"expert[") and collective["op"] == b"all_to_all"
    return tuple(collective[k] for k in (("group", "op", "calls") if routed else ("group", "op", "calls", "bytes")))


def rank_matches(planned, actual):
    return (all(planned[k] == actual[k] for k in RANK_KEYS) and same_shards(planned["shards"], actual["shards"])
            and [compared(c) for c in planned["collectives"]] == [compared(c) for c in actual["collectives"]])


def matches(saved, run):
    """Whether every rank of the run `run` (a plan of what each rank holds) matches `saved`:
    the same layout, and each rank's entry (the first with its rank) the same."""
    if any(saved[k] != run[k] for k in LAYOUT_KEYS):
        return False
    for actual in run["ranks"]:
        entry = next((r for r in saved["ranks"] if r["rank"] == actual["rank"]), None)
        if entry is None or not rank_matches(entry, actual):
            return False
    return True
