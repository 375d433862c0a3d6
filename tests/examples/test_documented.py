#!/usr/bin/env python3
"""Every command documented at the top of an example (its `--   partrain ...` lines) runs to the
end, for a few steps: the flags a user copies from the header must work together.

Usage: test_documented.py PATH/TO/partrain   (from the repository root)
"""
import os
import re
import shlex
import subprocess
import sys
import tempfile

ROOT = os.getcwd()
# Flags that keep each run short, by example; appended after the documented ones (the last wins).
SHORT = {
    "gpt": ["--steps", "2", "--sample", "4", "--log-every", "1"],
    "llama": ["--steps", "2", "--sample", "4", "--log-every", "1"],
    "mnist": ["--steps", "2", "--epochs", "1"],
    "simple": ["--steps", "2"],
}


def documented():
    """(example, argv after `partrain`) for every documented command line."""
    for name in sorted(os.listdir(os.path.join(ROOT, "examples"))):
        path = os.path.join(ROOT, "examples", name, "train.lua")
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.startswith("--"):
                    break
                m = re.match(r"^--\s+partrain\s+(.*)$", line.rstrip())
                if not m:
                    continue
                text = re.sub(r"\s+\(.*\)\s*$", "", m.group(1))  # a trailing (explanation)
                text = re.sub(r"\[[^\]]*\]", "", text).replace("...", "")  # [optional flags]
                yield name, shlex.split(text)


def main():
    binary = os.path.realpath(sys.argv[1])
    passed = failed = 0
    for name, argv in documented():
        with tempfile.TemporaryDirectory() as work:
            # Run where a user would: the repository's examples and data, files written to a fresh folder.
            for entry in ("examples", "data", "policies"):
                os.symlink(os.path.join(ROOT, entry), os.path.join(work, entry))
            cmd = [binary, "--threads", "1"] + argv + SHORT.get(name, [])
            try:
                run = subprocess.run(cmd, cwd=work, capture_output=True, timeout=240)
                out = (run.stdout + run.stderr).decode("utf-8", "replace")
                good = run.returncode == 0 and re.search(r"(^|\| )step 2 \|", out, re.M) is not None
            except subprocess.TimeoutExpired:
                out, good = "timed out after 240 s", False
            label = "partrain " + " ".join(argv)
            if good:
                passed += 1
                print("[ OK ] " + label)
            else:
                failed += 1
                print("[FAIL] " + label + "\n" + "\n".join(out.splitlines()[-15:]))
    print(f"{passed} passed, {failed} failed")
    if passed == 0:
        print("no documented commands found")
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
