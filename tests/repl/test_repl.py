#!/usr/bin/env python3
"""The SPMD REPL driven through a real pseudo-terminal, as a user at a keyboard drives it.

Usage: test_repl.py PATH/TO/partrain RANKS

Starts `partrain repl --nproc-per-node RANKS` (and `-i script.lua`, and a script that calls
pt.breakpoint()) on a pty, types chunks, and checks what rank 0 prints: outputs grouped by rank,
=expr, multi-line chunks, per-rank errors with tracebacks, the helpers, Ctrl-C interrupting an
endless loop on every rank without ending the session, Ctrl-C landing inside a collective
(ranks left at different points of it) bringing every rank back to a prompt where collectives
work again, a prompt left idle longer than --timeout, tab completion, exit(), and os.exit(0) on one
rank ending the session everywhere. Under
timeout(1), a background process group that may not read the terminal, pt.breakpoint() and -i
say so instead of hanging.
"""
import os
import pty
import re
import select
import shutil
import signal
import sys
import tempfile
import time

PARTRAIN, RANKS = os.path.realpath(sys.argv[1]), int(sys.argv[2])
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from checks import check, finish  # noqa: E402


class Session:
    def __init__(self, *args, home, argv=None):
        """`partrain --nproc-per-node RANKS args...` on a new pty, or `argv` as it is."""
        env = dict(os.environ, HOME=home, TERM="dumb", OMP_NUM_THREADS="1")
        argv = argv or [PARTRAIN, "--nproc-per-node", str(RANKS), *args]
        self.pid, self.fd = pty.fork()
        if self.pid == 0:
            os.chdir(ROOT)
            os.execve(argv[0] if "/" in argv[0] else shutil.which(argv[0]), argv, env)
        self.buffer = ""

    def read_until(self, pattern, timeout=60):
        """Reads until `pattern` (a regex) appears; returns the text before and including it."""
        deadline = time.time() + timeout
        regex = re.compile(pattern, re.S)
        while True:
            m = regex.search(self.buffer)
            if m:
                text, self.buffer = self.buffer[: m.end()], self.buffer[m.end():]
                return text
            left = deadline - time.time()
            if left <= 0:
                raise TimeoutError(f"waited {timeout}s for {pattern!r}; got:\n{self.buffer}")
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                try:
                    data = os.read(self.fd, 65536).decode(errors="replace")
                except OSError:
                    data = ""
                if not data:
                    raise EOFError(f"the session ended while waiting for {pattern!r}; got:\n{self.buffer}")
                self.buffer += data.replace("\r\n", "\n")

    def send(self, text):
        os.write(self.fd, text.encode())

    def chunk(self, line):
        """Types a line and returns what came back before the next prompt."""
        self.send(line + "\n")
        out = self.read_until(r"\n> $|^> $")
        # Drop the echoed input and the prompt.
        out = out[: out.rfind("> ")]
        return out.split("\n", line.count("\n") + 1)[-1] if out.startswith(line.split("\n")[0]) else out

    def wait(self, timeout=60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                try:
                    while data := os.read(self.fd, 65536):
                        self.buffer += data.decode(errors="replace").replace("\r\n", "\n")
                except OSError:
                    pass
                return os.waitstatus_to_exitcode(status)
            try:
                if select.select([self.fd], [], [], 0.2)[0]:
                    self.buffer += os.read(self.fd, 65536).decode(errors="replace").replace("\r\n", "\n")
            except OSError:
                pass
        os.kill(self.pid, signal.SIGKILL)
        raise TimeoutError("the session did not end")


every = f"[ranks 0-{RANKS - 1}]" if RANKS > 2 else "[ranks 0,1]"


def ranks_shown(text):
    """The ranks whose output `text` shows: every [rank N] and [ranks a,b-c] tag, expanded."""
    shown = set()
    for tag in re.findall(r"\[ranks? ([0-9,-]+)\]", text):
        for part in tag.split(","):
            lo, _, hi = part.partition("-")
            shown.update(range(int(lo), int(hi or lo) + 1))
    return shown


R_ALL = f"0-{RANKS - 1}" if RANKS > 2 else "0,1"
last = RANKS - 1

with tempfile.TemporaryDirectory() as home:
    # ---- partrain repl --nproc-per-node N: launcher flags after the subcommand ------------------
    s = Session(home=home, argv=[PARTRAIN, "repl", "--nproc-per-node", str(RANKS)])
    banner = s.read_until(r"\n> $")
    check("the REPL opens on every rank (launcher flags after repl)", f"on {RANKS} rank(s)" in banner, banner)

    out = s.chunk("print(pt.dist.rank())")
    want = "".join(f"[rank {r}] {r}\n" for r in range(RANKS))
    check("a chunk runs on every rank; outputs come back per rank", out == want, repr(out))

    out = s.chunk("=1 + 1")
    check("=expr prints the value, grouped when every rank agrees", out == f"{every} 2\n", repr(out))

    out = s.chunk("=1, nil, 3")
    check("=a, nil, b shows every value, the nil and those after it", out == f"{every} 1\tnil\t3\n", repr(out))

    for bad, shown in (("0.5", "0.5"), ("0/0", "nan"), ("1/0", "inf")):
        out = s.chunk(f"on({bad}, print)")
        check(f"on({bad}) is refused, naming the rank, not run nowhere",
              f"on: rank {shown} is not one of the ranks 0..{RANKS - 1}" in out, repr(out))

    out = s.chunk("=pt.dist.rank() % 2")
    want = "[ranks 0,2] 0\n[ranks 1,3] 1\n" if RANKS == 4 else "[rank 0] 0\n[rank 1] 1\n"
    check("identical outputs are grouped by the ranks that printed them", out == want, repr(out))

    s.send("for i = 1, 2 do\n")
    more = s.read_until(r">> $")
    s.send("  print('line', i) end\n")
    out = s.read_until(r"\n> $")
    check("a multi-line chunk continues with >> and runs whole",
          "line\t1\nline\t2" in out and every in out, more + out)

    out = s.chunk("x = 40 + pt.dist.rank()")
    out = s.chunk("=x")
    check("globals persist between chunks", f"[rank {last}] {40 + last}" in out, repr(out))

    out = s.chunk("if pt.dist.rank() == 1 then error('boom on one') end")
    check("an error shows on the rank that raised it, without frames of partrain's own",
          re.search(r"\[rank 1\][ \n]stdin:1: boom on one", out) is not None
          and "[rank 0]" not in out and "partrain/" not in out, repr(out))
    out = s.chunk("function deep() error('boom deep') end; function call() deep(); return 1 end")
    out = s.chunk("if pt.dist.rank() == 1 then call() end")
    check("an error through the user's own functions shows their frames",
          re.search(r"\[rank 1\]\nstdin:1: boom deep\nstack traceback:\n.*in function 'deep'", out, re.S) is not None,
          repr(out))

    out = s.chunk("model = pt.parallelize(pt.models.gpt2 { vocab = 64, seq = 8, dim = 16, heads = 4, layers = 1 }, nil, "
                  f"pt.mesh {{ tensor = {2 if RANKS == 2 else 2} }})")
    out = s.chunk("shards('attn.c_attn')")
    check("shards() lists logical and local shapes and who holds which slice",
          "h.0.attn.c_attn.weight" in out and "[48, 16]" in out and "[24, 16]" in out and every in out
          and "ranks 0" in out, out)
    out = s.chunk("shards('[')")
    check("shards() with a malformed pattern says so, not from inside the helper",
          "shards: '[' is not a valid Lua pattern" in out and "repl.lua:" not in out.split("stack traceback")[0], out)
    out = s.chunk("mesh(1)")
    check("mesh() given a number says what it takes", "mesh: the argument must be a mesh" in out, out)
    out = s.chunk("mem('x')")
    check("mem() given a string says what it takes", "mem: the model must be a module" in out, out)
    out = s.chunk("mesh()")
    check("mesh() shows each rank's coordinates", "rank 0: tensor 0" in out and f"rank {last}: tensor 1" in out, out)
    out = s.chunk("mesh(pt.mesh { expert = 2 })")
    check("mesh() shows the expert size, this rank's expert place and groups where experts are split",
          "expert=2" in out and f"rank {last}: tensor 0, data {last}, pipeline 0, expert 1 |" in out
          and "expert group" in out and "expert_data group" in out, out)
    out = s.chunk("opt = pt.optim.adamw(model); pt.loss_fn(model)(model(pt.randint(0, 64, {2, 8})), "
                  "pt.randint(0, 64, {2, 8})):backward(); opt:step()")
    out = s.chunk("mem()")
    check("mem() reports parameters, gradients, optimizer state, master weights, the allocator's bytes and resident memory",
          re.search(r"params [0-9.]+ MB \| grads [0-9.]+ MB \| optimizer [0-9.]+ MB \| masters 0.00 MB \| "
                    r"tensors [0-9.]+ MB \(peak [0-9.]+ MB\) \| resident", out) is not None
          and "optimizer 0.00 MB" not in out and "tensors 0.00 MB" not in out and "ZeRO" not in out, out)
    # ZeRO-2 over every rank: mem() names the stage and group, the shard's float32 masters and the
    # gradients' scratch.
    s.chunk("zm = pt.models.gpt2 { vocab = 64, seq = 8, dim = 64, heads = 4, layers = 1 }")
    s.chunk("zm = pt.parallelize(zm, nil, pt.mesh { zero = 0 }, { zero = { stage = 2 } })")
    s.chunk("zo = pt.optim.adamw(zm); zx = pt.randint(0, 64, {2, 9})")
    s.chunk("pt.loss_fn(zm)(zm(zx:narrow(1, 0, 8)), zx:narrow(1, 1, 8)):backward()")
    s.chunk("zo:step()")
    out = s.chunk("mem(zm)")
    # Ranks with the same line share one (its tag lists them): count the ranks each line covers.
    zero_lines = [l for l in out.splitlines() if f"ZeRO-2 over {RANKS} ranks" in l
                  and re.search(r"grads [0-9.]+ MB \(scratch [0-9.]+ MB\)", l)]
    check("mem() under ZeRO-2 names the stage and the zero group, counts the master shard and the gradient scratch",
          ranks_shown("\n".join(zero_lines)) == set(range(RANKS)) and re.search(r"masters 0.00 MB", out) is None, out)
    out = s.chunk("moe = pt.parallelize(pt.models.llama { vocab = 64, seq = 16, dim = 16, heads = 4, layers = 1, "
                  "hidden = 24, experts = 4 }, 'policies.llama', pt.mesh { expert = 2 }); shards('experts.w1', moe)")
    holders = f"ranks {','.join(str(r) for r in range(0, RANKS, 2))} 0:2"
    check("shards() shows which ranks hold which experts (the expert_data ranks alike)",
          "layers.0.block_sparse_moe.experts.w1" in out and "[4, 24, 16]" in out and "[2, 24, 16]" in out
          and holders in out, out)
    out = s.chunk(f"=on({last}, function() return 'only here' end)")
    check("on(rank, fn) runs on one rank only",
          f"[rank {last}] \"only here\"" in out and out.count("only here") == 1, repr(out))

    # A pipeline over every rank: each shows its own stage; on() reaches a stage's own parameter.
    # (Lines kept short: the echo of a line wider than the terminal comes back scrolled.)
    s.chunk(f"cfg = {{ vocab = 64, seq = 8, dim = 16, heads = 4, layers = {RANKS} }}")
    s.chunk(f"pm = pt.mesh {{ pipeline = {RANKS} }}")
    out = s.chunk("pmodel = pt.parallelize(pt.models.gpt2(cfg), 'policies.gpt2', pm)")
    check("a pipeline over every rank is made at the prompt", out == "", out)
    out = s.chunk("shards('ln_f')")
    check("shards() on a pipeline shows each rank's stage, its blocks and who holds a stage's whole parameter",
          f"pipeline rank 0 of {RANKS} (1f1b, {RANKS} micro-batches), stage 0: h.0 + wte, wpe" in out
          and f"stage {last}: h.{last} + ln_f, lm_head" in out
          and f"ln_f.weight" in out and f"ranks {last} (whole)" in out, out)
    out = s.chunk("mesh()")
    check("mesh() shows the pipeline group and this rank's stage",
          f"pipeline group {R_ALL}" in out and "| pipeline rank 1 of" in out and "stage 1: h.1" in out, out)
    out = s.chunk(f"=on({last}, function() return pmodel.ln_f.weight:sum():item() end)")
    check("on(rank, fn) reaches a parameter only the last stage holds", out == f"[rank {last}] 16\n", repr(out))
    out = s.chunk("=on(0, function() return pmodel.wte.weight.shape[1] end)")
    check("on(rank, fn) reaches a parameter only the first stage holds", out == "[rank 0] 64\n", repr(out))
    s.chunk("pmodel = nil; collectgarbage()")

    # Context 2 (with data 2 on 4 ranks): shards() says which positions of a sequence of the
    # model's 16 each context rank holds, chunks r and 3-r of 4.
    s.chunk("cfg.layers, cfg.seq = 1, 16; cm = pt.mesh { context = 2 }")
    out = s.chunk("cmodel = pt.parallelize(pt.models.gpt2(cfg), 'policies.gpt2', cm)")
    check("a model split over context 2 is made at the prompt", out == "", out)
    out = s.chunk("shards('ln_f', cmodel)")
    zero, one = ("[ranks 0,2]", "[ranks 1,3]") if RANKS == 4 else ("[rank 0]", "[rank 1]")
    check("shards() under context parallelism shows the positions each context rank holds",
          re.search(re.escape(zero) + r"\n(.*\n)*context rank 0 of 2: positions 0-3 and 12-15 of 16 \(chunks 0 and 3 of 4", out)
          is not None and re.search(re.escape(one) + r"\n(.*\n)*context rank 1 of 2: positions 4-7 and 8-11 of 16", out)
          is not None and "ln_f.weight" in out, out)
    s.chunk("cmodel = nil; collectgarbage()")

    s.send("while true do end\n")
    time.sleep(1.5)
    s.send("\x03")  # Ctrl-C
    out = s.read_until(r"\n> $", timeout=30)
    check("Ctrl-C interrupts an endless loop on every rank and keeps the session",
          "interrupted" in out and every in out, repr(out))
    out = s.chunk("=x")
    check("the session goes on after Ctrl-C", f"[rank {last}] {40 + last}" in out, repr(out))

    # Ctrl-C inside a loop of collectives: some ranks stop between two all-reduces, others inside
    # the next one, waiting for a peer that will not come. Every rank must come back to the
    # prompt (not after --timeout, not dead), and the world group must work again.
    come_back, work_again = 0, 0
    trials = 4
    for trial in range(trials):
        s.send("t = pt.ones(64); for i = 1, 1e9 do pt.dist.world():all_reduce(t) end\n")
        time.sleep(1.0 + 0.3 * trial)
        s.send("\x03")
        try:
            out = s.read_until(r"\n> $", timeout=40)
        except (TimeoutError, EOFError) as e:
            check(f"Ctrl-C inside a collective brings every rank back to the prompt (trial {trial + 1})", False, e)
            break
        shown = ranks_shown(out)
        if "interrupted" in out and shown == set(range(RANKS)) and "timed out" not in out:
            come_back += 1
        else:
            print("     trial", trial + 1, repr(out[-1500:]))
        out = s.chunk("=pt.dist.world():all_reduce(pt.ones(1)):item()")
        if out == f"{every} {RANKS}\n":
            work_again += 1
        else:
            print("     trial", trial + 1, "after:", repr(out))
    check(f"Ctrl-C inside a collective brings every rank back, interrupted ({come_back} of {trials} trials)",
          come_back == trials)
    check(f"... and the next collective gives the right sum on every rank ({work_again} of {trials} trials)",
          work_again == trials)
    # The same, made certain: rank 0 spins in Lua while the others wait for it in an all-reduce.
    s.send("if pt.dist.rank() == 0 then while true do end end; pt.dist.world():all_reduce(pt.ones(1))\n")
    time.sleep(2)
    s.send("\x03")
    try:
        out = s.read_until(r"\n> $", timeout=40)
    except (TimeoutError, EOFError) as e:
        out = str(e)
    check("Ctrl-C ends a wait in a collective for a rank that never comes, on every rank",
          re.search(r"\[rank 0\][ \n]interrupted", out) is not None
          # (the wait is in the all-reduce itself, or in pt.dist's check that every rank calls it)
          and all(re.search(rf"\[rank {r}\][ \n]stdin:1: all_reduce(\(sum\)| \(checking that every rank calls it\)) "
                            rf"on group 'world' \(ranks {','.join(map(str, range(RANKS)))}\) failed on rank {r}: "
                            rf"interrupted while waiting for the other ranks \(Ctrl-C\)", out)
                  for r in range(1, RANKS)), repr(out))
    out = s.chunk("=pt.dist.world():all_reduce(pt.ones(1)):item()")
    check("... and the world group, renewed, sums right again", out == f"{every} {RANKS}\n", repr(out))
    out = s.chunk("=x")
    check("globals survive interrupted collectives", f"[rank {last}] {40 + last}" in out, repr(out))

    s.send("=pt.dist.worl\t")  # completes to the common prefix of world and world_size
    time.sleep(1)
    s.send("_size()\n")
    out = s.read_until(r"\n> $")
    check("tab completes fields", f"{every} {RANKS}" in out, repr(out))

    s.send("exit()\n")
    code = s.wait()
    check("exit() ends every rank cleanly", code == 0, f"exit code {code}")
    history = os.path.join(home, ".partrain_history")
    check("the history is saved", os.path.exists(history) and "=1 + 1" in open(history).read())

    # ---- an idle prompt outlives --timeout; Ctrl-C at the first prompt ----------------------
    s = Session("--timeout", "2", "repl", home=home)
    s.read_until(r"\n> $")
    s.send("\x03")  # before any chunk: no rank may die of it
    s.read_until(r"> $")
    time.sleep(5)  # longer than --timeout 2: the other ranks wait for the next chunk anyway
    out = s.chunk("=pt.dist.world():all_reduce(pt.ones(1)):item()")
    check("a prompt idle longer than --timeout, after Ctrl-C at the prompt, still runs collectives",
          out == f"{every} {RANKS}\n", repr(out))
    out = s.chunk("os.execute('sleep 3')")
    out = s.chunk("=pt.dist.rank()")
    check("a chunk that runs longer than --timeout on every rank is no error",
          f"[rank {last}] {last}" in out and "timed out" not in out, repr(out))
    s.send(f"on({last}, exit)\n")
    check("exit() on one rank ends the REPL on every rank, cleanly", s.wait() == 0)

    # ---- os.exit(0) on one rank: its process ends, and so does the session, on every rank -----
    for who in (last, 0):
        s = Session("--timeout", "2", "repl", home=home)
        s.read_until(r"\n> $")
        s.send(f"on({who}, function() os.exit(0) end)\n")
        code = s.wait(30)
        check(f"os.exit(0) in a chunk on rank {who} ends the session on every rank with status 0, not a hang",
              code == 0, f"exit code {code}: {s.buffer[-600:]!r}")
        if who != 0:
            check("... saying which rank ended its process", f"rank {who} ended its process (os.exit)" in s.buffer,
                  repr(s.buffer[-600:]))

    # ---- partrain -i script.lua, and Ctrl-D -------------------------------------------------
    script = os.path.join(home, "script.lua")
    with open(script, "w") as f:
        f.write("pt = require \"partrain\"\nanswer = 6 * 7 + pt.dist.rank()\n")
    s = Session("-i", script, home=home)
    s.read_until(r"\n> $")
    out = s.chunk("=answer")
    check("-i runs the script, then the REPL in its globals", f"[rank 0] 42" in out and f"[rank {last}] {42 + last}" in out,
          repr(out))
    s.send("\x04")  # Ctrl-D
    check("Ctrl-D ends every rank cleanly", s.wait() == 0)

    # ---- pt.breakpoint() ----------------------------------------------------------------------
    with open(script, "w") as f:
        f.write("local pt = require \"partrain\"\nlocal step = 0\nfor i = 1, 3 do\n  step = i\n  if i == 2 then pt.breakpoint() end\nend\n"
                "print('finished at step ' .. step)\n")
    s = Session("-i", script, home=home)  # -i: rank 0 has the terminal (and a REPL at the end)
    banner = s.read_until(r"\n> $")
    check("pt.breakpoint() opens the REPL on every rank where it is called", "breakpoint at" in banner, banner)
    out = s.chunk("=step")
    check("a breakpoint sees the caller's locals", f"{every} 2" in out, repr(out))
    s.send("exit()\n")
    rest = s.read_until(r"finished at step 3")
    check("exit() at a breakpoint continues the script", "finished at step 3" in rest, rest)
    s.read_until(r"\n> $")
    s.send("exit()\n")
    check("and the run ends cleanly", s.wait() == 0)

    # ---- a breakpoint only rank 0 reaches: an error naming the others, not a wait -------------
    lonely = os.path.join(home, "lonely.lua")
    with open(lonely, "w") as f:
        # The others sleep in the process (not in a child, which would hold the launcher's output
        # pipes open after the rank is stopped, and so the run, for the rest of its sleep).
        f.write("local pt = require \"partrain\"\nif pt.dist.rank() == 0 then pt.breakpoint() else\n"
                "  local ffi = require 'ffi'; ffi.cdef 'int usleep(unsigned int)'\n"
                "  for _ = 1, 600 do ffi.C.usleep(100000) end\nend\n")
    s = Session("--timeout", "3", "-i", lonely, home=home)
    s.read_until(r"\n> $")
    s.send("=1\n")
    try:
        out = s.read_until(r"the other ranks were stopped", timeout=60)
    except (TimeoutError, EOFError) as e:
        out = str(e)
    others = ",".join(str(r) for r in range(1, RANKS))
    check("a breakpoint the other ranks never reach ends with an error naming them",
          f"rank(s) {others} did not reach the REPL within --timeout (3 s)" in out, out)
    check("... with status 1", s.wait() == 1)

    # ---- under timeout(1): a background process group may not read the terminal --------------
    # `sh -c 'timeout ...'`: timeout moves itself and partrain out of the terminal's foreground
    # group; reading the terminal there would stop the process and hang the run.
    s = Session(home=home, argv=["sh", "-c", f"timeout 120 {PARTRAIN} {script}"])
    try:
        out = s.read_until(r"finished at step 3", timeout=60)
    except (TimeoutError, EOFError) as e:
        out = str(e)
    check("pt.breakpoint() under timeout is skipped with a message, not a hang",
          re.search(r"pt\.breakpoint\(\) at .*script\.lua:5 skipped: partrain runs in a background process group", out)
          is not None and "finished at step 3" in out, out)
    check("... and the script ends cleanly", s.wait() == 0)
    s = Session(home=home, argv=["sh", "-c", f"timeout 120 {PARTRAIN} --nproc-per-node {RANKS} --threads 1 -i {script}"])
    try:
        out = s.read_until(r"the other ranks were stopped|all ranks were stopped", timeout=90)
    except (TimeoutError, EOFError) as e:
        out = str(e)
    check("-i under timeout skips the breakpoint and refuses the REPL, naming why",
          "skipped: partrain runs in a background process group" in out
          and "the REPL cannot start: partrain runs in a background process group" in out, out)
    check("... with status 1", s.wait() == 1)

finish("REPL")
