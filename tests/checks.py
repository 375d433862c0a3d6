"""What the Python test drivers share: check() prints one line a check (with the detail when it
fails) and finish() prints the count and exits non-zero on any failure. A driver imports it
with `sys.path.insert(0, <tests folder>)`."""
import os
import socket
import subprocess
import sys

failures = []


def check(what, ok, detail=""):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)
        print("     " + str(detail)[:3000].replace("\n", "\n     "), flush=True)


def finish(what):
    print(f"{len(failures)} failure(s)" if failures else f"all {what} checks passed", flush=True)
    sys.exit(1 if failures else 0)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(command, n, env=None, timeout=300):
    """Runs `command` as n ranks started the way torchrun starts them (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT on loopback, one intra-op thread a rank); returns (exit codes, rank 0's
    stdout, every rank's stderr)."""
    port = str(free_port())
    procs = []
    for r in range(n):
        rank_env = dict(env if env is not None else os.environ, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r),
                        LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PARTRAIN_TIMEOUT="60",
                        OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(command, env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = [p.communicate(timeout=timeout) for p in procs]
    return [p.returncode for p in procs], outs[0][0], "".join(o[1] for o in outs)


def step_losses(text):
    """The losses of "step N loss L" lines, in order."""
    return [float(line.split()[3]) for line in text.splitlines() if line.startswith("step ")]


def worst_difference(got, want):
    """The largest relative difference of two loss lists (infinite when either is empty)."""
    return max((abs(a - b) / max(abs(b), 1) for a, b in zip(got, want)), default=float("inf"))
