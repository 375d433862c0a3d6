"""The engine as an installed C++ library: `cmake --install` of the build into a fresh prefix holds
the headers, the static libraries and the CMake package (and the partrain command, which runs from
there with the installed Lua library); examples/cpp, configured and built out of tree with
find_package(partrain) and nothing but CMAKE_PREFIX_PATH naming the prefix (LibTorch found again
where the build found it), runs serially without LD_LIBRARY_PATH, on the installed Lua library
(PARTRAIN_HOME), and prints the in-tree gpt_cpp's losses exactly; at tensor 2 x data 2 with ZeRO-1
(four processes started as torchrun starts them) it gives the losses of the same training written in
Lua (tests/examples/gpt_lua.lua, run by the installed partrain) within 1e-6, loss for loss.

Usage: test_installed_package.py CMAKE BUILD_DIR GPT_CPP WORK_DIR GENERATOR CXX [LAUNCHER]
(WORK_DIR is emptied first; it holds the prefix and the out-of-tree build.)
"""
import glob
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from checks import check, finish, step_losses, torchrun, worst_difference  # noqa: E402

CMAKE, BUILD, GPT_CPP, WORK, GENERATOR, CXX = sys.argv[1:7]
LAUNCHER = sys.argv[7] if len(sys.argv) > 7 else ""
SOURCE = os.getcwd()
PREFIX = os.path.join(WORK, "prefix")
OUT = os.path.join(WORK, "gpt_cpp-build")
STEPS = "2"

# Nothing from the caller's environment helps: no search path for CMake, no library path, no
# torchrun variables (a serial run).
env = {k: v for k, v in os.environ.items()
       if k not in ("CMAKE_PREFIX_PATH", "Torch_DIR", "LD_LIBRARY_PATH", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                    "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
env["OMP_NUM_THREADS"] = "1"


def run(what, args, timeout=600, **extra_env):
    start = time.time()
    p = subprocess.run(args, env=dict(env, **extra_env), capture_output=True, text=True, timeout=timeout)
    print(f"     {what}: {time.time() - start:.1f} s", flush=True)
    return p


def losses(text):
    return [line for line in text.splitlines() if line.startswith("step ")]


shutil.rmtree(WORK, ignore_errors=True)
os.makedirs(WORK)

p = run("install", [CMAKE, "--install", BUILD, "--prefix", PREFIX])
check("cmake --install puts the build into a fresh prefix", p.returncode == 0, p.stdout + p.stderr)


def installed(pattern):
    return glob.glob(os.path.join(PREFIX, pattern), recursive=True)


for pattern, what in (("include/partrain/engine/models/gpt2.hpp", "the engine's headers, as engine/..."),
                      ("include/partrain/engine/parallel/parallel_model.hpp", "the engine's headers, as engine/..."),
                      ("include/partrain/bindings/host.hpp", "the Lua host's headers"),
                      ("**/libpartrain_engine.a", "the engine library"), ("**/libpartrain_lua.a", "the Lua library"),
                      ("**/cmake/partrain/partrainConfig.cmake", "the package's configuration"),
                      ("**/cmake/partrain/partrainConfigVersion.cmake", "the package's version file"),
                      ("**/cmake/partrain/partrainTargets.cmake", "the exported targets"),
                      ("share/partrain/lua/partrain/init.lua", "the Lua half of the library"),
                      ("share/partrain/policies/gpt2.lua", "the policies")):
    check(f"installed: {what} ({pattern})", len(installed(pattern)) == 1, installed("**"))
exported = "".join(open(f).read() for f in installed("**/cmake/partrain/partrainTargets*.cmake"))
check("bindings/lua.hpp stays inside the library", not installed("include/partrain/bindings/lua.hpp"))
check("the exported targets are partrain::engine and partrain::lua",
      "add_library(partrain::engine STATIC IMPORTED)" in exported and "add_library(partrain::lua STATIC IMPORTED)" in exported,
      exported[:3000])
check("the exported targets name neither the precompiled header nor the build folder",
      "partrain_pch" not in exported and "cmake_pch" not in exported and os.path.realpath(BUILD) not in exported, exported[:3000])

# The installed command finds LibTorch through its RPATH and the installed Lua library beside it.
exe = os.path.join(PREFIX, "bin", "partrain")
p = run("installed partrain", [exe, "--threads", "1", "-e", 'print(package.path); require "policies.gpt2"'])
check("the installed partrain runs without LD_LIBRARY_PATH, on the installed Lua library and policies",
      p.returncode == 0 and os.path.join(PREFIX, "bin", "..", "share", "partrain", "lua") in p.stdout,
      p.stdout + p.stderr)

configure = [CMAKE, "-S", os.path.join(SOURCE, "examples", "cpp"), "-B", OUT, "-G", GENERATOR,
             "-DCMAKE_BUILD_TYPE=Release", f"-DCMAKE_CXX_COMPILER={CXX}", f"-DCMAKE_PREFIX_PATH={PREFIX}"]
if LAUNCHER:
    configure.append(f"-DCMAKE_CXX_COMPILER_LAUNCHER={LAUNCHER}")
p = run("configure examples/cpp", configure)
check("examples/cpp configures out of tree with find_package(partrain), CMAKE_PREFIX_PATH the prefix alone",
      p.returncode == 0 and "-- gpt_cpp: partrain " in p.stdout, p.stdout[-3000:] + p.stderr[-3000:])
check("the package names its installed Lua library and policies (PARTRAIN_LUA_DIR, PARTRAIN_POLICY_DIR)",
      f"its Lua library in {PREFIX}/share/partrain/lua, its policies in {PREFIX}/share/partrain/policies" in p.stdout,
      p.stdout[-3000:])

p = run("build gpt_cpp", [CMAKE, "--build", OUT])
built = os.path.join(OUT, "gpt_cpp")
check("gpt_cpp builds against partrain::engine and partrain::lua", p.returncode == 0 and os.path.exists(built),
      p.stdout[-3000:] + p.stderr[-3000:])

want = run("in-tree gpt_cpp", [GPT_CPP, "--steps", STEPS], timeout=300)
# The program finds the installed Lua library and policies as docs/cpp.md says: through PARTRAIN_HOME.
home = os.path.join(PREFIX, "share", "partrain")
got = run("out-of-tree gpt_cpp", [built, "--steps", STEPS], timeout=300, PARTRAIN_HOME=home) if os.path.exists(built) else None
check(f"the in-tree gpt_cpp trains {STEPS} steps", want.returncode == 0 and len(losses(want.stdout)) == int(STEPS),
      want.stdout + want.stderr)
check(f"the out-of-tree gpt_cpp runs without LD_LIBRARY_PATH and prints the in-tree one's {STEPS} losses",
      got is not None and got.returncode == 0 and losses(got.stdout) == losses(want.stdout) and losses(want.stdout),
      (losses(want.stdout), got and (got.stdout + got.stderr)))

# The proof the issue asks for: the installed package's gpt_cpp, tensor 2 x data 2 with ZeRO-1 by
# policies/gpt2.lua, against the Lua run of the same training on the installed partrain.
if os.path.exists(built):
    start = time.time()
    codes, out, err = torchrun([built, "--tensor", "2", "--zero", "1", "--steps", "4"], 4,
                               env=dict(env, PARTRAIN_HOME=home))
    print(f"     out-of-tree gpt_cpp, 4 ranks: {time.time() - start:.1f} s", flush=True)
    cpp = step_losses(out)
    lua = run("the Lua run, 4 ranks", [os.path.join(PREFIX, "bin", "partrain"), "--nproc-per-node", "4", "--threads",
                                       "1", os.path.join(SOURCE, "tests", "examples", "gpt_lua.lua"), "4"], timeout=300)
    script = step_losses(lua.stdout)
    worst = worst_difference(cpp, script)
    check(f"the installed package's gpt_cpp at tensor 2 x data 2 with ZeRO-1 gives the Lua run's 4 losses within "
          f"1e-6 (worst {worst:.2e})",
          codes == [0] * 4 and lua.returncode == 0 and len(cpp) == 4 and len(script) == 4 and worst <= 1e-6,
          (codes, cpp, script, err[-2000:], lua.stdout[-1000:], lua.stderr[-2000:]))

finish("installed package")
