"""Two nodes on loopback (two launchers, --nnodes 2 --nproc-per-node 2: a world of 4) agreeing
through node 0's control store: a rank of node 1 killed on the first start makes both launchers
report the restart, both nodes' ranks resume from the same checkpoint, and the final losses and
weights equal an uninterrupted run's, bit for bit; a rank dying on every start exhausts
--max-restarts and both launchers exit non-zero naming it; node 1's launcher killed with SIGKILL
makes node 0 exit non-zero within a bounded time naming node 1 as lost, with no process left, and
node 0's launcher killed makes node 1 name node 0, the control store's host, as lost; node 0 alone
names node 1 as not arrived after --timeout; nodes disagreeing on --nproc-per-node both refuse; a
second launcher given a node rank already in the job is refused without disturbing it; a job
that ends at once succeeds on both nodes; nodes disagreeing on --nnodes (either way) are refused
at once, naming both values and the node; node 1 joins while another process holds thousands of
idle connections to node 0's control store.
Usage: test_nodes.py PATH/TO/partrain"""
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from checks import check, finish  # noqa: E402

binary = os.path.realpath(sys.argv[1])
root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
tmp = tempfile.mkdtemp(prefix="partrain-nodes-")
secret = os.path.join(tmp, "secret")
with open(os.open(secret, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
    f.write(os.urandom(32).hex())
NODE_TIMEOUT = 5
env = {k: v for k, v in os.environ.items() if not k.startswith(("PARTRAIN_", "RANK", "WORLD_SIZE", "MASTER_"))}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One node's launcher, its output (stdout and stderr) read as it comes."""

    def __init__(self, node, port, flags, script_args, nproc=2, nnodes=2):
        cmd = [binary, "--nnodes", str(nnodes), "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port",
               str(port), "--rdzv-secret-file", secret, "--nproc-per-node", str(nproc), "--threads", "1", "--tee",
               "--node-timeout", str(NODE_TIMEOUT), *flags, "tests/ckpt/train.lua", "--tensor", "2", *script_args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=root, env=env)
        self.lines = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait(self, timeout=120):
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.reader.join(10)
        return self.proc.returncode

    @property
    def out(self):
        return "".join(self.lines)


def run_both(flags, script_args):
    port = free_port()
    nodes = [Node(n, port, flags, script_args) for n in (0, 1)]
    return nodes, [n.wait() for n in nodes]


def losses(text):
    return dict(re.findall(r"^\[rank 0\] step (\d+) loss (\S+)$", text, re.M))


def descendants(pid):
    """Every process descended from `pid` now (children by their parent in /proc)."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
                parent[int(d)] = int(stat[stat.rindex(")") + 2:].split()[1])
            except (OSError, ValueError):
                pass
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        found += kids
        frontier += kids
    return found


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return stat[stat.rindex(")") + 2] != "Z"
    except OSError:
        return False


train = ["--steps", "8", "--save_every", "3"]

# --- An uninterrupted run over two nodes: the reference --------------------------------------
nodes, status = run_both([], train + ["--export", os.path.join(tmp, "clean.safetensors")])
check(f"an uninterrupted two-node run succeeds on both nodes (status {status})", status == [0, 0],
      nodes[0].out[-3000:] + nodes[1].out[-3000:])
clean = losses(nodes[0].out)
check("it printed the loss of every step", len(clean) == 8, nodes[0].out[-2000:])

# --- A job that ends at once: node 0 keeps the control store until node 1 has read the verdict
# (its last look at node 1's heartbeat may predate it; it looks again before judging node 1 gone).
quick = []
for _ in range(5):
    port = free_port()
    cmds = [[binary, "--nnodes", "2", "--node-rank", str(n), "--master-addr", "127.0.0.1", "--master-port", str(port),
             "--rdzv-secret-file", secret, "--nproc-per-node", "1", "--threads", "1", "--node-timeout",
             str(NODE_TIMEOUT), "-e", 'local pt = require "partrain"'] for n in (0, 1)]
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=root, env=env)
             for c in cmds]
    quick.append([(p.wait(timeout=120), p.stdout.read()) for p in procs])
check("a job whose ranks end at once succeeds on both nodes, 5 times of 5",
      all(code == 0 for run in quick for code, _ in run), [run for run in quick if any(code for code, _ in run)])

# --- A rank of node 1 killed on the first start: both nodes restart and resume ----------------
ck = os.path.join(tmp, "ck")
nodes, status = run_both(["--max-restarts", "2", "--restart-backoff", "0.2"],
                         train + ["--ckpt", ck, "--die_at", "5", "--die_rank", "3", "--say_all=true",
                                  "--export", os.path.join(tmp, "restarted.safetensors")])
both = nodes[0].out + nodes[1].out
check(f"with rank 3 (node 1) killed at step 5, both nodes finish with status 0 (status {status})",
      status == [0, 0], both[-6000:])
for n in (0, 1):
    check(f"node {n}'s launcher reports the restart, naming node 1's rank 3 and how it died",
          re.search(r"partrain: restart 1 of 2: node 1's rank 3 \(local rank 1, pid \d+\) was killed by signal 9 "
                    r"\(SIGKILL\); starting the ranks of all 2 nodes again", nodes[n].out) is not None, nodes[n].out[-3000:])
    check(f"node {n}'s launcher says it finished after 1 restart", "partrain: finished after 1 restart" in nodes[n].out,
          nodes[n].out[-2000:])
resumed = sorted(re.findall(r"^\[rank (\d)\] resumed (step-\d+) at step (\d+)", both, re.M))
check("every rank of both nodes resumed from the checkpoint of step 3",
      resumed == [(str(r), "step-00000003", "3") for r in range(4)], resumed)
again = losses(nodes[0].out)
check("the losses after the restart are those of the uninterrupted run (steps 4-8, bit for bit)",
      all(again.get(str(s)) == clean.get(str(s)) for s in range(4, 9)) and len(clean) == 8,
      (sorted(clean.items()), sorted(again.items())))
with open(os.path.join(tmp, "clean.safetensors"), "rb") as a, open(os.path.join(tmp, "restarted.safetensors"), "rb") as b:
    check("the final weights are bitwise those of the uninterrupted run", a.read() == b.read())

# --- A rank dying on every start: restarts exhausted, both nodes exit non-zero naming it ------
nodes, status = run_both(["--max-restarts", "1", "--restart-backoff", "0"],
                         ["--steps", "3", "--die_at", "2", "--die_rank", "3", "--die_always=true"])
check(f"a rank dying on every start ends both nodes non-zero (status {status})", 0 not in status,
      nodes[0].out[-3000:] + nodes[1].out[-3000:])
for n in (0, 1):
    check(f"node {n} gives up naming node 1's rank 3",
          re.search(r"partrain: giving up after 1 restart \(--max-restarts 1\): node 1's rank 3 \(local rank 1, pid \d+\) "
                    r"was killed by signal 9", nodes[n].out) is not None, nodes[n].out[-3000:])

# --- Node 1's launcher killed: node 0 names node 1 as lost, in bounded time, and leaves nothing
port = free_port()
nodes = [Node(n, port, ["--max-restarts", "2"], ["--steps", "100000"]) for n in (0, 1)]
deadline = time.time() + 90
while time.time() < deadline and not re.search(r"^\[rank 0\] step 1 loss", nodes[0].out, re.M):
    time.sleep(0.1)
check("the two-node run is training", re.search(r"^\[rank 0\] step 1 loss", nodes[0].out, re.M) is not None,
      nodes[0].out[-2000:])
family = {n: descendants(nodes[n].proc.pid) for n in (0, 1)}
check("node 0's launcher has its 2 ranks and the control store's process; node 1's its 2 ranks",
      len(family[0]) >= 3 and len(family[1]) >= 2, family)
killed_at = time.time()
os.kill(nodes[1].proc.pid, signal.SIGKILL)
status0 = nodes[0].wait(timeout=60)
took = time.time() - killed_at
nodes[1].wait()
bound = NODE_TIMEOUT + 15
check(f"node 0 exits non-zero (status {status0}) within {bound} s of node 1's launcher's death (took {took:.1f} s)",
      status0 not in (0, None) and took < bound, nodes[0].out[-3000:])
check("node 0 names node 1 as lost", "partrain: node 1 was lost: its launcher sent no heartbeat for 5 s (--node-timeout)"
      in nodes[0].out, nodes[0].out[-3000:])
check("node 0 does not restart without node 1", "partrain: restart" not in nodes[0].out, nodes[0].out[-3000:])
time.sleep(1)  # node 1's ranks die with their launcher (PR_SET_PDEATHSIG): give the kernel a moment
left = [p for n in (0, 1) for p in family[n] if alive(p)]
check("no process of either node is left", not left, left)

# --- A second launcher given --node-rank 1 while the job runs: refused, and the job goes on ----
port = free_port()
nodes = [Node(n, port, [], ["--steps", "100000"]) for n in (0, 1)]
deadline = time.time() + 90
while time.time() < deadline and not re.search(r"^\[rank 0\] step 1 loss", nodes[0].out, re.M):
    time.sleep(0.1)
check("the two-node run is training", re.search(r"^\[rank 0\] step 1 loss", nodes[0].out, re.M) is not None,
      nodes[0].out[-2000:])
extra = Node(1, port, [], ["--steps", "100000"])
status = extra.wait(timeout=60)
steps_then = len(losses(nodes[0].out))
time.sleep(2)
check(f"a second launcher with --node-rank 1 exits non-zero (status {status}) and names the taken node rank",
      status not in (0, None) and "a launcher with --node-rank 1 has joined it already" in extra.out, extra.out[-2000:])
check("it started no rank", "[rank" not in extra.out, extra.out[-2000:])
check("the job it tried to join goes on training",
      nodes[0].proc.poll() is None and nodes[1].proc.poll() is None and len(losses(nodes[0].out)) > steps_then,
      nodes[0].out[-2000:] + nodes[1].out[-2000:])
for n in nodes:
    n.proc.send_signal(signal.SIGINT)
    n.wait(timeout=60)

# --- Node 0's launcher killed: node 1 sees the control store's connection close at once -------
port = free_port()
nodes = [Node(n, port, ["--max-restarts", "2"], ["--steps", "100000"]) for n in (0, 1)]
deadline = time.time() + 90
while time.time() < deadline and not re.search(r"^\[rank 0\] step 1 loss", nodes[0].out, re.M):
    time.sleep(0.1)
family = {n: descendants(nodes[n].proc.pid) for n in (0, 1)}
killed_at = time.time()
os.kill(nodes[0].proc.pid, signal.SIGKILL)
status1 = nodes[1].wait(timeout=60)
took = time.time() - killed_at
nodes[0].wait()
check(f"with node 0's launcher killed, node 1 exits non-zero (status {status1}) within {bound} s (took {took:.1f} s)",
      status1 not in (0, None) and took < bound, nodes[1].out[-3000:])
check("node 1 names node 0, the control store's host, as lost",
      "partrain: node 0 (the host of the job's control store) was lost" in nodes[1].out, nodes[1].out[-3000:])
time.sleep(1)
left = [p for n in (0, 1) for p in family[n] if alive(p)]
check("no process of either node is left (node 0's control store died with its launcher)", not left, left)

# --- Node 1 never comes: node 0 ends the meeting after --timeout, naming node 1 ----------------
lone = Node(0, free_port(), ["--timeout", "3"], ["--steps", "2"])
started = time.time()
status0 = lone.wait(timeout=60)
took = time.time() - started
check(f"node 0 alone exits non-zero (status {status0}) soon after --timeout 3 (took {took:.1f} s)",
      status0 not in (0, None) and took < 30, lone.out[-2000:])
check("it names the node that did not arrive", "node 1 did not arrive within --timeout 3 s (1 of 2 nodes came)"
      in lone.out, lone.out[-2000:])

# --- The nodes disagree on --nproc-per-node: both refuse before any rank starts --------------
port = free_port()
nodes = [Node(0, port, ["--timeout", "20"], ["--steps", "2"]), Node(1, port, ["--timeout", "20"], ["--steps", "2"], nproc=1)]
status = [n.wait(timeout=60) for n in nodes]
check(f"nodes started with different --nproc-per-node both exit non-zero (status {status})",
      all(s not in (0, None) for s in status), nodes[0].out[-2000:] + nodes[1].out[-2000:])
check("node 0 names the disagreement", "--nproc-per-node 1" in nodes[0].out and "--nproc-per-node 2" in nodes[0].out,
      nodes[0].out[-2000:])
check("no rank started on either node", "step 1 loss" not in nodes[0].out + nodes[1].out, nodes[0].out[-2000:])

# --- The nodes disagree on --nnodes: refused at once, naming both values and the node --------
# A node counting 3 nodes had waited for a meeting that never filled while node 0's ranks (or its
# own, counting 2 against node 0's 3) waited out --timeout and blamed a rank that had arrived.
for mine, theirs in [(3, 2), (2, 3)]:
    port = free_port()
    began = time.time()
    nodes = [Node(0, port, ["--timeout", "60"], ["--steps", "2"], nnodes=theirs),
             Node(1, port, ["--timeout", "60"], ["--steps", "2"], nnodes=mine)]
    status = [n.wait(timeout=120) for n in nodes]
    took = time.time() - began
    said = f"--nnodes {mine} on node 1 but --nnodes {theirs} on node 0"
    check(f"node 1 with --nnodes {mine} and node 0 with --nnodes {theirs} both exit non-zero within 20 s, not at "
          f"--timeout 60 (status {status}, {took:.1f} s)", all(x not in (0, None) for x in status) and took < 20,
          nodes[0].out[-2000:] + nodes[1].out[-2000:])
    check(f"... node 1 is refused naming both values ({said})",
          f"node 1 cannot join the job through node 0's launcher at 127.0.0.1:{port}: {said}" in nodes[1].out,
          nodes[1].out[-2000:])
    check("... node 0 names the disagreement and node 1", f"node 1 stopped the job: the nodes disagree: {said}"
          in nodes[0].out, nodes[0].out[-2000:])
    check("... and no rank started on either node", "[rank" not in nodes[0].out + nodes[1].out,
          nodes[0].out[-2000:] + nodes[1].out[-2000:])

# --- Thousands of idle connections to node 0's control store do not keep node 1 out -----------
# A local process holding connections that never present the secret had filled the store's 4096
# places (10 s each), and node 1, closed at once, was told its secret was wrong. Connections
# without the secret now have few places, per address and in all, for 3 s, the oldest making way
# for a new one, which a node presenting its secret at once keeps.
import resource  # noqa: E402
import select  # noqa: E402

soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 20000), hard))
HOLD = min(5000, min(hard, 20000) - 200)
port = free_port()
job = 'local pt = require "partrain"; local t = pt.ones(1); pt.dist.world():all_reduce(t); print("sum " .. t:item())'


def quick_node(n):
    return subprocess.Popen([binary, "--nnodes", "2", "--node-rank", str(n), "--master-addr", "127.0.0.1",
                             "--master-port", str(port), "--rdzv-secret-file", secret, "--nproc-per-node", "1",
                             "--threads", "1", "--timeout", "60", "-e", job],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=root, env=env)


node0 = quick_node(0)
for _ in range(200):  # its store is up
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        break
    except OSError:
        time.sleep(0.05)
flood = {"stop": False, "opened": 0, "dropped": 0, "held": 0}


def hold_connections():
    """Keeps up to HOLD connections open to the store, none presenting anything, reopening dropped ones."""
    held = []
    while not flood["stop"]:
        while len(held) < HOLD and not flood["stop"]:
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", port))
            held.append(c)
            flood["opened"] += 1
        flood["held"] = max(flood["held"], len(held))
        time.sleep(0.5)
        watch = select.poll()
        for c in held:
            watch.register(c, select.POLLIN)
        readable = {fd for fd, _ in watch.poll(0)}
        for c in held:
            if c.fileno() in readable:  # answered 'B' and closed, or reset
                c.close()
        held = [c for c in held if c.fileno() != -1]
        flood["dropped"] += len(readable)
    for c in held:
        c.close()


flooder = threading.Thread(target=hold_connections)
flooder.start()
time.sleep(3)  # the store has taken thousands of them by now
joined = time.time()
node1 = quick_node(1)
out1 = node1.communicate(timeout=120)[0]
took = time.time() - joined
out0 = node0.communicate(timeout=120)[0]
flood["stop"] = True
flooder.join()
check(f"with another process holding {HOLD} idle connections to node 0's control store ({flood['opened']} opened, "
      f"{flood['dropped']} dropped by the store), node 1 joins and the job succeeds on both nodes "
      f"(status {node0.returncode}, {node1.returncode}; node 1 done in {took:.1f} s)",
      node0.returncode == 0 and node1.returncode == 0 and "sum 2" in out0, out0[-2000:] + out1[-2000:])
check("... the store dropped the idle connections rather than the node (thousands opened, most dropped)",
      flood["opened"] > HOLD and flood["dropped"] > HOLD // 2, flood)
check("... and node 1 was never told its secret was wrong", "secret" not in out1, out1[-2000:])

finish("two-node")
