"""LLaMA against PyTorch and Hugging Face's files: random weights written by Python in Hugging
Face's sharded layout (two files and an index) import into partrain's LLaMA whole and split over
tensor 2 (grouped-query heads divided), export back with the same bytes (one file, and a sharded
folder of its own), and ten AdamW steps on the same bytes give PyTorch's losses (the model written
in plain PyTorch in llama_reference.py): step 1 within 1e-5, every step within 1e-4 (relative).

  test_llama.py PARTRAIN"""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from checks import check, finish  # noqa: E402

BIN = os.path.abspath(sys.argv[1])
HERE = os.path.dirname(os.path.abspath(__file__))
TORCH_PYTHON = sys.executable  # the python3 that holds PyTorch (scripts/build names .venv's)


def tensor_bytes(path):
    """Name -> (dtype, shape, raw bytes) of one .safetensors file."""
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    return {k: (v["dtype"], v["shape"], raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]])
            for k, v in header.items() if k != "__metadata__"}


def sharded_bytes(folder):
    index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
    out = {}
    for f in sorted(set(index["weight_map"].values())):
        part = tensor_bytes(os.path.join(folder, f))
        for k in part:
            if index["weight_map"].get(k) != f:
                raise ValueError(f"{f} holds {k}, which the index puts elsewhere")
        out.update(part)
    return out, index


def losses(text):
    return [float(l.split()[2]) for l in text.splitlines() if l.startswith("loss ")]


def close(a, b, tol):
    return len(a) == len(b) and all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b))


work = tempfile.mkdtemp()
try:
    hf = os.path.join(work, "hf")
    os.mkdir(hf)
    p = subprocess.run([TORCH_PYTHON, os.path.join(HERE, "llama_reference.py"), "write", hf], capture_output=True, text=True)
    check("Python writes LLaMA weights in Hugging Face's sharded layout", p.returncode == 0, p.stderr)
    original, _ = sharded_bytes(hf)
    ref = subprocess.run([TORCH_PYTHON, os.path.join(HERE, "llama_reference.py"), "train", hf], capture_output=True,
                         text=True)
    want = losses(ref.stdout)
    check("the PyTorch reference trains 10 steps", ref.returncode == 0 and len(want) == 10, ref.stderr)

    script = os.path.join(HERE, "llama_train.lua")
    runs = {
        "serial": [BIN, "--threads", "1", script, "--import", hf],
        "tensor 2": [BIN, "--nproc-per-node", "2", "--threads", "1", script, "--tensor", "2",
                     "--import", os.path.join(hf, "model.safetensors.index.json")],
    }
    for name, cmd in runs.items():
        single, sharded = os.path.join(work, name.replace(" ", "") + ".safetensors"), os.path.join(work, name.replace(" ", ""))
        r = subprocess.run(cmd + ["--export", single, "--export-sharded", sharded], capture_output=True, text=True,
                           cwd=os.path.dirname(os.path.dirname(HERE)))
        got = losses(r.stdout)
        check(f"{name}: imports the sharded Hugging Face weights and trains 10 steps", r.returncode == 0 and len(got) == 10,
              r.stderr[-3000:])
        check(f"{name}: step 1's loss equals PyTorch's within 1e-5", close(got[:1], want[:1], 1e-5), (got[:1], want[:1]))
        check(f"{name}: ten steps' losses equal PyTorch's within 1e-4", close(got, want, 1e-4), list(zip(got, want)))
        exported = tensor_bytes(single) if os.path.exists(single) else {}
        check(f"{name}: the exported file holds Python's tensors with the same names, dtypes, shapes and bytes",
              exported == original, sorted(set(exported) ^ set(original))[:10])
        try:
            resharded, index = sharded_bytes(sharded)
            files = sorted(set(index["weight_map"].values()))
        except (OSError, ValueError) as e:
            resharded, files = {}, [str(e)]
        check(f"{name}: the sharded export (model-0000N-of-0000M.safetensors + index) holds the same bytes",
              resharded == original and len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors",
              files[:3])
finally:
    shutil.rmtree(work, ignore_errors=True)

finish("LLaMA")
