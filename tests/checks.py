"""What the Python test drivers share: check() prints one line a check (with the detail when it
fails) and finish() prints the count and exits non-zero on any failure. A driver imports it
with `sys.path.insert(0, <tests folder>)`."""
import sys

failures = []


def check(what, ok, detail=""):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)
        print("     " + str(detail)[:3000].replace("\n", "\n     "), flush=True)


def finish(what):
    print(f"{len(failures)} failure(s)" if failures else f"all {what} checks passed", flush=True)
    sys.exit(1 if failures else 0)
