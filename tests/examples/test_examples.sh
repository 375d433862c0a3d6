#!/usr/bin/env bash
# The examples as a user runs them: the MNIST example reaches 85 % test accuracy within its
# default 3 epochs, and the tutorial model's example trains.
# Usage: test_examples.sh PATH/TO/partrain
set -u
bin="$(realpath "$1")"
passed=0 failed=0
report() { if [ "$1" = 0 ]; then passed=$((passed + 1)); echo "[ OK ] $2"; else failed=$((failed + 1)); echo "[FAIL] $2"; fi; }

out=$("$bin" --threads 1 examples/mnist/train.lua --log-every 500 2>&1)
status=$?
echo "$out" | tail -4
acc=$(echo "$out" | awk -F'test_accuracy ' '/test_accuracy/ { a = $2 } END { print a }')
report $(( status != 0 )) "examples/mnist runs to the end"
report "$(awk -v a="${acc:-0}" 'BEGIN { print (a >= 0.85) ? 0 : 1 }')" "examples/mnist reaches >= 85 % test accuracy in 3 epochs (got ${acc:-none})"
report "$(echo "$out" | grep -c '^epoch 1 | step 500 | loss' | awk '{ print ($1 == 1) ? 0 : 1 }')" "examples/mnist prints the loss at its steps"

out=$("$bin" --threads 1 examples/simple/train.lua --steps 5 2>&1)
status=$?
report $(( status != 0 )) "examples/simple runs"
report "$(echo "$out" | grep -c '^step [0-9]* | loss' | awk '{ print ($1 == 5) ? 0 : 1 }')" "examples/simple prints a loss per step"

out=$("$bin" --threads 1 examples/gpt/train.lua --steps 10 --log-every 5 --sample 20 2>&1)
status=$?
report $(( status != 0 )) "examples/gpt runs"
report "$(echo "$out" | grep -c '^sample: And God said' | awk '{ print ($1 == 1) ? 0 : 1 }')" "examples/gpt prints a sample after its prompt"
first=$(echo "$out" | awk -F'loss ' '/^step 1 \|/ { split($2, a, " "); print a[1] }')
last=$(echo "$out" | awk -F'loss ' '/^step 10 \|/ { split($2, a, " "); print a[1] }')
report "$(awk -v a="${first:-0}" -v b="${last:-9}" 'BEGIN { print (b < a - 1) ? 0 : 1 }')" "examples/gpt's loss falls in 10 steps ($first -> $last)"

# examples/llama: the same script and flags with LLaMA (grouped-query attention), a sample at the end.
out=$("$bin" --threads 1 examples/llama/train.lua --steps 20 --log-every 10 --dim 64 --layers 2 --kv-heads 2 --sample 10 2>&1)
status=$?
report $(( status != 0 )) "examples/llama runs"
report "$(echo "$out" | grep -c '^sample: And God said' | awk '{ print ($1 == 1) ? 0 : 1 }')" "examples/llama prints a sample after its prompt"
first=$(echo "$out" | awk -F'loss ' '/^step 1 \|/ { split($2, a, " "); print a[1] }')
last=$(echo "$out" | awk -F'loss ' '/^step 20 \|/ { split($2, a, " "); print a[1] }')
report "$(awk -v a="${first:-0}" -v b="${last:-9}" 'BEGIN { print (b < a - 1) ? 0 : 1 }')" "examples/llama's loss falls in 20 steps ($first -> $last)"
out=$("$bin" --threads 1 examples/llama/train.lua --steps 1 --dropout 0.1 2>&1)
report "$(echo "$out" | grep -c 'LLaMA has no dropout' | awk '{ print ($1 >= 1) ? 0 : 1 }')" "examples/llama refuses --dropout"

# --dtype bfloat16: float32 masters kept by the optimizer; the loss falls as in float32.
out=$("$bin" --threads 1 examples/gpt/train.lua --steps 10 --log-every 5 --sample 5 --dtype bfloat16 2>&1)
status=$?
report $(( status != 0 )) "examples/gpt --dtype bfloat16 runs"
first=$(echo "$out" | awk -F'loss ' '/^step 1 \|/ { split($2, a, " "); print a[1] }')
last=$(echo "$out" | awk -F'loss ' '/^step 10 \|/ { split($2, a, " "); print a[1] }')
report "$(awk -v a="${first:-0}" -v b="${last:-9}" 'BEGIN { print (b < a - 1) ? 0 : 1 }')" "examples/gpt --dtype bfloat16's loss falls in 10 steps ($first -> $last)"

# --ckpt/--save-every: a run that stops saves; the next one resumes from its newest checkpoint.
ck=$(mktemp -d)
trap 'rm -rf "$ck"' EXIT
"$bin" --threads 1 examples/gpt/train.lua --steps 6 --log-every 2 --sample 0 --ckpt "$ck/gpt" --save-every 3 >/dev/null 2>&1
out=$("$bin" --threads 1 examples/gpt/train.lua --steps 10 --log-every 2 --sample 0 --ckpt "$ck/gpt" --save-every 5 2>&1)
report "$(echo "$out" | grep -c 'resumed from .*/step-00000006 at step 6' | awk '{ print ($1 == 1) ? 0 : 1 }')" "examples/gpt --ckpt resumes from its newest checkpoint"
report "$( [ "$(head -n 1 "$ck/gpt/newest")" = step-00000010 ] && echo 0 || echo 1)" "examples/gpt --save-every saves at its steps and at the end"  # newest: the tag, then its checksum
"$bin" --threads 1 examples/mnist/train.lua --steps 30 --log-every 10 --ckpt "$ck/mnist" --save-every 20 >/dev/null 2>&1
out=$("$bin" --threads 1 examples/mnist/train.lua --steps 40 --log-every 10 --ckpt "$ck/mnist" --save-every 20 2>&1)
at10=$(echo "$out" | grep -c '^epoch 1 | step 10 |'); at30=$(echo "$out" | grep -c '^epoch 1 | step 30 |')
report "$( [ "$at10" = 0 ] && [ "$at30" = 1 ] && echo 0 || echo 1)" "examples/mnist --ckpt resumes mid-epoch at step 20 (logs step 30, not step 10)"
"$bin" --threads 1 examples/simple/train.lua --steps 4 --ckpt "$ck/simple" --save-every 2 >/dev/null 2>&1
out=$("$bin" --threads 1 examples/simple/train.lua --steps 6 --ckpt "$ck/simple" --save-every 2 2>&1)
logged=$(echo "$out" | grep '^step [0-9]* | loss' | awk '{ printf "%s ", $2 }')
report "$( [ "$logged" = "5 6 " ] && echo 0 || echo 1)" "examples/simple --ckpt resumes at step 5 (logs steps 5 and 6 only: ${logged})"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
