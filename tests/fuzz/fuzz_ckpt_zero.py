#!/usr/bin/env python3
"""Pipelined checkpoints of a bfloat16 GPT-2 saved under ZeRO-2 (pipeline 2 x data 2: each
stage's data rank 0 writes the stage's file, float32 masters and moments gathered over the zero
group), damaged and loaded: into one process, and at the saving layout, 4 ranks at once.

Usage: fuzz_ckpt_zero.py PARTRAIN [--seed N] [--cases N] [--ranked-cases N]

The pristine folder holds step-00000002 and step-00000004 (tests/fuzz/zero_ckpt_batch.lua
make); each case is a copy with one damage, run through pt.ckpt.verify, pt.ckpt.load of step 4
and pt.ckpt.resume in one job (zero_ckpt_batch.lua check, restarted after a case that kills or
stalls it), each process bounded to common.MEMORY_LIMIT bytes of address space. Classes: the
manifest's magic, version, length, checksum or payload flipped; the payload flipped with its
length and CRC-32 made to match again (so that the parser and the checks behind it see the
damage: names, dtypes, shapes, pieces, masters); the manifest cut or extended; a stage's data
file flipped, cut or extended; newest's bytes or garbage; step 2 flipped; files deleted,
swapped with step 2's, replaced by a FIFO or /dev/zero; a tag deleted; harmless additions.

A case passes as fuzz_ckpt.py's do (its judge): verify passes step 4 exactly when its load
succeeds; a load restores step 4 exactly (weights, masters, moments, step) or fails naming a
file of the case and changes nothing; resume takes step 4, else step 2 loudly, else fails
naming the folder. At 4 ranks, every rank must also succeed or fail alike.
"""
import os
import random
import shutil
import struct
import sys
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import fuzz_ckpt  # noqa: E402  (its judge, and its byte-level damage)

BIN = os.path.abspath(sys.argv[1])
SEED = common.seed_from_argv()
CASES = common.int_flag("--cases", 180)
RANKED = common.int_flag("--ranked-cases", 24)
BATCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zero_ckpt_batch.lua")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
T2, T4 = "step-00000002", "step-00000004"
HEADER = fuzz_ckpt.HEADER
flip, truncate, extend, replace = fuzz_ckpt.flip, fuzz_ckpt.truncate, fuzz_ckpt.extend, fuzz_ckpt.replace


def structure(payload):
    """The byte span of a format-9 manifest payload's tensor and file tables (what says where
    each tensor's bytes are and what they hold): (begin, end). Before it: the step, the layout,
    the model's and optimizer's kinds, counts and the user's table; after it: the generators'
    states, the pipeline layout, the loss scaler, the configuration and per-parameter steps."""
    at = 0

    def take(n):
        nonlocal at
        at += n
        return payload[at - n:at]

    def u64():
        return struct.unpack("<Q", take(8))[0]

    def string():
        take(u64())

    def numbers(width):
        take(u64() * width)
    take(8 + 5 * 4)  # step, world, tensor, data, pipeline, zero
    for _ in range(3):
        string()  # model type, policy, optimizer
    take(16)  # optimizer steps, samples seen
    string()  # user
    take(1)  # full
    begin = at
    for _ in range(u64()):  # tensors
        string(), string(), numbers(8), take(4), numbers(8)  # name, dtype, shape, dim, parts
        for _ in range(u64()):  # pieces
            take(4 + 8 + 8), numbers(8), numbers(8), take(4)  # file, offset, bytes, start, size, crc32
    for _ in range(u64()):  # files
        string(), take(8 + 4)
    return begin, at


def data_files(tag):
    return sorted(f for f in os.listdir(tag) if f.startswith("rank-") and f.endswith(".bin"))


def damage(case, cls, rng):
    """Applies damage of class `cls` to the folder `case`; returns what was done."""
    t4, t2 = os.path.join(case, T4), os.path.join(case, T2)
    manifest = os.path.join(t4, "manifest.bin")
    data = os.path.join(t4, rng.choice(data_files(t4)))
    newest = os.path.join(case, "newest")
    region = {"manifest magic": (0, 27), "manifest version": (27, 31), "manifest length": (31, 39),
              "manifest checksum": (39, 43), "manifest payload": (43, 1 << 30)}
    if cls in region:
        return flip(manifest, *region[cls], rng)
    if cls in ("tables re-checksummed", "values re-checksummed"):
        payload = bytearray(open(manifest, "rb").read()[HEADER:])
        begin, end = structure(bytes(payload))
        inside = cls.startswith("tables")
        spots = []
        while len(spots) < rng.randint(1, 4):
            at = rng.randrange(len(payload))
            if (begin <= at < end) == inside:
                spots.append(at)
        for at in spots:
            payload[at] ^= 1 << rng.randrange(8)
        fuzz_ckpt.rechecksum(manifest, bytes(payload))
        return f"payload bytes {spots} (tables at {begin}-{end})"
    if cls == "manifest truncated":
        return truncate(manifest, rng)
    if cls == "manifest extended":
        return extend(manifest, rng)
    if cls == "data flipped":
        return os.path.basename(data) + " " + flip(data, 0, 1 << 30, rng)
    if cls == "data truncated":
        return os.path.basename(data) + " " + truncate(data, rng)
    if cls == "data extended":
        return os.path.basename(data) + " " + extend(data, rng)
    if cls == "newest damaged":
        if rng.random() < 0.5:
            return "newest " + flip(newest, 0, 1 << 30, rng)
        open(newest, "wb").write(bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40))))
        return "newest garbage"
    if cls == "older tag flipped":
        path = os.path.join(t2, rng.choice(["manifest.bin"] + data_files(t2)))
        return os.path.basename(path) + " " + flip(path, 0, 1 << 30, rng)
    if cls == "file deleted":
        path = rng.choice([manifest, data, newest, os.path.join(t4, "summary.txt")])
        os.remove(path)
        return os.path.relpath(path, case)
    if cls == "file swapped":
        name = rng.choice(["manifest.bin"] + data_files(t4))
        return name + " " + replace(os.path.join(t4, name), rng.choice(["link", "copy"]), os.path.join(t2, name))
    if cls == "FIFO or device":
        path = rng.choice([manifest, data, newest])
        return os.path.relpath(path, case) + " " + replace(path, rng.choice(["fifo", "devzero"]))
    if cls == "tag deleted":
        which = rng.choice([t4, t2])
        shutil.rmtree(which)
        return os.path.basename(which)
    if cls == "harmless":
        open(os.path.join(t4, "notes.txt"), "w").write("x")
        return "a file of the user's"
    raise ValueError(cls)


CLASSES = ["manifest magic", "manifest version", "manifest length", "manifest checksum", "manifest payload",
           "tables re-checksummed", "tables re-checksummed", "values re-checksummed", "manifest truncated",
           "manifest extended", "data flipped", "data truncated", "data extended", "newest damaged",
           "older tag flipped", "file deleted", "file swapped", "FIFO or device", "tag deleted", "harmless"]


def run_batch(where, work, items, tally_crash):
    """Runs zero_ckpt_batch.lua check over `items` [(index, path)] at `where` ("serial", or
    "zero": 4 ranks), restarting after a case that kills or stalls it; {index: result}."""
    launch = ["--nproc-per-node", "4", "--timeout", "60"] if where == "zero" else []

    def argv(lst, out):
        return [BIN, "--threads", "1", *launch, BATCH, "check", work, lst, out, where]
    return common.run_batched(argv, ROOT, work, items, lambda c: f"{c[0]}\t{c[1]}", tally_crash,
                              f"zero_ckpt_batch.lua at {where}", memory=common.MEMORY_LIMIT)


def main():
    tally = common.Tally(f"ZeRO and bf16 pipelined checkpoints (seed {SEED})",
                         kinds=["refused", "fallback", "accepted", "wrong", "unclear", "crash", "hang"])
    rng = random.Random(SEED)
    work = common.scratch_dir("fuzz-ckpt-zero-")
    try:
        made = common.run([BIN, "--nproc-per-node", "4", "--threads", "1", BATCH, "make", work], timeout=180, cwd=ROOT,
                          memory=common.MEMORY_LIMIT)
        if made.kind != "accepted":
            raise SystemExit(f"could not make the pristine checkpoints: {made!r}")
        cases_dir = os.path.join(work, "cases")
        os.makedirs(cases_dir)
        meta = {}
        for i in range(CASES + RANKED):
            cls = CLASSES[i % len(CLASSES)]
            where = "serial" if i < CASES else "zero"
            case = os.path.join(cases_dir, str(i))
            shutil.copytree(os.path.join(work, "pristine"), case, symlinks=True)
            meta[i] = (case, f"{cls} ({'1 process' if where == 'serial' else '4 ranks'})", where, damage(case, cls, rng))
        done = {}

        def crashed(i, kind, detail):
            case, cls, where, what = meta[i]
            tally.add(cls, kind, False, f"case {i} ({what}): {detail}")
            done[i] = kind

        results = {}
        for where in ("serial", "zero"):
            items = [(i, meta[i][0]) for i in sorted(meta) if meta[i][2] == where]
            began = time.monotonic()
            results.update(run_batch(where, work, items, crashed))
            print(f"{len(items)} cases at {where} in {time.monotonic() - began:.0f} s", flush=True)
        for i in sorted(meta):
            if i in done:
                continue
            case, cls, where, what = meta[i]
            r = results[i]
            if cls.startswith("values re-checksummed"):
                # A step, count, user table or generator state rewritten with its checksum is a
                # valid checkpoint of other values, restored as it says: every other rule holds.
                r = dict(r, load_match=True, resume_match=True)
            kind, ok, detail = fuzz_ckpt.judge(case, cls, r)
            if ok and not (r.get("load_agree", True) and r.get("resume_agree", True)):
                kind, ok, detail = "wrong", False, "the ranks disagreed: " + str(r)[:600]
            tally.add(cls, kind, ok, f"case {i} ({what}): {detail}")
        # The command line on a few cases: verify agrees with pt.ckpt.verify, inspect never fails
        # without naming the case.
        for i in sorted(meta)[:: max(1, len(meta) // 12)]:
            if i in done:
                continue
            case, cls, where, what = meta[i]
            v = common.run([BIN, "ckpt", "verify", case], timeout=30, memory=common.MEMORY_LIMIT)
            good = v.kind not in ("crash", "hang") and (v.rc == 0) == bool(results[i]["verify"])
            tally.add("command line", ("refused" if v.rc else "accepted") if good else v.kind if v.kind in
                      ("crash", "hang") else "unclear", good, f"case {i} ({cls}: {what}): ckpt verify {v!r}")
            v = common.run([BIN, "ckpt", "inspect", os.path.join(case, T4)], timeout=30, memory=common.MEMORY_LIMIT)
            good = v.kind == "accepted" or (v.kind == "refused" and case in v.err)
            tally.add("command line", v.kind if good or v.kind in ("crash", "hang") else "unclear", good,
                      f"case {i} ({cls}: {what}): ckpt inspect {v!r}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tally.finish()


if __name__ == "__main__":
    sys.exit(main())
