"""The engine from C++ alone (examples/cpp/gpt_cpp.cpp): GPT-2 split tensor 2 x data 2 over four
processes that join the world from torchrun's variables, trained through ParallelModel::train_step,
gives the serial run's losses on the same data within 1e-5 (relative, float32), also with
accumulate = 2; and a bad layout is an error, not a hang.

Usage: test_gpt_cpp.py GPT_CPP
"""
import os
import socket
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from checks import check, finish  # noqa: E402

BIN = sys.argv[1]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def losses(text):
    return [float(line.split()[3]) for line in text.splitlines() if line.startswith("step ")]


def world(n, *args):
    """Runs n ranks as torchrun would start them; returns (exit codes, rank 0's stdout, stderrs)."""
    port = str(free_port())
    procs = []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PARTRAIN_TIMEOUT="60", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([BIN, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outs = [p.communicate(timeout=300) for p in procs]
    return [p.returncode for p in procs], outs[0][0], "".join(o[1] for o in outs)


serial = subprocess.run([BIN, "--steps", "4"], capture_output=True, text=True, timeout=300)
want = losses(serial.stdout)
check("the serial run trains 4 steps", serial.returncode == 0 and len(want) == 4, serial.stdout + serial.stderr)

for extra, name in (((), "tensor 2 x data 2"), (("--accumulate", "2"), "tensor 2 x data 2, accumulate 2")):
    codes, out, err = world(4, "--tensor", "2", "--steps", "4", *extra)
    got = losses(out)
    worst = max((abs(a - b) / max(abs(b), 1) for a, b in zip(got, want)), default=float("inf"))
    check(f"{name}: the losses equal the serial run's within 1e-5 (worst {worst:.2e})",
          codes == [0] * 4 and len(got) == 4 and worst <= 1e-5, (codes, got, want, err[-2000:]))

codes, out, err = world(4, "--tensor", "3")
check("a tensor size that does not divide the world is an error naming the sizes",
      all(c != 0 for c in codes) and "tensor=3" in err, (codes, err[-2000:]))

finish("gpt_cpp")
