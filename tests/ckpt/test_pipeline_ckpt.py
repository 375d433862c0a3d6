"""Checkpoints of a pipelined GPT-2 resume under other pipeline sizes with the uninterrupted run's
losses (fp32, 1e-5 relative): saved at pipeline 2 x data 2 (1F1B) after 3 of 8 steps and resumed
at 1 process, at pipeline 4 (GPipe) and at tensor 2; saved again at tensor 2 and resumed at
pipeline 2. `partrain ckpt convert --pipeline` rewrites the checkpoint for 4 stages and for 1,
and each, like a full (consolidated) save at pipeline 2 x data 2, loads to the same parameters as
the original, bit for bit, and trains on the same way;
bad sizes are refused. Pipeline 2 x tensor 2 saved, resumed at pipeline 1 x tensor 4 and at 1
process. A load that one stage refuses (a 6-block model, whose second stage finds no h.4) changes
no parameter and no step count on any rank. A model of heads=2 (same shapes) refuses the heads=4
checkpoint on every rank, one of dropout=0.1 loads it, and so does heads=2 once the manifest is
rewritten as format 6 (no configuration recorded).

Usage: test_pipeline_ckpt.py PARTRAIN
"""
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from checks import check, finish  # noqa: E402

BIN = os.path.abspath(sys.argv[1])
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pipeline.lua")
STEPS, SAVE_AT, TOL = 8, 3, 1e-5
RANKS = {"serial": 1, "pp2": 2, "tp2": 2, "pp2dp2": 4, "pp4": 4, "tp4": 4, "pp2tp2": 4}


def run(*args):
    p = subprocess.run([BIN, *args], capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout + p.stderr


def train(mode, folder, layout, *rest):
    n = RANKS[layout]
    launch = ["--nproc-per-node", str(n)] if n > 1 else []
    return run(*launch, "--threads", "1", SCRIPT, mode, folder, layout, str(STEPS), *rest)


def losses(out, k=1):
    """The losses run k printed (LOSS k step value), by step."""
    return {int(s): float(v) for r, s, v in re.findall(r"^LOSS (\d+) (\d+) (\S+)$", out, re.M) if int(r) == k}


def same_losses(what, out, straight, first, k=1):
    got = losses(out, k)
    want = {s: v for s, v in straight.items() if s >= first}
    worst = max((abs(got[s] - v) / max(1.0, abs(v)) for s, v in want.items() if s in got), default=float("inf"))
    check(f"{what}: losses of steps {first}-{max(want)} equal the uninterrupted run's within {TOL} "
          f"(largest difference {worst:.1e})", set(got) == set(want) and worst <= TOL, out)


with tempfile.TemporaryDirectory() as work:
    saved = os.path.join(work, "pp2dp2")
    rc, out = train("straight", saved, "pp2dp2", str(SAVE_AT))
    straight = losses(out)
    check("pipeline 2 x data 2 trains 8 steps and saves after step 3", rc == 0 and len(straight) == STEPS, out)
    tag = os.path.join(saved, "step-00000003")
    rc, out = run("ckpt", "inspect", tag)
    check("inspect shows the pipeline that saved it (schedule, stages and their blocks)",
          rc == 0 and "tensor 1 x data 2 x pipeline 2" in out and "pipeline: schedule 1f1b, 1 chunk(s) a rank" in out
          and "stage 0 (pipeline rank 0): h.0-h.1 + wte,wpe" in out
          and "stage 1 (pipeline rank 1): h.2-h.3 + ln_f,lm_head" in out, out)
    check("every tensor is stored once: the tied wte/lm_head as wte.weight, no lm_head.weight",
          "model/wte.weight" in out and "model/lm_head.weight" not in out
          and "optim/wte.weight/exp_avg" in out, out)
    check("both stages wrote their data (ranks 0 and 2, data rank 0 of each stage)",
          "rank-00000.bin" in out and "rank-00002.bin" in out and "rank-00001.bin" not in out, out)

    # Offline conversion to 4 stages and to none; bad sizes refused.
    converted = {}
    for pp in (4, 1):
        converted[pp] = os.path.join(work, f"converted-{pp}")
        rc, out = run("ckpt", "convert", saved, converted[pp], "--pipeline", str(pp))
        check(f"ckpt convert --pipeline {pp}", rc == 0 and f"x pipeline {pp}" in out, out)
        rc, out = run("ckpt", "inspect", os.path.join(converted[pp], "step-00000003"))
        files = sorted(set(re.findall(r"rank-\d+\.bin", out)))
        want = [f"rank-{r:05d}.bin" for r in range(pp)]
        check(f"... the files are those {pp} stage(s) would write ({', '.join(want)})", files == want, out)
        if pp == 4:
            check("... with the stages it was cut into", "stage 3 (pipeline rank 3): h.3 + ln_f,lm_head" in out, out)
    for bad, why in (("0", "--pipeline"), ("x", "--pipeline"), ("5", "4 blocks cannot fill 5 stages")):
        refused = os.path.join(work, "refused-" + bad)
        rc, out = run("ckpt", "convert", saved, refused, "--pipeline", bad)
        check(f"ckpt convert --pipeline {bad} is refused, saying why ({why})",
              rc != 0 and why in out and "Traceback" not in out, out)
        check("... and writes nothing", not os.path.exists(os.path.join(refused, "step-00000003")), out)

    # A load one stage refuses changes nothing on any stage: at pipeline 2 a 6-block model's first
    # stage finds all its tensors in the 4-block checkpoint, its second (h.3-h.5) has no h.4.
    rc, out = train("mismatch", saved, "pp2", "layers=6")
    got = {int(r): (what, int(n), int(s)) for r, what, n, s in
           re.findall(r"MISMATCH rank (\d+): (\w+); (\d+) parameters changed; optimizer steps (\d+);", out)}
    check("a 6-block model at pipeline 2 refuses the 4-block checkpoint on both ranks, rank 0 naming rank 1's "
          "missing tensor", rc == 0 and set(got) == {0, 1} and all(w == "refused" for w, _, _ in got.values())
          and "loading the checkpoint failed on rank 1" in out and "has no tensor 'h.4.ln_1.weight'" in out, out)
    check("... and no rank changed a parameter or the optimizer's step count (rank 0 had read all it needed)",
          all(n == 0 and s == 0 for _, n, s in got.values()), out)

    # The configuration: heads=2 computes another function with the same shapes and is refused;
    # dropout may change; a format 6 manifest records none, so nothing is compared.
    rc, out = train("mismatch", saved, "pp2", "heads=2")
    check("a GPT-2 of heads=2 at pipeline 2 refuses the heads=4 checkpoint on both ranks, naming both values",
          rc == 0 and len(re.findall(r"MISMATCH rank \d: refused; 0 parameters changed", out)) == 2
          and f"'{saved}/step-00000003' was saved by a GPT2 with heads=4; this one has heads=2" in out, out)
    rc, out = train("mismatch", saved, "pp2", "dropout=0.1")
    check("... one of dropout=0.1 loads it", rc == 0 and len(re.findall(r"MISMATCH rank \d: loaded;", out)) == 2, out)
    old = os.path.join(work, "format-6")
    shutil.copytree(saved, old)
    manifest = os.path.join(old, "step-00000003", "manifest.bin")
    data = open(manifest, "rb").read()
    head, payload = data[:43], data[43:]  # u64 19, magic, u32 version, u64 length, u32 CRC-32; payload
    config = [("vocab", 64), ("seq", 8), ("dim", 16), ("heads", 4), ("layers", 4), ("dropout", 0.0), ("eps", 1e-5),
              ("flash_attention", 0.0)]
    tail = struct.pack("<Q", len(config)) + b"".join(
        struct.pack("<Q", len(n)) + n.encode() + struct.pack("<d", v) + struct.pack("<Q", 0)  # format 9: no text
        for n, v in config)
    no_counts = struct.pack("<Q", 0)  # format 8: no parameter stepped fewer times than the optimizer
    check("the manifest is format 9 and ends with the model's configuration, then no per-parameter step counts",
          head[27:31] == struct.pack("<I", 9) and payload.endswith(tail + no_counts), repr(payload[-200:]))
    payload = payload[:-len(tail + no_counts)]
    head = head[:27] + struct.pack("<IQI", 6, len(payload), zlib.crc32(payload))
    open(manifest, "wb").write(head + payload)
    rc, out = train("mismatch", old, "pp2", "heads=2")
    check("the same checkpoint as format 6 (no configuration) still loads, into heads=2 too",
          rc == 0 and len(re.findall(r"MISMATCH rank \d: loaded;", out)) == 2, out)

    # Each layout resumes the original, then (a fresh model) the converted one, first checked
    # equal to the original's load.
    rc, out = run("ckpt", "inspect", os.path.join(saved + "-full", "step-00000003"))
    check("a full save at pipeline 2 x data 2: each stage's rank at data 0 writes its tensors whole",
          rc == 0 and "full (consolidated)" in out and "rank-00000.bin" in out and "rank-00002.bin" in out
          and "rank-00001.bin" not in out, out)
    for layout, pp in (("serial", 1), ("pp4", 4)):
        # The serial run resumes the full save too, first checked equal to the original's load.
        extra = f",{saved}-full@{saved}" if layout == "serial" else ""
        rc, out = train("resume", f"{saved},{converted[pp]}@{saved}{extra}", layout)
        check(f"resumed at {layout} from the original and from the converted checkpoint",
              rc == 0 and "RESUMED 1 step 3 saved by pp2dp2" in out and "RESUMED 2 step 3" in out, out)
        what = "1 process (pipeline 1 x data 1)" if layout == "serial" else "pipeline 4 (gpipe)"
        same_losses(f"pipeline 2 x data 2 -> {what}", out, straight, SAVE_AT + 1)
        check(f"ckpt convert --pipeline {pp} loads at {layout} to the original's parameters bit for bit",
              out.count(": 0 of this rank's parameters differ") >= RANKS[layout]
              and " parameters differ" in out and not re.search(r": [1-9]\d* of this rank's", out), out)
        same_losses(f"converted to pipeline {pp}, resumed at {layout}", out, straight, SAVE_AT + 1, k=2)
        if layout == "serial":
            check("the full save loads at 1 process to the original's parameters bit for bit",
                  out.count(": 0 of this rank's parameters differ") == 2, out)
            same_losses("full save at pipeline 2 x data 2 -> 1 process", out, straight, SAVE_AT + 1, k=3)

    # Pipeline to tensor and back: tensor 2 resumes step 3, trains to 6 and saves; pipeline 2
    # resumes that and trains to 8.
    tp_saved = os.path.join(work, "tp2")
    rc, out = run("--nproc-per-node", "2", "--threads", "1", SCRIPT, "resume", saved, "tp2", "6", tp_saved)
    check("resumed at tensor 2 (no pipeline) and saved there after step 6", rc == 0, out)
    same_losses("pipeline 2 x data 2 -> tensor 2", out, {s: v for s, v in straight.items() if s <= 6}, SAVE_AT + 1)
    rc, out = train("resume", tp_saved, "pp2")
    check("the tensor 2 checkpoint resumed at pipeline 2", rc == 0 and "RESUMED 1 step 6 saved by tp2" in out, out)
    same_losses("tensor 2 -> pipeline 2", out, straight, 7)

    # Pipeline 2 x tensor 2 -> pipeline 1 x tensor 4 and 1 process.
    pptp = os.path.join(work, "pp2tp2")
    rc, out = train("straight", pptp, "pp2tp2", str(SAVE_AT))
    straight = losses(out)
    check("pipeline 2 x tensor 2 trains 8 steps and saves after step 3", rc == 0 and len(straight) == STEPS, out)
    for layout in ("tp4", "serial"):
        rc, out = train("resume", pptp, layout)
        check(f"pipeline 2 x tensor 2 resumed at {layout}", rc == 0, out)
        same_losses(f"pipeline 2 x tensor 2 -> {layout}", out, straight, SAVE_AT + 1)

finish("pipelined checkpoint")
