#!/usr/bin/env bash
# Restarts (--max-restarts): a 4-rank GPT-2 run (tensor 2 x data 2) checkpointing every 3 steps,
# with one rank kill -9'd at a random step of its first start, is restarted, resumes from its
# newest checkpoint, finishes with status 0, reports the restart (which rank, why, from which
# checkpoint), and ends with weights bitwise equal to an uninterrupted run's; with
# --max-restarts 0 the kill ends the run as before; bad flag values (and --node-timeout on one
# node) are refused.
# Usage: test_restart.sh PATH/TO/partrain
set -u
bin="$(realpath "$1")"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0 failed=0
report() { if [ "$1" = 0 ]; then passed=$((passed + 1)); echo "[ OK ] $2"; else failed=$((failed + 1)); echo "[FAIL] $2"; echo "$3" | tail -30; fi; }
has() { grep -qF -- "$2" <<<"$1"; }
train=(tests/ckpt/train.lua --tensor 2 --steps 10 --save_every 3)

seed=${RESTART_SEED:-$RANDOM}
die_at=$(( 2 + seed % 8 ))      # 2..9
die_rank=$(( seed % 4 ))
echo "seed $seed: rank $die_rank dies at step $die_at"

out=$("$bin" --nproc-per-node 4 --threads 1 "${train[@]}" --export "$tmp/clean.safetensors" 2>&1)
report $? "the uninterrupted run succeeds" "$out"

out=$("$bin" --nproc-per-node 4 --threads 1 --max-restarts 2 --restart-backoff 0.2 "${train[@]}" --ckpt "$tmp/ck" \
      --die_at "$die_at" --die_rank "$die_rank" --export "$tmp/restarted.safetensors" 2>&1)
status=$?
report $status "the run with a rank killed at step $die_at finishes with status 0 (status $status)" "$out"
has "$out" "partrain: restart 1 of 2: rank $die_rank (local rank $die_rank, pid" && has "$out" "was killed by signal 9 (SIGKILL)"
report $? "the restart is reported with the failed rank and why" "$out"
saved=$(( (die_at - 1) / 3 * 3 ))
if [ "$saved" -gt 0 ]; then want="partrain: restart 1: resumed from $tmp/ck/"; else want="partrain: restart 1: no checkpoint in $tmp/ck yet: starting over"; fi
has "$out" "$want"; report $? "it says where it resumed (the checkpoint of step $saved)" "$out"
[ "$saved" -gt 0 ] && { has "$out" "at step $saved"; report $? "resumed at step $saved" "$out"; }
has "$out" "partrain: finished after 1 restart"; report $? "the end says how many restarts it took" "$out"
cmp -s "$tmp/clean.safetensors" "$tmp/restarted.safetensors"
report $? "the final weights are bitwise those of the uninterrupted run" "$out"

out=$("$bin" --nproc-per-node 2 --threads 1 --max-restarts 0 tests/ckpt/train.lua --steps 4 --die_at 2 --die_rank 1 2>&1)
status=$?
report $(( status == 0 )) "--max-restarts 0: a killed rank ends the run (status $status)" "$out"
has "$out" "failed first: it was killed by signal 9" && ! has "$out" "restart"
report $? "--max-restarts 0: no restart, the failure named as before" "$out"

out=$("$bin" --nproc-per-node 2 --threads 1 --max-restarts 1 --restart-backoff 0 tests/ckpt/train.lua --steps 3 \
      --die_at 1 --die_rank 0 --corpus /nonexistent 2>&1)
status=$?
report $(( status == 0 )) "a run failing on every start gives up (status $status)" "$out"
has "$out" "partrain: giving up after 1 restart (--max-restarts 1)"; report $? "and says it gave up" "$out"

for bad in "--max-restarts -1" "--max-restarts x" "--max-restarts 1001" "--restart-backoff -2" "--restart-backoff nan"; do
  out=$("$bin" --nproc-per-node 2 $bad tests/ckpt/train.lua 2>&1)
  status=$?
  report $(( status == 0 )) "'$bad' is refused (status $status)" "$out"
  has "$out" "${bad%% *}"; report $? "'$bad': the message names the flag" "$out"
done
out=$("$bin" --max-restarts 1 tests/ckpt/train.lua 2>&1)
has "$out" "--max-restarts needs the launcher"; report $? "--max-restarts without --nproc-per-node is refused" "$out"
# Over several nodes restarts are agreed through node 0's launcher (tests/dist/test_nodes.py);
# --node-timeout, which says when a silent node is lost, is for such jobs only.
for bad in "--node-timeout 2" "--node-timeout x" "--node-timeout 604801"; do
  out=$("$bin" --nproc-per-node 1 --nnodes 2 --node-rank 0 --master-addr 127.0.0.1 --master-port 29999 $bad tests/ckpt/train.lua 2>&1)
  status=$?
  report $(( status == 0 )) "'$bad' is refused (status $status)" "$out"
  has "$out" "a number of seconds from 3 to 604800" && has "$out" "--node-timeout"; report $? "'$bad': the message names the flag and the range" "$out"
done
out=$("$bin" --nproc-per-node 1 --node-timeout 5 tests/ckpt/train.lua 2>&1)
has "$out" "--node-timeout is for jobs over several nodes"; report $? "--node-timeout on one node is refused" "$out"

echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
