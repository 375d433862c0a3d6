"""Checkpoints of a pipelined GPT-2 resume under other pipeline sizes with the uninterrupted run's
losses (fp32, 1e-5 relative): saved at pipeline 2 x data 2 (1F1B) after 3 of 8 steps and resumed
at 1 process, at pipeline 4 (GPipe) and at tensor 2; saved again at tensor 2 and resumed at
pipeline 2. `partrain ckpt convert --pipeline` rewrites the checkpoint for 4 stages and for 1,
and each, like a full (consolidated) save at pipeline 2 x data 2, loads to the same parameters as
the original, bit for bit, and trains on the same way;
bad sizes are refused. Pipeline 2 x tensor 2 saved, resumed at pipeline 1 x tensor 4 and at 1
process.

Usage: test_pipeline_ckpt.py PARTRAIN
"""
import os
import re
import subprocess
import sys
import tempfile

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
