"""Seeing a run, end to end through the partrain command: the live progress line on a
pseudo-terminal and plain lines on a pipe; the metrics file after kill -9 (every completed step,
valid JSON a line) and after the resume that continues it (no step twice); tokens/s, TFLOP/s and
MFU of the GPT example against a hand count of its FLOPs, at 1 and 2 ranks; --config and --help; pt.log on rank 0
of 2 ranks, and its rank option.
Usage: test_observability.py PATH/TO/partrain"""
import json
import os
import pty
import select
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from checks import check, finish  # noqa: E402

BIN = os.path.abspath(sys.argv[1])
TINY = ["examples/gpt/train.lua", "--dim", "32", "--heads", "2", "--layers", "1", "--seq", "16", "--batch", "4",
        "--sample", "0"]
tmp = tempfile.mkdtemp()


def run(args, timeout=120, env=None):
    p = subprocess.run([BIN, "--threads", "1"] + args, capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, **(env or {})))
    return p.returncode, p.stdout, p.stderr


def records(path):
    """The metrics file's lines as JSON (a torn last line, without its newline, skipped) and
    whether every complete line parsed."""
    with open(path, "rb") as f:
        text = f.read().decode()
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    elif lines:
        lines.pop()  # torn
    out, valid = [], True
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            valid = False
    return out, valid


def steps_of(recs):
    return [r["step"] for r in recs if "step" in r and "event" not in r]


# --- Progress: in place on a terminal, plain lines on a pipe ------------------------------------
def on_pty(args):
    pid, fd = pty.fork()
    if pid == 0:
        os.execv(BIN, [BIN, "--threads", "1"] + args)
    out = b""
    deadline = time.time() + 120
    while time.time() < deadline:
        r, _, _ = select.select([fd], [], [], 1)
        if not r:
            continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out.decode(errors="replace")


code, out = on_pty(TINY + ["--steps", "12", "--log-every", "6"])
live = [part for part in out.split("\r") if part.startswith("step ") and "/12" in part]
check("on a terminal the progress line is rewritten in place (\\r, clear to end of line), first to last step",
      code == 0 and {"step 1/12", "step 6/12", "step 12/12"} <= {p.split(" |")[0] for p in live} and "\x1b[K" in out and any("tok/s" in p and "ETA" in p for p in live),
      f"exit {code}, {len(live)} rewrites: {out[-1500:]!r}")
check("on a terminal the log lines stay (step 6 | loss ...) and the last progress line ends with a newline",
      "step 6 | loss" in out and "step 12/12" in out and out.split("step 12/12")[-1].split("\x1b[K")[1].startswith("\r\n"),
      repr(out[-800:]))
code, out = on_pty(["--nproc-per-node", "2"] + TINY + ["--steps", "8", "--log-every", "4"])
live = [part for part in out.split("\r") if part.startswith("step ") and "/8" in part]
check("through the launcher (2 ranks) rank 0's live line reaches the terminal, rewritten in place",
      code == 0 and {"step 1/8", "step 4/8", "step 8/8"} <= {p.split(" |")[0] for p in live} and "step 4 | loss" in out and "\n" in out.split("step 8/8")[-1],
      f"exit {code}, {len(live)} rewrites: {out[-1500:]!r}")
code, out = on_pty(TINY + ["--steps", "4", "--log-every", "2", "--no-progress"])
check("--no-progress (the example's flag): no live line on a terminal", code == 0 and "/4" not in out and "step 4 | loss" in out,
      repr(out[-800:]))
code, out, err = run(TINY + ["--steps", "6", "--log-every", "3"])
check("on a pipe: plain log lines (step 1, 3, 6), no carriage return",
      code == 0 and "\r" not in out and [l.split(" |")[0] for l in out.splitlines() if l.startswith("step ")] ==
      ["step 1", "step 3", "step 6"], out + err)

# --- The metrics file: kill -9, then a resume that continues it -----------------------------------
metrics, ckpt = os.path.join(tmp, "m.jsonl"), os.path.join(tmp, "ckpt")
p = subprocess.Popen([BIN, "--threads", "1", "--metrics", metrics] + TINY +
                     ["--steps", "100000", "--log-every", "1", "--ckpt", ckpt, "--save-every", "4"],
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
deadline = time.time() + 120
while time.time() < deadline:
    time.sleep(0.05)
    if os.path.exists(metrics) and len(steps_of(records(metrics)[0])) >= 10:
        break
p.send_signal(signal.SIGKILL)
p.wait()
recs, valid = records(metrics)
steps = steps_of(recs)
check("after kill -9 every completed line is valid JSON and steps 1..k are there, in order",
      valid and len(steps) >= 10 and steps == list(range(1, len(steps) + 1)) and recs[0].get("event") == "run",
      f"valid {valid}, steps {steps}")
header = recs[0]
check("the run header names the script, the world, the mesh, the resolved config and the FLOPs a token",
      header.get("script") == "examples/gpt/train.lua" and header.get("world") == 1 and
      header.get("mesh") == {"pipeline": 1, "tensor": 1, "data": 1} and header.get("config", {}).get("dim") == 32 and
      header.get("device") == "cpu" and header.get("flops_per_token", 0) > 0, header)
check("a memory record after the first step, with every rank's bytes",
      any(r.get("event") == "memory" and r.get("step") == 1 and len(r.get("ranks", [])) == 1 and r["ranks"][0] > 0
          for r in recs), recs[:4])
first_mem = next((r for r in recs if r.get("event") == "memory"), {})
state = (first_mem.get("state") or [{}])[0]
check("... with the rank's model state (pt.progress { model }): AdamW's two moments are twice the parameters",
      state.get("params", 0) > 0 and 2 * state["params"] <= state.get("optimizer", 0) <= 2 * state["params"] + 4096,
      first_mem)
plan = [r for r in recs if r.get("event") == "plan"]
check("... and the shard summary once, as a plan record the report shows",
      len(plan) == 1 and "params" in plan[0].get("text", "") and "\n0 " in plan[0]["text"], plan)
TORN = '{"step": 99999, "lo'  # (a plain "99999" can be part of a logged float)
with open(metrics, "a") as f:
    f.write(TORN)  # as if the kill had torn a line
end = steps[-1] + 8  # past what the killed run logged, so the resume repeats some of its steps
code, out, err = run(["--metrics", metrics] + TINY + ["--steps", str(end), "--log-every", "1", "--ckpt", ckpt,
                                                      "--save-every", "4"])
recs, valid = records(metrics)
steps = steps_of(recs)
resumed_at = int(out.split(" at step ")[1].split()[0]) if " at step " in out else -1
check(f"the resumed run (from step {resumed_at}) continues the file: steps 1..{end} once each, every line valid, "
      "the torn line gone",
      code == 0 and valid and steps == list(range(1, end + 1)) and sum(1 for r in recs if r.get("event") == "run") == 2
      and TORN not in open(metrics).read() and 0 < resumed_at <= end - 8,
      f"exit {code}, valid {valid}, runs {sum(1 for r in recs if r.get('event') == 'run')}, "
      f"torn line kept {TORN in open(metrics).read()}, steps {steps}: {err[-500:]}")
check("memory records at the resumed run's first step and at its end",
      [r["step"] for r in recs if r.get("event") == "memory"][-2:] == [resumed_at + 1, end], recs[-3:])

refusals = [run(["--metrics", bad, "-e", "print(1)"])[2].strip() for bad in ("/tmp", "/dev/null", tmp + "/no/m.jsonl")]
check("--metrics refuses a folder, a device and a missing folder before the script runs, naming the file",
      refusals == ["partrain: --metrics '/tmp' is a folder (expected the JSON-lines file to append to)",
                   "partrain: --metrics '/dev/null' is not a regular file (expected the JSON-lines file to append to)",
                   f"partrain: --metrics '{tmp}/no/m.jsonl': its folder does not exist"], refusals)

# --- Tokens/s, TFLOP/s and MFU against a hand count -------------------------------------------
V, D, L, T, B, PEAK = 256, 32, 1, 16, 4, 0.25
code, out, err = run(["-e", f'local pt = require "partrain"; print(pt.models.gpt2 {{ vocab = {V}, seq = {T}, '
                      f'dim = {D}, heads = 2, layers = {L} }}:num_parameters())'])
params = int(out.split()[-1]) if code == 0 else -1
# GPT-2 by hand: a block has ln_1, ln_2 (2D each), c_attn (3D x D, 3D), attn.c_proj (D x D, D), c_fc
# (4D x D, 4D), mlp.c_proj (D x 4D, D); then ln_f (2D); wte (V x D) is also the head; wpe (T x D).
block = 2 * D + 2 * D + (3 * D * D + 3 * D) + (D * D + D) + (4 * D * D + 4 * D) + (4 * D * D + D)
check("the hand count of GPT-2's parameters is the model's own", params == L * block + 2 * D + V * D + T * D,
      f"{params} vs {L * block + 2 * D + V * D + T * D}")
n = L * block + 2 * D + V * D  # position embeddings are a lookup: not in N
fpt = 6 * n + 12 * L * D * T
m2 = os.path.join(tmp, "mfu.jsonl")
code, out, err = run(TINY + ["--steps", "5", "--log-every", "1", "--metrics", m2, "--peak-tflops", str(PEAK)])
recs, _ = records(m2)
steps = [r for r in recs if "step" in r and "event" not in r]
worst = 0.0
prev = None
rate_ok = True
for r in steps:
    tflops = r["tokens_per_s"] * fpt / 1e12
    worst = max(worst, abs(r["tflops"] - tflops) / tflops, abs(r["mfu"] - tflops / PEAK) / (tflops / PEAK))
    if prev is not None:  # tokens/s: the global batch's tokens over the seconds between two records
        want = B * T * (r["step"] - prev["step"]) / (r["seconds"] - prev["seconds"])
        rate_ok = rate_ok and abs(r["tokens_per_s"] - want) / want < 0.25
    prev = r
check(f"MFU and TFLOP/s = tokens/s x (6N + 12LDT) / peak, N counted by hand (worst relative error {worst:.1e} <= 1e-9)",
      code == 0 and len(steps) == 5 and recs[0].get("flops_per_token") == fpt and recs[0].get("peak_tflops") == PEAK
      and worst <= 1e-9, f"{code} {recs[0]} {steps[:2]} {err[-300:]}")
check("tokens/s counts the global batch's tokens a second (within 25 % of batch x seq / the logged seconds)",
      rate_ok, steps)
check("the printed line carries mfu and tokens_per_s", "| mfu " in out and "| tokens_per_s " in out, out)
m3 = os.path.join(tmp, "mfu2.jsonl")  # two data-parallel ranks: the peak is two devices'
code, out, err = run(["--nproc-per-node", "2"] + TINY + ["--steps", "5", "--log-every", "1", "--metrics", m3,
                                                         "--peak-tflops", str(PEAK)])
recs, _ = records(m3)
steps = [r for r in recs if "step" in r and "event" not in r]
worst, prev, rate_ok = 0.0, None, True
for r in steps:
    tflops = r["tokens_per_s"] * fpt / 1e12
    worst = max(worst, abs(r["tflops"] - tflops) / tflops, abs(r["mfu"] - tflops / (2 * PEAK)) / (tflops / (2 * PEAK)))
    if prev is not None:
        want = B * T * (r["step"] - prev["step"]) / (r["seconds"] - prev["seconds"])
        rate_ok = rate_ok and abs(r["tokens_per_s"] - want) / want < 0.25
    prev = r
check(f"at 2 ranks, MFU is TFLOP/s over twice one device's peak and tokens/s counts the global batch "
      f"(worst relative error {worst:.1e} <= 1e-9)",
      code == 0 and len(steps) == 5 and worst <= 1e-9 and rate_ok, f"{code} {steps[:2]} {err[-300:]}")

# --- --config and --help ----------------------------------------------------------------------
cfg = os.path.join(tmp, "run.lua")
with open(cfg, "w") as f:
    f.write("-- a small run\nreturn {\n  steps = 3,\n  dim = 32,\n  heads = 2,\n  layers = 1,\n  seq = 16,\n"
            "  batch = 4,\n  sample = 0,\n}\n")
ck2 = os.path.join(tmp, "ck2")
code, out, err = run(["examples/gpt/train.lua", "--config", cfg, "--steps", "2", "--ckpt", ck2, "--save-every", "2"])
check("--config fills the defaults and a flag overrides it (2 steps, width 32), and the resolved config is printed",
      code == 0 and "1 layers of width 32" in out and "step 2 | loss" in out and "step 3" not in out
      and f"config ({cfg}): " in out and "steps=2" in out, out + err)
code, out, err = run(["-e", 'local pt = require "partrain"\n'
                      f'local l = pt.ckpt.load("{ck2}", {{ model = pt.deferred(function() return pt.models.gpt2 {{ '
                      'vocab = 256, seq = 16, dim = 32, heads = 2, layers = 1 } end) })\n'
                      'print(pt.metrics.json(l.user.config))'])
saved = json.loads(out.strip().splitlines()[-1]) if code == 0 else {}
check("the checkpoint's user data holds the resolved config (file values, flag overrides)",
      saved.get("steps") == 2 and saved.get("dim") == 32 and saved.get("lr") == 3e-3, out + err)
with open(cfg, "a") as f:
    f.write("")
with open(cfg, "w") as f:
    f.write("return {\n  steps = 3,\n  stpes = 4,\n}\n")
code, out, err = run(["examples/gpt/train.lua", "--config", cfg])
check("an unknown key in the config file is refused, naming the file:line and the key",
      code == 1 and f"{cfg}:3: unknown option 'stpes'" in err, err)
code, out, err = run(["examples/gpt/train.lua", "--help"])
check("--help prints each option's name, type, default and description",
      code == 0 and any(l.split() [:4] == ["--steps", "integer", "[200]", "steps"] for l in out.splitlines())
      and "--peak-tflops" in out and "--config" in out, out)

# --- pt.log on 2 ranks: rank 0 by default, the rank option ----------------------------------------
script = os.path.join(tmp, "ranks.lua")
with open(script, "w") as f:
    f.write('local pt = require "partrain"\n'
            'pt.log { step = 1, loss = pt.dist.rank() }\n'
            'pt.log({ step = 2, loss = 10 + pt.dist.rank() }, { rank = 1 })\n'
            'pt.log({ step = 3, loss = 20 + pt.dist.rank() }, { rank = "all" })\n')
m3 = os.path.join(tmp, "ranks.jsonl")
code, out, err = run(["--nproc-per-node", "2", "--tee", "--metrics", m3, script])
lines = sorted(l for l in out.splitlines() if "| loss" in l)
check("pt.log prints on rank 0 by default, on the rank it names, on every rank with rank = \"all\"",
      code == 0 and lines == ["[rank 0] step 1 | loss 0", "[rank 0] step 3 | loss 20", "[rank 1] step 2 | loss 11",
                              "[rank 1] step 3 | loss 21"], out + err)
recs, valid = records(m3)
check("the metrics file holds rank 0's records only, a step once",
      valid and [(r["step"], r["loss"]) for r in recs if "step" in r] == [(1, 0), (2, 10), (3, 20)]
      and recs[0].get("world") == 2, recs)

subprocess.run(["rm", "-rf", tmp])
finish("observability")
