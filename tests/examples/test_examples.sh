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

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
