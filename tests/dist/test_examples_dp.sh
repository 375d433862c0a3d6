#!/usr/bin/env bash
# The examples, parallel, equal their serial runs: the same global batch at 1, 2 and 4 ranks
# (data-parallel; GPT-2 also tensor=2 (with and without sequence parallelism), tensor=2 x data=2 and
# pipeline=2 (1F1B, 4 micro-batches) through policies/gpt2.lua, with gradient clipping) gives the same loss at every one of 20 steps (within 1e-5 relative)
# through the real launcher. Usage: test_examples_dp.sh PATH/TO/partrain
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

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
