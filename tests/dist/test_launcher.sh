#!/usr/bin/env bash
# The launcher under failure and misuse: a rank killed mid-training ends the run within 30 s
# naming that rank and leaving no process behind; a stalled collective times out naming its group
# and operation, and the rank the others waited for (one that sleeps, loops or is stopped) is the
# one named; a rank that raises while the others wait is named with its error in 10 runs of 10;
# pt.breakpoint() without -i says how to stop there; bad sizes, ports and environments are clear
# errors; torchrun-style environments run a single rank; a rank that never arrives at the rendezvous
# is named within one timeout; printed lines leave as they are printed, to a file or through the
# launcher; at the end of the run rank 0 may work on alone and a rank may os.exit(0) early, past
# --timeout, and a rank that skipped the last collective is named; 240 MB of unended progress lines
# are relayed in linear time and memory; a broken pipe is an EPIPE error in a rank, not its death.
# Usage: test_launcher.sh PATH/TO/partrain
set -u
bin="$(realpath "$1")"
worker="$(realpath tests/dist/worker.lua)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0 failed=0
report() { if [ "$1" = 0 ]; then passed=$((passed + 1)); echo "[ OK ] $2"; else failed=$((failed + 1)); echo "[FAIL] $2"; echo "$3" | head -20; fi; }
has() { grep -qF -- "$2" <<<"$1"; }

# --- kill -9 one rank of four mid-training ---------------------------------------------------
mkdir "$tmp/kill"
start=$(date +%s)
"$bin" --nproc-per-node 4 --threads 1 "$worker" --dir "$tmp/kill" --mode loop >"$tmp/kill.out" 2>&1 &
launcher=$!
for _ in $(seq 100); do [ "$(ls "$tmp/kill" | wc -l)" -eq 4 ] && break; sleep 0.2; done
sleep 1
victim=$(cat "$tmp/kill/pid.2")
kill -9 "$victim"
killed_at=$(date +%s)
wait "$launcher"
status=$?
took=$(( $(date +%s) - killed_at ))
out=$(cat "$tmp/kill.out")
report $(( status == 0 )) "the launcher exits non-zero when a rank is killed (status $status)" "$out"
report $(( took > 30 )) "it exits within 30 s of the kill (took ${took} s)" "$out"
has "$out" "partrain: rank 2 (local rank 2, pid $victim) failed first: it was killed by signal 9 (SIGKILL)"; report $? "its message names the killed rank and the signal" "$out"
left=0
for f in "$tmp"/kill/pid.*; do kill -0 "$(cat "$f")" 2>/dev/null && left=$((left + 1)); done
report $(( left != 0 )) "no rank is left running ($left left)" "$out"

# --- a stalled collective times out ----------------------------------------------------------
start=$(date +%s)
out=$("$bin" --nproc-per-node 2 --threads 1 --timeout 3 "$worker" --mode stall 2>&1)
status=$?
took=$(( $(date +%s) - start ))
report $(( status == 0 )) "a collective waiting on a stalled rank fails (status $status)" "$out"
has "$out" "barrier on group 'world' (ranks 0,1) failed on rank 0"; report $? "the timeout names the group and the operation" "$out"
report $(( took > 30 )) "the stalled run ends within 30 s with --timeout 3 (took ${took} s)" "$out"

summary=$(grep -A2 '^partrain: rank' <<<"$out")
grep -q '^partrain: rank 1 (local rank 1, pid [0-9]*) was still running, with no error, when the other ranks timed out' <<<"$summary"
report $? "the summary names the stalled rank as the one the others waited for" "$out"

# --- the rank that failed first is named, whatever order the ranks end in --------------------
# Rank 1 raises while ranks 0, 2 and 3 wait in an all-reduce; they then fail too ("connection
# closed"), often before the launcher reaps rank 1. Each rank reports its error with the time it
# happened, so the launcher names rank 1, with its message, every time.
named=0 last=""
for _ in $(seq 10); do
  out=$("$bin" --nproc-per-node 4 --threads 1 --timeout 60 "$worker" --mode raise 2>&1)
  summary=$(grep -A2 '^partrain: rank' <<<"$out")
  if grep -q '^partrain: rank 1 (local rank 1, pid [0-9]*) failed first: it exited with status 1' <<<"$summary" &&
     grep -q 'rank 1 raised on purpose' <<<"$summary"; then named=$((named + 1)); else last="$out"; fi
done
report $(( named != 10 )) "a rank raising while the others wait in a collective is named with its error ($named of 10 runs)" "$last"

# --- a user's error is one message, not one a rank plus the summary ----------------------------
printf 'local pt = require "partrain"\nlocal m = pt.mesh { tensor = 2 }\npt.models.gpt2 { vocab = 64, seq = 8, dim = 16, heads = 3, layers = 1 }\n' > "$tmp/heads.lua"
out=$("$bin" --nproc-per-node 2 --threads 1 "$tmp/heads.lua" 2>&1); status=$?
count=$(grep -c 'heads=3 does not divide dim=16' <<<"$out")
[ "$status" = 1 ] && [ "$count" = 1 ] && ! grep -q '^\[rank' <<<"$out" && ! grep -q 'partrain/init.lua\|stack traceback' <<<"$out"
report $? "a user's error on every rank is said once, by the launcher, with no traceback into partrain ($count times)" "$out"

# --- a rank that never reaches the collective is the one named ---------------------------------
for mode in spin stop; do
  start=$(date +%s)
  out=$(timeout 120 "$bin" --nproc-per-node 3 --threads 1 --timeout 2 "$worker" --mode $mode 2>&1); status=$?
  took=$(( $(date +%s) - start ))
  summary=$(grep -A2 '^partrain: rank' <<<"$out")
  grep -q '^partrain: rank 1 (local rank 1, pid [0-9]*) was still running, with no error, when the other ranks timed out' <<<"$summary"
  report $? "a rank that $( [ $mode = spin ] && echo 'loops forever' || echo 'is stopped (SIGSTOP)' ) is named as the one the others waited for" "$out"
  report $(( status != 1 || took > 40 )) "... and the run ends with status 1 within 40 s (status $status, ${took} s)" "$out"
done
has "$summary" "(rank 1 was stopped: SIGSTOP"; report $? "a stopped rank is said to be stopped" "$summary"

# --- pt.breakpoint() without -i under the launcher says so and goes on ------------------------
out=$(timeout 60 "$bin" --nproc-per-node 2 --threads 1 "$worker" --mode breakpoint 2>&1); status=$?
has "$out" "pt.breakpoint() at $worker:35 skipped: run with partrain -i to stop here" && has "$out" "after the breakpoint"
report $(( $? != 0 || status != 0 )) "pt.breakpoint() without -i under the launcher is skipped with a message saying to use -i (status $status)" "$out"

# --- ranks calling different collectives -----------------------------------------------------
out=$("$bin" --nproc-per-node 2 --threads 1 --check-collectives "$worker" --mode mismatch 2>&1); status=$?
has "$out" "the ranks called different collectives:"; report $(( status == 0 ? 1 : $? )) "--check-collectives stops ranks that call different collectives" "$out"
has "$out" "rank 1: all_reduce(max) of float32 [3] at $worker:44 (call 0 on this group)"; report $? "and says what each rank called" "$out"

# --- sizes, ports and environments -----------------------------------------------------------
out=$("$bin" --nproc-per-node 2 --threads 1 -e 'require("partrain").mesh { tensor = 3 }' 2>&1)
has "$out" "tensor=3 x pipeline=1 = 3 does not divide the world of 2 ranks"; report $? "a mesh that does not divide the world names the sizes" "$out"
out=$("$bin" --nproc-per-node 4 --threads 1 -e 'require("partrain").mesh { tensor = 2, data = 3 }' 2>&1)
has "$out" "tensor=2 x data=3 x pipeline=1 = 6 ranks, but the world has 4"; report $? "explicit sizes that do not multiply to the world are named" "$out"
out=$("$bin" --nproc-per-node 2 --master-port 70000 -e '' 2>&1); status=$?
has "$out" "--master-port 70000 is out of range: 1 to 65535"; report $(( status == 0 ? 1 : $? )) "a bad port is refused" "$out"
/usr/bin/python3 -c 'import socket,time,sys; s=socket.socket(); s.bind(("127.0.0.1",0)); s.listen(); print(s.getsockname()[1], flush=True); time.sleep(60)' >"$tmp/port" &
holder=$!
for _ in $(seq 50); do [ -s "$tmp/port" ] && break; sleep 0.1; done
port=$(cat "$tmp/port")
out=$(timeout 60 "$bin" --nproc-per-node 2 --threads 1 --timeout 10 --master-port "$port" -e '' 2>&1); status=$?
kill "$holder" 2>/dev/null
has "$out" "rendezvous at 127.0.0.1:$port (serving it) failed"; report $(( status == 0 ? 1 : $? )) "a port already in use is named" "$out"
out=$(RANK=1 WORLD_SIZE=2 "$bin" -e '' 2>&1)
has "$out" "MASTER_ADDR is not"; report $? "RANK and WORLD_SIZE without MASTER_ADDR is an error naming it" "$out"
out=$(RANK=1 "$bin" -e '' 2>&1)
has "$out" "RANK and WORLD_SIZE must be set together"; report $? "RANK without WORLD_SIZE is an error" "$out"
out=$(RANK=x WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=1 "$bin" -e '' 2>&1)
has "$out" "environment variable RANK='x' is not an integer in [0, 1]"; report $? "a malformed RANK is named" "$out"
out=$("$bin" --nproc-per-node 2 --nnodes 2 -e '' 2>&1)
has "$out" "--nnodes 2 needs --master-addr"; report $? "several nodes need --master-addr" "$out"
out=$("$bin" --tee -e '' 2>&1)
has "$out" "--tee is for the launcher: it needs --nproc-per-node"; report $? "launcher flags without --nproc-per-node are refused, naming the flag given" "$out"

# --- torchrun-style: the environment makes each process one rank ----------------------------
port=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
for r in 0 1; do
  RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
    "$bin" --threads 1 "$worker" --mode sum >"$tmp/env.$r" 2>&1 &
done
wait
has "$(cat "$tmp/env.0")" "rank 0 of 2: sum 3"; report $? "RANK/WORLD_SIZE/MASTER_* from the environment: rank 0 joins" "$(cat "$tmp/env.0")"
has "$(cat "$tmp/env.1")" "rank 1 of 2: sum 3"; report $? "and rank 1 joins" "$(cat "$tmp/env.1")"

# --- a rank that never arrives is named, within one timeout --------------------------------------
port=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
ms() { echo $(( $(date +%s%N) / 1000000 )); }
# What a process takes to start and end on this machine now (seconds, rounded up), so that a
# loaded machine's slow start is not counted as waiting: the bounds below are on the rest.
start=$(ms); "$bin" --threads 1 -e '' >/dev/null 2>&1; base=$(( ($(ms) - start + 999) / 1000 ))
start=$(ms); for r in 0 1; do "$bin" --threads 1 -e '' >/dev/null 2>&1 & done; wait; base2=$(( ($(ms) - start + 999) / 1000 ))
start=$(ms)
for r in 0 1; do  # rank 2 of 3 never starts
  RANK=$r WORLD_SIZE=3 LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$port PARTRAIN_TIMEOUT=3 \
    "$bin" --threads 1 -e '' >"$tmp/absent.$r" 2>&1 &
done
wait
took=$(( ($(ms) - start) / 1000 - base2 ))  # two processes started together
out=$(cat "$tmp/absent.0")
has "$out" "rendezvous at 127.0.0.1:$port failed: rank 2 has not arrived within the timeout of 3 s (world of 3"
report $? "rank 0 names the rank that never arrived" "$out"
out1=$(cat "$tmp/absent.1")  # it names rank 2 too when the store is still up as it looks, else points at rank 0
has "$out1" "rank 0, which serves the rendezvous, is gone" || has "$out1" "rank 2 has not arrived"
report $? "rank 1 names rank 2 or says where to look" "$out1"
report $(( took > 5 )) "they end within one timeout (3 s), not two (took ${took} s more than two bare starts)" "$out"
start=$(ms)
out=$(RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port PARTRAIN_TIMEOUT=2 "$bin" --threads 1 -e '' 2>&1)
took=$(( ($(ms) - start) / 1000 - base ))
has "$out" "rank 0 serves the rendezvous: it never started serving it"; report $? "a lone rank names rank 0 as the one missing" "$out"
report $(( took > 3 )) "a lone rank waits one timeout (2 s), not two (took ${took} s more than a bare start)" "$out"

# --- the end of the run ------------------------------------------------------------------------
# No rank waits for another at the end under the collectives' timeout: each says it has ended and
# leaves, and rank 0 (which serves the store) waits for that word, under the launcher without limit.
head='local pt = require "partrain"; local rank = pt.dist.rank(); pt.dist.world():all_reduce(pt.ones(2))'
out=$("$bin" --nproc-per-node 2 --threads 1 --timeout 1 -e "$head; if rank == 0 then os.execute('sleep 3'); print('rank 0 alone, done') end" 2>&1)
status=$?
report $(( status != 0 )) "rank 0 may work on alone past --timeout after the others have ended (status $status)" "$out"
has "$out" "rank 0 alone, done"; report $? "... and its work finishes" "$out"
out=$("$bin" --nproc-per-node 2 --threads 1 --timeout 1 -e "$head; if rank == 1 then os.exit(0) end; os.execute('sleep 2'); print('rank 0 after rank 1 left')" 2>&1)
status=$?
report $(( status != 0 )) "a rank may end early with os.exit(0) while rank 0 goes on past --timeout (status $status)" "$out"
has "$out" "rank 0 after rank 1 left"; report $? "... and rank 0's work finishes" "$out"
# The system keeps a status's low 8 bits and LuaJIT truncates a fraction: these end with status 0,
# so they are an ending too (they had left rank 0 waiting for word that never came, forever).
for code in 256 0.5; do
  out=$(timeout 60 "$bin" --nproc-per-node 2 --threads 1 --timeout 5 -e "$head; if rank == 1 then os.exit($code) end; print('rank 0 done')" 2>&1)
  status=$?
  report $(( status != 0 )) "os.exit($code) on a rank ends with status 0 and is an ending: the run finishes (status $status)" "$out"
done
# A process a rank started and left running holds the rank's output pipes: the run does not wait for it.
started=$SECONDS
out=$(timeout 60 "$bin" --nproc-per-node 2 --threads 1 -e "$head; if rank == 1 then os.execute('sleep 30 &') end; print('done')" 2>&1)
status=$?
report $(( status != 0 || SECONDS - started > 20 )) "a command a rank left running in the background does not hold the run (status $status, $((SECONDS - started)) s)" "$out"
has "$out" "done"; report $? "... and rank 0's output is all there" "$out"
out=$(timeout 60 "$bin" --nproc-per-node 2 --threads 1 --timeout 5 -e "$head; if rank == 1 then os.exit(257) end; os.execute('sleep 30')" 2>&1)
status=$?
report $(( status != 1 )) "os.exit(257) ends with status 1, a failure: the run stops at once (status $status)" "$out"
out=$("$bin" --nproc-per-node 2 --threads 1 --timeout 60 --hang-timeout 1 -e "$head; if rank == 1 then os.execute('sleep 3') end" 2>&1)
status=$?
report $(( status != 0 )) "rank 0 waiting at the end for a rank's long last work is no hang under --hang-timeout (status $status)" "$out"
out=$("$bin" --nproc-per-node 2 --threads 1 --timeout 2 -e "$head; if rank == 1 then pt.dist.world():all_reduce(pt.ones(2)) end" 2>&1)
status=$?
report $(( status != 1 )) "a rank that skips the last collective still ends the run with status 1 (status $status)" "$out"
has "$out" "rank 0 (local rank 0" && has "$out" "waits in barrier at (end of run) instead"
report $? "... naming it as the rank the others waited for, waiting at the end of the run" "$out"
port=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
for r in 0 1; do  # started by hand: no launcher watches rank 1, so rank 0's wait is bounded
  RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$port PARTRAIN_TIMEOUT=1 \
    "$bin" --threads 1 -e "$head; if rank == 1 then os.execute('sleep 4') end" >"$tmp/bounded.$r" 2>&1 &
done
wait
out=$(cat "$tmp/bounded.0")
has "$out" "rank 0 ended its script and waited 1 s for rank 1 to end"
report $? "without the launcher, rank 0's wait at the end is bounded by the timeout and names the rank" "$out"

# --- output ----------------------------------------------------------------------------------
out=$("$bin" --nproc-per-node 2 --threads 1 "$worker" --mode sum 2>&1)
has "$out" "rank 0 of 2: sum 3" && ! has "$out" "rank 1 of 2"; report $? "by default only rank 0's stdout is shown" "$out"
bytes=$("$bin" --nproc-per-node 2 --threads 1 -e 'io.write("no newline")' 2>/dev/null | od -An -c | tr -s ' ')
[ "$bytes" = " n o n e w l i n e" ]; report $? "rank 0's stdout passes through as written, a last line without its newline too" "$bytes"
out=$("$bin" --nproc-per-node 2 --threads 1 --tee "$worker" --mode sum 2>&1)
has "$out" "[rank 1] rank 1 of 2: sum 3"; report $? "--tee shows every rank's stdout with its rank" "$out"

# A printed line leaves at once, through the launcher or straight to a file: the test creates
# DIR/go only once it has read "ready" in the output, which the script waits for.
handshake() {  # handshake NAME COMMAND...: runs it, answering "ready" with DIR/go; prints its output
  local dir="$tmp/$1" && shift && mkdir "$dir"
  "$@" "$worker" --dir "$dir" --mode handshake >"$dir/out" 2>&1 &
  local pid=$!
  for _ in $(seq 200); do grep -q '^ready$' "$dir/out" && { touch "$dir/go"; break; }; sleep 0.1; done
  wait "$pid"
  cat "$dir/out"
}
out=$(handshake launched "$bin" --nproc-per-node 2 --threads 1)
has "$out" "released"; report $? "rank 0's printed line reaches the launcher's output (a file) while the run goes on" "$out"
out=$(handshake alone "$bin" --threads 1)
has "$out" "released"; report $? "a single process's printed line reaches its output file while it runs" "$out"

# --- a rank's output that never ends its line ------------------------------------------------
# 240 MB of progress redrawn with \r (100-byte updates) and no newline, on rank 0's stdout and
# on both ranks' stderr (480 MB): relayed whole, in bounded pieces, in linear time and memory.
# Held for a newline the relay had grown super-linearly (240 MB took 35 s and 667 MB); relayed in
# pieces, stderr's pieces were still all kept for the failure summary (+229 MiB at 240 MB). The
# launcher's peak RSS (VmHWM) is read once all is relayed, while the ranks wait for DIR/go; a run
# of a tenth of the size is the baseline for both time and memory.
cat >"$tmp/cr.lua" <<'LUA'
local pt = require "partrain"
local mb, go = tonumber(arg[1]), arg[2]
local updates = {}
for i = 1, 1000 do updates[i] = ("step %08d | loss 1.2345 | %s\r"):format(i, ("#"):rep(69)) end
local piece = table.concat(updates)  -- 1000 updates of 100 bytes
for _ = 1, mb * 10 do
  if pt.dist.rank() == 0 then io.stdout:write(piece) end
  io.stderr:write(piece)
end
io.stdout:flush(); io.stderr:flush()
local until_ = os.time() + 120
while not io.open(go) and os.time() < until_ do os.execute("sleep 0.1") end
LUA
relay() {  # relay MB: prints "MILLISECONDS PEAK_KIB STATUS STDOUT_BYTES LONGEST_STDERR_LINE"
  local mb=$1 go="$tmp/go.$1" started launcher want peak status
  started=$(date +%s%N)
  "$bin" --nproc-per-node 2 --threads 1 "$tmp/cr.lua" "$mb" "$go" >"$tmp/cr.out" 2>"$tmp/cr.err" &
  launcher=$!
  want=$(( mb * 1000000 ))
  # All relayed but the last unended piece of each stream (under 64 KiB: it waits for the rank's end).
  for _ in $(seq 1200); do
    [ "$(stat -c %s "$tmp/cr.out")" -ge $(( want - 65536 )) ] &&
      [ "$(stat -c %s "$tmp/cr.err")" -ge $(( 2 * (want - 65536) )) ] && break
    sleep 0.05
  done
  took=$(( ($(date +%s%N) - started) / 1000000 ))
  peak=$(awk '/^VmHWM/ {print $2}' "/proc/$launcher/status" 2>/dev/null)
  touch "$go"
  wait "$launcher"; status=$?
  echo "$took ${peak:-0} $status $(stat -c %s "$tmp/cr.out") $(awk '{ if (length($0) > n) n = length($0) } END { print n + 0 }' "$tmp/cr.err")"
}
read -r small_ms small_kib small_status _ <<<"$(relay 24)"
read -r ms kib status bytes longest <<<"$(relay 240)"
report $(( status != 0 || small_status != 0 )) "runs printing 24 and 240 MB without a newline end cleanly (status $small_status, $status)" "$(tail -c 300 "$tmp/cr.err")"
report $(( bytes != 240000000 )) "rank 0's 240 MB of stdout are relayed byte for byte, untagged ($bytes bytes)" ""
report $(( longest == 0 || longest > 2 * 65536 + 9 )) "each rank's stderr arrives tagged, in pieces of at most 128 KiB (the longest: $longest bytes)" "$(head -c 300 "$tmp/cr.err")"
report $(( ms > 20 * small_ms + 5000 || ms > 50000 )) "relaying 10x the output takes about 10x the time: ${ms} ms for 240 MB, ${small_ms} ms for 24 MB" ""
report $(( kib == 0 || small_kib == 0 || kib - small_kib > 32768 )) "... and no more memory: the launcher's peak RSS $(( kib / 1024 )) MiB at 240 MB, $(( small_kib / 1024 )) MiB at 24 MB" ""

# --- a broken pipe is an error in a rank, not a death by SIGPIPE ------------------------------
# A rank writing to a command that has ended gets EPIPE ("Broken pipe") and goes on; a death by
# SIGPIPE had been named as the rank that failed. The script's own commands still end on SIGPIPE
# (`yes | head` ends quietly: exec gives them the default back).
out=$(timeout 60 "$bin" --nproc-per-node 2 --threads 1 --tee -e '
local pt = require "partrain"
local p = io.popen("true", "w")
os.execute("sleep 0.3")
local ok, err = p:write(("x"):rep(1000000))
if ok then ok, err = p:flush() end
print(("rank %d: writing to an ended command: %s"):format(pt.dist.rank(), tostring(err)))
print(("rank %d: yes | head: %s"):format(pt.dist.rank(), io.popen("yes 2>&1 | head -c 2; echo \" $?\""):read("*a"):gsub("\n", "")))
' 2>&1); status=$?
report $(( status != 0 )) "ranks writing to a command that has ended are not killed by SIGPIPE (status $status)" "$out"
has "$out" "[rank 1] rank 1: writing to an ended command: Broken pipe"; report $? "... the write fails with EPIPE, which the script sees" "$out"
has "$out" "[rank 1] rank 1: yes | head: y 0" && ! has "$out" "write error"; report $? "... and the script's own commands still end quietly on SIGPIPE" "$out"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
