"""`partrain parity A B`: on metrics files, equal losses pass (0), a 1e-7 wobble passes under the
default tolerance and reports its size, a 1 % change at step 3 fails (1) naming step 3 and both
losses, --steps and --tol bound the comparison, no common step / a step logged twice / bad flags
are usage errors (2), -o writes the overlay page with the verdict. On real runs: GPT-2 serial
against tensor 2 x data 2 (4 ranks) agrees within TOL_TP (the float32 difference measured is
printed), the same script with another --lr fails naming step 2 (step 1's loss is computed before
the first update), a command that fails is reported as failed (3) with its output's file, and a
command that logs no loss is refused.
Usage: test_parity.py PATH/TO/partrain"""
import os
import re
import subprocess
import sys
import tempfile

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, ".."))
sys.path.insert(0, here)
from checks import check, finish  # noqa: E402
import metrics_files as mf  # noqa: E402

BIN = os.path.abspath(sys.argv[1])
tmp = tempfile.mkdtemp(prefix="parity-test-")
# GPT-2 at tensor 2 x data 2 against serial, float32, 6 steps: the largest relative difference of
# the losses measured here is printed by the test; this bound holds it with room.
TOL_TP = 1e-5


def parity(*args, timeout=300):
    env = dict(os.environ, TMPDIR=tmp)
    p = subprocess.run([BIN, "parity"] + list(args), capture_output=True, text=True, timeout=timeout, env=env)
    return p.returncode, p.stdout + p.stderr


base = mf.steps(10)
a = mf.write(os.path.join(tmp, "a.jsonl"), [mf.header()] + base)
wobble = [dict(r, loss=r["loss"] * (1 + 1e-7 * (-1) ** r["step"])) for r in base]
a2 = mf.write(os.path.join(tmp, "a2.jsonl"), [mf.header()] + wobble)
changed = [dict(r, loss=r["loss"] * (1.01 if r["step"] >= 3 else 1)) for r in base]
# Nesting far below the line-length bound had overflowed the parser's stack (SIGSEGV).
deep = mf.write(os.path.join(tmp, "deep.jsonl"), [mf.header()] + base[:3] + ['{"step": 4, "x": ' + "[" * 200000 + "]" * 200000 + "}"])
rc, text = parity(deep, deep)
check("parity refuses a line nested 200,000 deep with its line, not a crash",
      rc > 0 and "deep.jsonl:5: a JSON value nested deeper than 64 levels" in text, (rc, text[-500:]))
c = mf.write(os.path.join(tmp, "c.jsonl"), [mf.header()] + changed)

rc, out = parity(a, a)
check("a file against itself agrees (0)", rc == 0 and "within tolerance" in out and "compared 10 common steps" in out, out)
rc, out = parity(a, a2)
m = re.search(r"largest relative difference (\S+) at step (\d+)", out)
check("a 1e-7 wobble is within the default tolerance and its size is reported",
      rc == 0 and m and 0.9e-7 < float(m.group(1)) < 1.1e-7, out)
rc, out = parity(a, c)
loss3 = base[2]["loss"]
check("a 1 % change from step 3 diverges (1) naming step 3 and both losses",
      rc == 1 and "diverged at step 3: A loss %.9g, B loss %.9g" % (loss3, loss3 * 1.01) in out, out)
check("the largest difference and its step are reported", "largest relative difference 0.00990099" in out, out)
rc, out = parity(a, c, "--steps", "2")
check("--steps 2 compares steps 1 and 2 only", rc == 0 and "compared 2 common steps (1 to 2)" in out, out)
rc, out = parity(a, c, "--tol", "0.02")
check("--tol 0.02 lets a 1 % difference pass", rc == 0, out)
page = os.path.join(tmp, "parity.html")
rc, out = parity(a, c, "-o", page)
html = open(page).read() if os.path.isfile(page) else ""
check("-o writes the overlay page with the verdict", rc == 1 and "diverged at step 3" in html and
      html.count('<path class="series" data-file="1" data-field="loss"') == 1, out)
run = os.path.join(tmp, "run")
os.mkdir(run)
mf.write(os.path.join(run, "metrics.jsonl"), [mf.header()] + base)
rc, out = parity(run, a)
check("a run folder is a metrics input", rc == 0, out)

late = mf.write(os.path.join(tmp, "late.jsonl"), mf.steps(30)[20:])
rc, out = parity(a, late)
check("no common step is refused (2)", rc == 2 and "no step in common" in out, out)
twice = mf.write(os.path.join(tmp, "twice.jsonl"), base + base[4:5])
rc, out = parity(a, twice)
check("a step logged twice is refused (2) with both lines", rc == 2 and "step 5 is logged twice (lines 5 and 11)" in out, out)
for args, what, text in (([a], "one input", "expected two runs"), ([a, a, "--tol", "-1"], "a negative --tol", "--tol '-1'"),
                         ([a, a, "--steps", "0"], "--steps 0", "--steps 0 is out of range"),
                         ([a, a, "--bogus"], "an unknown flag", "unknown flag '--bogus'"),
                         ([a, "examples/gpt/train.lua --prompt 'oops"], "an unclosed quote", "an unclosed '")):
    rc, out = parity(*args)
    check(f"{what} is a usage error (2)", rc == 2 and text in out, out)
rc, out = parity(a, os.path.join(tmp, "missing.jsonl"))
check("a missing metrics file is a usage error (2), before any command runs",
      rc == 2 and "B: there is no metrics file" in out, out)
rc, out = parity(a, "examples/gpt/train.lua --metrics elsewhere.jsonl")
check("a command choosing its own metrics file is a usage error (2)", rc == 2 and "leave out --metrics" in out, out)
rc, out = parity("--help")
check("--help documents the exit codes", rc == 0 and "Exit status: 0" in out, out)

# Real runs: the commands are run by parity with PARTRAIN_METRICS set.
gpt = "examples/gpt/train.lua --steps 6 --log-every 1 --dim 32 --heads 2 --layers 2 --seq 16 --batch 8 --sample 0"
rc, out = parity(gpt + " --no-such-option", gpt)
log = re.search(r"its output is in (\S+)", out)
check("a failing command is reported as failed (3) with its output's file",
      rc == 3 and "A failed (exit status 1)" in out and log and os.path.isfile(log.group(1)), out)
rc, out = parity("-e 'print(1)'", gpt)
check("a command that logs no loss is refused (2)", rc == 2 and "A logged no losses" in out, out)
rc, out = parity("--threads 1 " + gpt, "--nproc-per-node 4 --threads 1 " + gpt + " --tensor 2", timeout=600)
m = re.search(r"largest relative difference (\S+) at step (\d+)", out)
print(f"     measured: serial vs tensor 2 x data 2, largest relative loss difference {m.group(1) if m else '?'}")
check(f"GPT-2 serial and tensor 2 x data 2 agree within {TOL_TP} over 6 steps",
      rc == 0 and "compared 6 common steps" in out, out)
rc, out = parity("--threads 1 " + gpt, "--threads 1 " + gpt + " --lr 0.001", "--tol", str(TOL_TP))
check("another --lr diverges (1) at step 2, the first loss after an update", rc == 1 and "diverged at step 2:" in out, out)
finish("parity")
