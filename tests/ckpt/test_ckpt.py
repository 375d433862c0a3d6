"""Sharded checkpoints end to end, through real processes.

- Resume equivalence: 20 steps straight against 10 steps, a save, new processes, a resume and
  10 more: the same losses and weights bitwise in the same layout (tensor 2 x data 2), and
  within 1e-5 after resharding to tensor 4, to tensor 1 x data 4 and to one process. The same
  from a full (consolidated) checkpoint, and from one converted offline by `partrain ckpt
  convert`.
- Crashes: a process killed (SIGKILL) at several points of a save leaves the previous
  checkpoint loadable and `newest` valid; killed after the rename, the next run takes the
  complete newer tag and says why.
- Corruption: a truncated, altered or deleted data file, a manifest of another version, a model
  of another shape or with more parameters: each a clear error naming the file or tensor, and
  `partrain ckpt verify` exits non-zero. A damaged newest tag at 2 ranks: both ranks fall back
  to the previous tag, say so once, and continue bitwise as the original run; the next save of
  the damaged tag keeps it aside.
- safetensors: the exported file read by Python (with PyTorch where it is installed) in Hugging
  Face GPT-2's layout, and a file written by Python imported.
- num_kept keeps the newest checkpoints only; `partrain ckpt inspect` describes one; every
  `partrain ckpt` command refuses a FIFO manifest and a newest linked to /dev/zero at once.

Usage: test_ckpt.py PARTRAIN
"""
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from array import array

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from checks import check, finish  # noqa: E402

BIN = sys.argv[1]
SCRIPT = "tests/ckpt/train.lua"

def run(args, env=None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([BIN] + args, capture_output=True, text=True, timeout=600, env=e)


def train(nproc, *args, env=None, expect_ok=True):
    launch = ["--nproc-per-node", str(nproc)] if nproc > 1 else []
    r = run(launch + ["--threads", "1", SCRIPT, *args], env=env)
    if expect_ok and r.returncode != 0:
        raise SystemExit(f"training failed ({args}):\n{r.stdout}\n{r.stderr}")
    return r


def losses(out):
    return {int(l.split()[1]): float(l.split()[3]) for l in out.splitlines() if l.startswith("step ")}


def read_safetensors(path):
    """Name -> (dtype, shape, list of floats), parsed by hand (no safetensors package needed)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        values = array("f")
        values.frombytes(data[begin:end])
        out[name] = (info["dtype"], info["shape"], values)
    return out


def newest_of(d):
    """The tag d/newest names (its first line; the second is its checksum), or ""."""
    path = os.path.join(d, "newest")
    return open(path).read().split("\n")[0] if os.path.exists(path) else ""


def max_diff(a, b):
    worst = 0.0
    for name in a:
        va, vb = a[name][2], b[name][2]
        worst = max(worst, max(abs(x - y) for x, y in zip(va, vb)))
    return worst


work = tempfile.mkdtemp()
try:
    # ---- Resume equivalence ------------------------------------------------------------------
    straight_st = os.path.join(work, "straight.safetensors")
    straight = losses(train(4, "--tensor", "2", "--export", straight_st).stdout)
    W = read_safetensors(straight_st)
    ck = os.path.join(work, "ck")
    first = losses(train(4, "--tensor", "2", "--ckpt", ck, "--save-every", "10", "--stop-after", "10").stdout)
    check("the first 10 steps before the save match the straight run bitwise",
          all(first[s] == straight[s] for s in range(1, 11)), (first, straight))
    backup = os.path.join(work, "ck-step10")
    shutil.copytree(ck, backup)

    resumed_st = os.path.join(work, "resumed.safetensors")
    r = train(4, "--tensor", "2", "--ckpt", ck, "--export", resumed_st)
    got = losses(r.stdout)
    check("new processes resume at step 10 with the user table", "resumed step-00000010 at step 10 user step 10"
          in r.stdout, r.stdout)
    check("same layout (tensor 2 x data 2): steps 11-20 have the straight run's losses bitwise",
          sorted(got) == list(range(11, 21)) and all(got[s] == straight[s] for s in got), (got, straight))
    with open(straight_st, "rb") as a, open(resumed_st, "rb") as b:
        check("same layout: the final weights are the straight run's bitwise", a.read() == b.read())

    def resharded(name, nproc, *layout, source=backup):
        d = os.path.join(work, "re-" + name.replace(" ", "_"))
        shutil.copytree(source, d)
        st = os.path.join(work, name.replace(" ", "_") + ".safetensors")
        got = losses(train(nproc, *layout, "--ckpt", d, "--export", st).stdout)
        worst = max(abs(got[s] - straight[s]) / abs(straight[s]) for s in range(11, 21)) if len(got) == 10 else 1
        check(f"resharded to {name}: steps 11-20 within 1e-5 of the straight run (worst {worst:.2e})",
              worst <= 1e-5, got)
        diff = max_diff(W, read_safetensors(st))
        check(f"resharded to {name}: final weights within 1e-5 (worst {diff:.2e})", diff <= 1e-5, diff)

    resharded("tensor 4", 4, "--tensor", "4")
    resharded("tensor 1 x data 4", 4, "--tensor", "1")
    resharded("1 process", 1)

    # A full (consolidated) checkpoint, loaded under another layout.
    full = os.path.join(work, "full")
    train(4, "--tensor", "2", "--ckpt", full, "--save-every", "10", "--stop-after", "10", "--full")
    r = run(["ckpt", "inspect", full])
    check("a full checkpoint is one file of whole tensors",
          r.returncode == 0 and "full (consolidated)" in r.stdout and "rank-00001.bin" not in r.stdout, r.stdout)
    resharded("tensor 4 from a full checkpoint", 4, "--tensor", "4", source=full)

    # Offline conversion, then a resume under the new layout.
    converted = os.path.join(work, "converted")
    r = run(["ckpt", "convert", backup, converted, "--tensor", "4", "--data", "1"])
    check("ckpt convert rewrites the checkpoint for tensor 4", r.returncode == 0 and
          run(["ckpt", "verify", converted]).returncode == 0, r.stderr)
    r = run(["ckpt", "inspect", converted])
    check("the converted checkpoint is split 4 ways", "tensor 4 x data 1" in r.stdout and "rank-00003.bin" in r.stdout,
          r.stdout)
    resharded("tensor 4 from the converted checkpoint", 4, "--tensor", "4", source=converted)

    # ---- Inspect, num_kept --------------------------------------------------------------------
    r = run(["ckpt", "inspect", backup])
    check("ckpt inspect shows the step, mesh, data position and tensors with their slices",
          r.returncode == 0 and "step 10; saved by 4 rank(s): tensor 2 x data 2" in r.stdout
          and "data position: 80 samples" in r.stdout
          and "model/h.0.attn.c_attn.weight  Float 192x64  split on 0 (parts 64+64+64)" in r.stdout
          and "model/wte.weight  Float 255x64" in r.stdout, r.stdout)
    kept = os.path.join(work, "kept")
    train(2, "--tensor", "2", "--ckpt", kept, "--save-every", "2", "--stop-after", "10", "--num-kept", "2")
    tags = sorted(t for t in os.listdir(kept) if t.startswith("step-"))
    check("num_kept 2 keeps the two newest", tags == ["step-00000008", "step-00000010"]
          and newest_of(kept) == "step-00000010", tags)

    # ---- Crashes during a save ----------------------------------------------------------------
    for point in ("data", "manifest", "renamed"):
        d = os.path.join(work, "crash-" + point)
        shutil.copytree(backup, d)
        r = train(2, "--tensor", "2", "--ckpt", d, "--save-every", "5", "--steps", "20",
                  env={"PARTRAIN_CKPT_CRASH_AT": point}, expect_ok=False)
        newest = newest_of(d)
        check(f"killed during a save ({point}): the run fails, newest still names step 10, and the folder verifies",
              r.returncode != 0 and newest == "step-00000010" and run(["ckpt", "verify", d]).returncode == 0,
              (r.returncode, newest, r.stderr))
        # After the rename, step 15 is complete though newest was not updated: a resume takes it.
        expected = "step-00000015" if point == "renamed" else "step-00000010"
        r = train(2, "--tensor", "2", "--ckpt", d, "--steps", "12")
        check(f"... and the next run resumes from {expected} ({point})", "resumed " + expected in r.stdout and
              (point != "renamed" or "'step-00000015' (step 15) is complete and newer" in r.stderr), r.stdout + r.stderr)

    # A real kill -9 of every process at a random moment of a run that saves every step.
    def descendants(pid):
        children = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = open(f"/proc/{entry}/stat").read()
                    children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
                except OSError:
                    pass
        out, todo = [], [pid]
        while todo:
            p = todo.pop()
            out.append(p)
            todo.extend(children.get(p, []))
        return out

    rng = random.Random(5)
    for trial in range(3):
        d = os.path.join(work, f"killed-{trial}")
        proc = subprocess.Popen([BIN, "--nproc-per-node", "2", "--threads", "1", SCRIPT, "--tensor", "2", "--dim", "256",
                                 "--layers", "4", "--ckpt", d, "--save-every", "1", "--steps", "100000"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while not os.path.exists(os.path.join(d, "newest")) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.5))
        for pid in descendants(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        proc.wait()
        v = run(["ckpt", "verify", d])
        newest = newest_of(d)
        check(f"kill -9 of every process mid-run ({trial + 1}/3): newest ({newest}) and every complete tag verify",
              newest != "" and v.returncode == 0, v.stdout)

    # ---- Corruption -----------------------------------------------------------------------------
    def damaged(name, damage, expect):
        d = os.path.join(work, "bad-" + name.replace(" ", "_"))
        shutil.copytree(backup, d)
        tag = os.path.join(d, "step-00000010")
        damage(tag)
        v = run(["ckpt", "verify", d])
        check(f"{name}: ckpt verify exits non-zero", v.returncode != 0, v.stdout)
        r = train(4, "--tensor", "2", "--ckpt", d, expect_ok=False)
        check(f"{name}: loading fails with a clear error ({expect})",
              r.returncode != 0 and expect in r.stderr, r.stderr[-2000:])

    def truncate(tag):
        p = os.path.join(tag, "rank-00001.bin")
        os.truncate(p, os.path.getsize(p) // 2)

    def flip(tag):
        p = os.path.join(tag, "rank-00000.bin")
        with open(p, "r+b") as f:
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 0xFF]))

    def delete(tag):
        os.remove(os.path.join(tag, "rank-00001.bin"))

    def version(tag):
        p = os.path.join(tag, "manifest.bin")
        data = bytearray(open(p, "rb").read())
        magic = b"partrain-checkpoint"
        at = data.index(magic) + len(magic)
        data[at:at + 4] = struct.pack("<I", 99)
        open(p, "wb").write(bytes(data))

    damaged("a truncated data file", truncate, "rank-00001.bin' has")
    damaged("a flipped byte", flip, "fails its checksum")
    damaged("a deleted shard file", delete, "rank-00001.bin' is missing")
    damaged("a manifest of another version", version, "format version 99")

    # A damaged newest tag on a run of 2 ranks: only rank 1 reads the damaged file, yet both fall
    # back to the previous tag, continue exactly as the original run did, and the save of the
    # damaged tag keeps it aside.
    d = os.path.join(work, "fallback")
    original = losses(train(2, "--tensor", "2", "--ckpt", d, "--save-every", "5", "--stop-after", "10").stdout)
    with open(os.path.join(d, "step-00000010", "rank-00001.bin"), "r+b") as f:
        f.seek(7)
        b = f.read(1)
        f.seek(7)
        f.write(bytes([b[0] ^ 0x10]))
    r = train(2, "--tensor", "2", "--ckpt", d, "--save-every", "5", "--stop-after", "10", expect_ok=False)
    got = losses(r.stdout)
    check("a damaged newest tag at 2 ranks: both fall back to step 5, saying which file is damaged, once",
          r.returncode == 0 and "resumed step-00000005" in r.stdout
          and r.stderr.count("falling back to 'step-00000005'") == 1
          and "rank-00001.bin' fails its checksum in tensor" in r.stderr, r.stdout + r.stderr)
    check("... steps 6-10 repeat the original run's losses bitwise",
          sorted(got) == list(range(6, 11)) and all(got[s] == original[s] for s in got), (got, original))
    v = run(["ckpt", "verify", d])
    check("... the new step 10 verifies and the damaged one is kept as step-00000010~damaged",
          v.returncode == 0 and os.path.exists(os.path.join(d, "step-00000010~damaged", "rank-00001.bin"))
          and "was damaged" in r.stderr, v.stdout + r.stderr)

    # The command line on a FIFO manifest and a newest linked to /dev/zero: refused, never waited on.
    d = os.path.join(work, "fifo")
    shutil.copytree(backup, d)
    os.remove(os.path.join(d, "step-00000010", "manifest.bin"))
    os.mkfifo(os.path.join(d, "step-00000010", "manifest.bin"))
    os.remove(os.path.join(d, "newest"))
    os.symlink("/dev/zero", os.path.join(d, "newest"))
    for args in (["verify", d], ["inspect", d], ["export", d, os.path.join(work, "fifo.safetensors")],
                 ["convert", d, os.path.join(work, "fifo-out"), "--tensor", "1"]):
        try:
            r = subprocess.run([BIN, "ckpt"] + args, capture_output=True, text=True, timeout=60)
            out, rc = r.stdout + r.stderr, r.returncode
        except subprocess.TimeoutExpired:
            out, rc = "hung", None
        check(f"partrain ckpt {args[0]} on a FIFO manifest and a newest linked to /dev/zero: exit 1 naming both",
              rc == 1 and "manifest.bin' is a FIFO" in out and "newest' is a symbolic link" in out, out)

    d = os.path.join(work, "shape")
    shutil.copytree(backup, d)
    r = train(2, "--tensor", "2", "--ckpt", d, "--dim", "32", expect_ok=False)
    check("a model of another shape: the error names the tensor and both shapes",
          r.returncode != 0 and "tensor 'wte.weight'" in r.stderr and "[255, 64]" in r.stderr
          and "[255, 32]" in r.stderr, r.stderr[-2000:])
    r = train(2, "--tensor", "2", "--ckpt", d, "--layers", "3", expect_ok=False)
    check("a model with a parameter the checkpoint lacks: the error names it",
          r.returncode != 0 and "has no tensor 'h.2." in r.stderr, r.stderr[-2000:])
    r = run(["ckpt", "verify", backup])
    check("an intact checkpoint verifies", r.returncode == 0 and ": ok" in r.stdout, r.stdout)

    # ---- safetensors ----------------------------------------------------------------------------
    exported = os.path.join(work, "cli.safetensors")
    r = run(["ckpt", "export", backup, exported])
    T = read_safetensors(exported)
    check("ckpt export writes Hugging Face GPT-2 names and Conv1D layouts [in, out]",
          r.returncode == 0 and T["h.0.attn.c_attn.weight"][1] == [64, 192] and T["h.0.mlp.c_proj.weight"][1] == [256, 64]
          and T["wte.weight"][1] == [255, 64] and "lm_head.weight" not in T, {k: v[1] for k, v in T.items()})
    torch_python = None
    for candidate in (sys.executable,):
        if subprocess.run([candidate, "-c", "import torch"], capture_output=True).returncode == 0:
            torch_python = candidate
            break
    if torch_python is None:
        print("skip the PyTorch round trip: no python3 with torch here")
    else:
        written = os.path.join(work, "from_python.safetensors")
        reread = os.path.join(work, "reread.safetensors")
        code = r'''
import json, struct, sys, torch

src, dst = sys.argv[1], sys.argv[2]
raw = open(src, "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
header = json.loads(raw[8:8 + n])
tensors = {}
for name, info in header.items():
    if name == "__metadata__": continue
    b, e = info["data_offsets"]
    t = torch.frombuffer(bytearray(raw[8 + n + b:8 + n + e]), dtype=torch.float32).reshape(info["shape"])
    tensors[name] = t
# Hugging Face's GPT-2 keeps Conv1D weights [in, out]: y = x @ W + b.
x = torch.randn(3, 64)
w, b = tensors["h.0.attn.c_attn.weight"], tensors["h.0.attn.c_attn.bias"]
assert (x @ w + b).shape == (3, 192)
# Write new weights, as Python's safetensors would: sorted names, 8-byte aligned header.
torch.manual_seed(0)
out = {k: (torch.randn_like(v) * 0.02).contiguous() for k, v in tensors.items()}
def write(path, ts):
    head, off = {}, 0
    for k in sorted(ts):
        nb = ts[k].numel() * 4
        head[k] = {"dtype": "F32", "shape": list(ts[k].shape), "data_offsets": [off, off + nb]}
        off += nb
    text = json.dumps(head).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text))); f.write(text)
        for k in sorted(ts): f.write(ts[k].numpy().tobytes())
write(dst, out)
# As Hugging Face saves GPT-2: with its causal-mask buffer; and a file with a name GPT-2 lacks.
write(dst + ".hf", dict(out, **{"h.0.attn.bias": torch.ones(1, 1, 4, 4)}))
write(dst + ".bad", dict(out, **{"bogus.weight": torch.ones(3)}))
print("python read", len(tensors), "tensors")
'''
        p = subprocess.run([torch_python, "-c", code, exported, written], capture_output=True, text=True)
        check("PyTorch reads the exported file and uses its Conv1D weights as Hugging Face does",
              p.returncode == 0 and "python read" in p.stdout, p.stderr)
        r = train(2, "--tensor", "2", "--steps", "0", "--import", written, "--export", reread)
        A, B = read_safetensors(written), read_safetensors(reread)
        check("a file written by Python imports into a split GPT-2 and exports back unchanged",
              r.returncode == 0 and sorted(A) == sorted(B) and max_diff(A, B) == 0.0, r.stderr)
        r = train(2, "--tensor", "2", "--steps", "0", "--import", written + ".hf", "--export", reread)
        check("Hugging Face's attention-mask buffers are skipped on import",
              r.returncode == 0 and max_diff(A, read_safetensors(reread)) == 0.0, r.stderr)
        r = train(2, "--tensor", "2", "--steps", "0", "--import", written + ".bad", expect_ok=False)
        check("a tensor the model has no parameter for fails the import, named",
              r.returncode != 0 and "bogus.weight" in r.stderr and ".bad'" in r.stderr, r.stderr[-2000:])
finally:
    shutil.rmtree(work, ignore_errors=True)

finish("checkpoint")
