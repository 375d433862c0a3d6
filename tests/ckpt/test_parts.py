"""Checkpoints of a tensor split into parts of unequal sizes (format 3 records the sizes): saved
at tensor 2, loaded whole at 1 process directly and after `partrain ckpt convert` to tensor 1,
each equal to the serial layer bit for bit; `inspect` shows the parts; a save of a split
tensor without its mesh is refused; a conversion to a tensor
size that does not divide a part is refused naming the tensor.

Usage: test_parts.py PARTRAIN
"""
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from checks import check, finish  # noqa: E402

BIN = os.path.abspath(sys.argv[1])
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "parts.lua")


def run(*args):
    p = subprocess.run([BIN, *args], capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout + p.stderr


with tempfile.TemporaryDirectory() as work:
    saved = os.path.join(work, "saved")
    rc, out = run("--nproc-per-node", "2", "--threads", "1", SCRIPT, "save", saved)
    check("a layer of parts 4+2+2 split over tensor 2 saves", rc == 0, out)
    check("a save of a split tensor without its mesh is refused, naming the tensor and what to pass",
          "without a mesh: " in out and "'model/0.weight' is split over tensor=2 but the save was given no mesh" in out
          and not os.path.exists(os.path.join(saved, "no-mesh")), out)
    rc, out = run("ckpt", "inspect", os.path.join(saved, "step-00000001"))
    check("inspect shows the parts", "split on 0 (parts 4+2+2)" in out, out)
    rc, out = run("--threads", "1", SCRIPT, "load", saved)
    check("loaded whole at 1 process it equals the serial layer", rc == 0 and "largest difference 0" in out, out)

    converted = os.path.join(work, "converted")
    rc, out = run("ckpt", "convert", saved, converted, "--tensor", "1", "--data", "1")
    check("convert to tensor 1 succeeds", rc == 0, out)
    rc, out = run("--threads", "1", SCRIPT, "load", converted)
    check("the converted checkpoint equals the serial layer", rc == 0 and "largest difference 0" in out, out)

    refused = os.path.join(work, "refused")
    rc, out = run("ckpt", "convert", saved, refused, "--tensor", "4", "--data", "1")
    check("convert to tensor 4 is refused, naming the tensor and the part",
          rc != 0 and "model/0.weight cannot be split over tensor 4" in out and "part of 2" in out, out)
    check("... and writes nothing", not os.path.exists(os.path.join(refused, "step-00000001")), os.listdir(work))

finish("unequal-parts checkpoint")
