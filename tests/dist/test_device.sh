#!/usr/bin/env bash
# Each rank's device: --device and PARTRAIN_DEVICE set it explicitly (cpu here), pt.device() says
# it, and modules, models and loader batches land there; devices this machine cannot have (cuda:0
# without CUDA), unknown devices (tpu) and malformed ones (cuda:x) are refused with a message
# naming the value; the launcher passes the device to every rank, and groups and the engine's own
# collectives run on it. Usage: test_device.sh PATH/TO/partrain
set -u
bin="$(realpath "$1")"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0 failed=0
report() { if [ "$1" = 0 ]; then passed=$((passed + 1)); echo "[ OK ] $2"; else failed=$((failed + 1)); echo "[FAIL] $2"; echo "$3" | head -20; fi; }
has() { grep -qF -- "$2" <<<"$1"; }

# What a rank reports: its device, where a new module, a model and a batch live, and the device
# variable it inherited.
cat >"$tmp/where.lua" <<'EOF'
local pt = require "partrain"
local lin = pt.nn.Linear(3, 2)
local gpt = pt.models.gpt2 { vocab = 16, seq = 4, dim = 8, heads = 2, layers = 1 }
local data = pt.data.text { path = "data/kjv.txt", seq = 4, batch = 2 }
local x, y = data:next()
print(("rank %d device=%s linear=%s gpt2=%s batch=%s,%s env=%s"):format(pt.dist.rank(), pt.device(),
  lin.weight.device, gpt:parameters()[1].device, x.device, y.device, tostring(os.getenv("PARTRAIN_DEVICE"))))
EOF

out=$("$bin" --threads 1 --device cpu "$tmp/where.lua" 2>&1); s=$?
[ $s = 0 ] && has "$out" "rank 0 device=cpu linear=cpu gpt2=cpu batch=cpu,cpu env=cpu"; report $? "--device cpu: pt.device(), a module, a model and a batch are on cpu" "$out"

out=$(PARTRAIN_DEVICE=cpu "$bin" --threads 1 "$tmp/where.lua" 2>&1); s=$?
[ $s = 0 ] && has "$out" "rank 0 device=cpu linear=cpu gpt2=cpu batch=cpu,cpu env=cpu"; report $? "PARTRAIN_DEVICE=cpu sets the device" "$out"

out=$("$bin" --threads 1 --nproc-per-node 2 --tee --device cpu "$tmp/where.lua" 2>&1); s=$?
[ $s = 0 ] && has "$out" "rank 0 device=cpu linear=cpu gpt2=cpu batch=cpu,cpu env=cpu" &&
  has "$out" "rank 1 device=cpu linear=cpu gpt2=cpu batch=cpu,cpu env=cpu"
report $? "the launcher passes --device to every rank" "$out"

# The engine's own collectives (verify under --check-collectives, all_gather_strings behind
# the sharder's first-error exchange) run on the device at 2 ranks.
cat >"$tmp/collect.lua" <<'EOF'
local pt = require "partrain"
local t = pt.ones { 2 } * (pt.dist.rank() + 1)
pt.dist.world():all_reduce(t)
local first, from = require("partrain.core").dist._first_error(pt.dist.rank() == 1 and "r1" or "")
print(("rank %d sum=%g first=%s from=%d"):format(pt.dist.rank(), t:sum():item() / 2, first, from))
EOF
out=$("$bin" --threads 1 --nproc-per-node 2 --tee --device cpu --check-collectives "$tmp/collect.lua" 2>&1); s=$?
[ $s = 0 ] && has "$out" "rank 0 sum=3 first=r1 from=1" && has "$out" "rank 1 sum=3 first=r1 from=1"
report $? "groups and checked collectives run on --device cpu" "$out"

# Refusals: one line naming the value, before any script runs.
refuse() {  # refuse NAME PATTERN -- COMMAND...
  local name="$1" pattern="$2"
  shift 3
  local out s
  out=$("$@" -e 'print("ran")' 2>&1); s=$?
  [ $s != 0 ] && has "$out" "$pattern" && ! has "$out" "ran" && ! has "$out" "Exception raised from"
  report $? "$name" "$out"
}
if ! "$bin" --threads 1 -e 'os.exit(require("partrain").device():match("^cuda") and 0 or 1)' 2>/dev/null; then
  refuse "--device cuda:0 without CUDA is refused" "--device: device 'cuda:0' needs CUDA, but this LibTorch sees no CUDA device" -- "$bin" --device cuda:0
  refuse "--device cuda without CUDA is refused" "device 'cuda' needs CUDA" -- "$bin" --device cuda
  refuse "PARTRAIN_DEVICE=cuda:0 without CUDA is refused" "PARTRAIN_DEVICE: device 'cuda:0' needs CUDA" -- env PARTRAIN_DEVICE=cuda:0 "$bin"
  refuse "the launcher refuses --device cuda:0 once, before any rank" "--device: device 'cuda:0' needs CUDA" -- "$bin" --nproc-per-node 2 --device cuda:0
else
  echo "[SKIP] CUDA is present: the no-CUDA refusals do not apply"
fi
refuse "--device tpu is refused" "--device: unknown device 'tpu' (expected cpu, cuda or cuda:N)" -- "$bin" --device tpu
refuse "--device cuda:x is refused" "--device: unknown device 'cuda:x' (expected cpu, cuda or cuda:N)" -- "$bin" --device cuda:x
refuse "--device cuda:-1 is refused" "unknown device 'cuda:-1'" -- "$bin" --device cuda:-1
refuse "an empty --device is refused" "--device is empty" -- "$bin" --device ""
refuse "PARTRAIN_DEVICE=tpu is refused" "PARTRAIN_DEVICE: unknown device 'tpu'" -- env PARTRAIN_DEVICE=tpu "$bin"
refuse "a rank with PARTRAIN_DEVICE=tpu is refused" "PARTRAIN_DEVICE: unknown device 'tpu'" -- \
  env PARTRAIN_DEVICE=tpu RANK=0 WORLD_SIZE=1 "$bin"

echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
