#!/usr/bin/env bash
# The GPU tests (ctest label cuda): skipped, with exit code 77 and a message, where partrain sees
# no CUDA device. Otherwise, on cuda:0: tests/dist/test_cuda.lua at 2 ranks over Gloo (both on
# the one GPU) and the checkpoint's round trip through the CPU; NCCL at world 1; pt.cuda and
# fused AdamW (tests/lua/test_cuda.lua) on the device.
# Usage: test_cuda.sh PATH/TO/partrain   (PARTRAIN_TEST_DEVICE=cpu runs the same on the CPU, to
# check the scripts themselves)
set -u
bin="$(realpath "$1")"
device="${PARTRAIN_TEST_DEVICE:-cuda:0}"
if [ "$device" != cpu ] && ! "$bin" --device cpu -e 'os.exit(require("partrain").cuda.is_available() and 0 or 1)'; then
  echo "SKIP: no CUDA device (this partrain's LibTorch sees none, or was built without CUDA)"
  exit 77
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0 failed=0
report() { if [ "$1" = 0 ]; then passed=$((passed + 1)); echo "[ OK ] $2"; else failed=$((failed + 1)); echo "[FAIL] $2"; echo "$3" | tail -30; fi; }

out=$(PARTRAIN_BACKEND=gloo "$bin" --nproc-per-node 2 --threads 1 --device "$device" tests/dist/test_cuda.lua \
      --dir "$tmp/gpu" 2>&1); report $? "2 ranks on $device over Gloo: data and tensor parallel equal serial; checkpoint and generators" "$out"
out=$("$bin" --threads 1 --device cpu tests/dist/test_cuda.lua --phase cpu_load --saved-on "$device" \
      --dir "$tmp" 2>&1)
report $? "the checkpoint saved on $device loads on the CPU" "$out"
out=$("$bin" --threads 1 --device "$device" tests/dist/test_cuda.lua --phase compare --dir "$tmp" 2>&1)
report $? "saved on $device, through the CPU, back on $device: the same bits" "$out"
if [ "$device" != cpu ]; then
  cat >"$tmp/nccl.lua" <<'LUA'
local pt = require "partrain"
local t = pt.ones({ 4 }, { device = pt.device() })
pt.dist.world():all_reduce(t)
assert(t:sum():item() == 4, "all_reduce at world 1")
print("nccl ok")
LUA
  out=$(PARTRAIN_BACKEND=nccl "$bin" --nproc-per-node 1 --threads 1 --device "$device" "$tmp/nccl.lua" 2>&1); s=$?
  [ $s = 0 ] && grep -q "nccl ok" <<<"$out"; report $? "NCCL at world 1 on $device" "$out"
  out=$("$bin" --threads 1 --device "$device" tests/lua/test_cuda.lua 2>&1)
  report $? "pt.cuda and fused AdamW on $device" "$out"
fi
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
