"""partrain against PyTorch itself, in float64 where rounding cannot hide a real difference: the
LLaMA of llama_reference.py (plain PyTorch, as Hugging Face computes it) and partrain's LLaMA start
from the same Hugging Face weights and train 50 AdamW steps on the same bytes; partrain serially,
at data 2, tensor 2, pipeline 2 (2 micro-batches) and ZeRO-2 over data 2. Every step's loss must
equal PyTorch's within 1e-12 (relative); the serial run's largest difference is printed, and
whether it is bit-identical.

  test_parity_torch.py PARTRAIN"""
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from checks import check, finish  # noqa: E402

BIN = os.path.abspath(sys.argv[1])
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
STEPS, TOL = 50, 1e-12


def losses(text):
    return [float(line.split()[2]) for line in text.splitlines() if line.startswith("loss ")]


def worst(a, b):
    """The largest relative difference of two loss curves (inf if their lengths differ)."""
    if len(a) != len(b) or not a:
        return float("inf")
    return max(abs(x - y) / max(1.0, abs(y)) for x, y in zip(a, b))


work = tempfile.mkdtemp()
try:
    hf = os.path.join(work, "hf")
    os.mkdir(hf)
    reference = os.path.join(HERE, "llama_reference.py")
    p = subprocess.run([sys.executable, reference, "write", hf], capture_output=True, text=True, cwd=ROOT)
    check("PyTorch writes LLaMA weights in Hugging Face's layout", p.returncode == 0, p.stderr)
    ref = subprocess.run([sys.executable, reference, "train", hf, "--dtype", "float64", "--steps", str(STEPS)],
                         capture_output=True, text=True, cwd=ROOT)
    want = losses(ref.stdout)
    check(f"PyTorch trains {STEPS} float64 steps", ref.returncode == 0 and len(want) == STEPS, ref.stderr[-2000:])

    script = os.path.join(HERE, "llama_parity.lua")
    index = os.path.join(hf, "model.safetensors.index.json")
    init = os.path.join(work, "init")
    common = ["--threads", "1", script, "--steps", str(STEPS)]
    runs = [  # the serial run saves the imported weights for the pipeline, which cannot import them
        ("serial", [BIN] + common + ["--import", index, "--save", init]),
        ("data 2", [BIN, "--nproc-per-node", "2"] + common + ["--import", index]),
        ("tensor 2", [BIN, "--nproc-per-node", "2"] + common + ["--tensor", "2", "--import", index]),
        ("pipeline 2", [BIN, "--nproc-per-node", "2"] + common + ["--pipeline", "2", "--load", init]),
        ("ZeRO-2 over data 2", [BIN, "--nproc-per-node", "2"] + common + ["--zero", "2", "--import", index]),
    ]
    for name, cmd in runs:
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        got = losses(r.stdout)
        check(f"{name}: trains {STEPS} float64 steps", r.returncode == 0 and len(got) == STEPS, r.stderr[-3000:])
        diff = worst(got, want)
        same = got == want
        print(f"  {name}: largest relative difference from PyTorch 2.11 over {STEPS} steps {diff:.3g}"
              + (" (bit-identical)" if same else ""))
        check(f"{name}: every step's loss equals PyTorch's within {TOL} (relative)", diff <= TOL,
              [(i + 1, g, w) for i, (g, w) in enumerate(zip(got, want)) if abs(g - w) / max(1.0, abs(w)) > TOL][:5])
finally:
    shutil.rmtree(work, ignore_errors=True)

finish("parity with PyTorch")
