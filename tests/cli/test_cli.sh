#!/usr/bin/env bash
# The partrain command as a user meets it: flags, exit codes, and the messages bad input gives:
# every number flag of the command, plan and ckpt out of range or malformed is one short line
# naming the flag, the value and the range; FIFOs, folders, devices and bytecode as files are
# refused, never waited on; plan, ckpt and repl stay commands beside files of those names, and
# repl takes partrain's flags after it. Usage: test_cli.sh PATH/TO/partrain
set -u
bin="$(realpath "$1")"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0 failed=0

# check NAME EXPECTED_STATUS PATTERN -- COMMAND...: runs COMMAND, wants its exit status
# ("nonzero" for any failure) and PATTERN (fixed text) in its combined output.
check() {
  local name="$1" want="$2" pattern="$3"
  shift 4
  local out status
  out=$("$@" 2>&1)
  status=$?
  local ok=1
  if [ "$want" = nonzero ]; then [ "$status" -ne 0 ] || ok=0; else [ "$status" -eq "$want" ] || ok=0; fi
  if [ -n "$pattern" ] && ! grep -qF -- "$pattern" <<<"$out"; then ok=0; fi
  if [ $ok = 1 ]; then
    passed=$((passed + 1)); echo "[ OK ] $name"
  else
    failed=$((failed + 1)); echo "[FAIL] $name (status $status, wanted $want and '$pattern')"; echo "$out" | head -20
  fi
}

check "--version names partrain and LibTorch" 0 "partrain 0.1" -- "$bin" --version
check "a mesh of more ranks than the world says how to start them" nonzero \
  "tensor=2 x pipeline=2 = 4 does not divide the world of 1 ranks (start it with partrain --nproc-per-node 4)" \
  -- "$bin" -e 'require("partrain").mesh { tensor = 2, pipeline = 2 }'
check "a mesh with an explicit data size says the ranks it needs" nonzero \
  "= 6 ranks, but the world has 1 (start it with partrain --nproc-per-node 6)" \
  -- "$bin" -e 'require("partrain").mesh { tensor = 3, data = 2 }' 
check "--help lists every flag" 0 "--threads" -- "$bin" --help
check "a misspelt flag gets the nearest one" 1 "--nproc-per-nod; did you mean --nproc-per-node?" -- "$bin" --nproc-per-nod 2 x.lua
check "a misspelt plan flag gets plan's nearest" 1 "--jsn; did you mean --json?" -- "$bin" plan --world 2 --jsn x.lua
check "--help lists -e" 0 "-e,--execute" -- "$bin" --help
check "no script and no -e is an error" nonzero "nothing to run" -- "$bin"
check "an unknown flag is an error" nonzero "--bogus" -- "$bin" --bogus
check "a missing script names the file" 1 "partrain: cannot read the script 'no/such.lua': No such file or directory" -- "$bin" no/such.lua
check "-e runs code" 0 "hello	3" -- "$bin" -e 'print("hello", 1 + 2)'
check "-e code can exit with a status" 3 "" -- "$bin" -e 'os.exit(3)'

printf 'local x = \n  = 2\n' > "$tmp/syntax.lua"
check "a syntax error names file and line" 1 "syntax.lua:2:" -- "$bin" "$tmp/syntax.lua"

printf 'local function f()\n  error("kaput")\nend\nf()\n' > "$tmp/runtime.lua"
check "a runtime error names file and line" 1 "runtime.lua:2: kaput" -- "$bin" "$tmp/runtime.lua"
check "a runtime error prints a traceback" 1 "stack traceback:" -- "$bin" "$tmp/runtime.lua"
first=$("$bin" "$tmp/runtime.lua" 2>&1 | head -1)
if [[ "$first" == "partrain: "*"runtime.lua:2: kaput" ]]; then passed=$((passed + 1)); echo "[ OK ] the first line is the whole message";
else failed=$((failed + 1)); echo "[FAIL] the first line is the whole message: $first"; fi

printf 'local pt = require "partrain"\nlocal a = pt.ones(2, 3)\nlocal b = a:matmul(pt.ones(2, 3))\n' > "$tmp/shape.lua"
check "a LibTorch error becomes a Lua error at the script line" 1 "shape.lua:3: mat1 and mat2 shapes cannot be multiplied" -- "$bin" "$tmp/shape.lua"

printf 'local pt = require "partrain"\nlocal x = pt.ones(2):sum(pt.ones(1))\n' > "$tmp/argtype.lua"
check "a wrong argument type names the argument" 1 "argtype.lua:2: bad argument #2 to 'sum'" -- "$bin" "$tmp/argtype.lua"

printf 'print(select("#", ...), table.concat({...}, " "), table.concat(arg, " "), arg[0], arg[-1])\n' > "$tmp/args.lua"
check "script arguments reach arg and ..." 0 "4	a --b c --help	a --b c --help	$tmp/args.lua	partrain" -- "$bin" "$tmp/args.lua" a --b c --help
check "partrain flags before the script are partrain's" 0 "0			$tmp/args.lua" -- "$bin" --threads 1 "$tmp/args.lua"

printf 'local pt = require "partrain"\nlocal cfg = pt.args { epochs = 3 }\nprint("epochs", cfg.epochs)\n' > "$tmp/cfg.lua"
check "pt.args reads overrides" 0 "epochs	1" -- "$bin" "$tmp/cfg.lua" --epochs 1
check "pt.args refuses unknown keys" 1 "cfg.lua:2: unknown option --epoch (known: --epochs)" -- "$bin" "$tmp/cfg.lua" --epoch 1
check "pt.args checks types" 1 "--epochs expects an integer, got 'x'" -- "$bin" "$tmp/cfg.lua" --epochs x
check "pt.args --help lists the options" 0 "--epochs" -- "$bin" "$tmp/cfg.lua" --help
check "a partrain flag after the script, spelled with _, is told where it goes" 1 "--nproc_per_node is partrain's own flag" -- "$bin" "$tmp/cfg.lua" --nproc_per_node 2
check "a bad PARTRAIN_HOME leaves ckpt, which runs no Lua, alone" 1 "cannot read the checkpoint folder" -- env PARTRAIN_HOME=/nonexistent "$bin" ckpt inspect "$tmp/none"
check "a partrain flag after the script is told where it goes" 1 "unknown option --nproc-per-node (known: --epochs); --nproc-per-node is partrain's own flag: it goes before the script (partrain --nproc-per-node ... $tmp/cfg.lua)" -- "$bin" "$tmp/cfg.lua" --nproc-per-node 2
# Every flag partrain --help lists gets that hint (the list in args.lua keeps up with the command).
flags=$("$bin" --help | grep -oE '^ +(-[a-z], ?)?--[a-z-]+' | sed 's/.*--//' | grep -vx help | tr '\n' ' ')
printf 'local pt = require "partrain"\nlocal missing = {}\nfor _, f in ipairs(arg) do\n  local ok, err = pcall(pt.args, { epochs = 3 }, { "--" .. f, "1" })\n  if ok or not tostring(err):find("is partrain.s own flag") then missing[#missing + 1] = f end\nend\nprint(#arg .. " flags, without the hint: " .. table.concat(missing, " "))\nos.exit(#missing == 0 and #arg > 20 and 0 or 1)\n' > "$tmp/flags.lua"
check "pt.args knows every flag of partrain --help" 0 "flags, without the hint: " -- "$bin" "$tmp/flags.lua" $flags

mkdir -p "$tmp/proj"
printf 'return { answer = 42 }\n' > "$tmp/proj/helper.lua"
printf 'local pt = require "partrain"\nprint("answer", require("helper").answer, pt.version)\n' > "$tmp/proj/main.lua"
check "require finds the script's own folder and partrain from anywhere" 0 "answer	42	0.1" -- bash -c "cd / && '$bin' '$tmp/proj/main.lua'"

# The subcommands that start no ranks: partrain plan and partrain ckpt.
check "partrain plan --help lists its flags" 0 "--world" -- "$bin" plan --help
check "partrain plan needs --world" 1 "--world" -- "$bin" plan "$tmp/cfg.lua"
check "partrain plan needs a script" 1 "give the script to plan" -- "$bin" plan --world 2
check "partrain plan names a missing script" 1 "cannot read the script 'no/such.lua'" -- "$bin" plan --world 2 no/such.lua
check "partrain ckpt --help lists its commands" 0 "inspect" -- "$bin" ckpt --help
check "partrain ckpt needs a command" 1 "subcommand" -- "$bin" ckpt
check "partrain ckpt inspect names a folder without a checkpoint" 1 "no checkpoint in '$tmp'" -- "$bin" ckpt inspect "$tmp"
check "partrain ckpt verify fails on a folder without a checkpoint" 1 "no checkpoint" -- "$bin" ckpt verify "$tmp"
check "partrain ckpt convert needs positive sizes" 1 "--tensor" -- "$bin" ckpt convert "$tmp" "$tmp/out" --tensor 0

# refuse NAME PATTERN -- COMMAND...: wants status 1, PATTERN in the output, and a short message:
# at most 2 lines of at most 200 characters (no usage text, no CLI11 essay). A bound of 30 s
# catches a hang (timeout's status 124 fails the check). Refusals run 4 at a time (each is a
# process start, mostly loading LibTorch); settle_refusals reports them in order.
refusals=0
refuse_one() {
  local name="$1" pattern="$2"
  shift 3
  local out status lines longest
  out=$(timeout 30 "$@" 2>&1 </dev/null)
  status=$?
  lines=$(printf '%s\n' "$out" | wc -l)
  longest=$(printf '%s\n' "$out" | awk '{ if (length($0) > m) m = length($0) } END { print m + 0 }')
  if [ "$status" -eq 1 ] && grep -qF -- "$pattern" <<<"$out" && [ "$lines" -le 2 ] && [ "$longest" -le 200 ]; then
    echo "[ OK ] $name"
  else
    echo "[FAIL] $name (status $status, $lines lines, longest $longest; wanted 1 and '$pattern')"
    echo "$out" | head -20
  fi
}
refuse() {
  refusals=$((refusals + 1))
  refuse_one "$@" >"$tmp/refusal.$(printf %03d $refusals)" &
  while [ "$(jobs -rp | wc -l)" -ge 4 ]; do sleep 0.05; done
}
settle_refusals() {
  wait
  for f in "$tmp"/refusal.*; do
    [ -e "$f" ] || continue
    cat "$f"
    if head -1 "$f" | grep -q '^\[ OK \]'; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
    rm -f "$f"
  done
}

# --- every number flag: in its range, or a short message naming the flag, the value and the range
refuse "PARTRAIN_MALLOC with a value that is not a choice is refused, naming it" "PARTRAIN_MALLOC='sytem' is not a choice: kept (the default: freed CPU memory stays in the heap) or system" -- env PARTRAIN_MALLOC=sytem "$bin" -e ""
refuse "--threads 0 is out of range" "--threads 0 is out of range: 1 to 1024" -- "$bin" --threads 0 -e ""
refuse "--threads 100000 is out of range (it used to hang)" "--threads 100000 is out of range: 1 to 1024" -- "$bin" --threads 100000 -e ""
refuse "--threads -3 is out of range" "--threads -3 is out of range" -- "$bin" --threads -3 -e ""
refuse "--threads abc is not a number" "--threads 'abc' is not a whole number (expected 1 to 1024)" -- "$bin" --threads abc -e ""
refuse "--threads 2.5 is not a whole number" "--threads '2.5' is not a whole number" -- "$bin" --threads 2.5 -e ""
refuse "--threads beyond 64 bits is out of range" "--threads 99999999999999999999999 is out of range" -- "$bin" --threads 99999999999999999999999 -e ""
refuse "--nproc-per-node 1000000 is out of range" "--nproc-per-node 1000000 is out of range: 1 to 1024" -- "$bin" --nproc-per-node 1000000 -e ""
refuse "--nproc-per-node 0 is out of range" "--nproc-per-node 0 is out of range: 1 to 1024" -- "$bin" --nproc-per-node 0 -e ""
refuse "--nproc-per-node x is not a number" "--nproc-per-node 'x' is not a whole number" -- "$bin" --nproc-per-node x -e ""
refuse "--nnodes 0 is out of range" "--nnodes 0 is out of range: 1 to 1024" -- "$bin" --nproc-per-node 1 --nnodes 0 -e ""
refuse "--nnodes 5000 is out of range" "--nnodes 5000 is out of range: 1 to 1024" -- "$bin" --nproc-per-node 1 --nnodes 5000 -e ""
refuse "--node-rank must be below --nnodes" "--node-rank 2 is out of range: 0 to 1" -- "$bin" --nproc-per-node 1 --nnodes 2 --node-rank 2 -e ""
refuse "--node-rank -1 is out of range" "--node-rank -1 is out of range: 0 to 0" -- "$bin" --nproc-per-node 1 --node-rank -1 -e ""
refuse "--master-port 0 is out of range" "--master-port 0 is out of range: 1 to 65535" -- "$bin" --nproc-per-node 1 --master-port 0 -e ""
refuse "--master-port http is not a number" "--master-port 'http' is not a whole number" -- "$bin" --nproc-per-node 1 --master-port http -e ""
refuse "--master-addr must resolve" "--master-addr 'no such host' is not an address" -- "$bin" --nproc-per-node 1 --master-addr "no such host" -e ""
refuse "--master-addr must not be empty" "--master-addr is empty" -- "$bin" --nproc-per-node 1 --master-addr "" -e ""
refuse "--timeout 0 is out of range" "--timeout 0 is out of range: 1 to 604800" -- "$bin" --timeout 0 -e ""
refuse "--timeout of a year is out of range" "--timeout 31536000 is out of range: 1 to 604800" -- "$bin" --timeout 31536000 -e ""
refuse "--plan-mode takes match, override or moo (short)" "--plan-mode 'maybe' is not one of match, override, moo" -- "$bin" --plan x --plan-mode maybe -e ""
refuse "a flag without its value names the flag" "--threads" -- "$bin" --threads
refuse "-e without code names the flag" "-e" -- "$bin" -e
refuse "an unknown flag is named, briefly" "--bogus" -- "$bin" --bogus -e ""
refuse "no script and no -e is a short error" "nothing to run" -- "$bin"
refuse "partrain plan --world 0 is out of range" "--world 0 is out of range: 1 to 65536" -- "$bin" plan --world 0 "$tmp/cfg.lua"
refuse "partrain plan --world 70000 is out of range" "--world 70000 is out of range: 1 to 65536" -- "$bin" plan --world 70000 "$tmp/cfg.lua"
refuse "partrain plan --world x is not a number" "--world 'x' is not a whole number" -- "$bin" plan --world x "$tmp/cfg.lua"
refuse "partrain plan --nproc-per-node above --world is out of range" "--nproc-per-node 8 is out of range: 1 to 4" -- "$bin" plan --world 4 --nproc-per-node 8 "$tmp/cfg.lua"
refuse "partrain plan --save into a folder is refused" "--save '$tmp' is a folder" -- "$bin" plan --world 2 --save "$tmp" "$tmp/cfg.lua"
refuse "partrain plan --save in a missing folder is refused" "its folder does not exist" -- "$bin" plan --world 2 --save "$tmp/no/plan.bin" "$tmp/cfg.lua"
refuse "partrain ckpt convert --tensor 0 is out of range" "--tensor 0 is out of range: 1 to 65536" -- "$bin" ckpt convert "$tmp" "$tmp/out" --tensor 0
refuse "partrain ckpt convert --data abc is not a number" "--data 'abc' is not a whole number" -- "$bin" ckpt convert "$tmp" "$tmp/out" --data abc
refuse "partrain ckpt --tag must be a plain name" "--tag '../x' is not a tag name" -- "$bin" ckpt inspect "$tmp" --tag ../x
refuse "partrain ckpt inspect of a missing folder names it" "cannot read the checkpoint folder '$tmp/none'" -- "$bin" ckpt inspect "$tmp/none"
refuse "partrain ckpt verify of a file names it" "'$tmp/cfg.lua' is not a folder" -- "$bin" ckpt verify "$tmp/cfg.lua"
refuse "partrain ckpt export into a folder is refused" "the output '$tmp' is a folder" -- "$bin" ckpt export "$tmp" "$tmp"
refuse "partrain ckpt with an unknown command names it" "ckpt: 'bogus' is not a command" -- "$bin" ckpt bogus "$tmp"
# An empty value had read as the flag not given: --plan "" trained without the check, plan
# --save "" saved nothing, ckpt --tag "" took the newest, all with status 0.
refuse "--plan '' is refused" "--plan is empty (expected a plan file)" -- "$bin" --plan "" -e ""
refuse "plan --save '' is refused" "--save: is empty (expected the file to write the plan to)" -- "$bin" plan --world 1 --save "" "$tmp/cfg.lua"
refuse "ckpt inspect --tag '' is refused" "--tag: is empty (expected a tag name)" -- "$bin" ckpt inspect "$tmp" --tag ""
refuse "ckpt export to '' is refused" "out: is empty (expected a file name)" -- "$bin" ckpt export "$tmp" ""
refuse "report --trace '' is refused" "--trace: is empty (expected a trace file)" -- "$bin" report "$tmp/none.jsonl" --trace ""
refuse "an empty script name is refused as itself" "the script's name is empty" -- "$bin" "" a
# Seconds: decimal numbers in the range; --hang-timeout below 1 s had stopped healthy runs.
refuse "--hang-timeout 1e-300 is out of range" "--hang-timeout 1e-300 is out of range: a number of seconds from 1 to 604800, or 0 (off)" -- "$bin" --nproc-per-node 1 --hang-timeout 1e-300 -e ""
refuse "--hang-timeout 0x10 is not decimal" "--hang-timeout '0x10' is not a number of seconds" -- "$bin" --nproc-per-node 1 --hang-timeout 0x10 -e ""
refuse "--hang-timeout ' 5' is refused" "--hang-timeout ' 5' is not a number of seconds" -- "$bin" --nproc-per-node 1 --hang-timeout " 5" -e ""
refuse "--restart-backoff inf is refused" "--restart-backoff 'inf' is not a number of seconds from 0 to 3600" -- "$bin" --nproc-per-node 1 --restart-backoff inf -e ""
# The environment variables that stand in for flags are checked as the flags are, before any rank starts.
printf 'x = 1\n' > "$tmp/victim.lua"
refuse "PARTRAIN_METRICS naming a script is refused before the run" "PARTRAIN_METRICS '$tmp/victim.lua' exists and is not a JSON-lines metrics file" -- env PARTRAIN_METRICS="$tmp/victim.lua" "$bin" -e ""
refuse "PARTRAIN_METRICS naming a folder is refused" "PARTRAIN_METRICS '$tmp' is a folder" -- env PARTRAIN_METRICS="$tmp" "$bin" -e ""
refuse "a bad PARTRAIN_HOME is refused before plan runs" "PARTRAIN_HOME '$tmp' is not a partrain installation" -- env PARTRAIN_HOME="$tmp" "$bin" plan --world 1 "$tmp/cfg.lua"
refuse "a bad PARTRAIN_DEVICE is refused before ranks start" "PARTRAIN_DEVICE: unknown device 'tpu'" -- env PARTRAIN_DEVICE=tpu "$bin" --nproc-per-node 2 -e ""
refuse "a PARTRAIN_HOME that is no installation is refused" "PARTRAIN_HOME '$tmp' is not a partrain installation" -- env PARTRAIN_HOME="$tmp" "$bin" -e ""
refuse "RANK with a leading space is refused" "environment variable RANK=' 0' is not an integer" -- env RANK=" 0" WORLD_SIZE=1 "$bin" -e ""
settle_refusals
# plan --save over a file that is not a plan is refused before planning, not minutes later.
start=$(date +%s%N)
check "plan --save over a script is refused before planning" 1 "plan: --save '$tmp/victim.lua' exists and is not a partrain plan" -- "$bin" plan --world 4096 --save "$tmp/victim.lua" "$tmp/cfg.lua"
took=$(( ($(date +%s%N) - start) / 1000000 ))
if [ "$took" -lt 5000 ]; then passed=$((passed + 1)); echo "[ OK ] ... in ${took} ms"
else failed=$((failed + 1)); echo "[FAIL] plan --save's refusal took ${took} ms (planned first?)"; fi
check "an empty PARTRAIN_DEVICE is the default device, as a rank reads it" 0 "ran" -- env PARTRAIN_DEVICE= PARTRAIN_HOME= "$bin" -e 'print("ran")'
check "parity -o '' is refused" 2 "-o is empty (expected the HTML file to write)" -- "$bin" parity a.jsonl b.jsonl -o ""
check "parity --tol= is refused" 2 "--tol is empty" -- "$bin" parity a.jsonl b.jsonl --tol=
# `--` makes the next word the script, even one that looks like a flag or a subcommand; its
# arguments all reach it (the first had been dropped).
printf 'print("n=" .. #arg, table.concat(arg, ","))\n' > "$tmp/-dash.lua"
check "-- then a script named like a flag keeps every argument" 0 "n=3	one,two,three" -- env -C "$tmp" "$bin" -- -dash.lua one two three
cp "$tmp/-dash.lua" "$tmp/plan"
check "-- then a script named plan runs it" 0 "n=1	x" -- env -C "$tmp" "$bin" -- plan x
out=$(timeout 60 "$bin" --threads 1024 -e 'print("ran")' 2>&1); status=$?
[ $status -eq 0 ] && grep -q ran <<<"$out"; if [ $? = 0 ]; then passed=$((passed + 1)); echo "[ OK ] --threads 1024 (the top of the range) runs"
else failed=$((failed + 1)); echo "[FAIL] --threads 1024 (the top of the range) runs (status $status)"; echo "$out" | head; fi

# --- files the command line names: regular files only, never a wait on a FIFO ------------------
mkfifo "$tmp/fifo"
refuse "a FIFO as the script is refused, not waited on" "the script '$tmp/fifo' is a FIFO" -- "$bin" "$tmp/fifo"
refuse "a folder as the script is refused" "the script '$tmp' is a folder" -- "$bin" "$tmp"
refuse "a device as the script is refused" "the script '/dev/zero' is a character device" -- "$bin" /dev/zero
refuse "a FIFO as the script is refused before ranks start" "is a FIFO" -- "$bin" --nproc-per-node 2 "$tmp/fifo"
refuse "partrain plan refuses a FIFO as the script" "is a FIFO" -- "$bin" plan --world 2 "$tmp/fifo"
refuse "--plan of a folder is refused (not basic_filebuf::underflow)" "the plan (--plan) '$tmp' is a folder" -- "$bin" --plan "$tmp" -e ""
refuse "--plan of a FIFO is refused" "the plan (--plan) '$tmp/fifo' is a FIFO" -- "$bin" --plan "$tmp/fifo" -e ""
refuse "--plan of a missing file is refused up front in match mode" "there is no plan at '$tmp/none.bin'" -- "$bin" --plan "$tmp/none.bin" -e ""
"$bin" -e "io.open('$tmp/bytecode.lua', 'wb'):write(string.dump(function() print('x') end))"
refuse "a LuaJIT bytecode file is refused (LuaJIT does not verify bytecode)" "bytecode.lua: LuaJIT bytecode; partrain runs Lua source only" -- "$bin" "$tmp/bytecode.lua"
refuse "bytecode through -e is refused" "LuaJIT bytecode" -- "$bin" -e "$(head -c 4 "$tmp/bytecode.lua")"
settle_refusals
printf 'local pt = require "partrain"\npt.parallelize(pt.models.mlp { sizes = { 4, 2 } }, nil, pt.mesh {})\npt.breakpoint()\n' > "$tmp/planbp.lua"
check "partrain plan skips pt.breakpoint(), saying so" 0 "pt.breakpoint() at $tmp/planbp.lua:3 skipped: partrain plan does not stop at breakpoints" -- "$bin" plan --world 2 "$tmp/planbp.lua"
printf '#!/usr/bin/env partrain\nprint("shebang", 1)\nerror("at line 3")\n' > "$tmp/shebang.lua"
check "a #! first line is skipped and line numbers stay right" 1 "shebang.lua:3: at line 3" -- "$bin" "$tmp/shebang.lua"

# --- plan, ckpt and repl are commands whatever the working folder holds -------------------------
mkdir -p "$tmp/cwd/ckpt" "$tmp/cwd/plan" "$tmp/cwd/repl" "$tmp/cwd2"
check "partrain ckpt verify is the command even beside a folder named ckpt" 1 "no checkpoint" -- bash -c "cd '$tmp/cwd' && '$bin' ckpt verify '$tmp'"
printf 'local pt = require "partrain"\npt.parallelize(pt.models.mlp { sizes = { 4, 2 } }, nil, pt.mesh {})\n' > "$tmp/par.lua"
check "partrain plan is the command even beside a folder named plan" 0 "rank" -- bash -c "cd '$tmp/cwd' && '$bin' plan --world 2 '$tmp/par.lua'"
check "partrain repl is the command even beside a folder named repl" 0 "" -- bash -c "cd '$tmp/cwd' && '$bin' repl </dev/null"
printf 'print("the script named plan ran")\n' > "$tmp/cwd2/plan"
check "a script named plan runs as ./plan" 0 "the script named plan ran" -- bash -c "cd '$tmp/cwd2' && '$bin' ./plan"
check "partrain repl takes launcher flags after it" 0 "" -- bash -c "'$bin' repl --nproc-per-node 2 --threads 1 --timeout 30 </dev/null"
check "partrain repl -e runs the chunk first" 0 "chunk ran" -- bash -c "'$bin' repl -e 'print(\"chunk ran\")' </dev/null"
refuse "partrain repl refuses a bad flag after it, naming it" "--threads 0 is out of range" -- "$bin" repl --threads 0
refuse "partrain repl refuses an unknown flag after it" "--bogus" -- "$bin" repl --bogus
refuse "partrain repl refuses a script after it" "repl takes partrain's flags only, not 'x.lua'" -- "$bin" repl x.lua
refuse "partrain flags before plan are refused, briefly" "plan takes no partrain flags before it" -- "$bin" --threads 2 plan --world 2 "$tmp/cfg.lua"
settle_refusals

# --- outputs: never written over a device, a FIFO, a link, or a file of another kind -------------
mkdir -p "$tmp/out"
printf 'local pt = require "partrain"\nfor s = 1, 3 do pt.log { step = s, loss = 1 / s } end\n' > "$tmp/out/log.lua"
cp "$tmp/out/log.lua" "$tmp/out/keep.lua"
"$bin" --metrics "$tmp/out/m.jsonl" "$tmp/out/log.lua" >/dev/null
mkfifo "$tmp/out/fifo"
ln -s "$tmp/out/m.jsonl" "$tmp/out/link"
check "report -o over its own metrics file is refused" 1 "-o '$tmp/out/m.jsonl' exists and is not an HTML report" -- "$bin" report "$tmp/out/m.jsonl" -o "$tmp/out/m.jsonl"
check "report -o over a script is refused" 1 "exists and is not an HTML report" -- "$bin" report "$tmp/out/m.jsonl" -o "$tmp/out/keep.lua"
check "report -o of a device is refused" 1 "-o '/dev/null' is a character device" -- "$bin" report "$tmp/out/m.jsonl" -o /dev/null
check "report -o of a FIFO is refused" 1 "is a FIFO" -- "$bin" report "$tmp/out/m.jsonl" -o "$tmp/out/fifo"
check "report -o of a link is refused" 1 "is a symbolic link" -- "$bin" report "$tmp/out/m.jsonl" -o "$tmp/out/link"
check "report -o writes a new page" 0 "wrote $tmp/out/r.html" -- "$bin" report "$tmp/out/m.jsonl" -o "$tmp/out/r.html"
check "report -o replaces a page it wrote" 0 "wrote $tmp/out/r.html" -- "$bin" report "$tmp/out/m.jsonl" -o "$tmp/out/r.html"
check "parity -o over an input is refused" 2 "exists and is not an HTML report" -- "$bin" parity "$tmp/out/m.jsonl" "$tmp/out/m.jsonl" -o "$tmp/out/m.jsonl"
# One rule for every file partrain writes, whoever names it: pt.metrics(path) in a script (and an
# example's --metrics) as partrain --metrics (it had appended through the link).
check "--metrics through a link is refused" 1 "is a symbolic link" -- "$bin" --metrics "$tmp/out/link" "$tmp/out/log.lua"
before=$(cat "$tmp/out/m.jsonl")
check "pt.metrics(path) through a link is refused" 1 "is a symbolic link" -- "$bin" -e "local pt = require 'partrain'; pt.metrics('$tmp/out/link'); pt.log { step = 1, loss = 1 }"
check "pt.metrics(path) over a script is refused" 1 "is not a JSON record (local pt = require" -- "$bin" -e "local pt = require 'partrain'; pt.metrics('$tmp/out/keep.lua'); pt.log { step = 1, loss = 1 }"
check "the link's target and the script are left as they were" 0 "" -- \
  bash -c '[ "$1" = "$(cat "$2")" ] && cmp -s "$3" "$4"' _ "$before" "$tmp/out/m.jsonl" "$tmp/out/keep.lua" "$tmp/out/log.lua"
check "--metrics naming a script is refused before it runs" 1 "--metrics '$tmp/out/keep.lua' exists and is not a JSON-lines metrics file" -- "$bin" --metrics "$tmp/out/keep.lua" "$tmp/out/keep.lua"
# A name the file system cannot take is refused before the run, with the system's reason (a
# 300-character --metrics name had failed only at the first pt.log, after a training step).
long=$(printf 'a%.0s' $(seq 300))
check "--metrics with a name too long is refused before the run" 1 "--metrics '$tmp/out/$long.jsonl': File name too long" -- "$bin" --metrics "$tmp/out/$long.jsonl" -e 'print("ran")'
check "PARTRAIN_METRICS with a name too long is refused before the run" 1 "PARTRAIN_METRICS '$tmp/out/$long': File name too long" -- env PARTRAIN_METRICS="$tmp/out/$long" "$bin" -e 'print("ran")'
check "--trace with a name too long is refused before the run" 1 "--trace '$tmp/out/$long.json': File name too long" -- "$bin" --trace "$tmp/out/$long.json" -e 'print("ran")'
check "--metrics under a file, not a folder, is refused before the run" 1 "--metrics '$tmp/out/keep.lua/m.jsonl': Not a directory" -- "$bin" --metrics "$tmp/out/keep.lua/m.jsonl" -e 'print("ran")'
check "--trace naming a script is refused before it runs" 1 "--trace '$tmp/out/keep.lua' exists and is not a trace partrain wrote" -- "$bin" --trace "$tmp/out/keep.lua" "$tmp/out/keep.lua"
check "plan --save over a script is refused" 1 "exists and is not a partrain plan" -- "$bin" plan --world 2 --save "$tmp/out/keep.lua" "$tmp/par.lua"
printf 'local pt = require "partrain"\npt.ckpt.save(arg[1], { model = pt.models.mlp { sizes = { 4, 2 } }, step = 1 })\n' > "$tmp/out/save.lua"
"$bin" "$tmp/out/save.lua" "$tmp/out/ck" >/dev/null
check "ckpt export over the checkpoint's own data file is refused" 1 "exists and is not a .safetensors file" -- "$bin" ckpt export "$tmp/out/ck" "$tmp/out/ck/step-00000001/rank-00000.bin"
check "ckpt export to a device is refused" 1 "'/dev/null' is a character device" -- "$bin" ckpt export "$tmp/out/ck" /dev/null
# A destination inside the tag had nested a checkpoint in it, status 0.
check "ckpt convert into a tag's folder is refused" 1 "the destination '$tmp/out/ck/step-00000001' is one tag's folder" -- "$bin" ckpt convert "$tmp/out/ck" "$tmp/out/ck/step-00000001"
check "ckpt convert inside the tag it converts is refused" 1 "is inside the tag being converted" -- "$bin" ckpt convert "$tmp/out/ck" "$tmp/out/ck/step-00000001/../step-00000001/x"
mkdir -p "$tmp/out/fiforun" && mkfifo "$tmp/out/fiforun/metrics.jsonl"
check "report of a run folder whose metrics.jsonl is a FIFO says so" 1 "holds a metrics.jsonl that is not a regular file" -- "$bin" report "$tmp/out/fiforun" -o "$tmp/out/f.html"
check "the script given as an output is intact" 0 "" -- cmp "$tmp/out/log.lua" "$tmp/out/keep.lua"
check "and the device is still one" 0 "" -- test -c /dev/null
printf '{"step":1,"loss":1}\nnot a record\n' > "$tmp/out/notes.jsonl"
check "a metrics file with a line that is not a record is left as it is, not rewritten" 1 "has a line 2 that is not a JSON record" -- "$bin" --metrics "$tmp/out/notes.jsonl" "$tmp/out/log.lua"
printf '{"lr": 0.1, "steps": 100}' > "$tmp/out/config.json"; cp "$tmp/out/config.json" "$tmp/out/config.keep"
check "a JSON file given as --metrics (one object, no newline) is refused, not emptied" 1 \
  "ends with a JSON value on a line without its newline" -- "$bin" --metrics "$tmp/out/config.json" "$tmp/out/log.lua"
check "and the JSON file is intact" 0 "" -- cmp "$tmp/out/config.json" "$tmp/out/config.keep"
printf '{"step":1,"loss":1}\n{"step":2,"x":%s%s}\n' "$(printf '[%.0s' $(seq 3000))" "$(printf ']%.0s' $(seq 3000))" > "$tmp/out/deep.jsonl"
check "a metrics file with a line nested 3000 deep is refused, not a crash" 1 "has a line 2 that is not a JSON record" \
  -- "$bin" --metrics "$tmp/out/deep.jsonl" "$tmp/out/log.lua"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
