"""Mixtral (partrain's LLaMA with experts) against PyTorch and Hugging Face's files. Python writes
random weights in Hub Mixtral's layout (two files and an index; one tensor an expert:
block_sparse_moe.experts.M.w1.weight), which partrain stacks on import (experts.w1 [E, ffn, dim])
and cuts again on export, with the same names, dtypes, shapes and bytes (one file, a sharded
folder, and `partrain ckpt export` of a checkpoint), whole and split over expert 2. Files with an
expert missing, named twice, out of range or of another shape are refused naming the tensor,
leaving the weights as they were. Then 30 AdamW steps in float64 (experts 4, top_k 2, aux_loss
0.02, z_loss 0.001, dropless) on the same bytes as the PyTorch twin (llama_reference.py
--experts): every step's cross-entropy within 1e-9 (relative), serially and at expert 2, and each
block's load-balancing and z losses (pt.moe.stats) within 1e-9 of the twin's at step 1 and at
every step.

  test_mixtral.py PARTRAIN"""
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
ROOT = os.path.dirname(os.path.dirname(HERE))
STEPS, TOL = 30, 1e-9
MOE = ["--experts", "4", "--top-k", "2", "--aux-loss", "0.02", "--z-loss", "0.001"]
SCRIPT = os.path.join(HERE, "mixtral_twin.lua")
REFERENCE = os.path.join(HERE, "llama_reference.py")
EXPERT = "model.layers.{}.block_sparse_moe.experts.{}.{}.weight"


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


def write_raw(path, tensors):
    """A .safetensors file of name -> (dtype, shape, bytes), as Python's safetensors lays it out."""
    head, data = {"__metadata__": {"format": "pt"}}, b""
    for k in sorted(tensors):
        dtype, shape, blob = tensors[k]
        head[k] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    text = json.dumps(head).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


def lines(text, kind):
    """(step, [block,] value) of the lines "<kind> <step> [<block>] <value>"."""
    out = []
    for line in text.splitlines():
        f = line.split()
        if f and f[0] == kind:
            out.append((int(f[1]), *f[2:-1], float(f[-1])))
    return out


def worst(a, b):
    """The largest relative difference of two lists of (key..., value) (inf unless the keys agree;
    an exact zero compares absolutely)."""
    if len(a) != len(b) or not a or any(x[:-1] != y[:-1] for x, y in zip(a, b)):
        return float("inf")
    return max(abs(x[-1] - y[-1]) / (abs(y[-1]) or 1.0) for x, y in zip(a, b))


def run(cmd):
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)


def partrain(ranks, *args):
    launch = [BIN] + (["--nproc-per-node", str(ranks)] if ranks > 1 else []) + ["--threads", "1", SCRIPT]
    return run(launch + list(args))


work = tempfile.mkdtemp()
try:
    hf = os.path.join(work, "hf")
    os.mkdir(hf)
    p = run([sys.executable, REFERENCE, "write", hf] + MOE)
    check("Python writes Mixtral weights in Hugging Face's sharded layout, one tensor an expert", p.returncode == 0,
          p.stderr)
    original, _ = sharded_bytes(hf)
    check("the Hub layout names each expert apart", EXPERT.format(1, 3, "w2") in original and
          "model.layers.1.block_sparse_moe.gate.weight" in original, sorted(original)[:8])
    index = os.path.join(hf, "model.safetensors.index.json")

    # ---- The names: stacked on import, cut again on export -----------------------------------
    for name, ranks in (("serial", 1), ("expert 2", 2)):
        tag = name.replace(" ", "")
        single, sharded = os.path.join(work, tag + ".safetensors"), os.path.join(work, tag)
        saved, offline = os.path.join(work, tag + "-ckpt"), os.path.join(work, tag + "-offline.safetensors")
        r = partrain(ranks, "--dtype", "float32", "--steps", "0", "--expert", str(ranks), "--import", index,
                     "--export", single, "--export-sharded", sharded, "--save", saved)
        check(f"{name}: imports the per-expert files into the stacked experts and exports them", r.returncode == 0,
              r.stderr[-3000:])
        c = run([BIN, "ckpt", "export", saved, offline])
        check(f"{name}: partrain ckpt export writes the checkpoint's experts apart with the same bytes",
              c.returncode == 0 and os.path.exists(offline) and tensor_bytes(offline) == original,
              c.stderr[-2000:])
        exported = tensor_bytes(single) if os.path.exists(single) else {}
        check(f"{name}: the exported file holds Python's tensors with the same names, dtypes, shapes and bytes",
              exported == original, sorted(set(exported) ^ set(original))[:10])
        try:
            resharded, idx = sharded_bytes(sharded)
            files = sorted(set(idx["weight_map"].values()))
        except (OSError, ValueError) as e:
            resharded, files = {}, [str(e)]
        check(f"{name}: the sharded export holds the same bytes, an expert a tensor",
              resharded == original and len(files) > 1, files[:3])

    # ---- Files that do not number the experts 0..E-1 once each, with one shape ---------------
    bad = os.path.join(work, "bad")
    os.mkdir(bad)
    cases = {  # what -> the names and words the refusal must quote
        "an expert missing": ["layers.1.block_sparse_moe.experts.w3", EXPERT.format(1, 2, "w3")],
        "the last expert missing": ["layers.0.block_sparse_moe.experts.w1", "the model has 4"],
        "an expert named twice": [EXPERT.format(0, 1, "w2"), EXPERT.format(0, 1, "w2")[len("model."):]],
        "an expert out of range": ["layers.1.block_sparse_moe.experts.w2", EXPERT.format(1, 4, "w2"),
                                   "the model has 4"],
        "an expert far out of range": [EXPERT.format(1, 9, "w1"), EXPERT.format(1, 4, "w1")],
        "an expert of another shape": [EXPERT.format(0, 2, "w2"), EXPERT.format(0, 0, "w2")],
        "an expert of another dtype": [EXPERT.format(0, 2, "w2"), "Double"],
        "an expert numbered with a leading zero": ["layers.0.block_sparse_moe.experts.01.w1.weight"],
        "the stack and its experts both": ["model.layers.0.block_sparse_moe.experts.w3",
                                           "layers.0.block_sparse_moe.experts.w3"],
    }

    def damaged(what):
        """The original tensors with the damage `what`."""
        t = dict(original)
        dtype, (dim, hidden), w2 = t[EXPERT.format(0, 2, "w2")]  # [dim, hidden]
        if what == "an expert missing":
            del t[EXPERT.format(1, 2, "w3")]
        elif what == "the last expert missing":
            del t[EXPERT.format(0, 3, "w1")]
        elif what == "an expert named twice":  # with and without "model."
            t[EXPERT.format(0, 1, "w2")[len("model."):]] = t[EXPERT.format(0, 1, "w2")]
        elif what == "an expert out of range":  # a fifth expert
            t[EXPERT.format(1, 4, "w2")] = t[EXPERT.format(1, 0, "w2")]
        elif what == "an expert far out of range":  # five, numbered 0-3 and 9
            t[EXPERT.format(1, 9, "w1")] = t[EXPERT.format(1, 0, "w1")]
        elif what == "an expert of another shape":  # [dim, hidden - 1]
            t[EXPERT.format(0, 2, "w2")] = (dtype, [dim, hidden - 1], w2[:-4 * dim])
        elif what == "an expert of another dtype":
            t[EXPERT.format(0, 2, "w2")] = ("F64", [dim, hidden], w2 * 2)
        elif what == "an expert numbered with a leading zero":
            t[EXPERT.format(0, "01", "w1")] = t[EXPERT.format(0, 1, "w1")]
        else:  # the stack as partrain names it, beside its experts
            t["model.layers.0.block_sparse_moe.experts.w3"] = (
                dtype, [4, hidden, dim], b"".join(t[EXPERT.format(0, e, "w3")][2] for e in range(4)))
        return t

    paths = {}
    for i, what in enumerate(cases):
        paths[what] = os.path.join(bad, f"case-{i}.safetensors")
        write_raw(paths[what], damaged(what))
    good = os.path.join(bad, "good.safetensors")
    write_raw(good, original)
    after = os.path.join(work, "after.safetensors")
    refuse = os.path.join(work, "refuse.lua")
    with open(refuse, "w") as f:
        f.write("local pt = require 'partrain'\n"
                "local model = pt.models.llama { vocab = 256, seq = 16, dim = 32, heads = 8, kv_heads = 4,\n"
                "  layers = 2, hidden = 48, experts = 4, top_k = 2 }\n"
                f"pt.ckpt.import_safetensors(model, {json.dumps(good)})\n"
                f"for _, path in ipairs({{{', '.join(json.dumps(p) for p in paths.values())}}}) do\n"
                "  local ok, err = pcall(pt.ckpt.import_safetensors, model, path)\n"
                "  print(('case\\t%s\\t%s\\t%s'):format(path, tostring(ok), tostring(err):gsub('\\n', ' ')))\n"
                "end\n"
                f"pt.ckpt.export_safetensors(model, {json.dumps(after)})\n")
    r = run([BIN, "--threads", "1", refuse])
    check("one process tries every damaged file", r.returncode == 0, r.stderr[-3000:])
    results = {f[1]: (f[2], f[3] if len(f) > 3 else "") for f in (line.split("\t") for line in r.stdout.splitlines())
               if f[0] == "case"}
    for what, quoted in cases.items():
        ok, err = results.get(paths[what], ("missing", ""))
        check(f"{what}: refused, naming the file and " + ", ".join(f"'{q}'" if "." in q else q for q in quoted),
              ok == "false" and paths[what] in err and all(q in err for q in quoted), err or ok)
    check("the refused files leave the imported weights as they were",
          os.path.exists(after) and tensor_bytes(after) == original)

    # ---- 30 float64 steps against the twin ---------------------------------------------------
    ref = run([sys.executable, REFERENCE, "train", hf, "--dtype", "float64", "--steps", str(STEPS)] + MOE)
    want, want_aux, want_z = lines(ref.stdout, "loss"), lines(ref.stdout, "aux"), lines(ref.stdout, "z")
    check(f"the PyTorch twin trains {STEPS} float64 steps", ref.returncode == 0 and len(want) == STEPS and
          len(want_aux) == 2 * STEPS, ref.stderr[-2000:])
    for name, ranks in (("serial", 1), ("expert 2", 2)):
        r = partrain(ranks, "--expert", str(ranks), "--steps", str(STEPS), "--import", index)
        got, aux, z = lines(r.stdout, "loss"), lines(r.stdout, "aux"), lines(r.stdout, "z")
        check(f"{name}: trains {STEPS} float64 steps", r.returncode == 0 and len(got) == STEPS, r.stderr[-3000:])
        diff = worst(got, want)
        print(f"  {name}: largest relative difference of the cross-entropy over {STEPS} steps {diff:.3g}, "
              f"of the aux losses {worst(aux, want_aux):.3g}, of the z losses {worst(z, want_z):.3g}")
        check(f"{name}: every step's cross-entropy equals the twin's within {TOL} (relative)", diff <= TOL,
              [(g, w) for g, w in zip(got, want) if worst([g], [w]) > TOL][:5])
        first = [a for a in aux if a[0] == 1]
        check(f"{name}: each block's load-balancing loss at step 1 (pt.moe.stats) equals the twin's within {TOL}",
              worst(first, [a for a in want_aux if a[0] == 1]) <= TOL and len(first) == 2, (first, want_aux[:2]))
        check(f"{name}: each block's load-balancing and z losses equal the twin's at every step within {TOL}",
              worst(aux, want_aux) <= TOL and worst(z, want_z) <= TOL, (aux[:4], want_aux[:4], z[:2], want_z[:2]))
finally:
    shutil.rmtree(work, ignore_errors=True)

finish("Mixtral")
