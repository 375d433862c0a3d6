#!/usr/bin/env bash
# The launcher's hang summary, read from the ranks' collective ledgers, at 2 and 4 ranks: a rank
# that skips a collective, one stopped with SIGSTOP, one in an endless Lua loop, and a send that
# nobody receives each end the run with status 1 within 30 s of --timeout, and the summary names
# the culprit rank (never a waiting one) with its last call and script line, and each waiting
# rank's call and line; a looping rank with the JIT off says the line it loops on. --hang-timeout
# ends a hang before the collectives' own timeout, also when a rank is stopped inside the call the
# others wait in, and names a rank sleeping in C without waking it. kill -USR1 to the launcher
# prints every rank's ledger while a healthy run goes on (one whose rank sleeps in C too), and that
# run still ends with status 0.
# Usage: test_hang.sh PATH/TO/partrain (from the source root)
set -u
bin="$(realpath "$1")"
script=tests/dist/hang.lua
line() { grep -n -- "-- @$1\$" "$script" | cut -d: -f1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0 failed=0
report() { if [ "$1" = 0 ]; then passed=$((passed + 1)); echo "[ OK ] $2"; else failed=$((failed + 1)); echo "[FAIL] $2"; echo "$3" | tail -25; fi; }
has() { grep -qF -- "$2" <<<"$1"; }
matches() { grep -qE -- "$2" <<<"$1"; }

# run NAME RANKS TIMEOUT MODE [partrain flags...] [-- script flags...]: in the background; output
# in NAME.out, then "STATUS SECONDS" in NAME.status.
run() {
  local name=$1 n=$2 timeout=$3 mode=$4
  shift 4
  local flags=() args=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do flags+=("$1"); shift; done
  [ $# -gt 0 ] && shift && args=("$@")
  (
    start=$(date +%s)
    timeout 120 "$bin" --nproc-per-node "$n" --threads 1 --timeout "$timeout" "${flags[@]}" "$script" --mode "$mode" \
      "${args[@]}" >"$tmp/$name.out" 2>&1
    echo "$? $(( $(date +%s) - start )) $(date +%s)" >"$tmp/$name.status"
  ) &
}
S="$script"
first="all_reduce(sum) of 4 float32 (16 B) at $S:$(line first) (call 0 on group 'world'"

# Checks a finished hang run: status 1, within 30 s of the timeout (plus start-up), the headline
# naming the culprit, and each listed line of the summary (extended regular expressions).
check() {
  local name=$1 culprit=$2 headline=$3
  shift 3
  local out status took ended begun timeout
  out=$(cat "$tmp/$name.out")
  read -r status took ended <"$tmp/$name.status"
  begun=$(grep -oE "^hang begins at [0-9]+" <<<"$out" | grep -oE "[0-9]+$")
  timeout=$(grep -oE "failed on rank [0-9]+: .*\(waited [0-9]+ s" <<<"$out" | head -1 | grep -oE "[0-9]+ s$" | cut -d' ' -f1)
  timeout=${timeout:-$(grep -oE "made progress for [0-9]+ s" <<<"$out" | grep -oE "[0-9]+ s$" | cut -d' ' -f1)}
  report $(( status != 1 )) "$name: the run ends with status 1 (status $status)" "$out"
  local after=$(( ended - ${begun:-0} - ${timeout:-0} ))
  report $(( ${begun:-0} == 0 || ${timeout:-0} == 0 || after > 30 )) "$name: it ends within 30 s of the ${timeout:-?} s timeout (${after} s after it; ${took} s in all)" "$out"
  grep -qE "^partrain: rank $culprit \(local rank $culprit, pid [0-9]+\) $headline" <<<"$out"
  report $? "$name: the summary names rank $culprit: $headline" "$out"
  for want in "$@"; do
    matches "$out" "$want"; report $? "$name: the summary says: $want" "$out"
  done
}
# A regular expression for a literal text.
re() { sed 's/[][\.*^$(){}+?|/]/\\&/g' <<<"$1"; }

# Checked below, run beside the 4-rank cases: --hang-timeout ends a hang long before a 60 s
# collective timeout; kill -USR1 shows a healthy run's ledgers, and that run goes on to finish.
healthy_dump() {
  (
    "$bin" --nproc-per-node 2 --threads 1 "$script" --mode healthy --seconds 4 >"$tmp/healthy.out" 2>&1 &
    launcher=$!
    for _ in $(seq 600); do grep -q "healthy run started" "$tmp/healthy.out" && break; sleep 0.1; done
    kill -USR1 "$launcher"
    wait "$launcher"
    echo "$? $launcher" >"$tmp/healthy.status"
  ) &
}

for n in 2 4; do
  last=$((n - 1))
  ranks=$(seq -s, 0 $last)
  world="group 'world' \(ranks $ranks\)"
  wave_start=$(date +%s)
  if [ "$n" = 2 ]; then  # 8 ranks at once; at 4 ranks two runs at a time
    run skip$n $n 3 skip; run stop$n $n 3 stop; run spin$n $n 3 spin; run send$n $n 3 send; wait
  else
    run skip$n $n 3 skip; run stop$n $n 3 stop; healthy_dump; wait
    run spin$n $n 3 spin_interpreted; run send$n $n 3 send; run hang_timeout 2 60 stop --hang-timeout 2; wait
  fi

  # A skipped collective: the others wait in the world all-reduce it skipped; it waits in its
  # data group's barrier, which they never reach.
  waits=()
  for r in $(seq 0 $((last - 1))); do
    waits+=("^  rank $r: (timed out|failed|waiting) in $(re "all_reduce(sum) of 4 float32 (16 B) at $S:$(line skipped)") \(call 1 on $world\).*it waits for rank $last, which has not reached call 1 on $world")
  done
  check skip$n $last "$(re "is the rank the others waited for: it never made the call they wait in (all_reduce(sum) of 4 float32 (16 B) at $S:$(line skipped)) and waits in barrier at $S:$(line skip_barrier) instead")" \
    "^  rank $last: (timed out|failed|waiting) in barrier at $(re "$S:$(line skip_barrier)") \(call 0 on group 'data\[$ranks\]'" "${waits[@]}"

  # A stopped rank.
  waits=()
  for r in $(seq 0 $((last - 1))); do
    waits+=("^  rank $r: (timed out|failed|waiting) in barrier at $(re "$S:$(line stop_barrier)") \(call 1 on $world\).*it waits for rank $last, which has not reached call 1")
  done
  check stop$n $last "$(re "was still running, with no error, when the other ranks timed out waiting in a collective: it is the rank the others waited for (rank $last was stopped: SIGSTOP, Ctrl-Z or a debugger)")" \
    "^  rank $last: stopped \(process state T.*its last call: $(re "$first")" "${waits[@]}"

  # An endless Lua loop: compiled by the JIT at 2 ranks (no hook runs in compiled code: the summary
  # says the line could not be read, and gives the last call), interpreted at 4 (the rank names
  # the line it loops on).
  waits=()
  for r in $(seq 0 $((last - 1))); do
    waits+=("^  rank $r: (timed out|failed|waiting) in barrier at $(re "$S:$(line spin_barrier)") \(call 1 on $world\).*it waits for rank $last")
  done
  if [ "$n" = 2 ]; then
    now="its Lua line could not be read: it did not answer within a second"
  else
    now="its Lua line now: $(re "$S:$(line spin)")"
  fi
  check spin$n $last "was still running, with no error, when the other ranks timed out waiting in a collective: it is the rank the others waited for" \
    "^  rank $last: running, not in any collective or send/recv; its last call: $(re "$first").*$now" "${waits[@]}"

  # A send nobody receives: rank 0 waits in it, the receiver went on to the barrier, where the
  # other ranks wait for rank 0.
  waits=("^  rank 0: (timed out|failed|waiting) in $(re "send of 3 float32 (12 B) to rank $last (tag 0) at $S:$(line send)") \(message 0 of this channel on $world\).*it waits for rank $last, which has not posted the receive for message 0")
  for r in $(seq 1 $((last - 1))); do
    waits+=("^  rank $r: (timed out|failed|waiting) in barrier at $(re "$S:$(line send_barrier)") \(call 1 on $world\).*it waits for rank 0, which has not reached call 1")
  done
  check send$n $last "$(re "is the rank the others waited for: it never made the call they wait in (send of 3 float32 (12 B) to rank $last (tag 0) at $S:$(line send)) and waits in barrier at $S:$(line send_barrier) instead")" \
    "^  rank $last: (timed out|failed|waiting) in barrier at $(re "$S:$(line send_barrier)") \(call 1 on $world\)" "${waits[@]}"
  echo "($n ranks: $(( $(date +%s) - wave_start )) s)"
done


read -r status launcher <"$tmp/healthy.status"
out=$(cat "$tmp/healthy.out")
report $status "a healthy run asked for its ledgers still ends with status 0 (status $status)" "$out"
has "$out" "partrain: the ranks' collective ledgers (kill -USR1 $launcher; the run goes on):"; report $? "kill -USR1 prints the ledgers" "$out"
for r in 0 1; do
  matches "$out" "^  rank $r \(local rank $r, pid [0-9]+\): running"; report $? "... with rank $r's state" "$out"
done
matches "$out" "^      call [0-9]+: $(re "all_reduce(mean) of 8 float32 (32 B) at $S:$(line healthy)"), (completed|waiting|started)"
report $? "... and its last calls with their script line" "$out"
has "$out" "healthy run finished"; report $? "... and the run finished its work" "$out"
check hang_timeout 1 "$(re "was still running, with no error, when no rank had made progress for 2 s (--hang-timeout): it is the rank the others waited for (rank 1 was stopped")" \
  "^  rank 0: waiting in barrier at $(re "$S:$(line stop_barrier)") \(call 1 on group 'world' \(ranks 0,1\)\) for [0-9.]+ s"
out=$(cat "$tmp/hang_timeout.out")
waited=$(grep -oE "^  rank 0: waiting in barrier .* for [0-9.]+ s" <<<"$out" | grep -oE "[0-9.]+ s$" | cut -d. -f1)
read -r status took _ <"$tmp/hang_timeout.status"
report $(( ${waited:-99} >= 10 || took >= 60 )) "--hang-timeout 2 names the hang after rank 0 waited ${waited:-?} s, long before the 60 s timeout (the run took ${took} s)" "$out"

# A rank stopped inside the all-reduce the others wait in: every ledger says "waiting" in the same
# call, so no rank is behind another; --hang-timeout still ends the run, naming the stopped rank
# (it had run on to the 60 s --timeout). A rank sleeping in C's sleep() while the others wait is
# asked for its line without being woken: --hang-timeout names it (the question had cut its sleep
# short after 2 s, and the run ended with status 0 and no report), and a healthy run asked for its
# ledgers twice during such a sleep sleeps it all and finishes.
run stop_inside 2 60 stop_inside --hang-timeout 2
run sleep_in_c 2 60 sleep_in_c --hang-timeout 2 -- --seconds 40
(
  "$bin" --nproc-per-node 2 --threads 1 "$script" --mode sleep_in_c --seconds 4 >"$tmp/asked.out" 2>&1 &
  launcher=$!
  for _ in $(seq 600); do grep -q "hang begins at" "$tmp/asked.out" && break; sleep 0.1; done
  sleep 1.5; kill -USR1 "$launcher"; sleep 1; kill -USR1 "$launcher"
  wait "$launcher"
  echo "$? $launcher" >"$tmp/asked.status"
) &
wait
check stop_inside 1 "$(re "was still running, with no error, when no rank had made progress for 2 s (--hang-timeout): it is the rank the others waited for (rank 1 was stopped: SIGSTOP")" \
  "^  rank 1: stopped \(process state T.*its last call: $(re "all_reduce(sum) of 1048576 float32 (4194304 B) at $S:$(line stop_inside)") \(call 2 on group 'world' \(ranks 0,1\)\), waiting" \
  "^  rank 0: waiting in $(re "all_reduce(sum) of 1048576 float32 (4194304 B) at $S:$(line stop_inside)") \(call 2 on group 'world' \(ranks 0,1\)\) for [0-9.]+ s"
out=$(cat "$tmp/stop_inside.out")
begun=$(grep -oE "^hang begins at [0-9]+" <<<"$out" | grep -oE "[0-9]+$")
read -r status took ended <"$tmp/stop_inside.status"
report $(( ended - ${begun:-0} > 15 )) "--hang-timeout 2 ends a run whose rank is stopped inside a collective $(( ended - ${begun:-0} )) s after it began (the stop comes 2 s in; the --timeout is 60 s)" "$out"
check sleep_in_c 1 "$(re "was still running, with no error, when no rank had made progress for 2 s (--hang-timeout): it is the rank the others waited for")" \
  "^  rank 1: running, not in any collective or send/recv; its last call: $(re "$first").*its Lua line could not be read" \
  "^  rank 0: waiting in barrier at $(re "$S:$(line sleep_barrier)")"
out=$(cat "$tmp/sleep_in_c.out")
! has "$out" "woke with"; report $? "... and the rank asked for its line sleeps on: it never woke (C's sleep was not cut short)" "$out"
read -r status launcher <"$tmp/asked.status"
out=$(cat "$tmp/asked.out")
report $status "a run asked for its ledgers (kill -USR1, twice) while a rank sleeps 4 s in C ends with status 0 (status $status)" "$out"
[ "$(grep -c "partrain: the ranks' collective ledgers (kill -USR1 $launcher" <<<"$out")" = 2 ]; report $? "... both questions answered" "$out"
has "$out" "rank 1 woke with 0 s of its sleep left"; report $? "... and the sleeping rank slept all 4 s (the questions did not wake it)" "$out"

out=$("$bin" --hang-timeout 5 -e '' 2>&1); status=$?
has "$out" "--hang-timeout needs the launcher"; report $(( status == 0 ? 1 : $? )) "--hang-timeout without the launcher is refused" "$out"
out=$("$bin" --nproc-per-node 2 --hang-timeout abc -e '' 2>&1); status=$?
has "$out" "--hang-timeout 'abc' is not a number of seconds from 1 to 604800, or 0 (off)"; report $(( status == 0 ? 1 : $? )) "a bad --hang-timeout is refused" "$out"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
