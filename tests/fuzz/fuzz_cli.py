#!/usr/bin/env python3
"""Malformed partrain command lines, generated from a seed: every one must be a clear refusal
(status 1, at most a few short lines naming the flag or the file concerned) or, where the line
is valid after all, a documented success; never a crash, a hang or an essay.

Usage: fuzz_cli.py PATH/TO/partrain [--seed N] [--cases N]

Classes:
  number      a number flag of the command, plan or ckpt convert with a bad value: zero,
              negative, huge, past 64 bits, fractional, hexadecimal, words, empty
  missing     a flag that takes a value, last on the line
  unknown     a flag partrain does not have (misspelt, extra dashes, a short one)
  subcommand  plan, ckpt, report and parity with wrong, missing or extra arguments
  file        the script, --plan, --metrics, plan's script and --save, report's metrics file,
              ckpt's folders as a folder, a FIFO,
              a device, a missing path, an unreadable file, bytecode, binary junk, a symlink loop
  repl        flags after `repl`, good and bad, and words that do not belong there
  mixed       a random sequence of flags, values, subcommand words and paths
  plan-file   --plan with a real plan (partrain plan --save) damaged at random: bytes flipped,
              cut short, counts inflated; loaded up front, so refused at once (or accepted
              when the damage hit a number the run does not check)
  device      --device with a device this machine cannot have (cuda without CUDA), an unknown
              or malformed one (tpu, cuda:x, CPU, padded, random printable junk), alone or
              before a launch; cpu is accepted
"""
import os
import random
import re
import stat
import string
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

BIN = os.path.realpath(sys.argv[1])
SEED = common.seed_from_argv()
CASES = common.int_flag("--cases", 200)
ROOT = os.getuid() == 0  # root reads a file whatever its mode

NUMBER_FLAGS = {  # flag: (lowest, highest) valid
    "--threads": (1, 1024),
    "--timeout": (1, 604800),
    "--nproc-per-node": (1, 1024),
    "--nnodes": (1, 1024),
    "--master-port": (1, 65535),
    "--trace-steps": (1, 1000),
    "--node-timeout": (3, 604800),
}
LAUNCHER_ONLY = {"--nnodes", "--master-port", "--node-rank", "--master-addr", "--tee", "--node-timeout"}
BAD_NUMBERS = ["0", "-1", "-7", "1000000", "2147483648", "9223372036854775808", "99999999999999999999999999",
               "1.5", "1e3", "0x10", "abc", "", " 3", "3 ", "+-1", "--", "NaN", "inf", "٣", "1_000"]
VALUE_FLAGS = ["-e", "--execute", "--threads", "--timeout", "--nproc-per-node", "--nnodes", "--node-rank",
               "--master-addr", "--master-port", "--plan", "--plan-mode", "--trace", "--trace-steps", "--metrics",
               "--node-timeout"]
BAD_DEVICES = ["tpu", "mps", "cuda:x", "cuda:", "cuda:-1", "cuda:1.5", "cuda:0:1", "cuda0", "cpu:0", "CPU", "Cuda",
               "cpu ", " cpu", "cuda:99999", "", "cuda:00000", "gpu", "cpu\tcpu"]
UNKNOWN = ["--bogus", "--thread", "--threads-per-rank", "---threads", "-x", "-Z", "--nproc", "--world",
           "--Threads", "--tee=1", "--i", "--interactive=maybe", "--plan-modes", "--check-collective"]


def setup(tmp):
    """The paths the cases name: a script, a folder, a FIFO, and worse."""
    paths = {"dir": tmp, "missing": os.path.join(tmp, "no", "such.lua"), "devzero": "/dev/zero"}
    script = os.path.join(tmp, "ok.lua")
    with open(script, "w") as f:
        f.write("local x = 1\n")
    paths["script"] = script
    fifo = os.path.join(tmp, "fifo")
    os.mkfifo(fifo)
    paths["fifo"] = fifo
    unreadable = os.path.join(tmp, "unreadable.lua")
    with open(unreadable, "w") as f:
        f.write("local y = 2\n")
    os.chmod(unreadable, 0)
    paths["unreadable"] = unreadable
    junk = os.path.join(tmp, "junk.lua")
    with open(junk, "wb") as f:
        f.write(bytes(random.Random(SEED).randrange(256) for _ in range(512)))
    paths["junk"] = junk
    bytecode = os.path.join(tmp, "bytecode.lua")
    with open(bytecode, "wb") as f:  # a LuaJIT bytecode header and junk after it
        f.write(b"\x1bLJ\x02" + bytes(random.Random(SEED + 1).randrange(256) for _ in range(200)))
    paths["bytecode"] = bytecode
    loop = os.path.join(tmp, "loop.lua")
    os.symlink(loop, loop)
    paths["loop"] = loop
    os.mkdir(os.path.join(tmp, "ckptdir"))
    paths["ckptdir"] = os.path.join(tmp, "ckptdir")
    model = os.path.join(tmp, "model.lua")
    with open(model, "w") as f:
        f.write('local pt = require "partrain"\npt.parallelize(pt.models.mlp { sizes = { 8, 4, 2 } }, nil, pt.mesh {})\n')
    plan = os.path.join(tmp, "good.plan")
    made = common.run([BIN, "plan", "--world", "2", "--save", plan, model], timeout=60)
    if made.kind != "accepted":
        sys.exit(f"cannot make a plan to damage: {made!r}")
    with open(plan, "rb") as f:
        paths["plan_bytes"] = f.read()
    paths["cuda"] = common.run([BIN, "-e", "os.exit(require('partrain').cuda_available() and 0 or 1)"],
                               timeout=60).rc == 0
    return paths


class Case:
    def __init__(self, cls, args, names=None, accept=False, refuse=True, stdin_null=True, codes=(1,)):
        self.cls, self.args = cls, args
        self.codes = codes            # the exit statuses of a refusal (parity's usage errors: 2)
        self.names = names or []      # any one of these must appear in a refusal
        self.accept = accept          # exit 0 is a documented success here
        self.refuse = refuse          # a refusal is right here


def number_case(rng, paths):
    flag = rng.choice(list(NUMBER_FLAGS) + ["--node-rank", "plan --world", "plan --nproc-per-node",
                                            "ckpt --tensor", "ckpt --data"])
    value = rng.choice(BAD_NUMBERS)
    if flag.startswith("plan "):
        f = flag.split()[1]
        extra = ["--world", "4"] if f == "--nproc-per-node" else []
        return Case("number", ["plan", *extra, f, value, paths["script"]], [f])
    if flag.startswith("ckpt "):
        f = flag.split()[1]
        return Case("number", ["ckpt", "convert", paths["ckptdir"], os.path.join(paths["dir"], "out"), f, value], [f])
    launcher = ["--nproc-per-node", "1"] if flag in LAUNCHER_ONLY else []
    args = [*launcher, flag, value, "-e", ""]
    if rng.random() < 0.3:  # the same with --flag=value
        args = [*launcher, f"{flag}={value}", "-e", ""]
    # "0" for --node-rank is valid (the only node): a documented success.
    return Case("number", args, [flag], accept=flag == "--node-rank" and value == "0")


def missing_case(rng, paths):
    flag = rng.choice(VALUE_FLAGS)
    before = rng.choice([[], ["--threads", "1"], ["-i"], ["--tee"]])
    names = ["-e", "--execute"] if flag in ("-e", "--execute") else [flag]
    return Case("missing", [*before, flag], names)


def unknown_case(rng, paths):
    flag = rng.choice(UNKNOWN)
    where = rng.random()
    if where < 0.5:
        args = [flag, "-e", ""]
    elif where < 0.75:
        args = ["repl", flag]
    else:
        args = ["plan", flag, "--world", "2", paths["script"]]
    name = flag.split("=")[0]
    return Case("unknown", args, [name, name.lstrip("-")])


def subcommand_case(rng, paths):
    d, s, out = paths["ckptdir"], paths["script"], os.path.join(paths["dir"], "out")
    options = [
        (["plan"], ["--world"]),
        (["plan", "--world", "2"], ["give the script"]),
        (["plan", s], ["--world"]),
        (["plan", "--world", "6", "--nproc-per-node", "4", s], ["--nproc-per-node"]),
        (["plan", "--world", "2", "--save", paths["dir"], s], ["--save"]),
        (["plan", "--world", "2", "--save", os.path.join(paths["missing"], "p.bin"), s], ["--save"]),
        (["ckpt"], ["subcommand"]),
        (["ckpt", "bogus"], ["bogus"]),
        (["ckpt", "inspect"], ["dir"]),
        (["ckpt", "inspect", d, "extra"], ["extra"]),
        (["ckpt", "inspect", paths["missing"]], [paths["missing"]]),
        (["ckpt", "inspect", s], [s]),
        (["ckpt", "inspect", d], [d]),
        (["ckpt", "verify", paths["fifo"]], [paths["fifo"]]),
        (["ckpt", "inspect", d, "--tag", rng.choice(["../x", ".hidden", "-x", "a/b", "x" * 200, ""])], ["--tag", d]),
        (["ckpt", "convert", d], ["dst"]),
        (["ckpt", "convert", d, s, "--tensor", "2"], [s]),
        (["ckpt", "convert", d, os.path.join(paths["missing"], "x")], ["destination"]),
        (["ckpt", "export", d], ["out"]),
        (["ckpt", "export", d, paths["dir"]], ["output"]),
        (["ckpt", "export", d, os.path.join(paths["missing"], "x.safetensors")], ["output"]),
        (["ckpt", "verify", d, "--tensor", "2"], ["--tensor"]),
        (["--threads", "2", "plan", "--world", "2", s], ["plan takes no partrain flags"]),
        (["-i", "ckpt", "inspect", d], ["ckpt takes no partrain flags"]),
        (["report"], ["runs"]),
        (["report", paths["missing"]], [paths["missing"]]),
        (["report", d], [d]),
        (["report", s, "--trace", paths["fifo"]], [s, paths["fifo"]]),
        (["-i", "report", d], ["report takes no partrain flags"]),
    ]
    parity = [  # parity's usage errors end with status 2 (docs/observability.md)
        (["parity"], ["two runs"]),
        (["parity", s], ["two runs"]),
        (["parity", paths["missing"] + ".jsonl", d], [paths["missing"]]),
        (["parity", d, d], [d]),
        (["parity", d, d, "--tol", rng.choice(["-1", "abc", "nan"])], ["--tol"]),
        (["parity", d, d, "--steps", rng.choice(["0", "-3", "x"])], ["--steps"]),
    ]
    if rng.random() < len(parity) / (len(parity) + len(options)):
        args, names = rng.choice(parity)
        return Case("subcommand", args, names, codes=(2,))
    args, names = rng.choice(options)
    return Case("subcommand", args, names)


def file_case(rng, paths):
    kind = rng.choice(["dir", "missing", "devzero", "fifo", "unreadable", "junk", "bytecode", "loop"])
    path = paths[kind]
    how = rng.choice(["script", "launcher", "plan-file", "plan-script", "args-after", "metrics", "report"])
    if how == "script":
        args = [path]
    elif how == "launcher":
        args = ["--nproc-per-node", "2", "--timeout", "5", "--threads", "1", path]
    elif how == "plan-file":
        args = ["--plan", path, "-e", ""]
    elif how == "plan-script":
        args = ["plan", "--world", "2", path]
    elif how == "metrics":  # a regular file is appended to (nothing, for -e ''): the rest refused
        args = ["--metrics", path, "-e", ""]
    elif how == "report":  # none of them is a metrics file
        args = ["report", path, "-o", os.path.join(paths["dir"], "r.html")]
    else:
        args = [path, "--help", "-e", "x"]
    # An unreadable file is read anyway by root: as a script its harmless code runs (success),
    # as it would for a user who can read it; as a plan it is not one, and planning it finds
    # nothing to plan. Junk is Lua source with syntax errors: refused with its file:line. As
    # --metrics every one of them is refused: none is a file of JSON records, which a run would
    # append to and a resume rewrite.
    accept = kind == "unreadable" and ROOT and how in ("script", "launcher", "args-after")
    return Case("file", args, [path, os.path.basename(path)], accept=accept, refuse=not accept)


def repl_case(rng, paths):
    good = [["--threads", "1"], ["--timeout", "5"], ["-e", "x = 1"], ["--check-collectives"]]
    bad = [(["--threads", "0"], "--threads"), (["--bogus"], "--bogus"), (["x.lua"], "x.lua"),
           (["--timeout", "-5"], "--timeout"), (["repl"], "repl"), (["--plan-mode", "no"], "--plan-mode"),
           (["--tee"], "--nproc-per-node"), (["-e"], "-e"), (["--nproc-per-node", "2000"], "--nproc-per-node")]
    if rng.random() < 0.3:  # a good one: the REPL reads end of input at once and ends (status 0)
        flags = rng.choice(good)
        if rng.random() < 0.3:
            flags = ["--nproc-per-node", "2", "--threads", "1", "--timeout", "10"]
        return Case("repl", ["repl", *flags], accept=True, refuse=False)
    flags, name = rng.choice(bad)
    before = rng.choice([[], ["-e", "y = 2"]])
    return Case("repl", [*before, "repl", *rng.choice(good[:2]), *flags], [name])


def mixed_case(rng, paths):
    pool = ["-e", "", "print(1)", "--threads", "0", "1", "4096", "--timeout", "-1", "--nproc-per-node",
            "--tee", "--nnodes", "2", "--node-rank", "--master-port", "99999", "--master-addr", "-i", "repl",
            "plan", "ckpt", "--plan", "--plan-mode", "moo", "--check-collectives", "--", "-", "--help=1",
            paths["dir"], paths["fifo"], paths["missing"], "x" * 300, "--world", "\x01\x02", "ключ"]
    args = [rng.choice(pool) for _ in range(rng.randint(1, 5))]
    # Lines that run something harmless (-e print(1) alone, say) may succeed; what matters is
    # that none crashes, hangs or writes an essay. But no line may start ranks that wait: a
    # launcher line gets a short --timeout and one thread.
    if "--nproc-per-node" in args:
        args = ["--timeout", "5", *args]
    return Case("mixed", args, accept=True, refuse=True)


def plan_file_case(rng, paths):
    data = bytearray(paths["plan_bytes"])
    how = rng.choice(["flip", "cut", "count", "grow"])
    if how == "flip":
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif how == "cut":
        data = data[: rng.randrange(len(data))]
    elif how == "count":  # a length field made huge: 8 bytes of 0xff, or a large count, somewhere
        at = rng.randrange(max(1, len(data) - 8))
        data[at:at + 8] = rng.choice([b"\xff" * 8, (1 << 40).to_bytes(8, "little"), (10 ** 7).to_bytes(8, "little")])
    else:
        data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    path = os.path.join(paths["dir"], f"damaged.{rng.randrange(10 ** 9)}.plan")
    with open(path, "wb") as f:
        f.write(data)
    return Case("plan-file", ["--plan", path, "-e", ""], [path], accept=True)


def device_case(rng, paths):
    how = rng.random()
    if how < 0.15:
        value = "cpu"
    elif how < 0.3:
        value = rng.choice(["cuda", "cuda:0", "cuda:1"])
    elif how < 0.7:
        value = rng.choice(BAD_DEVICES)
    else:
        value = "".join(rng.choice(string.printable[:94]) for _ in range(rng.randint(1, 12)))
    flag = ["--device", value] if rng.random() < 0.7 else [f"--device={value}"]
    launch = ["--nproc-per-node", "2", "--threads", "1", "--timeout", "10"] if rng.random() < 0.3 else []
    # cpu runs; a cuda device runs where CUDA is (or is refused for a missing index); all else is refused.
    cuda = value in ("cuda", "cuda:0", "cuda:1") and paths["cuda"]
    return Case("device", [*launch, *flag, "-e", ""], ["--device", value], accept=value == "cpu" or cuda,
                refuse=value != "cpu")


GENERATORS = [number_case, missing_case, unknown_case, subcommand_case, file_case, repl_case, mixed_case,
              plan_file_case, device_case]
WEIGHTS = [6, 2, 2, 4, 4, 3, 3, 3, 2]


def judge(case, outcome, tally):
    text = outcome.err + outcome.out
    lines = [l for l in outcome.err.strip().splitlines() if l.strip()]
    if outcome.kind == "crash" and outcome.rc in case.codes:
        outcome.kind = "refused"
    if outcome.kind in ("crash", "hang"):
        tally.add(case.cls, outcome.kind, False, f"{case.args!r}: {outcome!r}")
        return
    if outcome.kind == "accepted":
        tally.add(case.cls, "accepted", case.accept, f"{case.args!r} was accepted: {text[-500:]!r}")
        return
    # A refusal: short, plainly partrain's, naming what is wrong (a line may quote a long value).
    widest = 300 + max((len(a) for a in case.args), default=0)
    short = len(lines) <= 3 and all(len(l) <= widest for l in lines)
    ok = case.refuse and short and lines and lines[0].startswith("partrain: ")
    if ok and case.names:
        ok = any(n and n in text for n in case.names)
    if ok:
        ok = common.INTERNAL_LOCATION.search(text) is None
    if ok and case.cls == "file" and "junk" in " ".join(case.args):
        ok = re.search(r"junk\.lua:\d+:", text) is not None or "junk.lua" in text
    tally.add(case.cls, "refused" if ok else "unclear", ok,
              f"{case.args!r}: status {outcome.rc}, {len(lines)} lines: {outcome.err[-600:]!r}")


def main():
    rng = random.Random(SEED)
    tally = common.Tally(f"partrain command lines (seed {SEED})")
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        paths = setup(tmp)
        # Every class at least 3 times, whatever the seed; the rest drawn by weight.
        cases = [g(rng, paths) for g in GENERATORS for _ in range(3)]
        cases += [rng.choices(GENERATORS, WEIGHTS)[0](rng, paths) for _ in range(CASES - len(cases))]

        def run(case):
            return common.run([BIN, *case.args], timeout=30, cwd=tmp, env={"HOME": tmp})

        with ThreadPoolExecutor(max_workers=4) as pool:
            outcomes = list(pool.map(run, cases))
        for case, outcome in zip(cases, outcomes):
            judge(case, outcome, tally)
        print(f"mean {sum(o.seconds for o in outcomes) / len(outcomes):.2f} s a command line")
    print(f"{len(cases)} command lines in {time.monotonic() - start:.1f} s; the slowest:")
    for case, outcome in sorted(zip(cases, outcomes), key=lambda co: -co[1].seconds)[:3]:
        print(f"  {outcome.seconds:.1f} s  {case.cls}: {' '.join(case.args)[:150]}")
    tally.finish()


if __name__ == "__main__":
    main()
