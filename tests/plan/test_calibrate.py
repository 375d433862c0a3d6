"""partrain/calibrate.lua writes a device table the layout search can load, and refuses a bad --out.

At 2 ranks and at 1 (a short --seconds: the figures' values are the machine's, not checked here),
the file it writes loads with dofile, holds exactly the device description's keys, and every
figure is positive and finite: flops for float32 and float64 at least, an efficiency in (0, 1],
the memory MemTotal / ranks, inter equal to intra, overlap 0, ranks and threads as launched. No
FILE.tmp is left behind. An empty --out, a folder and a folder that does not exist are refused
before anything is measured, naming the option.

Usage: test_calibrate.py PARTRAIN   (from the source folder)
"""
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from checks import check, finish  # noqa: E402

BIN = sys.argv[1]
SCRIPT = "bindings/lua/partrain/calibrate.lua"

# Prints "ok" or what is wrong with the table in FILE (given as arg[1]), for a run of RANKS ranks.
CHECK = r"""
local path, ranks, mem = arg[1], tonumber(arg[2]), tonumber(arg[3])
local d = dofile(path)
local problems = {}
local function bad(s) problems[#problems + 1] = s end
local function positive(name, x)
  if type(x) ~= "number" or not (x > 0) or x == math.huge then bad(name .. " = " .. tostring(x)) end
end
local want = { name = 1, flops = 1, efficiency = 1, memory = 1, intra = 1, inter = 1, overlap = 1, ranks = 1,
               threads = 1, source = 1, cores = 1, op_seconds = 1 }
for k in pairs(d) do if not want[k] then bad("unexpected key " .. k) end end
for k in pairs(want) do if d[k] == nil then bad("missing key " .. k) end end
positive("cores", d.cores)
positive("op_seconds", d.op_seconds)
if d.name ~= "calibrated" then bad("name " .. tostring(d.name)) end
if d.source ~= "partrain plan --calibrate" then bad("source " .. tostring(d.source)) end
positive("flops.float32", d.flops.float32)
positive("flops.float64", d.flops.float64)
for k, v in pairs(d.flops) do positive("flops." .. k, v) end
positive("efficiency", d.efficiency)
if d.efficiency > 1 then bad("efficiency above 1: " .. d.efficiency) end
positive("memory", d.memory)
if d.memory ~= math.floor(mem / ranks) then bad(("memory %d, expected %d"):format(d.memory, math.floor(mem / ranks))) end
for _, link in ipairs { "intra", "inter" } do
  positive(link .. ".bandwidth", d[link].bandwidth)
  positive(link .. ".latency", d[link].latency)
end
if d.inter.bandwidth ~= d.intra.bandwidth or d.inter.latency ~= d.intra.latency then bad("inter differs from intra") end
if d.overlap ~= 0 then bad("overlap " .. tostring(d.overlap)) end
if d.ranks ~= ranks then bad("ranks " .. tostring(d.ranks)) end
if d.threads ~= 1 then bad("threads " .. tostring(d.threads)) end
print(#problems == 0 and "ok" or table.concat(problems, "; "))
"""


def mem_total():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def calibrate(ranks, out, *extra):
    return subprocess.run([BIN, "--nproc-per-node", str(ranks), "--threads", "1", "--timeout", "120", SCRIPT,
                           "--out", out, *extra], capture_output=True, text=True, timeout=180)


with tempfile.TemporaryDirectory() as d:
    check_lua = os.path.join(d, "check.lua")
    with open(check_lua, "w") as f:
        f.write(CHECK)
    for ranks in (2, 1):
        out = os.path.join(d, f"dev{ranks}.lua")
        r = calibrate(ranks, out, "--seconds", "3")
        check(f"calibrate at {ranks} rank(s) writes its table", r.returncode == 0 and os.path.isfile(out),
              r.stdout[-2000:] + r.stderr[-2000:])
        check(f"calibrate at {ranks} rank(s) prints a summary", "wrote " + out in r.stdout, r.stdout[-2000:])
        check(f"calibrate at {ranks} rank(s) leaves no .tmp", not os.path.exists(out + ".tmp"))
        if os.path.isfile(out):
            r = subprocess.run([BIN, "--threads", "1", check_lua, out, str(ranks), str(mem_total())],
                               capture_output=True, text=True, timeout=60)
            check(f"the {ranks}-rank table loads, its keys exact and every figure positive and finite",
                  r.returncode == 0 and r.stdout.strip().endswith("ok"),
                  r.stdout[-2000:] + r.stderr[-2000:] + "\n" + open(out).read())

    for what, out, says in [("an empty --out", "", "--out is required"),
                            ("a folder", d, "is a folder"),
                            ("a folder given with a slash", d + "/", "is a folder"),
                            ("a file in a folder that does not exist", os.path.join(d, "no", "dev.lua"),
                             "cannot write --out")]:
        r = calibrate(2, out)
        check(f"calibrate refuses {what}", r.returncode != 0 and says in r.stderr, r.stderr[-2000:])

finish("calibrate")
