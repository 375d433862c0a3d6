"""The closed rendezvous and the forked start, through the launcher at 2 ranks.

While a 2-rank job waits after joining, `ss -ltnp` shows every socket the job listens on (its
store and Gloo's) bound to 127.0.0.1 only; a client that connects without the secret, or with a
wrong one, is closed without a byte of answer, and one that presents nothing is told 'B' (busy)
and closed after about 3 s; the job then finishes with the right sum, and
its script never sees the secret. Ranks started by the launcher say (PARTRAIN_STARTUP_TRACE=1)
that they were forked; PARTRAIN_EXEC_RANKS=1 starts them with exec instead, also correct.
No rank's /proc/self/environ (nor its commands', nor os.getenv) holds the secret, forked or
exec'd, whether the launcher made it, read it from --rdzv-secret-file or was given it in its
environment, nor does a torchrun-style rank's. --rdzv-secret-file is refused when others can read
it, when it is too short or not a regular file, and used when it is right; several nodes need it.

    python3 tests/dist/test_rendezvous.py build/partrain
"""
import os
import re
import secrets
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, ".."))
from checks import check, finish  # noqa: E402

binary = os.path.abspath(sys.argv[1])
root = os.path.dirname(os.path.dirname(here))
env = dict(os.environ, OMP_NUM_THREADS="1")
env.pop("PARTRAIN_RDZV_SECRET", None)
env.pop("PARTRAIN_EXEC_RANKS", None)

# Each rank: one all-reduce; rank 0 prints the store's port, then both wait (a file the test
# removes says when) and all-reduce again.
SCRIPT = r"""
local pt = require "partrain"
local rank = pt.dist.rank()
local t = pt.tensor({ rank + 1 })
pt.dist.world():all_reduce(t)
if rank == 0 then
  print("port " .. os.getenv("MASTER_PORT"))
  print("secret seen by the script: " .. tostring(os.getenv("PARTRAIN_RDZV_SECRET")))
  io.stdout:flush()
end
local hold = arg[1]
local deadline = os.time() + 60
while io.open(hold) and os.time() < deadline do os.execute("sleep 0.1") end
local u = pt.tensor({ 10 * (rank + 1) })
pt.dist.world():all_reduce(u)
print(("rank %d of %d: sums %d %d"):format(rank, pt.dist.world_size(), t:item(), u:item()))
"""


def descendants(pid):
    """pid and every process below it."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry))
        except OSError:
            continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def listening(pids):
    """(local address, pid) of every listening TCP socket of these processes, from ss -ltnp."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    found = []
    for line in out.splitlines():
        cols = line.split()
        if len(cols) < 6:
            continue
        for pid in re.findall(r"pid=(\d+)", line):
            if int(pid) in pids:
                found.append((cols[3], int(pid)))
    return found


def exchange(port, hello):
    """Connects, sends `hello` then a request for a key, and returns what comes back before the
    server closes the connection (None if it stays open for 5 s)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    key = b"partrain/arrived/0"
    get = bytes([2]) + struct.pack(">I", len(key)) + key + struct.pack(">Q", 1000)
    setter = bytes([1]) + struct.pack(">I", 4) + b"evil" + struct.pack(">I", 1) + b"x"
    got = b""
    try:
        s.sendall(hello + setter + get)
        while True:
            chunk = s.recv(4096)
            if not chunk:
                return got
            got += chunk
    except ConnectionResetError:
        return got
    except socket.timeout:
        return None
    finally:
        s.close()


tmp = tempfile.mkdtemp()
script = os.path.join(tmp, "hold.lua")
with open(script, "w") as f:
    f.write(SCRIPT)


def hold_file(name):
    path = os.path.join(tmp, name)
    open(path, "w").close()
    return path


# --- the store is closed to strangers and bound to loopback -----------------------------------
hold = hold_file("hold")
p = subprocess.Popen([binary, "--nproc-per-node", "2", "--threads", "1", "--timeout", "60", script, hold],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=root, env=env)
port_line = p.stdout.readline()
secret_line = p.stdout.readline()
m = re.match(r"port (\d+)", port_line)
check("rank 0 prints the store's port", m is not None, port_line)
if m:
    port = int(m.group(1))
    pids = descendants(p.pid)
    socks = listening(set(pids))
    store = [a for a, _ in socks if a.endswith(f":{port}")]
    check("ss -ltnp shows the job's store listening", len(store) == 1, socks)
    check("the store listens on 127.0.0.1 only", store == [f"127.0.0.1:{port}"], socks)
    check("every socket the job listens on (store and Gloo) is on 127.0.0.1",
          socks and all(a.startswith("127.0.0.1:") for a, _ in socks), socks)
    no_secret = exchange(port, b"")
    check("a client without the secret is closed and gets no answer, no key", no_secret == b"", no_secret)
    wrong = secrets.token_hex(32).encode()
    wrong_secret = exchange(port, b"PTRDZV01" + struct.pack(">I", len(wrong)) + wrong)
    check("a client with a wrong secret is closed and gets no answer, no key", wrong_secret == b"", wrong_secret)
    huge = exchange(port, b"PTRDZV01" + struct.pack(">I", 0xFFFFFFF0))
    check("a client announcing a 4 GiB secret is closed, nothing allocated", huge == b"", huge)
    with socket.create_connection(("127.0.0.1", port), timeout=20) as idle:
        began = time.time()
        said = idle.recv(16)
        waited = time.time() - began
    check(f"a connection that presents nothing is answered 'B' (busy: try again) and closed in about 3 s "
          f"(after {waited:.1f} s)", said == b"B" and 2 < waited < 10, said)
os.remove(hold)
out, err = p.communicate(timeout=120)
check("the job still finishes (status 0)", p.returncode == 0, out + err)
check("with the right sums: the strangers changed nothing", "rank 0 of 2: sums 3 30" in out, out + err)
check("the script does not see the secret", secret_line.strip() == "secret seen by the script: nil", secret_line)

# --- the ranks are forked; exec still works --------------------------------------------------
for mode, extra in [("fork", {}), ("exec", {"PARTRAIN_EXEC_RANKS": "1"})]:
    hold = hold_file("hold-" + mode)
    os.remove(hold)  # no wait
    run = subprocess.run([binary, "--nproc-per-node", "2", "--threads", "1", "--tee", script, hold],
                         capture_output=True, text=True, timeout=120, cwd=root,
                         env=dict(env, PARTRAIN_STARTUP_TRACE="1", **extra))
    both = run.stdout + run.stderr
    check(f"{mode}: status 0 and both ranks' sums right",
          run.returncode == 0 and "[rank 0] rank 0 of 2: sums 3 30" in both and "[rank 1] rank 1 of 2: sums 3 30" in both,
          both)
    started = re.search(r"launcher: starting 2 rank\(s\) with (\w+)", both)
    check(f"{mode}: the launcher says it started the ranks with {mode}", started and started.group(1) == mode, both)
    forked = [r for r in (0, 1) if re.search(rf"\[rank {r}\] partrain startup: \S+ s rank {r}: forked by the launcher", both)]
    execd = [r for r in (0, 1) if re.search(rf"\[rank {r}\] partrain startup: \S+ s rank {r}: main entered", both)]
    if mode == "fork":
        check("fork: each rank reports it was forked (never entered main)", forked == [0, 1] and execd == [], both)
    else:
        check("exec: each rank entered main itself (not forked)", execd == [0, 1] and forked == [], both)
    check(f"{mode}: each rank traced its first collective group and its script",
          all(re.search(rf"rank {r}: group 'world' created", both) and re.search(rf"rank {r}: script starts", both)
              for r in (0, 1)), both)

# --- the secret is never in a rank's environment block --------------------------------------
# /proc/self/environ shows the environment a process was exec'd with, whatever unsetenv did since:
# an exec'd rank given the secret as PARTRAIN_RDZV_SECRET showed it there to its script, and so
# did a forked rank whose launcher had been given it so (the forked rank shares its launcher's
# block). The secret now reaches a launcher's rank through a pipe, and a process started with it
# in its environment (the launcher, torchrun's ranks) overwrites it there.
ENV_SCRIPT = r"""
local pt = require "partrain"
local secret = arg[1]
local f = io.open("/proc/self/environ")
local block = f:read("*a")
f:close()
local child = io.popen("cat /proc/self/environ"):read("*a")
local function says(text) return text:find(secret, 1, true) and "HAS THE SECRET" or "clean" end
print(("rank %d: environ %s, its command's %s, os.getenv %s"):format(pt.dist.rank(), says(block), says(child),
  tostring(os.getenv("PARTRAIN_RDZV_SECRET"))))
"""
env_script = os.path.join(tmp, "environ.lua")
with open(env_script, "w") as f:
    f.write(ENV_SCRIPT)
file_secret = secrets.token_hex(32)
secret_path = os.path.join(tmp, "environ-secret")
with open(os.open(secret_path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
    f.write(file_secret + "\n")
clean = [f"[rank {r}] rank {r}: environ clean, its command's clean, os.getenv nil" for r in (0, 1)]
for mode, extra in [("fork", {}), ("exec", {"PARTRAIN_EXEC_RANKS": "1"})]:
    for given, secret, flags, more in [("--rdzv-secret-file", file_secret, ["--rdzv-secret-file", secret_path], {}),
                                       ("PARTRAIN_RDZV_SECRET", "e" * 40, [], {"PARTRAIN_RDZV_SECRET": "e" * 40})]:
        run = subprocess.run([binary, "--nproc-per-node", "2", "--threads", "1", "--tee", *flags, env_script, secret],
                             capture_output=True, text=True, timeout=120, cwd=root, env=dict(env, **extra, **more))
        check(f"{mode}, secret from {given}: no rank's /proc/self/environ, command or os.getenv has it",
              run.returncode == 0 and all(line in run.stdout for line in clean), run.stdout + run.stderr)
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
procs = [subprocess.Popen([binary, "--threads", "1", env_script, "t" * 40], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, cwd=root,
                          env=dict(env, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                                   MASTER_PORT=str(port), PARTRAIN_TIMEOUT="30", PARTRAIN_RDZV_SECRET="t" * 40))
         for r in (0, 1)]
outs = [q.communicate(timeout=60)[0] for q in procs]
check("torchrun-style ranks given PARTRAIN_RDZV_SECRET overwrite it in their /proc/self/environ",
      all(q.returncode == 0 for q in procs) and all(f"rank {r}: environ clean, its command's clean, os.getenv nil"
                                                    in outs[r] for r in (0, 1)), outs)

# --- --rdzv-secret-file ----------------------------------------------------------------------
def with_file(content, mode, *flags):
    path = os.path.join(tmp, "secret")
    if os.path.exists(path):
        os.remove(path)
    with open(path, "w") as f:
        f.write(content)
    os.chmod(path, mode)
    run = subprocess.run([binary, "--nproc-per-node", "2", "--threads", "1", *flags, "--rdzv-secret-file", path,
                          "-e", "local pt = require 'partrain'; local t = pt.ones(1); pt.dist.world():all_reduce(t); "
                                "if pt.dist.rank() == 0 then print('sum ' .. t:item()) end"],
                         capture_output=True, text=True, timeout=120, cwd=root, env=env)
    return run.returncode, run.stdout + run.stderr, path


good = secrets.token_hex(32) + "\n"
rc, out, path = with_file(good, 0o644)
check("a secret file others can read is refused, naming it and its mode",
      rc != 0 and f"--rdzv-secret-file '{path}' can be read or written by users other than its owner (mode 0644)" in out, out)
rc, out, path = with_file(good, 0o640)
check("a secret file its group can read is refused too ('readable by you alone')",
      rc != 0 and "(mode 0640): chmod 600 it" in out, out)
rc, out, path = with_file("short\n", 0o600)
check("a secret under 16 bytes is refused", rc != 0 and "holds a secret of 5 bytes (expected 16 to 1024" in out, out)
rc, out, path = with_file(good, 0o600)
check("a private secret file of 64 hex digits is used: the job runs", rc == 0 and "sum 2" in out, out)
fifo = os.path.join(tmp, "fifo")
os.mkfifo(fifo)
run = subprocess.run([binary, "--nproc-per-node", "2", "--rdzv-secret-file", fifo, "-e", ""],
                     capture_output=True, text=True, timeout=30, cwd=root, env=env)
check("a FIFO as the secret file is refused without blocking", run.returncode != 0 and "FIFO" in run.stderr,
      run.stderr)
run = subprocess.run([binary, "--nproc-per-node", "1", "--nnodes", "2", "--master-addr", "127.0.0.1",
                      "--master-port", "29999", "-e", ""], capture_output=True, text=True, timeout=30, cwd=root, env=env)
check("several nodes without --rdzv-secret-file are refused", run.returncode != 0 and
      "--nnodes 2 needs --rdzv-secret-file FILE" in run.stderr, run.stderr)
run = subprocess.run([binary, "--rdzv-secret-file", path, "-e", ""], capture_output=True, text=True, timeout=30,
                     cwd=root, env=env)
check("--rdzv-secret-file without the launcher is refused", run.returncode != 0 and
      "--rdzv-secret-file is for the launcher: it needs --nproc-per-node" in run.stderr,
      run.stderr)

# --- torchrun-style ranks present PARTRAIN_RDZV_SECRET when it is set -------------------------
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
procs = []
for r, secret in [(0, "a" * 32), (1, "b" * 32)]:
    procs.append(subprocess.Popen([binary, "--threads", "1", "-e", ""], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, cwd=root, env=dict(env, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                                                                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                                                PARTRAIN_TIMEOUT="5", PARTRAIN_RDZV_SECRET=secret)))
outs = [q.communicate(timeout=60)[0] for q in procs]
check("without the launcher, a rank with another secret is refused by the store",
      procs[1].returncode != 0 and "closed the connection before accepting this process: it did not present the job's secret" in outs[1], outs)

finish("rendezvous")
