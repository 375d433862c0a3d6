"""The engine from C++ (examples/cpp/gpt_cpp.cpp): GPT-2 split tensor 2 x data 2 by policies/gpt2.lua
(planned by the Lua library's policy loader, applied by parallel::apply_policy) over four processes
that join the world from torchrun's variables, trained through ParallelModel::train_step, gives the
serial run's losses on the same data within 1e-5 (relative, float32), also with accumulate = 2; with
ZeRO-1 it gives the losses of the same training written in Lua (tests/examples/gpt_lua.lua: the
sharder, pt.parallelize, pt.optim.adamw) within 1e-6, loss for loss. A policy applied from C++ is
refused as from Lua when it splits the model wrong, and refused by name when it holds Lua code (a
postprocess, a method); a bad layout is an error, not a hang.

Usage: test_gpt_cpp.py GPT_CPP PARTRAIN
"""
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from checks import check, finish, step_losses, torchrun, worst_difference  # noqa: E402

BIN = sys.argv[1]
PARTRAIN = sys.argv[2]
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def world(n, *args):
    """Runs n ranks of gpt_cpp as torchrun would start them; returns (exit codes, rank 0's stdout, stderrs)."""
    return torchrun([BIN, *args], n)


losses = step_losses


serial = subprocess.run([BIN, "--steps", "4"], capture_output=True, text=True, timeout=300)
want = losses(serial.stdout)
check("the serial run trains 4 steps", serial.returncode == 0 and len(want) == 4, serial.stdout + serial.stderr)

for extra, name in (((), "tensor 2 x data 2"), (("--accumulate", "2"), "tensor 2 x data 2, accumulate 2")):
    codes, out, err = world(4, "--tensor", "2", "--steps", "4", *extra)
    got = losses(out)
    worst = worst_difference(got, want)
    check(f"{name}: the losses equal the serial run's within 1e-5 (worst {worst:.2e})",
          codes == [0] * 4 and len(got) == 4 and worst <= 1e-5, (codes, got, want, err[-2000:]))

# The same training in Lua, loss for loss: ZeRO-1 over the data group on both sides.
codes, out, err = world(4, "--tensor", "2", "--zero", "1", "--steps", "4")
cpp = losses(out)
lua = subprocess.run([PARTRAIN, "--nproc-per-node", "4", "--threads", "1", os.path.join(ROOT, "tests/examples/gpt_lua.lua"),
                      "4"], capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
script = losses(lua.stdout)
worst = worst_difference(cpp, script)
check(f"tensor 2 x data 2, ZeRO-1: gpt_cpp's losses equal the Lua script's within 1e-6 (worst {worst:.2e})",
      codes == [0] * 4 and lua.returncode == 0 and len(cpp) == 4 and len(script) == 4 and worst <= 1e-6,
      (codes, cpp, script, err[-2000:], lua.stdout[-2000:], lua.stderr[-2000:]))
worst = worst_difference(cpp, want)
check(f"tensor 2 x data 2, ZeRO-1: the losses equal the serial run's within 1e-5 (worst {worst:.2e})",
      len(cpp) == 4 and worst <= 1e-5, (cpp, want))

# A policy that splits GPT-2 wrong is refused from C++ as from Lua (test_policy_checks.lua), at its line.
codes, out, err = world(4, "--tensor", "2", "--policy", os.path.join(HERE, "bad_policies/gpt2_no_heads.lua"))
check("a policy without the heads division is refused by the engine's applier, naming the policy's line",
      all(c != 0 for c in codes) and "gpt2_no_heads.lua:6: policy gpt2-no-heads splits GPT2 wrong" in err
      and "divide n_head by the tensor size" in err, (codes, err[-2000:]))

# What is Lua code, not data, is refused by name: a postprocess, a replaced method.
GPT2 = open(os.path.join(ROOT, "policies/gpt2.lua")).read()
with tempfile.TemporaryDirectory() as tmp:
    cases = (
        ("post.lua", GPT2.replace('ties = { { "lm_head.weight", "wte.weight" } },',
                                  'postprocess = function(model) P.tie(model, "lm_head.weight", "wte.weight") end,'),
         "its postprocess is a Lua function", "a postprocess"),
        ("method.lua", GPT2.replace("if cfg.sequence_parallel then", "if true then"),
         "modules.GPT2.methods.forward of GPT2 is a Lua function", "a replaced forward"),
    )
    for name, text, message, what in cases:
        check(f"{name}: the policy text was made", text != GPT2, name)
        path = os.path.join(tmp, name)
        with open(path, "w") as f:
            f.write(text)
        codes, out, err = world(4, "--tensor", "2", "--policy", path)
        check(f"a policy with {what} is refused from C++, naming the file and the function",
              all(c != 0 for c in codes) and message in err and path in err, (codes, err[-2000:]))

codes, out, err = world(4, "--tensor", "3")
check("a tensor size that does not divide the world is an error naming the sizes",
      all(c != 0 for c in codes) and "tensor=3" in err, (codes, err[-2000:]))

finish("gpt_cpp")
