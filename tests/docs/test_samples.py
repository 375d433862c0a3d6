"""Runs every fenced Lua and shell sample of README.md and docs/*.md, so a sample that stops working
fails here. Usage, from the repository root: test_samples.py PATH/TO/partrain [doc.md ...]

How each sample runs:
- ```lua: a script (it requires "partrain") runs as `partrain --threads 1 file.lua`; a fragment
  (it uses `pt`, `model`, `cfg`, ... without making them) runs after tests/docs/prelude.lua, which
  makes those names when the fragment first reads one. A sample runs on N ranks
  (`--nproc-per-node N`) when its pt.mesh sizes or a comment ("2 ranks or more") say so, or RUN
  below does. A sample whose first line names a Lua file (`-- schedules/reverse_gpipe.lua: ...`)
  is written there, for the samples after it to use, and run.
- ```sh / ```shell / ```bash: each `partrain ...` (or `build/partrain ...`) line runs with this
  partrain, with `--threads 1` (but for plan, ckpt, report and parity, which take no flags before
  them); `mkdir` lines run too; any other command (scripts/, apt, pip, ...) is not run. An example
  script given without a shown output gets a few steps (SMALL below, after the doc's own options:
  the last value wins). `train.lua` is tests/docs/train.lua.
- A ```text fence right after a sample is what it prints: its lines must appear in the sample's
  stdout in that order and together (a line `...` stands for any lines). Numbers agree to 1e-5
  relative (the last printed digit may differ between CPUs); fields a sample's text says vary
  (VARIES below) are not compared.
- A ```text fence that starts with `> ` is a REPL session: its chunks (`> ` and `>> ` lines) go to
  `partrain repl --nproc-per-node N` (N from the `[ranks ...]` tags of its output) and its other
  lines are the output.
Untagged fences (synopses, messages, trees) are not read. SKIP lists the few samples that cannot
run here, each with its reason. Every doc's samples run in order in one temporary folder
(examples/, tests/, policies/ and data/ linked from the checkout), each within TIMEOUT seconds,
with stdin empty.
"""
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, ".."))
from checks import check, finish  # noqa: E402

BIN = os.path.abspath(sys.argv[1])
ROOT = os.getcwd()
DOCS = sys.argv[2:] or ["README.md"] + sorted(
    os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
PRELUDE = os.path.join(here, "prelude.lua")
TIMEOUT = 120
SUBCOMMANDS = {"plan", "ckpt", "report", "parity"}  # they take no partrain flags before them

# Samples that cannot run here, keyed by (doc, first line of a Lua sample or a shell command line).
SKIP = {
    ("docs/parallel.md", "partrain --nnodes 2 --node-rank 0 --master-addr HOST --master-port 29500 "
     "--rdzv-secret-file ~/.partrain-secret --nproc-per-node 8 train.lua"):
        "node 0 of two machines waits for node 1 (tests/dist/test_nodes.py runs two nodes on loopback)",
    ("docs/parallel.md", "17  world:all_reduce(pt.ones(4))"):
        "lines of tests/dist/hang.lua with their numbers; it hangs on purpose (tests/dist/test_hang.sh runs it)",
    ("docs/parallel.md", 'local pt = require "partrain"\npt.dist.rank(), pt.dist.world_size()'):
        "a summary of pt.dist's calls, not a program (tests/dist/test_collectives.lua makes every one)",
}

# How some Lua samples run, keyed like SKIP: ranks, script arguments, Lua run first (setup), the
# prelude for a sample that requires partrain but elides what it uses (`-- ...`).
RUN = {
    ("README.md", "-- examples/mnist/train.lua, shortened"): {"args": ["--epochs", "1"]},
    ("docs/checkpoints.md", 'local pt = require "partrain"\n-- ... model = pt.parallelize(...)'): {"prelude": True},
    ("docs/observability.md", 'local pt = require "partrain"\nlocal cfg = pt.args { steps = { 200'): {"prelude": True},
    ("docs/parallel.md", "local logits = model(context):select(1, -1)"):  # a tensor-parallel model's logits
        {"ranks": 2, "setup": 'model = pt.parallelize(pt.models.gpt2(cfg), nil, pt.mesh { tensor = 2 })'},
    ("docs/policies.md", "pt.tp.is_sharded(model, name)"):
        {"ranks": 2, "setup": 'model = pt.parallelize(pt.models.gpt2(cfg), nil, pt.mesh { tensor = 2 })'},
    ("docs/policies.md", "pt.parallelize(model, nil, mesh, { sequence_parallel = true"):
        {"ranks": 2, "setup": "mesh = pt.mesh { tensor = 2 }"},
    ("docs/repl.md", "for step = 1, steps do"):  # to its breakpoint, whose REPL the empty stdin ends
        {"setup": "steps = 100; function train_step() return pt.zeros(1) end"},
}

# Example scripts run with a few steps where the doc shows no output.
SMALL = {
    "examples/gpt/train.lua": ["--steps", "3", "--sample", "0"],
    "examples/llama/train.lua": ["--steps", "3", "--sample", "0"],
    "examples/mnist/train.lua": ["--steps", "3"],
    "examples/simple/train.lua": ["--steps", "3"],
    "train.lua": ["--steps", "2"],
}

# Fields of an output that change from run to run, as the doc's text says, keyed like SKIP: the
# first group of each pattern is not compared.
MEASURED = r"\| (?:seconds|tflops|tokens_per_s|mem_bytes) ([-+.e0-9]+)"
VARIES = {
    ("docs/parallel.md", "partrain --nproc-per-node 4 examples/gpt/train.lua --pipeline 2 --zero-stage 2 --steps 40 "
     "--dim 64 --layers 2 --log-every 10"): [MEASURED],
    ("docs/plan.md", "partrain plan --world 4 --device-memory 80GiB -v examples/gpt/train.lua --tensor 2"):
        [r"planned in ([.0-9]+) s"],
    ("docs/plan.md", "partrain plan --world 8 --device-memory 40GiB examples/gpt/train.lua --vocab 50257 --seq 1024 "
     "--dim 2048 --layers 24 --heads 16 --batch 64"): [r"planned in ([.0-9]+) s"],
    ("docs/observability.md", "partrain parity examples/gpt/train.lua --steps 10 --log-every 1 --sample 0 "
     "--nproc-per-node 2 examples/gpt/train.lua --steps 10 --log-every 1 --sample 0 --tensor 2"):
        [r"largest relative difference (\S+ at step \d+)"],
}

FENCE = re.compile(r"^(\s*)```\s*(\w*)\s*$")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


class Sample:
    def __init__(self, doc, line, lang, text):
        self.doc, self.line, self.lang, self.text = doc, line, lang, text
        self.output = None  # the ```text fence right after it

    def find(self, table, text=None):
        """The entry of a table keyed (doc, start of the sample's text, or a command line), and its key."""
        text = self.text if text is None else text
        for key, value in table.items():
            if key[0] == self.doc and (text == key[1] if self.lang == "sh" else text.startswith(key[1])):
                return key, value
        return None, None

    def where(self):
        return f"{self.doc}:{self.line}"


def fences(doc):
    """Every fenced block of a Markdown file, as (line of its first code line, tag, text, line
    after its closing fence); indentation of the fence removed."""
    with open(os.path.join(ROOT, doc)) as f:
        lines = f.read().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, tag = len(m.group(1)), m.group(2)
        j = i + 1
        while not re.match(r"^\s*```\s*$", lines[j]):
            j += 1
        body = [ln[indent:] if ln[:indent].strip() == "" else ln for ln in lines[i + 1:j]]
        out.append((i + 2, tag, "\n".join(body), j + 1))
        i = j + 1
    return out, lines


def samples(doc):
    """The doc's samples in order: Lua, shell and REPL sessions, each with the output shown after it."""
    blocks, lines = fences(doc)
    found = []
    for n, (line, tag, text, end) in enumerate(blocks):
        lang = {"lua": "lua", "sh": "sh", "shell": "sh", "bash": "sh"}.get(tag)
        if tag == "text" and text.startswith("> "):
            lang = "repl"
        if lang is None:
            continue
        s = Sample(doc, line, lang, text)
        if lang != "repl" and n + 1 < len(blocks):
            nline, ntag, ntext, _ = blocks[n + 1]
            between = lines[end:nline - 2]
            if ntag == "text" and not ntext.startswith("> ") and all(b.strip() == "" for b in between):
                s.output = ntext
        found.append(s)
    return found


def ranks_of(text):
    """The ranks a Lua sample needs: its pt.mesh sizes multiplied, or a comment's "N ranks or more"."""
    n = 1
    for body in re.findall(r"pt\.mesh\s*\{([^}]*)\}", text):
        for kind in ("tensor", "context", "pipeline", "data"):
            m = re.search(kind + r"\s*=\s*(\d+)", body)
            n *= int(m.group(1)) if m else 1
    m = re.search(r"--.*?\b(\d+) ranks or more", text)
    return max(n, int(m.group(1))) if m else n


def normalized(text, varies):
    for pattern in varies:
        text = re.sub(pattern, lambda m: m.string[m.start(0):m.start(1)] + "#" + m.string[m.end(1):m.end(0)], text)
    return text


def same_line(want, got):
    """Equal text, numbers within 1e-5 relative."""
    if want == got:
        return True
    wn, gn = NUMBER.split(want), NUMBER.split(got)
    if wn != gn:
        return False
    for a, b in zip(NUMBER.findall(want), NUMBER.findall(got)):
        x, y = float(a), float(b)
        if abs(x - y) > 1e-5 * max(abs(x), abs(y)):
            return False
    return True


def shows(expected, actual, varies):
    """'' when the expected lines appear in actual in order (runs between `...` lines together),
    else what is missing."""
    want = [ln.rstrip() for ln in normalized(expected, varies).strip("\n").split("\n")]
    got = [ln.rstrip() for ln in normalized(actual, varies).split("\n")]
    runs, run = [], []
    for ln in want:
        if ln.strip() == "...":
            if run:
                runs.append(run)
            run = []
        else:
            run.append(ln)
    if run:
        runs.append(run)
    at = 0
    for run in runs:
        for start in range(at, len(got) - len(run) + 1):
            if all(same_line(w, g) for w, g in zip(run, got[start:start + len(run)])):
                at = start + len(run)
                break
        else:
            # Where the run matches best after the previous one, and its first line that differs there.
            best = max(range(at, len(got) + 1), key=lambda s: sum(
                same_line(w, g) for w, g in zip(run, got[s:s + len(run)])))
            there = got[best:best + len(run)] + [""] * len(run)
            miss = next((w for w, g in zip(run, there) if not same_line(w, g)), run[0])
            return f"not printed in this order (the first line that differs): {miss!r}"
    return ""


def run(cmd, cwd, stdin=""):
    started = time.time()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name in ("PARTRAIN_METRICS", "PARTRAIN_DEVICE", "PARTRAIN_PROGRESS"):
        env.pop(name, None)
    try:
        p = subprocess.run(cmd, cwd=cwd, input=stdin, capture_output=True, text=True, timeout=TIMEOUT, env=env)
        return p.returncode, p.stdout, p.stderr, time.time() - started
    except subprocess.TimeoutExpired as e:
        return None, e.stdout or "", e.stderr or "", time.time() - started


def result(s, what, rc, out, err, took, varies=()):
    detail = f"{' '.join(what)}\nstatus {rc}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}"
    ok = rc == 0
    if ok and s.output is not None:
        missing = shows(s.output, out, varies)
        ok, detail = not missing, missing + "\n" + detail
    check(f"{s.where()} {s.lang}: {' '.join(what)[:100]} ({took:.1f} s)", ok,
          f"timed out after {TIMEOUT} s\n{detail}" if rc is None else detail)


def run_lua(s, folder, used, tally):
    key, opts = s.find(RUN)
    used.add(key)
    opts = opts or {}
    m = re.match(r"-- ([\w./-]+\.lua)(:|$)", s.text)
    path = m.group(1) if m else f"sample_{s.line}.lua"
    os.makedirs(os.path.dirname(os.path.join(folder, path)) or folder, exist_ok=True)
    with open(os.path.join(folder, path), "w") as f:
        f.write(s.text + "\n")
    cmd = [BIN, "--threads", "1"]
    n = opts.get("ranks", ranks_of(s.text))
    if n > 1:
        cmd += ["--nproc-per-node", str(n)]
    if opts.get("prelude") or not re.search(r"""require\s*\(?\s*["']partrain["']""", s.text):
        cmd += ["-e", f"dofile({PRELUDE!r})"]
    if "setup" in opts:
        cmd += ["-e", opts["setup"]]
    cmd += [path] + opts.get("args", [])
    rc, out, err, took = run(cmd, folder)
    tally["run"] += 1
    result(s, ["partrain"] + cmd[1:], rc, out, err, took)


def commands(text):
    """A shell sample's command lines, continuations joined, comments dropped."""
    lines, cur = [], ""
    for ln in text.split("\n"):
        if ln.rstrip().endswith("\\"):
            cur += ln.rstrip()[:-1] + " "
            continue
        cur += ln
        if cur.strip():
            lines.append(" ".join(cur.split()))
        cur = ""
    return [(ln, shlex.split(ln, comments=True)) for ln in lines]


def run_sh(s, folder, used, tally):
    outs, errs, took, ran = [], [], 0.0, []
    for line, words in commands(s.text):
        key, why = s.find(SKIP, " ".join(words))
        if key:
            used.add(key)
            tally["skipped"].append((s.where(), line, why))
            continue
        if words and words[0] == "mkdir":
            subprocess.run(words, cwd=folder, check=True)
            continue
        if not words or words[0] not in ("partrain", "build/partrain"):
            tally["not_partrain"].append((s.where(), line))
            continue
        if set(words) & {"|", "||", "&&", ";", ">", ">>", "<", "&"}:
            check(f"{s.where()} sh: {line[:100]} is one command (no pipes or redirections to run)", False)
            continue
        cmd = [BIN] + words[1:]
        if len(words) > 1 and words[1] not in SUBCOMMANDS:
            cmd[1:1] = ["--threads", "1"]
        if s.output is None:
            script = next((w for w in words if w.endswith(".lua")), None)
            cmd += SMALL.get(script, []) if "--help" not in words else []
        rc, out, err, t = run(cmd, folder)
        took += t
        ran.append(cmd)
        outs.append(out)
        errs.append(err)
        if rc != 0:
            break
    if not ran:
        return
    tally["run"] += 1
    what = [" ; ".join(" ".join(["partrain"] + c[1:]) for c in ran)]
    key, varies = s.find(VARIES, " ".join(commands(s.text)[0][1]))
    used.add(key)
    result(s, what, rc, "".join(outs), "".join(errs), took, varies or [])


def run_repl(s, folder, tally):
    typed = re.compile(r"^>>? ")  # a chunk's first line, and the lines that continue it
    chunks = "".join(typed.sub("", ln) + "\n" for ln in s.text.split("\n") if typed.match(ln))
    s.output = "\n".join(ln for ln in s.text.split("\n") if not typed.match(ln))
    tags = re.findall(r"^\[ranks? ([-0-9,]+)\]", s.output, re.M)
    n = 1 + max((int(r) for tag in tags for r in re.split(r"[-,]", tag)), default=0)
    cmd = [BIN, "--threads", "1", "repl"] + (["--nproc-per-node", str(n)] if n > 1 else [])
    rc, out, err, took = run(cmd, folder, stdin=chunks)
    tally["run"] += 1
    result(s, ["partrain"] + cmd[1:], rc, out, err, took)


def main():
    tally = {"found": 0, "run": 0, "skipped": [], "not_partrain": []}
    used = set()
    top = tempfile.mkdtemp(prefix="doc-samples-")
    started = time.time()
    try:
        for doc in DOCS:
            folder = os.path.join(top, os.path.basename(doc)[:-3])
            os.makedirs(folder)
            for name in ("examples", "tests", "policies", "data"):
                os.symlink(os.path.join(ROOT, name), os.path.join(folder, name))
            shutil.copy(os.path.join(here, "train.lua"), folder)
            for s in samples(doc):
                tally["found"] += 1
                key, why = s.find(SKIP)
                if s.lang == "lua" and key:
                    used.add(key)
                    tally["skipped"].append((s.where(), s.text.split("\n")[0], why))
                elif s.lang == "lua":
                    run_lua(s, folder, used, tally)
                elif s.lang == "sh":
                    run_sh(s, folder, used, tally)
                else:
                    run_repl(s, folder, tally)
    finally:
        shutil.rmtree(top)
    for key in list(SKIP) + list(RUN) + list(VARIES):
        if key[0] in DOCS:
            check(f"the sample {key[0]}: {key[1][:60]!r} named in the test's tables is still there", key in used)
    print(f"{tally['found']} samples in {len(DOCS)} files: {tally['run']} run, {tally['found'] - tally['run']} not "
          f"({time.time() - started:.0f} s)")
    if tally["skipped"] or tally["not_partrain"]:
        print("not run:")
    for where, line, why in tally["skipped"]:
        print(f"  {where}: {line[:70]}: {why}")
    for where, line in tally["not_partrain"]:
        print(f"  {where}: {line[:70]}: not a partrain command")
    finish("doc sample")

main()
