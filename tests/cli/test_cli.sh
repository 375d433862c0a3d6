#!/usr/bin/env bash
# The partrain command as a user meets it: flags, exit codes, and the messages bad input gives.
# Usage: test_cli.sh PATH/TO/partrain
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
check "--help lists every flag" 0 "--threads" -- "$bin" --help
check "--help lists -e" 0 "-e,--execute" -- "$bin" --help
check "no script and no -e is an error" nonzero "nothing to run" -- "$bin"
check "an unknown flag is an error" nonzero "--bogus" -- "$bin" --bogus
check "a bad --threads is an error" nonzero "threads" -- "$bin" --threads 0 -e ""
check "a missing script names the file" 1 "partrain: cannot open script 'no/such.lua'" -- "$bin" no/such.lua
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

mkdir -p "$tmp/proj"
printf 'return { answer = 42 }\n' > "$tmp/proj/helper.lua"
printf 'local pt = require "partrain"\nprint("answer", require("helper").answer, pt.version)\n' > "$tmp/proj/main.lua"
check "require finds the script's own folder and partrain from anywhere" 0 "answer	42	0.1" -- bash -c "cd / && '$bin' '$tmp/proj/main.lua'"

# The subcommands that start no ranks: partrain plan and partrain ckpt.
check "partrain plan --help lists its flags" 0 "--world" -- "$bin" plan --help
check "partrain plan needs --world" 1 "--world" -- "$bin" plan "$tmp/cfg.lua"
check "partrain plan needs a script" 1 "give the script to plan" -- "$bin" plan --world 2
check "partrain plan names a missing script" 1 "cannot open script 'no/such.lua'" -- "$bin" plan --world 2 no/such.lua
check "partrain ckpt --help lists its commands" 0 "inspect" -- "$bin" ckpt --help
check "partrain ckpt needs a command" 1 "subcommand" -- "$bin" ckpt
check "partrain ckpt inspect names a folder without a checkpoint" 1 "no checkpoint in '$tmp'" -- "$bin" ckpt inspect "$tmp"
check "partrain ckpt verify fails on a folder without a checkpoint" 1 "no checkpoint" -- "$bin" ckpt verify "$tmp"
check "partrain ckpt convert needs positive sizes" 1 "--tensor" -- "$bin" ckpt convert "$tmp" "$tmp/out" --tensor 0
check "--plan-mode takes match, override or moo" 1 "--plan-mode" -- "$bin" --plan x --plan-mode maybe -e ""

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
