"""What the fuzz drivers share. Each driver (tests/fuzz/fuzz_*.py) generates malformed inputs of
one class from a seed, runs partrain on each with a time bound, and classifies the outcome:

  refused  - a clear error: non-zero exit status (1), no signal, a message that names the bad
             value and a location (the user's file:line, or the file and the tensor)
  accepted - exit 0 where the input was harmless (the driver says when that is allowed)
  crash    - killed by a signal (SIGSEGV, SIGABRT, ...) or an exit status other than 0 and 1
  hang     - did not end within the bound
  unclear  - refused, but without the location or the detail the driver asked for

Anything but refused/accepted (and accepted only where the driver allows it) is a failure.
Every driver prints one line a class with its counts, then the summary table that
docs/fuzz.md shows, and exits non-zero on any failure."""
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# A location inside partrain's own Lua library, or none at all: never what a user should see
# as the place of their mistake.
INTERNAL_LOCATION = re.compile(r"(\[C\]:-?\d+|bindings/lua/partrain/[a-z_]+\.lua:\d+: (?!in ))")


class Outcome:
    def __init__(self, kind, rc, out, err, seconds):
        self.kind, self.rc, self.out, self.err, self.seconds = kind, rc, out, err, seconds

    @property
    def text(self):
        return self.out + self.err

    def __repr__(self):
        return f"Outcome({self.kind}, rc={self.rc}, {self.seconds:.1f}s, err={self.err[-400:]!r})"


# The address space a partrain process is given by drivers that bound memory (run's `memory`):
# LibTorch and its CUDA libraries map about 3 GiB before main, so this leaves about 1 GiB to
# whatever a case makes partrain allocate. PARTRAIN_FUZZ_MEMORY_GB changes it.
MEMORY_LIMIT = int(float(os.environ.get("PARTRAIN_FUZZ_MEMORY_GB", "4")) * (1 << 30))


def limits(memory):
    """A preexec_fn bounding a child's address space to `memory` bytes (a blow-up then fails
    inside the child, as a crash or a refusal, instead of taking the machine) and its core dumps
    to none."""
    import resource

    def apply():
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def run(cmd, timeout=30, cwd=None, env=None, stdin=subprocess.DEVNULL, memory=None):
    """Runs `cmd` (a list) in its own process group; a run past `timeout` seconds is killed
    with its whole group and reported as a hang. With `memory`, the process may map at most
    that many bytes (limits())."""
    start = time.monotonic()
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    if env:
        full_env.update(env)
    p = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdin=stdin, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, start_new_session=True, text=True, errors="replace",
                         preexec_fn=limits(memory) if memory else None)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return Outcome("hang", None, out, err, time.monotonic() - start)
    rc = p.returncode
    seconds = time.monotonic() - start
    if rc == 0:
        return Outcome("accepted", rc, out, err, seconds)
    if rc == 1:
        return Outcome("refused", rc, out, err, seconds)
    return Outcome("crash", rc, out, err, seconds)


def located(outcome, pattern):
    """Whether a refusal's message matches `pattern` (a regular expression naming the location:
    r"policy\\.lua:\\d+" or a file and tensor) and shows no internal location."""
    text = outcome.text
    return re.search(pattern, text) is not None and INTERNAL_LOCATION.search(text.split("stack traceback")[0]) is None


class Tally:
    """Counts outcomes by class and prints the table docs/fuzz.md shows. `kinds` names the
    columns (default: refused, accepted, unclear, crash, hang); a driver with outcomes of its own
    (a fallback, wrong numbers) lists them."""

    def __init__(self, title, kinds=None):
        self.title = title
        self.kinds = list(kinds or ["refused", "accepted", "unclear", "crash", "hang"])
        self.rows = {}  # class -> {kind: count}
        self.failures = []
        self.began = time.monotonic()

    def add(self, cls, kind, ok, detail=""):
        row = self.rows.setdefault(cls, {})
        row[kind] = row.get(kind, 0) + 1
        if not ok:
            self.failures.append((cls, kind, detail))
            print(f"FAIL {cls}: {kind}\n     " + str(detail)[:2000].replace("\n", "\n     "), flush=True)

    def total(self):
        return sum(sum(r.values()) for r in self.rows.values())

    def finish(self):
        """Prints the count and time, the table and the failures; exits 1 on any failure."""
        print(f"{self.total()} cases in {time.monotonic() - self.began:.0f} s")
        kinds = self.kinds + sorted({k for r in self.rows.values() for k in r} - set(self.kinds))
        print(f"\n{self.title}: {self.total()} cases")
        print("| class | cases | " + " | ".join(kinds) + " |")
        print("| --- | --- | " + " | ".join("---" for _ in kinds) + " |")
        for cls, row in sorted(self.rows.items()):
            print(f"| {cls} | {sum(row.values())} | " + " | ".join(str(row.get(k, 0)) for k in kinds) + " |")
        print(f"{len(self.failures)} failure(s)" if self.failures else "no failures", flush=True)
        sys.exit(1 if self.failures else 0)


def scratch_dir(prefix):
    """A fresh folder for a driver's files: in memory (/dev/shm) where there is one, since fuzz
    cases write, flush and delete thousands of small files; the caller removes it."""
    shm = "/dev/shm"
    base = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
    return tempfile.mkdtemp(prefix=prefix, dir=base)


def make_with_batch(binary, batch, work, root):
    """Runs ckpt_batch.lua's `make` at 2 ranks in `work` (which gets a small corpus first): the
    pristine files a checkpoint or safetensors driver then damages. Returns the outcome."""
    with open(os.path.join(root, "data", "kjv.txt"), "rb") as f:
        open(os.path.join(work, "corpus.txt"), "wb").write(f.read(4096))
    return run([binary, "--nproc-per-node", "2", "--threads", "1", batch, "make", work], timeout=180, cwd=root)


def int_flag(name, default):
    """The integer after `name` on the command line ("--cases 40"), else `default`."""
    return int(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


def seed_from_argv(default=1):
    """--seed N from the command line (or PARTRAIN_FUZZ_SEED), so a failure can be replayed."""
    seed = int(os.environ.get("PARTRAIN_FUZZ_SEED", default))
    if "--seed" in sys.argv:
        seed = int(sys.argv[sys.argv.index("--seed") + 1])
    return seed


def kill_tree(pid):
    """SIGKILLs `pid` and every process below it (the launcher puts each rank in its own process
    group, so killing the launcher's group alone would leave what a rank started running)."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def run_batched(argv, cwd, work, cases, line, tally_crash, what, memory=None):
    """Runs a batched runner (ckpt_batch.lua, data_batch.lua) over `cases` (tuples whose first
    item is the case's index), restarting after a case that kills the process or stalls 20 s.
    `argv(list_file, results_file)` is the command; `line(case)` the case's line in the list. The
    runner appends one JSON line a case (tests/fuzz/results.lua), the first {"ready": true}.
    Returns {index: result}; a case the process died on goes to tally_crash(index, kind, detail).
    With `memory`, each process may map at most that many bytes (limits()); a stalled job is
    killed with every process below it (a launcher's ranks too)."""
    results, pending = {}, list(cases)
    while pending:
        lst = os.path.join(work, f"list-{pending[0][0]}")
        out = os.path.join(work, f"results-{pending[0][0]}")
        with open(lst, "w") as f:
            f.writelines(line(c) + "\n" for c in pending)
        open(out, "w").close()
        # A file, not a pipe: notes must never fill a pipe and stall.
        log = open(out + ".stderr", "w+", errors="replace")
        p = subprocess.Popen(argv(lst, out), cwd=cwd, stdout=subprocess.DEVNULL, stderr=log,
                             start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                             preexec_fn=limits(memory) if memory else None)
        done, last, stalled = 0, time.monotonic(), False
        while p.poll() is None:
            time.sleep(0.05)
            lines = open(out, errors="replace").read().splitlines()
            if len(lines) > done:
                done, last = len(lines), time.monotonic()
            elif time.monotonic() - last > 20:
                kill_tree(p.pid)
                p.wait()
                stalled = True
        log.seek(0)
        err = log.read()
        log.close()
        lines = [json.loads(text) for text in open(out, errors="replace").read().splitlines()]
        if not lines or not lines[0].get("ready"):
            raise SystemExit(f"{what} could not set up (rc={p.returncode}):\n{err[-3000:]}")
        for r in lines[1:]:
            results[r["index"]] = r
        pending = [c for c in pending if c[0] not in results]
        if pending:
            i = pending.pop(0)[0]  # the case the process was on when it died or stalled
            tally_crash(i, "hang" if stalled else "crash", f"rc={p.returncode}: {err[-1500:]}")
    return results


def make_special(path, what):
    """Puts at `path` the special file `what` names: "fifo", "devzero" (a link to /dev/zero),
    "folder", "empty", "link to itself", or "missing" (nothing). False for another name, which
    the caller makes itself."""
    if what == "fifo":
        os.mkfifo(path)
    elif what == "devzero":
        os.symlink("/dev/zero", path)
    elif what == "folder":
        os.makedirs(path)
    elif what == "empty":
        open(path, "wb").close()
    elif what == "link to itself":
        os.symlink(path, path)
    elif what != "missing":
        return False
    return True


def special_file(path, rng):
    """Puts at `path` something a reader must refuse without waiting on it: a FIFO, a link to
    /dev/zero, a folder, an empty file, or nothing. Returns which."""
    what = rng.choice(["fifo", "devzero", "folder", "empty", "missing"])
    make_special(path, what)
    return what


def json_depth(text):
    """How deeply the JSON text (bytes) nests arrays and objects, strings skipped."""
    depth = deepest = 0
    in_string = escaped = False
    for c in text:
        if in_string:
            if escaped:
                escaped = False
            elif c == 0x5C:
                escaped = True
            elif c == 0x22:
                in_string = False
        elif c == 0x22:
            in_string = True
        elif c in (0x7B, 0x5B):
            depth += 1
            deepest = max(deepest, depth)
        elif c in (0x7D, 0x5D):
            depth -= 1
    return deepest
