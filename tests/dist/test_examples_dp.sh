#!/usr/bin/env bash
# The examples, parallel, equal their serial runs: the same global batch at 1, 2 and 4 ranks
# (data-parallel; GPT-2 also tensor=2 (with and without sequence parallelism), tensor=2 x data=2 and
# pipeline=2 (1F1B, 4 micro-batches) through policies/gpt2.lua, with gradient clipping) gives the same loss at every one of 20 steps (within 1e-5 relative)
# through the real launcher. GPT-2 with ZeRO: --zero-stage 1 at data 4 and --zero-stage 2 with
# --zero-groups 2 equal the plain data-4 run, and --pipeline 2 --zero-stage 2 (ZeRO-2 x pipeline,
# data 2) equals 1 rank and its loss falls; bad ZeRO flags are refused naming the flag. GPT-2 with
# each sequence split over 2 ranks (--context 2: ring attention; all_to_all; with ZeRO-2 over
# data x context at 4 ranks) equals 1 rank and its loss falls; a --seq that does not cut into
# 2 x context chunks is refused naming the flag.
# Usage: test_examples_dp.sh PATH/TO/partrain
set -u
bin="$(realpath "$1")"
passed=0 failed=0
report() { if [ "$1" = 0 ]; then passed=$((passed + 1)); echo "[ OK ] $2"; else failed=$((failed + 1)); echo "[FAIL] $2"; fi; }

losses() {  # losses NPROC SCRIPT ARGS...: the loss column, one line a step
  local n="$1"; shift
  "$bin" --nproc-per-node "$n" --threads 1 "$@" 2>/dev/null | awk -F'loss ' '/\| loss / { split($2, a, " "); print a[1] }'
}

compare() {  # compare NAME FILE_A FILE_B
  local name="$1"
  if [ ! -s "$2" ] || [ "$(wc -l <"$2")" -ne "$(wc -l <"$3")" ]; then report 1 "$name (runs printed $(wc -l <"$2") and $(wc -l <"$3") losses)"; return; fi
  local worst
  worst=$(paste "$2" "$3" | awk '{ d = $1 - $2; if (d < 0) d = -d; m = $2 < 0 ? -$2 : $2; if (m < 1) m = 1; r = d / m; if (r > w) w = r } END { printf "%.2e", w }')
  report "$(awk -v w="$worst" 'BEGIN { print (w <= 1e-5) ? 0 : 1 }')" "$name (worst relative difference $worst over $(wc -l <"$2") steps)"
}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for example in mnist simple; do
  args=(examples/$example/train.lua --steps 20)
  [ $example = mnist ] && args+=(--batch 32 --log-every 1)
  losses 1 "${args[@]}" >"$tmp/$example.1"
  for n in 2 4; do
    losses $n "${args[@]}" >"$tmp/$example.$n"
    compare "examples/$example at $n ranks equals 1 rank" "$tmp/$example.$n" "$tmp/$example.1"
  done
done
gpt=(examples/gpt/train.lua --steps 20 --log-every 1 --sample 0 --dim 64 --layers 2)
losses 1 "${gpt[@]}" >"$tmp/gpt.1"
losses 2 "${gpt[@]}" --tensor 2 >"$tmp/gpt.t2"
compare "examples/gpt at tensor=2 equals 1 rank" "$tmp/gpt.t2" "$tmp/gpt.1"
losses 4 "${gpt[@]}" --tensor 2 >"$tmp/gpt.t2d2"
compare "examples/gpt at tensor=2 x data=2 equals 1 rank" "$tmp/gpt.t2d2" "$tmp/gpt.1"
losses 2 "${gpt[@]}" --tensor 2 --sequence-parallel >"$tmp/gpt.t2sp"
compare "examples/gpt at tensor=2 with sequence parallelism equals 1 rank" "$tmp/gpt.t2sp" "$tmp/gpt.1"
losses 2 "${gpt[@]}" --pipeline 2 --microbatches 4 --schedule 1f1b >"$tmp/gpt.p2"
compare "examples/gpt at pipeline=2 (1f1b, 4 micro-batches) equals 1 rank" "$tmp/gpt.p2" "$tmp/gpt.1"

# ZeRO through the example's flags.
losses 4 "${gpt[@]}" >"$tmp/gpt.d4"
losses 4 "${gpt[@]}" --zero-stage 1 >"$tmp/gpt.z1"
compare "examples/gpt with --zero-stage 1 at data 4 equals the plain data-4 run" "$tmp/gpt.z1" "$tmp/gpt.d4"
losses 4 "${gpt[@]}" --zero-stage 3 >"$tmp/gpt.z3"
compare "examples/gpt with --zero-stage 3 at data 4 equals the plain data-4 run" "$tmp/gpt.z3" "$tmp/gpt.d4"
losses 4 "${gpt[@]}" --zero-stage 2 --zero-groups 2 >"$tmp/gpt.z2g2"
compare "examples/gpt with --zero-stage 2 --zero-groups 2 at data 4 equals the plain data-4 run" "$tmp/gpt.z2g2" "$tmp/gpt.d4"
out=$("$bin" --nproc-per-node 4 --threads 1 "${gpt[@]}" --pipeline 2 --zero-stage 2 2>&1)
echo "$out" | awk -F'loss ' '/\| loss / { split($2, a, " "); print a[1] }' >"$tmp/gpt.p2z2"
compare "examples/gpt with --pipeline 2 --zero-stage 2 (data 2) equals 1 rank" "$tmp/gpt.p2z2" "$tmp/gpt.1"
falls=$(awk 'NR == 1 { first = $1 } { last = $1 } END { print (NR >= 2 && last < first - 0.5) ? 0 : 1 }' "$tmp/gpt.p2z2")
report "$falls" "examples/gpt --pipeline 2 --zero-stage 2 runs, says so and its loss falls ($(head -1 "$tmp/gpt.p2z2") -> $(tail -1 "$tmp/gpt.p2z2"))"
echo "$out" | grep -q "ZeRO-2 over 2 ranks" || report 1 "the ZeRO-2 x pipeline run names its stage and group: $(echo "$out" | head -3)"
# Context parallelism through the example's flags: each rank holds 2 of the 4 chunks of every sequence.
losses 2 "${gpt[@]}" --context 2 >"$tmp/gpt.c2"
compare "examples/gpt at context=2 (ring) equals 1 rank" "$tmp/gpt.c2" "$tmp/gpt.1"
falls=$(awk 'NR == 1 { first = $1 } { last = $1 } END { print (NR >= 2 && last < first - 0.5) ? 0 : 1 }' "$tmp/gpt.c2")
report "$falls" "examples/gpt --context 2 trains: its loss falls ($(head -1 "$tmp/gpt.c2") -> $(tail -1 "$tmp/gpt.c2"))"
losses 2 "${gpt[@]}" --context 2 --context-mode all_to_all >"$tmp/gpt.c2a2a"
compare "examples/gpt at context=2 (all_to_all) equals 1 rank" "$tmp/gpt.c2a2a" "$tmp/gpt.1"
losses 4 "${gpt[@]}" --context 2 --zero-stage 2 >"$tmp/gpt.c2d2z2"
compare "examples/gpt at context=2 x data=2 with --zero-stage 2 equals 1 rank" "$tmp/gpt.c2d2z2" "$tmp/gpt.1"

refused() {  # refused NAME EXPECTED ARGS...: the run fails, naming EXPECTED at the example's line
  local name="$1" want="$2"; shift 2
  local err
  err=$("$bin" --nproc-per-node 4 --threads 1 "${gpt[@]}" --steps 1 "$@" 2>&1)
  local rc=$?
  if [ $rc -ne 0 ] && [[ "$err" == *"$want"* ]] && [[ "$err" == *"train.lua:"* ]]; then report 0 "$name"; else report 1 "$name (rc $rc): $err"; fi
}
refused "--zero-stage 4 is refused" "--zero-stage 4: expected 0 (off), 1, 2 or 3" --zero-stage 4
refused "--zero-groups without a stage is refused" "--zero-groups 2 needs --zero-stage 1, 2 or 3" --zero-groups 2
refused "zero groups that do not split the data ranks are refused" "must split into 3 group(s)" --zero-stage 1 --zero-groups 3
refused "ZeRO where the data group has one rank is refused" "the 1 data rank(s)" --zero-stage 1 --tensor 2 --pipeline 2
refused "a --seq that does not cut into 2 x context chunks is refused" "--seq 62 with --context 2" --context 2 --seq 62
refused "--context-mode without --context is refused" "--context-mode all_to_all needs --context 2 or more" --context-mode all_to_all
refused "GPT-2's attention dropout under --context is refused" "add --attn-dropout 0" --context 2 --dropout 0.1

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
