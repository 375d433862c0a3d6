"""Fuzzes checkpoint folders: seeded random byte flips, truncations and extensions over every
region of the manifest (magic, version, length, checksum, payload), of `newest` and of the data
files, and structural damage (deleted or swapped files, FIFOs, links, a tag folder that is a
link, a newest escaping the folder), on the newest tag and the older one.

The pristine folder is a tensor-2 run's step-00000002 and step-00000004; a second one, saved at
pipeline 2 (each stage writing its own data file, the manifest recording the stages), takes its
own cases: manifest and data damage, and the pipeline layout at the manifest's end flipped or
rewritten with the checksum made to match again (a load never depends on the layout, so such a
case is refused naming the manifest or loads exactly). Each damaged copy goes
through one partrain process (tests/fuzz/ckpt_batch.lua, restarted after a case that kills it)
that runs pt.ckpt.verify, pt.ckpt.load of step 4 and pt.ckpt.resume, and saves what each loaded
again so that its bytes can be compared with the pristine state's. A case passes when:

  - verify of step 4 passes exactly when its load does; a load that succeeds restores step 4's
    weights, optimizer state, step, data position and generator exactly; one that fails names a
    file of the case (and the tensor, for a data file's checksum) and changes nothing;
  - resume takes step 4 when it verifies, else step 2 when that verifies (a fallback, with a note
    naming what was damaged), else fails naming the folder; what it took is restored exactly;
    and it says nothing when the folder verifies;
  - `partrain ckpt verify` (a sample of cases) agrees with pt.ckpt.verify, and `partrain ckpt
    inspect` never crashes or hangs.

Classes: refused (load refused, resume fine), fallback (resume took step 2, loudly), accepted
(harmless: everything as pristine); failures: wrong (accepted with other numbers, or the wrong
tag), unclear (a refusal without its file, or verify and load disagreeing), crash, hang.

Usage: fuzz_ckpt.py PARTRAIN [--seed N] [--cases N] [--staged-cases N]
"""
import os
import random
import re
import shutil
import struct
import sys
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

BIN = os.path.abspath(sys.argv[1])
SEED = common.seed_from_argv()
CASES = common.int_flag("--cases", 240)
STAGED_CASES = common.int_flag("--staged-cases", 50)
BATCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ckpt_batch.lua")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
T2, T4 = "step-00000002", "step-00000004"
HEADER = 43  # manifest: u64 magic length, magic (19), u32 version, u64 payload length, u32 CRC-32


def flip(path, lo, hi, rng):
    data = bytearray(open(path, "rb").read())
    hi = min(hi, len(data))
    at = rng.randrange(lo, hi)
    data[at] ^= rng.randrange(1, 256)
    open(path, "wb").write(bytes(data))
    return f"byte {at}"


def truncate(path, rng):
    size = os.path.getsize(path)
    n = rng.randrange(0, size)
    os.truncate(path, n)
    return f"to {n} of {size} bytes"


def extend(path, rng):
    extra = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 65)))
    with open(path, "ab") as f:
        f.write(extra)
    return f"{len(extra)} bytes"


def replace(path, how, other=None):
    os.remove(path)
    if how == "fifo":
        os.mkfifo(path)
    elif how == "devzero":
        os.symlink("/dev/zero", path)
    elif how == "link":
        os.symlink(other, path)
    elif how == "copy":
        shutil.copyfile(other, path)
    return how


def crc_line(tag):
    import zlib
    return f"{tag}\ncrc32 {zlib.crc32(tag.encode()):08x}\n"


def damage(case, cls, rng):
    """Applies damage of class `cls` to the folder `case`; returns what was done."""
    t4, t2 = os.path.join(case, T4), os.path.join(case, T2)
    manifest = os.path.join(t4, "manifest.bin")
    data_file = os.path.join(t4, rng.choice(["rank-00000.bin", "rank-00001.bin"]))
    newest = os.path.join(case, "newest")
    region = {"manifest magic": (0, 27), "manifest version": (27, 31), "manifest length": (31, 39),
              "manifest checksum": (39, 43), "manifest payload": (43, 1 << 30)}
    if cls in region:
        return flip(manifest, *region[cls], rng)
    if cls == "manifest truncated":
        return truncate(manifest, rng)
    if cls == "manifest extended":
        return extend(manifest, rng)
    if cls == "newest tag bytes":
        return flip(newest, 0, len(T4), rng)
    if cls == "newest checksum line":
        return flip(newest, len(T4), 1 << 30, rng)
    if cls == "newest truncated":
        return truncate(newest, rng)
    if cls == "newest extended":
        return extend(newest, rng)
    if cls == "newest garbage":
        open(newest, "wb").write(bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40))))
        return "random bytes"
    if cls == "newest escaping":
        target = rng.choice(["../../pristine/" + T4, "/tmp", "..", ".", T4 + "/..", "newest"])
        open(newest, "w").write(crc_line(target))
        return target
    if cls == "data flipped":
        return os.path.basename(data_file) + " " + flip(data_file, 0, 1 << 30, rng)
    if cls == "data truncated":
        return os.path.basename(data_file) + " " + truncate(data_file, rng)
    if cls == "data extended":
        return os.path.basename(data_file) + " " + extend(data_file, rng)
    if cls == "older tag flipped":
        path = os.path.join(t2, rng.choice(["manifest.bin", "rank-00000.bin", "rank-00001.bin"]))
        return os.path.basename(path) + " " + flip(path, 0, 1 << 30, rng)
    if cls == "file deleted":
        path = rng.choice([manifest, data_file, newest, os.path.join(t4, "summary.txt")])
        os.remove(path)
        return os.path.relpath(path, case)
    if cls == "tag deleted":
        which = rng.choice([t4, t2])
        shutil.rmtree(which)
        if rng.random() < 0.5:
            os.remove(newest)
            return os.path.basename(which) + " and newest"
        return os.path.basename(which)
    if cls == "FIFO or device":
        path = rng.choice([manifest, data_file, newest])
        return os.path.relpath(path, case) + " " + replace(path, rng.choice(["fifo", "devzero"]))
    if cls == "file swapped":
        name = rng.choice(["manifest.bin", "rank-00000.bin", "rank-00001.bin"])
        how = rng.choice(["link", "copy"])
        return name + " " + replace(os.path.join(t4, name), how, os.path.join(t2, name))
    if cls == "tag is a link":
        shutil.rmtree(t4)
        os.symlink(os.path.join(os.path.dirname(case), "..", "pristine", T4), t4)
        return "step-00000004 -> pristine"
    if cls == "harmless":
        what = rng.choice(["summary", "junk file", "junk folder"])
        if what == "summary":
            open(os.path.join(t4, "summary.txt"), "wb").write(b"\xff" * rng.randrange(0, 100))
        elif what == "junk file":
            open(os.path.join(t4, "notes.txt"), "w").write("x")
        else:
            os.makedirs(os.path.join(case, "logs"))
        return what
    raise ValueError(cls)


CLASSES = ["manifest magic", "manifest version", "manifest length", "manifest checksum", "manifest payload",
           "manifest truncated", "manifest extended", "newest tag bytes", "newest checksum line", "newest truncated",
           "newest extended", "newest garbage", "newest escaping", "data flipped", "data truncated", "data extended",
           "older tag flipped", "file deleted", "tag deleted", "FIFO or device", "file swapped", "tag is a link",
           "harmless"]


# ---- the pipelined checkpoint --------------------------------------------------------------

def cereal_string(text):
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def layout_bytes(schedule, chunks, blocks, first, last, bounds):
    """The manifest's pipeline layout as cereal's binary archive writes it (its last field)."""
    return (cereal_string(schedule) + struct.pack("<i", chunks) + cereal_string(blocks)
            + struct.pack("<Q", len(first)) + b"".join(map(cereal_string, first))
            + struct.pack("<Q", len(last)) + b"".join(map(cereal_string, last))
            + struct.pack("<Q", len(bounds)) + b"".join(struct.pack("<q", b) for b in bounds))


# What the pristine pipeline-2 save records: 1f1b, 1 chunk, blocks h.0 | h.1.
PRISTINE_LAYOUT = layout_bytes("1f1b", 1, "h", ["wte", "wpe"], ["ln_f", "lm_head"], [0, 1, 2])
# After the layout, format 5's loss-scale state and format 6's CUDA generator states: both empty
# (no scaler, a CPU run) in the pristine save. Format 7's model configuration follows, kept as it is.
EMPTY_TAIL = struct.pack("<Q", 0) + struct.pack("<Q", 0)


def rechecksum(manifest, payload):
    header = bytearray(open(manifest, "rb").read()[:HEADER])
    header[31:39] = struct.pack("<Q", len(payload))
    header[39:43] = struct.pack("<I", zlib.crc32(payload))
    open(manifest, "wb").write(bytes(header) + payload)


def staged_damage(case, cls, rng):
    """Damage of class `cls` to a copy of the pipelined folder; returns what was done."""
    t4 = os.path.join(case, T4)
    manifest = os.path.join(t4, "manifest.bin")
    payload = open(manifest, "rb").read()[HEADER:]
    at = payload.rfind(PRISTINE_LAYOUT + EMPTY_TAIL)
    if at < 0:
        raise SystemExit("the pipelined manifest does not hold the layout this driver expects")
    body, config = payload[:at], payload[at + len(PRISTINE_LAYOUT + EMPTY_TAIL):]
    if cls == "layout flipped, re-checksummed":
        layout = bytearray(PRISTINE_LAYOUT)
        at = rng.randrange(len(layout))
        layout[at] ^= rng.randrange(1, 256)
        rechecksum(manifest, body + bytes(layout) + EMPTY_TAIL + config)
        return f"layout byte {at}"
    if cls == "layout rewritten, re-checksummed" and rng.random() < 0.5:
        # Another layout that a pipeline 2 could have had: the load must not notice.
        layout = rng.choice([("gpipe", 1, "h", ["wte"], ["ln_f"], [0, 1, 2]),
                             ("", 2, "blocks", [], [], [0, 1, 2, 3, 4]),
                             ("interleaved", 1, "h", ["wte", "wpe"], ["ln_f", "lm_head"], [0, 5, 9])])
        rechecksum(manifest, body + layout_bytes(*layout) + EMPTY_TAIL + config)
        return f"another valid layout {layout}"
    if cls == "layout rewritten, re-checksummed":
        schedule = rng.choice(["1f1b", "gpipe", "", "x" * 300, "a\nb"])
        chunks = rng.choice([1, 2, 0, -1, 65, 2 ** 31 - 1])
        blocks = rng.choice(["h", "", "h\x01"])
        names = lambda: rng.choice([[], ["wte"], ["ln_f", "lm_head"], [""], ["n"] * 65])  # noqa: E731
        bounds = rng.choice([[], [0, 1, 2], [0, 1, 2, 3, 4], [0, 1], [1, 2, 3], [0, 2, 1], [0, 1, 2 ** 40],
                             [0, -1, 2], [0, 0, 2]])
        first, last = names(), names()
        rechecksum(manifest, body + layout_bytes(schedule, chunks, blocks, first, last, bounds) + EMPTY_TAIL + config)
        return f"schedule {schedule[:8]!r}, chunks {chunks}, blocks {blocks!r}, first {first[:2]}, last {last[:2]}, " \
               f"bounds {bounds}"
    return damage(case, cls, rng)


STAGED_CLASSES = ["manifest payload", "layout flipped, re-checksummed", "layout rewritten, re-checksummed",
                  "data flipped", "file deleted"]


def judge(case, cls, r):
    """(kind, ok, detail) for one case's results."""
    where = case + "/"  # a file or tag of the case, or the case folder itself
    v4, v2 = r["verify_" + T4], r["verify_" + T2]

    def named(message):
        return (where in message or case + "'" in message) and common.INTERNAL_LOCATION.search(message.split("stack traceback")[0]) is None

    # pt.ckpt.load of step 4.
    if r["load"] == "ok":
        if not r["load_match"]:
            return "wrong", False, "load of step 4 succeeded with other numbers"
        if not v4:
            return "unclear", False, "load of step 4 succeeded but verify says: " + r["verify_" + T4 + "_problems"]
    else:
        err = r["load_error"]
        if v4:
            return "unclear", False, "verify passes step 4 but its load fails: " + err
        if not named(err):
            return "unclear", False, "the load's refusal does not name a file of the case: " + err
        if "fails its checksum in" in err and "tensor '" not in err:
            return "unclear", False, "a data checksum error without its tensor: " + err
        if not r["load_unchanged"]:
            return "wrong", False, "a failed load changed the state: " + err
    # pt.ckpt.resume.
    expected = T4 if v4 else T2 if v2 else None
    if expected is None:
        anything = os.path.lexists(os.path.join(case, "newest")) or any(
            os.path.lexists(os.path.join(case, t)) for t in (T2, T4))
        if r["resume"] == "none" and not anything:
            return "refused", True, ""
        if r["resume"] != "error":
            return "wrong", False, f"nothing valid, yet resume gave {r['resume']} {r.get('resume_tag')}"
        if not named(r["resume_error"]):
            return "unclear", False, "resume's refusal does not name the damage: " + r["resume_error"]
        return "refused", True, ""
    if r["resume"] != "ok" or r["resume_tag"] != expected:
        return "wrong", False, f"resume should take {expected}: {r['resume']} {r.get('resume_tag')} " + \
            r.get("resume_error", "")
    if not r["resume_match"]:
        return "wrong", False, f"resume took {expected} with other numbers"
    if r["verify"] and r["resume_notes"]:
        return "unclear", False, "the folder verifies, yet resume says: " + r["resume_notes"]
    if expected == T2:
        if not named(r["resume_notes"]):
            return "unclear", False, "a fallback without naming the damage: " + r["resume_notes"]
        return "fallback", True, ""
    if not v4 or r["load"] != "ok":
        return "refused", True, ""
    if not r["verify"] and not r["resume_notes"] and cls.startswith("newest"):
        return "unclear", False, "newest is damaged (verify: " + r["verify_problems"] + ") but resume is silent"
    return "accepted", True, ""


def run_batch(mode, work, items, tally_crash):
    """Runs ckpt_batch.lua over `items` [(index, path)], restarting after a case that kills the
    process or stalls; returns {index: result}."""
    return common.run_batched(lambda lst, out: [BIN, "--threads", "1", BATCH, mode, work, lst, out], ROOT, work,
                              items, lambda c: f"{c[0]}\t{c[1]}", tally_crash, f"ckpt_batch.lua {mode}")


def main():
    tally = common.Tally(f"Checkpoints (seed {SEED})", kinds=["refused", "fallback", "accepted", "wrong", "unclear",
                                                               "crash", "hang"])
    rng = random.Random(SEED)
    work = common.scratch_dir("fuzz-ckpt-")
    try:
        made = common.make_with_batch(BIN, BATCH, work, ROOT)
        if made.kind != "accepted":
            print("could not make the pristine checkpoints:", made)
            return 1
        cases_dir = os.path.join(work, "cases")
        os.makedirs(cases_dir)
        meta = {}
        for i in range(CASES):
            cls = CLASSES[i % len(CLASSES)]
            case = os.path.join(cases_dir, str(i))
            shutil.copytree(os.path.join(work, "pristine"), case, symlinks=True)
            meta[i] = (case, cls, damage(case, cls, rng))
        classes = {}

        def crashed(i, kind, detail):
            case, cls, what = meta[i]
            tally.add(cls, kind, False, f"case {i} ({what}): {detail}")
            classes[i] = kind

        batch_start = time.monotonic()
        results = run_batch("ckpt", work, [(i, meta[i][0]) for i in range(CASES)], crashed)
        print(f"{CASES} damaged folders run in {time.monotonic() - batch_start:.0f} s", flush=True)
        for i in range(CASES):
            if i in classes:
                continue
            case, cls, what = meta[i]
            kind, ok, detail = judge(case, cls, results[i])
            tally.add(cls, kind, ok, f"case {i} ({what}): {detail}")
        # The command line on the first case of some classes: verify agrees, inspect neither
        # crashes nor hangs.
        # The pipelined checkpoint's cases, loaded into one process.
        staged = {}
        for k in range(STAGED_CASES):
            i = CASES + k
            cls = STAGED_CLASSES[k % len(STAGED_CLASSES)]
            case = os.path.join(cases_dir, str(i))
            shutil.copytree(os.path.join(work, "staged"), case, symlinks=True)
            staged[i] = meta[i] = (case, "pipeline 2: " + cls, staged_damage(case, cls, rng))
        batch_start = time.monotonic()
        results.update(run_batch("staged", work, [(i, staged[i][0]) for i in sorted(staged)], crashed))
        print(f"{STAGED_CASES} damaged pipelined folders run in {time.monotonic() - batch_start:.0f} s", flush=True)
        for i in sorted(staged):
            if i in classes:
                continue
            case, cls, what = meta[i]
            kind, ok, detail = judge(case, cls, results[i])
            tally.add(cls, kind, ok, f"case {i} ({what}): {detail}")
        for sample in ("FIFO or device", "tag is a link", "data flipped", "newest escaping"):
            i = CLASSES.index(sample)
            if i >= CASES or i not in results:
                continue
            case, cls, what = meta[i]
            v = common.run([BIN, "ckpt", "verify", case], timeout=30)
            if v.kind in ("crash", "hang") or (v.rc == 0) != bool(results[i]["verify"]):
                tally.add("command line", "unclear" if v.kind not in ("crash", "hang") else v.kind, False,
                          f"case {i} ({cls}: {what}): ckpt verify {v} vs pt.ckpt.verify {results[i]['verify']}")
            else:
                tally.add("command line", "refused" if v.rc else "accepted", True)
            v = common.run([BIN, "ckpt", "inspect", case], timeout=30)
            good = v.kind == "accepted" or (v.kind == "refused" and common.located(v, re.escape(case)))
            tally.add("command line", v.kind if good or v.kind in ("crash", "hang") else "unclear", good,
                      f"case {i} ({cls}: {what}): ckpt inspect {v}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tally.finish()


if __name__ == "__main__":
    sys.exit(main())
