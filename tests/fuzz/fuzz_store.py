#!/usr/bin/env python3
"""The control store's socket (engine/dist/store_server.cpp, served by node 0 of `partrain --nnodes`)
fed seeded garbage while node 0 waits for node 1: the store must not crash, must not grow without
bound, must close or refuse what is not its protocol, must answer what is exactly as a key-value
store would, and a legitimate client must still get in, however many strangers hold or churn
connections. Then node 1 joins and the job must finish with the right sum.

Usage: fuzz_store.py PATH/TO/partrain [--seed N] [--cases N]

Node 0 runs `partrain --nnodes 2 --node-rank 0 ... tests/fuzz/store_script.lua` with one rank,
each of its processes bounded to common.MEMORY_LIMIT bytes of address space. Classes:
  garbage           random bytes before the secret
  bad magic         the protocol's magic altered, cut, or in lower case
  huge length       a secret's length past the bound (1025 to 2^32-1), with or without bytes
  wrong secret      one byte off, cut, one byte longer, empty, 1024 bytes, another secret
  partial hello     the hello cut anywhere, then nothing (the store gives 3 s), or sent a
                    byte every half second
  idle flood        100 to 5000 connections that send nothing, held while a client comes in
  churn             connections opened and closed as fast as Python can for 1.5 s, meanwhile
  authed garbage    random bytes after a correct hello
  bad lengths       a key past 64 KiB, a value past 64 MiB, a key count past 65536, an
                    unknown operation, after a correct hello
  partial request   a request cut anywhere; a value of 64 MiB announced and 4 MiB sent
  requests          every operation with random keys (of this driver's own) and values,
                    answered as a reference store answers (gets and waits of missing keys
                    time out)
  unread answers    gets of a 1 MiB value sent twenty at a time and never read
Unauthenticated cases run 48 at a time (their 3 s overlap). A case passes when the connection
is closed (with 'B', busy, or nothing) or answered as expected, within bounds. After every ten
cases, and while each flood and churn is held, a client with the secret must connect and set and
get a key within 5 s ("legitimate client"); the store's process must live and stay under 1 GiB
resident.
"""
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

BIN = os.path.realpath(sys.argv[1])
SEED = common.seed_from_argv()
CASES = common.int_flag("--cases", 240)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "store_script.lua")
MAGIC = b"PTRDZV01"
MAX_SECRET, MAX_KEY, MAX_VALUE, MAX_KEYS = 1024, 64 * 1024, 64 * 1024 * 1024, 64 * 1024
MAX_RSS = 1 << 30
OPS = {"set": 1, "get": 2, "add": 3, "compare_set": 4, "delete": 5, "check": 6, "num_keys": 7, "wait": 8,
       "append": 9, "multi_get": 10, "multi_set": 11, "queue_push": 12, "queue_pop": 13, "queue_len": 14,
       "list_keys": 15}


def u32(n):
    return struct.pack(">I", n)


def u64(n):
    return struct.pack(">Q", n % (1 << 64))


def s(b):
    return u32(len(b)) + b


def hello(secret):
    return MAGIC + s(secret)


class Store:
    def __init__(self, port, secret):
        self.port, self.secret = port, secret

    def connect(self, timeout=5):
        c = socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
        c.settimeout(timeout)
        return c


def read_all(c, timeout):
    """What the peer sends until it closes or `timeout` passes: (bytes, closed)."""
    c.settimeout(0.05)
    got, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = c.recv(65536)
        except socket.timeout:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return got, True
        if not chunk:
            return got, True
        got += chunk
    return got, False


def read_exact(c, n):
    out = b""
    while len(out) < n:
        chunk = c.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return out


def read_answer(c):
    """One answer of the protocol: (status, value)."""
    status = read_exact(c, 1)
    if status == b"V" or status == b"E":
        return status, read_exact(c, struct.unpack(">I", read_exact(c, 4))[0])
    if status == b"I":
        return status, struct.unpack(">q", read_exact(c, 8))[0]
    if status == b"B":
        return status, read_exact(c, 1)[0]
    if status == b"L":
        n = struct.unpack(">I", read_exact(c, 4))[0]
        return status, [read_exact(c, struct.unpack(">I", read_exact(c, 4))[0]) for _ in range(n)]
    return status, None


def authed(store):
    """A connection that has presented the secret, retried while the store says it is busy."""
    deadline = time.monotonic() + 5
    while True:
        c = store.connect()
        try:
            c.sendall(hello(store.secret))
            if read_exact(c, 1) == b"K":
                return c
        except (ConnectionError, OSError):
            pass
        c.close()
        if time.monotonic() > deadline:
            raise ConnectionError("the store did not let a client with the secret in within 5 s")
        time.sleep(0.05)


def legitimate(store, tag):
    """Seconds a client with the secret takes to connect, set and get a key; None past 5 s."""
    start = time.monotonic()
    try:
        c = authed(store)
        with c:
            key, value = b"fuzz/probe/" + tag.encode(), os.urandom(16)
            c.sendall(bytes([OPS["set"]]) + s(key) + s(value))
            if read_answer(c) != (b"K", None):
                return None
            c.sendall(bytes([OPS["get"]]) + s(key) + u64(1000))
            if read_answer(c) != (b"V", value):
                return None
    except (ConnectionError, OSError):
        return None
    seconds = time.monotonic() - start
    return seconds if seconds <= 5 else None


# ---- cases before the secret ------------------------------------------------------------

def stranger_bytes(cls, rng, secret):
    """(bytes, then: None or "drip") of a connection that must not get in."""
    if cls == "garbage":
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 2000))), None
    if cls == "bad magic":
        m = bytearray(MAGIC)
        kind = rng.randrange(3)
        if kind == 0:
            m[rng.randrange(8)] ^= 1 << rng.randrange(8)
        elif kind == 1:
            m = bytearray(MAGIC.lower())
        else:
            m = m[:rng.randrange(1, 8)] + b"X"
        return bytes(m) + s(secret), None
    if cls == "huge length":
        n = rng.choice([MAX_SECRET + 1, 4096, 1 << 20, 1 << 31, (1 << 32) - 1])
        return MAGIC + u32(n) + os.urandom(rng.randrange(0, 2000)), None
    if cls == "wrong secret":
        kind = rng.randrange(6)
        if kind == 0:
            wrong = bytearray(secret)
            wrong[rng.randrange(len(wrong))] ^= 1
            wrong = bytes(wrong)
        elif kind == 1:
            wrong = secret[:-1]
        elif kind == 2:
            wrong = secret + b"0"
        elif kind == 3:
            wrong = b""
        elif kind == 4:
            wrong = os.urandom(MAX_SECRET)
        else:
            wrong = os.urandom(32).hex().encode()
        return MAGIC + s(wrong), None
    full = hello(secret)
    if rng.random() < 0.3:
        return full, "drip"
    return full[:rng.randrange(0, len(full))], None


def stranger(store, cls, data, then):
    """(kind, ok, detail) of one connection that must be closed or told busy, never let in."""
    try:
        c = store.connect()
    except OSError as e:
        return "refused", True, f"connect: {e}"  # a full backlog: refused before it began
    with c:
        try:
            if then == "drip":
                for i in range(len(data)):
                    c.sendall(data[i:i + 1])
                    got, closed = read_all(c, 0.5)
                    if closed or got:
                        break
                else:
                    got, closed = read_all(c, 6)
            else:
                c.sendall(data)
                got, closed = read_all(c, 6)
        except (BrokenPipeError, ConnectionResetError):
            return "refused", True, ""
    if got.startswith(b"K"):
        return "wrong", False, f"let in without the secret: {data[:40]!r}"
    if not closed:
        return "hang", False, f"neither closed nor answered after 6 s: {data[:40]!r}"
    if got not in (b"", b"B"):
        return "unclear", False, f"answered {got[:20]!r}"
    return "refused", True, ""


# ---- cases after the secret -------------------------------------------------------------

class Model:
    """A reference key-value store of this driver's keys (all under fuzz/)."""

    def __init__(self):
        self.kv, self.queues = {}, {}

    def integer(self, text):
        m = re.fullmatch(rb"[ \t\n\v\f\r]*([+-]?[0-9]+)", text)
        if not text or len(text) > 24 or not m:
            return None
        v = int(m.group(1))
        return v if -(1 << 63) <= v < (1 << 63) else None


def fuzz_key(rng):
    return b"fuzz/" + rng.choice([b"a", b"b", b"c", bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40)))])


def value(rng):
    return rng.choice([b"", b"7", b" -12", b"+3", b"0x5", b"1" * 30, b"9223372036854775807",
                       bytes(rng.randrange(256) for _ in range(rng.randrange(0, 300)))])


def request(rng, model):
    """(bytes, expected answer or "timeout", what)."""
    op = rng.choice(list(OPS))
    k = fuzz_key(rng)
    if op == "set":
        v = value(rng)
        model.kv[k] = v
        return bytes([1]) + s(k) + s(v), (b"K", None), op
    if op == "get":
        if k in model.kv:
            return bytes([2]) + s(k) + u64(rng.choice([0, 5, 1000])), (b"V", model.kv[k]), op
        return bytes([2]) + s(k) + u64(rng.randrange(1, 30)), (b"T", None), op + " (missing)"
    if op == "add":
        n = rng.choice([1, -1, 0, 1 << 40, -(1 << 62)])
        have = model.kv.get(k)
        now = 0 if have is None else model.integer(have)
        if now is None:
            return bytes([3]) + s(k) + u64(n), ("E", None), op + " (not an integer)"
        now = (now + n + (1 << 63)) % (1 << 64) - (1 << 63)
        model.kv[k] = str(now).encode()
        return bytes([3]) + s(k) + u64(n), (b"I", now), op
    if op == "compare_set":
        expected = model.kv.get(k, b"") if rng.random() < 0.5 else value(rng)
        desired = value(rng)
        if k not in model.kv:
            answer = desired if expected == b"" else expected
            if expected == b"":
                model.kv[k] = desired
        elif model.kv[k] == expected:
            model.kv[k], answer = desired, desired
        else:
            answer = model.kv[k]
        return bytes([4]) + s(k) + s(expected) + s(desired), (b"V", answer), op
    if op == "delete":
        had = k in model.kv
        model.kv.pop(k, None)
        return bytes([5]) + s(k), (b"B", int(had)), op
    if op == "check":
        keys = [k, fuzz_key(rng)]
        return bytes([6]) + u32(2) + b"".join(map(s, keys)), (b"B", int(all(x in model.kv for x in keys))), op
    if op == "num_keys":
        return bytes([7]), ("I", None), op
    if op == "list_keys":
        return bytes([15]), ("L", None), op
    if op == "wait":
        keys = [k, fuzz_key(rng)]
        if all(x in model.kv for x in keys):
            return bytes([8]) + u32(2) + b"".join(map(s, keys)) + u64(50), (b"K", None), op
        return bytes([8]) + u32(2) + b"".join(map(s, keys)) + u64(rng.randrange(1, 30)), (b"T", None), op + " (missing)"
    if op == "append":
        v = value(rng)
        model.kv[k] = model.kv.get(k, b"") + v
        return bytes([9]) + s(k) + s(v), (b"K", None), op
    if op == "multi_get":
        keys = [k, fuzz_key(rng)]
        if all(x in model.kv for x in keys):
            return bytes([10]) + u32(2) + b"".join(map(s, keys)) + u64(50), (b"L", [model.kv[x] for x in keys]), op
        return bytes([10]) + u32(2) + b"".join(map(s, keys)) + u64(rng.randrange(1, 30)), (b"T", None), op + " (missing)"
    if op == "multi_set":
        pairs = [(fuzz_key(rng), value(rng)) for _ in range(rng.randrange(0, 4))]
        for kk, vv in pairs:
            model.kv[kk] = vv
        return bytes([11]) + u32(len(pairs)) + b"".join(s(kk) + s(vv) for kk, vv in pairs), (b"K", None), op
    if op == "queue_push":
        v = value(rng)
        model.queues.setdefault(k, []).append(v)
        return bytes([12]) + s(k) + s(v), (b"K", None), op
    if op == "queue_pop":
        q = model.queues.get(k, [])
        if q:
            return bytes([13]) + s(k) + bytes([rng.randrange(2)]) + u64(50), (b"V", q.pop(0)), op
        if rng.random() < 0.5:
            return bytes([13]) + s(k) + bytes([0]) + u64(0), ("E", None), op + " (empty, not blocking)"
        return bytes([13]) + s(k) + bytes([1]) + u64(rng.randrange(1, 30)), (b"T", None), op + " (empty)"
    q = model.queues.get(k, [])
    return bytes([14]) + s(k), (b"I", len(q)), op


def bad_request(rng):
    kind = rng.randrange(5)
    if kind == 0:
        return bytes([1]) + u32(MAX_KEY + rng.randrange(1, 1 << 20)) + b"k" * 100, "a key past 64 KiB"
    if kind == 1:
        return bytes([1]) + s(b"fuzz/x") + u32(MAX_VALUE + rng.randrange(1, 1 << 20)), "a value past 64 MiB"
    if kind == 2:
        return bytes([6]) + u32(MAX_KEYS + rng.randrange(1, 1 << 20)), "a key count past 65536"
    if kind == 3:
        return bytes([11]) + u32((1 << 32) - 1), "a multi_set of 2^32-1"
    return bytes([rng.choice([0, 16, 99, 255])]) + os.urandom(20), "an unknown operation"


def insider(store, cls, rng, model):
    """(kind, ok, detail) of one connection that presents the secret and then `cls`."""
    try:
        c = authed(store)
    except ConnectionError as e:
        return "hang", False, str(e)
    with c:
        try:
            if cls == "authed garbage":
                c.sendall(os.urandom(rng.randrange(1, 3000)))
                got, closed = read_all(c, 0.3)
                return ("refused" if closed else "accepted"), True, ""
            if cls == "bad lengths":
                data, what = bad_request(rng)
                c.sendall(data)
                got, closed = read_all(c, 3)
                if not closed:
                    return "hang", False, f"{what}: not closed within 3 s"
                return ("refused", True, "") if got == b"" else ("unclear", False, f"{what}: answered {got[:20]!r}")
            if cls == "partial request":
                if rng.random() < 0.2:
                    c.sendall(bytes([1]) + s(b"fuzz/big") + u32(MAX_VALUE))
                    for _ in range(4):
                        c.sendall(b"v" * (1 << 20))
                    return "accepted", True, ""
                data, _, what = request(rng, Model())
                cut = data[:rng.randrange(0, len(data))]
                c.sendall(cut)
                got, closed = read_all(c, 0.2)
                if got:
                    return "wrong", False, f"answered a cut {what} request: {got[:20]!r}"
                return "accepted", True, ""
            if cls == "unread answers":
                c.sendall(bytes([1]) + s(b"fuzz/mib") + s(b"m" * (1 << 20)))
                if read_answer(c) != (b"K", None):
                    return "wrong", False, "set of 1 MiB not answered K"
                c.sendall((bytes([2]) + s(b"fuzz/mib") + u64(1000)) * 20)
                time.sleep(0.1)
                return "accepted", True, ""
            # requests: several, each answered as the model says
            for _ in range(rng.randrange(1, 8)):
                data, (status, answer), what = request(rng, model)
                c.sendall(data)
                got = read_answer(c)
                if status == "E":
                    ok = got[0] == b"E"
                elif status == "I":
                    ok = got[0] == b"I"
                elif status == "L":
                    ok = got[0] == b"L"
                else:
                    ok = got == (status, answer)
                if not ok:
                    return "wrong", False, f"{what}: answered {str(got)[:200]}, expected {status!r} {str(answer)[:200]}"
            return "accepted", True, ""
        except socket.timeout:
            return "hang", False, f"{cls}: no answer within 5 s"
        except (ConnectionError, OSError) as e:
            return "wrong", False, f"{cls}: the store closed a well-formed request's connection: {e}"


# ---- floods -----------------------------------------------------------------------------

def flood(store, n):
    """n connections that send nothing, opened now; the caller closes them."""
    held = []
    for _ in range(n):
        try:
            held.append(store.connect(timeout=2))
        except OSError:
            break
    return held


def churn(store, stop):
    while not stop.is_set():
        try:
            c = socket.create_connection(("127.0.0.1", store.port), timeout=1)
            c.close()
        except OSError:
            time.sleep(0.001)


# ---- the job ----------------------------------------------------------------------------

def free_port():
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def node(n, port, secret_file, log):
    cmd = [BIN, "--nnodes", "2", "--node-rank", str(n), "--master-addr", "127.0.0.1", "--master-port", str(port),
           "--rdzv-secret-file", secret_file, "--nproc-per-node", "1", "--threads", "1", "--timeout", "300",
           "--node-timeout", "30", SCRIPT]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PARTRAIN_", "RANK", "WORLD_SIZE", "MASTER_"))}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=common.limits(common.MEMORY_LIMIT))


def server_pid(port, root_pid):
    """The process below `root_pid` that holds the socket listening on `port`."""
    inode = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "0A":
                inode = f[9]
    if inode is None:
        return None
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    todo = [root_pid]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    return pid
        except OSError:
            continue
    return None


def resident(pid):
    """(VmRSS, VmHWM) of pid in bytes, or None when it is gone."""
    try:
        status = open(f"/proc/{pid}/status").read()
    except OSError:
        return None
    get = lambda key: int(re.search(rf"^{key}:\s+(\d+) kB", status, re.M).group(1)) * 1024  # noqa: E731
    return get("VmRSS"), get("VmHWM")


CLASSES = ["garbage", "bad magic", "huge length", "wrong secret", "partial hello", "authed garbage", "bad lengths",
           "partial request", "requests", "requests", "unread answers", "idle flood", "churn"]
STRANGERS = {"garbage", "bad magic", "huge length", "wrong secret", "partial hello"}


def main():
    tally = common.Tally(f"The control store (seed {SEED})",
                         kinds=["refused", "accepted", "wrong", "unclear", "crash", "hang"])
    rng = random.Random(SEED)
    work = common.scratch_dir("fuzz-store-")
    nodes = []
    try:
        secret_file = os.path.join(work, "secret")
        with open(os.open(secret_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(os.urandom(32).hex() + "\n")
        secret = open(secret_file, "rb").read().strip()
        port = free_port()
        logs = [open(os.path.join(work, f"node{n}.log"), "w+") for n in (0, 1)]
        nodes.append(node(0, port, secret_file, logs[0]))
        store = Store(port, secret)
        pid = None
        for _ in range(200):
            pid = server_pid(port, nodes[0].pid)
            if pid and legitimate(store, "first") is not None:
                break
            time.sleep(0.1)
        else:
            raise SystemExit(f"node 0's control store never served:\n{open(logs[0].name).read()[-3000:]}")
        model = Model()
        plan = [CLASSES[i % len(CLASSES)] for i in range(CASES)]
        strangers = [(i, c) for i, c in enumerate(plan) if c in STRANGERS]
        others = [(i, c) for i, c in enumerate(plan) if c not in STRANGERS]
        peak = [0]

        def healthy(tag):
            alive = resident(pid)
            if alive is None:
                tally.add("store process", "crash", False, f"the store's process is gone ({tag}): "
                          + open(logs[0].name).read()[-2000:])
                return False
            peak[0] = max(peak[0], alive[1])
            took = legitimate(store, tag)
            tally.add("legitimate client", "accepted" if took is not None else "hang", took is not None,
                      f"{tag}: a client with the secret was kept out")
            return took is not None

        # Strangers, 48 at a time (their 3 s overlap), a legitimate client beside each batch.
        inputs = {i: stranger_bytes(c, rng, secret) for i, c in strangers}
        with ThreadPoolExecutor(48) as pool:
            for at in range(0, len(strangers), 48):
                batch = strangers[at:at + 48]
                futures = [(i, c, pool.submit(stranger, store, c, *inputs[i])) for i, c in batch]
                time.sleep(0.2)
                if not healthy(f"beside strangers {at}"):
                    break
                for i, c, fut in futures:
                    kind, ok, detail = fut.result()
                    tally.add(c, kind, ok, f"case {i}: {detail}")
        for n, (i, c) in enumerate(others):
            if c == "idle flood":
                held = flood(store, rng.choice([100, 300, 1000, 3000, 5000]))
                took = legitimate(store, f"flood {i}")
                tally.add(c, "accepted" if took is not None else "hang", took is not None,
                          f"case {i}: {len(held)} idle connections kept a client with the secret out")
                for h in held:
                    h.close()
            elif c == "churn":
                stop = threading.Event()
                threads = [threading.Thread(target=churn, args=(store, stop), daemon=True) for _ in range(2)]
                for t in threads:
                    t.start()
                time.sleep(0.3)
                took = legitimate(store, f"churn {i}")
                time.sleep(1.2)
                stop.set()
                for t in threads:
                    t.join()
                tally.add(c, "accepted" if took is not None else "hang", took is not None,
                          f"case {i}: connections opened and closed fast kept a client with the secret out")
            else:
                kind, ok, detail = insider(store, c, rng, model)
                tally.add(c, kind, ok, f"case {i}: {detail}")
            if n % 10 == 9 and not healthy(f"after case {i}"):
                break
        healthy("the end")
        if peak[0] > MAX_RSS:
            tally.add("store process", "wrong", False, f"the store's process peaked at {peak[0] >> 20} MiB resident")
        # Node 1 joins while strangers hold 1000 idle connections and two threads churn.
        held = flood(store, 1000)
        stop = threading.Event()
        threads = [threading.Thread(target=churn, args=(store, stop), daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        nodes.append(node(1, port, secret_file, logs[1]))
        try:
            codes = [p.wait(timeout=120) for p in nodes]
        except subprocess.TimeoutExpired:
            codes = None
        stop.set()
        for h in held:
            h.close()
        out = open(logs[0].name).read()
        good = codes == [0, 0] and "SUM 3 of 2" in out
        tally.add("job", "accepted" if good else ("hang" if codes is None else "wrong"), good,
                  f"node 1 joining: exit {codes}: {out[-2000:]} / {open(logs[1].name).read()[-1000:]}")
        print(f"the store's process peaked at {peak[0] >> 20} MiB resident")
    finally:
        for p in nodes:
            if p.poll() is None:
                common.kill_tree(p.pid)
                p.wait()
        shutil.rmtree(work, ignore_errors=True)
    tally.finish()


if __name__ == "__main__":
    sys.exit(main())
