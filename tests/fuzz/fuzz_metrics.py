#!/usr/bin/env python3
"""Metrics files (JSON lines) given to `partrain report` and `partrain parity`, generated from a
seed and damaged: every outcome is compared with a reference reader written from
docs/observability.md's rules and app/metrics.cpp's documented behaviour.

Usage: fuzz_metrics.py PATH/TO/partrain [--seed N] [--cases N]

Each case writes one to three metrics files (or run folders holding metrics.jsonl; 33 to 40 for
"many files"), damages some of them, and runs `partrain report FILES -o page.html` (even cases)
or `partrain parity A B [--steps N] [--tol T]` (odd cases; B is A with its losses nudged, so
that the runs agree or diverge), each its own process bounded to 30 s and to
common.MEMORY_LIMIT bytes of address space, two at a time. The reference reader decides, line by
line: NaN, Infinity, nan and inf outside strings read as null; a line nested deeper than 64
brackets, a line that is not a JSON object (a torn last line without its newline is skipped), an
"event" that is not a string, a memory record without a list of numbers, a plan record without
its text, a record with neither event nor step, a step that is not a finite number, and (parity,
for a loss) a step that is not whole and in [0, 9e15) are refused naming FILE:LINE; a line
longer than 16 MiB, naming its line; a file without step records (report) or losses (parity)
naming the file. A case passes when partrain refuses exactly where the reference does, naming
that file (and line), in one short message, and otherwise reports what the reference read:
report's page gives each file's step count, first and last step and final loss; parity's exit
status, common steps, largest difference and the step where it diverged are the reference's.

Classes: valid, deep nesting, long lines, torn lines, huge numbers, non-finite, wrong types,
binary, events, order and repeats, encodings, many files, special files.
"""
import json
import math
import os
import random
import re
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

BIN = os.path.realpath(sys.argv[1])
SEED = common.seed_from_argv()
CASES = common.int_flag("--cases", 260)
MAX_DEPTH = 64
MAX_LINE = 16 << 20
MAX_RANKS = 65536
MAX_SERIES = 32
MAX_RUNS = 32


# ---- the reference reader ---------------------------------------------------------------

class Refused(Exception):
    def __init__(self, path, line=None, why=""):
        super().__init__(why)
        self.path, self.line, self.why = path, line, why


WORDS = [b"-Infinity", b"Infinity", b"-NaN", b"NaN", b"-nan", b"nan", b"-inf", b"inf"]


def alnum(c):
    return 0x30 <= c <= 0x39 or 0x41 <= c <= 0x5A or 0x61 <= c <= 0x7A


def nonfinite_to_null(line):
    """app/metrics.cpp's rewrite: each of WORDS outside a string, not followed by a letter or
    digit, becomes null."""
    out, i, in_string = bytearray(line), 0, False
    while i < len(out):
        c = out[i]
        if in_string:
            if c == 0x5C:
                i += 1
            elif c == 0x22:
                in_string = False
            i += 1
            continue
        if c == 0x22:
            in_string = True
        elif c in b"-NIni":
            for w in WORDS:
                if out[i:i + len(w)] == w and (i + len(w) == len(out) or not alnum(out[i + len(w)])):
                    out[i:i + len(w)] = b"null"
                    i += 3
                    break
        i += 1
    return bytes(out)


def surrogates_paired(text):
    """Whether every \\u escape of a surrogate in the JSON text is a high one followed by a low
    one (nlohmann's rule; Python's json takes lone ones)."""
    i, in_string = 0, False
    while i < len(text):
        c = text[i]
        if not in_string:
            in_string = c == '"'
            i += 1
            continue
        if c == '"':
            in_string = False
        elif c == "\\":
            if text[i + 1:i + 2] == "u":
                code = int(text[i + 2:i + 6], 16)
                if 0xDC00 <= code <= 0xDFFF:
                    return False
                if 0xD800 <= code <= 0xDBFF:
                    nxt = text[i + 6:i + 12]
                    if not (nxt[:2] == "\\u" and 0xDC00 <= int(nxt[2:], 16) <= 0xDFFF):
                        return False
                    i += 6
                i += 6
                continue
            i += 1
        i += 1
    return True


class Number(float):
    """A JSON number as nlohmann holds it (read as a double)."""


def parse_int(text):
    v = int(text)
    if -(1 << 63) <= v < (1 << 64):
        return Number(float(v))
    f = float(text)  # past 64 bits nlohmann reads it as a double
    if math.isinf(f):
        raise ValueError("overflow")
    return Number(f)


def parse_float(text):
    f = float(text)
    if math.isinf(f):
        raise ValueError("overflow")
    return Number(f)


def parse_constant(text):
    raise ValueError(text)


UNREADABLE = object()


def parse_json(line):
    """The value nlohmann reads from `line` (bytes), or UNREADABLE where it reads none."""
    if line.startswith(b"\xef\xbb\xbf"):
        line = line[3:]
    try:
        text = line.decode("utf-8")
        if not surrogates_paired(text):
            return UNREADABLE
        return json.loads(text, parse_int=parse_int, parse_float=parse_float, parse_constant=parse_constant)
    except (ValueError, RecursionError):
        return UNREADABLE


def is_number(v):
    return isinstance(v, Number)


def resolve(path):
    """The metrics file `path` names (itself, or a run folder's metrics.jsonl); raises Refused
    where there is none."""
    if os.path.isdir(path) and not os.path.islink(path):
        inner = os.path.join(path, "metrics.jsonl")
        if not os.path.isfile(inner) or os.path.islink(inner):
            raise Refused(path, why="a run folder without a regular metrics.jsonl")
        return inner
    if not os.path.exists(path):
        raise Refused(path, why="missing")
    return path


def read(path, parity=False, up_to=-1):
    """What app/metrics.cpp reads from `path`: {steps, first, last, loss (last value, or None
    when no series), losses [(step, loss, line)]}; raises Refused where it refuses."""
    path = resolve(path)
    if not os.path.isfile(path) or os.path.islink(path) and not os.path.isfile(os.path.realpath(path)):
        raise Refused(path, why="not a regular file")
    if os.path.getsize(path) > 4 << 30:
        raise Refused(path, why="over 4 GiB")
    with open(path, "rb") as f:
        data = f.read()
    m = {"path": path, "steps": 0, "first": 0.0, "last": 0.0, "series": [], "loss": None, "losses": []}
    pieces = data.split(b"\n")
    complete_count = len(pieces) - 1
    for number, line in enumerate(pieces, 1):
        complete = number <= complete_count
        if not complete and line == b"":
            break
        if len(line) > MAX_LINE:
            raise Refused(path, number, "a line longer than 16 MiB")
        if line.strip(b" \t\r") == b"":
            continue
        line = nonfinite_to_null(line)
        if common.json_depth(line) > MAX_DEPTH:
            raise Refused(path, number, "deeper than 64")
        record = parse_json(line)
        if record is UNREADABLE and not complete:
            break  # a torn last line: skipped
        if not isinstance(record, dict):
            raise Refused(path, number, "not a JSON object")
        if "event" in record:
            event = record["event"]
            if not isinstance(event, str):
                raise Refused(path, number, "event is not a string")
            if event == "memory":
                ranks = record.get("ranks")
                if not isinstance(ranks, list):
                    raise Refused(path, number, "memory without ranks")
                if len(ranks) > MAX_RANKS:
                    raise Refused(path, number, "too many ranks")
                if any(not (is_number(b) or b is None) for b in ranks):
                    raise Refused(path, number, "a rank's bytes not a number")
            elif event == "plan":
                if not isinstance(record.get("text"), str):
                    raise Refused(path, number, "plan without text")
            continue
        if "step" not in record:
            raise Refused(path, number, "neither event nor step")
        step = record["step"]
        if not is_number(step) or not math.isfinite(step):
            raise Refused(path, number, "step not a number")
        step = float(step)
        m["first"] = step if m["steps"] == 0 else min(m["first"], step)
        m["last"] = step if m["steps"] == 0 else max(m["last"], step)
        m["steps"] += 1
        for key, value in record.items():
            if key in ("step", "time") or not (is_number(value) or value is None):
                continue
            if key not in m["series"]:
                if len(m["series"]) >= MAX_SERIES:
                    continue
                m["series"].append(key)
            if key == "loss":
                m["loss"] = float(value) if is_number(value) and math.isfinite(value) else math.nan
        if parity and (up_to < 0 or step <= up_to):
            loss = record.get("loss", "absent")
            if is_number(loss) or loss is None:
                if not (step == math.floor(step) and 0 <= step < 9e15):
                    raise Refused(path, number, "a step that is not whole")
                m["losses"].append((int(step), float(loss) if is_number(loss) and math.isfinite(loss) else math.nan,
                                    number))
    return m


def sig(v, digits):
    return "0" if v == 0 else "%.*g" % (digits, v)


def expected_report(paths):
    """("refused", Refused) or ("ok", [cells of step records, final loss a file])."""
    if len(paths) > MAX_RUNS:
        return "refused", Refused(None, why="too many files")
    cells = []
    for p in paths:
        try:
            m = read(p)
        except Refused as r:
            return "refused", r
        if m["steps"] == 0:
            return "refused", Refused(m["path"], why="no step records")
        records = f"{m['steps']} (steps {sig(m['first'], 15)} to {sig(m['last'], 15)})"
        loss = sig(m["loss"], 7) if "loss" in m["series"] else ""
        cells.append((records, loss))
    return "ok", cells


def relative(a, b):
    if math.isnan(a) and math.isnan(b):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return 0.0 if a == b else math.inf
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def expected_parity(a, b, steps, tol):
    """(status, facts): 2 with the Refused (or None for "no common steps" and the like), else
    0 or 1 with the verdict's numbers."""
    # As app/parity.cpp takes its arguments: each a metrics input (anything there but a .lua
    # file) or a command line, the commands run before anything is read.
    commands = []
    for p in (a, b):
        if os.path.lexists(p) and not p.endswith(".lua"):
            try:
                resolve(p)
            except Refused as r:
                return 2, r
        elif p.endswith(".jsonl"):
            return 2, Refused(p, why="not a metrics file")
        else:
            commands.append(p)
    if commands:
        return 3, Refused(commands[0], why="run as a command")
    sides = []
    for p in (a, b):
        try:
            m = read(p, parity=True, up_to=steps)
        except Refused as r:
            return 2, r
        losses = sorted(m["losses"], key=lambda t: t[0])
        if not losses:
            return 2, Refused(m["path"], why="no losses")
        for x, y in zip(losses, losses[1:]):
            if x[0] == y[0]:
                return 2, Refused(m["path"], why=f"step {x[0]} twice")
        sides.append(losses)
    la, lb = sides
    i = j = common_steps = 0
    worst, worst_step, first_bad, first, last = -1.0, -1, -1, -1, -1
    while i < len(la) and j < len(lb):
        if la[i][0] < lb[j][0]:
            i += 1
            continue
        if lb[j][0] < la[i][0]:
            j += 1
            continue
        rel = relative(la[i][1], lb[j][1])
        first = la[i][0] if first < 0 else first
        last = la[i][0]
        common_steps += 1
        if rel > worst:
            worst, worst_step = rel, la[i][0]
        if not rel <= tol and first_bad < 0:
            first_bad = la[i][0]
        i += 1
        j += 1
    if common_steps == 0:
        return 2, None
    facts = {"compared": f"compared {common_steps} common steps ({first} to {last})",
             "worst": f"largest relative difference {'%.9g' % worst} at step {worst_step}"}
    if first_bad >= 0:
        facts["diverged"] = f"diverged at step {first_bad}:"
    return (1 if first_bad >= 0 else 0), facts


# ---- making files -----------------------------------------------------------------------

def header(rng):
    return {"event": "run", "time": 1767225600.0, "script": "train.lua", "world": rng.choice([1, 2, 4]),
            "mesh": {"pipeline": 1, "tensor": 1, "data": 1}, "config": {"lr": 0.003, "steps": 50}}


def records(rng):
    n = rng.randrange(1, 60)
    base = rng.uniform(0.5, 5)
    out = [header(rng)] if rng.random() < 0.8 else []
    for s in range(1, n + 1):
        r = {"step": s, "time": 1767225600.0 + s, "loss": base * math.exp(-s / 30) + 0.1, "lr": 0.003,
             "tokens_per_s": 12000.0 + s}
        if rng.random() < 0.1:
            r["grad_norm"] = rng.random()
        out.append(r)
        if rng.random() < 0.05:
            out.append({"event": "memory", "time": 1767225600.0 + s, "step": s, "ranks": [1 << 30, 2 << 30]})
    if rng.random() < 0.3:
        out.append({"event": "plan", "time": 0, "text": "rank 0: 1 GiB"})
    return out


def dumps(r, rng):
    return json.dumps(r, separators=rng.choice([(",", ":"), (", ", ": ")])).encode()


def nested(depth, rng):
    opener, closer = rng.choice([(b"[", b"]"), (b'{"a":', b"}")])
    return opener * depth + b"1" + closer * depth


def some_step_line(lines):
    """The index of a step record's line, or None."""
    picks = [i for i, line in enumerate(lines) if line.startswith(b'{"step"')]
    return picks


def damage(cls, lines, rng):
    """Damages the list of lines (bytes, without their newlines) in place; returns what it did
    and, for a torn tail, the bytes to write after the last newline."""
    steps = some_step_line(lines)
    at = rng.choice(steps) if steps else 0
    if cls == "valid":
        return "none", b""
    if cls == "deep nesting":
        depth = rng.choice([10, 63, 64, 65, 100, 1000, 100000])
        where = rng.randrange(3)
        if where == 0:
            lines.insert(at, b'{"step": 1000, "deep": ' + nested(depth, rng) + b"}")
        elif where == 1:
            lines.insert(at, nested(depth, rng))
        else:
            lines.insert(at, b'{"event": "run", "config": ' + nested(depth, rng) + b"}")
        return f"nesting {depth} deep", b""
    if cls == "long lines":
        size = rng.choice([1000, 100000, 1 << 20, 5 << 20] + ([MAX_LINE + 10] if rng.random() < 0.1 else []))
        kind = rng.randrange(3)
        if kind == 0:
            lines.insert(at, b'{"step": 7, "note": "' + b"x" * size + b'"}')
        elif kind == 1:
            lines.insert(at, b'{"event": "plan", "text": "' + b"y" * size + b'"}')
        else:
            lines.insert(at, b" " * size + b'{"step": 8}')
        return f"a line of {size} bytes", b""
    if cls == "torn lines":
        victim = rng.randrange(len(lines))
        line = lines[victim]
        cut = line[:rng.randrange(0, max(1, len(line)))]
        if rng.random() < 0.6:  # the last line, without its newline
            del lines[victim:]
            return f"line {victim + 1} cut to {len(cut)} bytes, last", cut
        lines[victim] = cut
        return f"line {victim + 1} cut to {len(cut)} bytes", b""
    if cls == "huge numbers":
        value = rng.choice([b"1e308", b"-1e308", b"1e309", b"-1e400", b"123456789012345678901234567890",
                            b"18446744073709551615", b"18446744073709551616", b"-9223372036854775809", b"5e-324",
                            b"-0.0", b"9e15", b"9007199254740993", b"1" * 400, b"0.000000001", b"-3", b"2.5"])
        field = rng.choice([b"step", b"loss", b"lr", b"time"])
        lines.insert(at, b'{"step": 3, "' + field + b'": ' + value + b"}" if field != b"step"
                     else b'{"step": ' + value + b', "loss": 1.5}')
        return f"{field.decode()} = {value[:30].decode()}", b""
    if cls == "non-finite":
        word = rng.choice(WORDS + [b"Infinityx", b"nanx", b"NAN", b"-Inf", b"infinity", b"1inf", b'"NaN"'])
        field = rng.choice([b"step", b"loss", b"lr", b"ranks"])
        if field == b"ranks":
            lines.insert(at, b'{"event": "memory", "step": 2, "ranks": [1, ' + word + b"]}")
        elif field == b"step":
            lines.insert(at, b'{"step": ' + word + b', "loss": 2}')
        else:
            lines.insert(at, b'{"step": 4, "' + field + b'": ' + word + b"}")
        return f"{field.decode()} = {word.decode()}", b""
    if cls == "wrong types":
        line = rng.choice([b'{"step": "3", "loss": 1}', b'{"step": true}', b'{"step": null}', b'{"step": [1]}',
                           b'{"step": {"a": 1}}', b'{"event": 5}', b'{"event": null, "step": 1}',
                           b'{"event": "memory", "ranks": "1,2"}', b'{"event": "memory", "ranks": [1, "2"]}',
                           b'{"event": "memory"}', b'{"event": "plan", "text": 5}', b'{"event": "plan"}',
                           b'{"step": 5, "loss": "low"}', b'{"step": 5, "time": "now"}', b"[1, 2]", b'"text"',
                           b"42", b"null", b'{"loss": 1}', b'{"step": 6, "loss": [1]}', b'{"event": "run", "x": 1}'])
        lines.insert(at, line)
        return line.decode()[:40], b""
    if cls == "binary":
        kind = rng.randrange(4)
        if kind == 0:
            line = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))).replace(b"\n", b"")
        elif kind == 1:
            line = b'{"step": 9, "note": "a\x00b"}'
        elif kind == 2:
            line = b'{"step": 9, "note": "' + bytes([rng.randrange(0x80, 0x100)]) + b'"}'
        else:
            line = b'{"step": 9, "note": "\x01"}'
        lines.insert(at, line)
        return f"binary line {kind}", b""
    if cls == "events":
        line = rng.choice([b'{"event": "memory", "step": 1, "ranks": []}',
                           b'{"event": "memory", "ranks": [' + b", ".join([b"1"] * rng.choice([3, 65536, 65537])) + b"]}",
                           b'{"event": "memory", "step": -5, "ranks": [null, 1e300]}',
                           b'{"event": "plan", "text": "<b>" }', b'{"event": "run"}', b'{"event": "run", "mesh": 3}',
                           b'{"event": "something_new"}', b'{"event": ""}', b'{"event": "run", "config": {"a": [1, {}]}}',
                           b'{"event": "memory", "step": 1e308, "ranks": [1e308, -1e308, 0]}'])
        lines.insert(at, line)
        return line.decode()[:40], b""
    if cls == "order and repeats":
        kind = rng.randrange(4)
        if kind == 0 and steps:
            lines.append(lines[rng.choice(steps)])
            return "a step record repeated", b""
        if kind == 1:
            rng.shuffle(lines)
            return "lines shuffled", b""
        if kind == 2:
            lines.insert(at, b'{"step": %s, "loss": 1.25}' % rng.choice([b"-1", b"0.5", b"1e16", b"0", b"-0.0"]))
            return "an odd step", b""
        lines.insert(at, b'{"step": 2, "step": 3, "loss": 1, "loss": 2}')
        return "keys twice in a record", b""
    if cls == "encodings":
        kind = rng.randrange(6)
        if kind == 0:
            lines[:] = [line + b"\r" for line in lines]
            return "CRLF", b""
        if kind == 1:
            lines[0] = b"\xef\xbb\xbf" + lines[0]
            return "BOM", b""
        if kind == 2:
            for _ in range(rng.randrange(1, 5)):
                lines.insert(rng.randrange(len(lines) + 1), rng.choice([b"", b"   ", b"\t", b" \r"]))
            return "blank lines", b""
        if kind == 3:
            lines.insert(at, rng.choice([b'{"step": 3, "l\\u00f6ss": 1, "loss": 2}', b'{"step": 3, "\\ud800": 1}',
                                         b'{"step": 3, "\\ud83d\\ude00": 1}', b'{"step": 3, "\\udc00x": 1}',
                                         '{"step": 3, "é": 1}'.encode(), b'{"step": 3, "k": "\\u0000"}']))
            return "escapes", b""
        if kind == 4:
            extra = {f"f{k}": float(k) for k in range(40)}
            lines.insert(at, dumps(dict(step=5, **extra), rng))
            return "40 fields", b""
        lines.insert(at, b"  " + lines[at] + b"  ")
        return "padded", b""
    raise ValueError(cls)


SPECIAL = ["fifo", "devzero", "folder without metrics", "missing", "empty", "link to itself", "metrics.jsonl a FIFO",
           "sparse 5 GiB", "no steps"]


def special(path, rng):
    what = rng.choice(SPECIAL)
    if common.make_special(path, "folder" if what == "folder without metrics" else what):
        return what
    if what == "metrics.jsonl a FIFO":
        os.makedirs(path)
        os.mkfifo(os.path.join(path, "metrics.jsonl"))
    elif what == "sparse 5 GiB":
        with open(path, "wb") as f:
            f.truncate(5 << 30)
    elif what == "no steps":
        open(path, "wb").write(b'{"event": "run"}\n{"event": "memory", "ranks": [1]}\n')
    return what


def write(path, lines, tail, as_folder):
    if as_folder:
        os.makedirs(path)
        target = os.path.join(path, "metrics.jsonl")
    else:
        target = path
    with open(target, "wb") as f:
        f.write(b"".join(line + b"\n" for line in lines) + tail)


def nudged(lines, rng):
    """B for parity: A's lines with some losses nudged (relative 1e-9 to 1e-2) or dropped."""
    out, scale = [], rng.choice([0, 0, 1e-9, 1e-6, 1e-3])
    for line in lines:
        try:
            r = json.loads(line)
        except ValueError:
            out.append(line)
            continue
        if isinstance(r, dict) and isinstance(r.get("loss"), float) and "event" not in r:
            if rng.random() < 0.05:
                continue
            r["loss"] = r["loss"] * (1 + scale * rng.uniform(-1, 1))
            out.append(json.dumps(r).encode())
        else:
            out.append(line)
    return out


CLASSES = ["valid", "deep nesting", "long lines", "torn lines", "huge numbers", "non-finite", "wrong types", "binary",
           "events", "order and repeats", "encodings", "many files", "special files"]


def make_case(i, cls, work, rng):
    """The files of case i and its command: (argv, what, paths, parity (steps, tol) or None)."""
    folder = os.path.join(work, f"case-{i}")
    os.makedirs(folder)
    parity = i % 2 == 1
    count = 2 if parity else (rng.randrange(33, 41) if cls == "many files" else rng.randrange(1, 4))
    paths, what = [], []
    base = [dumps(r, rng) for r in records(rng)]
    victim = rng.randrange(count)
    for k in range(count):
        as_folder = rng.random() < 0.2
        path = os.path.join(folder, f"run{k}" if as_folder else f"m{k}.jsonl")
        lines = list(base) if k == 0 or not parity else nudged(base, rng)
        if not parity and k > 0:
            lines = [dumps(r, rng) for r in records(rng)]
        if cls == "special files" and k == victim:
            what.append(f"file {k}: " + special(path, rng))
        elif cls not in ("many files",) and k == victim:
            did, tail = damage(cls, lines, rng)
            what.append(f"file {k}: {did}")
            write(path, lines, tail, as_folder)
        else:
            write(path, lines, b"", as_folder)
        paths.append(path)
    if parity and cls == "many files":
        paths[1] = paths[0]
    if parity:
        steps = rng.choice([-1, -1, -1, rng.randrange(1, 40)])
        tol = rng.choice([None, None, 1e-8, 1e-4, 0.0])
        argv = [BIN, "parity", *paths] + (["--steps", str(steps)] if steps > 0 else []) + \
            (["--tol", repr(tol)] if tol is not None else [])
        return argv, "; ".join(what), paths, (steps, 1e-5 if tol is None else tol)
    return [BIN, "report", *paths, "-o", os.path.join(folder, "page.html")], "; ".join(what), paths, None


# ---- judging ----------------------------------------------------------------------------

def names(o, refusal):
    """Whether a refusal's message names the file (and line) the reference refused."""
    text = o.err
    if refusal is None or refusal.path is None:
        return True
    shown = refusal.path
    if refusal.line is not None:
        return f"{shown}:{refusal.line}:" in text
    folder = os.path.dirname(shown) if shown.endswith("/metrics.jsonl") else shown
    return shown in text or folder in text


def judge_report(o, paths):
    kind, want = expected_report(paths)
    if o.kind in ("crash", "hang"):
        return o.kind, False, repr(o)
    if kind == "refused":
        if o.kind != "refused":
            return "wrong", False, f"accepted, where the reference refuses ({want.why} at {want.path}:{want.line})"
        if not o.err.startswith("partrain: report: ") or len(o.err) > 1200 or not names(o, want):
            return "unclear", False, f"expected a refusal naming {want.path}:{want.line} ({want.why}): {o.err[-800:]}"
        return "refused", True, ""
    if o.kind != "accepted":
        return "wrong", False, "refused a file the reference reads: " + o.err[-800:]
    html = open(paths_page(paths), errors="replace").read()
    row = lambda name: re.findall(r"<td[^>]*>(.*?)</td>", (re.search(rf"<tr><th>{name}</th>(.*?)</tr>", html)  # noqa: E731
                                                            or re.search("()", "")).group(1))
    records_cells, loss_cells = row("step records"), row("final loss")
    if records_cells != [c[0] for c in want] or (loss_cells or [""] * len(want)) != [c[1] for c in want]:
        return "wrong", False, f"the page says {records_cells} / {loss_cells}, the reference {want}"
    return "accepted", True, ""


def paths_page(paths):
    return os.path.join(os.path.dirname(paths[0]), "page.html")


def judge_parity(o, paths, steps, tol):
    status, facts = expected_parity(paths[0], paths[1], steps, tol)
    if o.kind == "hang" or (o.kind == "crash" and o.rc not in (2, 3)):
        return o.kind, False, repr(o)
    rc = o.rc
    if status in (2, 3):
        if rc != status:
            return "wrong", False, f"exit {rc}, where the reference says {status} ({facts and facts.why}): " \
                                   f"{o.text[-800:]}"
        if not o.err.startswith("partrain: parity: ") or len(o.err) > 1600 or not names(o, facts):
            return "unclear", False, f"expected a refusal naming {facts and (facts.path, facts.line, facts.why)}: " \
                                     f"{o.err[-800:]}"
        return "refused", True, ""
    if rc != status:
        return "wrong", False, f"exit {rc}, the reference {status} ({facts}): {o.text[-800:]}"
    for key, text in facts.items():
        if text not in o.out:
            return "wrong", False, f"the verdict lacks '{text}': {o.out[-800:]}"
    return "accepted", True, ""


def main():
    tally = common.Tally(f"Metrics files (seed {SEED})", kinds=["refused", "accepted", "wrong", "unclear", "crash", "hang"])
    rng = random.Random(SEED)
    work = common.scratch_dir("fuzz-metrics-")
    try:
        cases = []
        for i in range(CASES):
            cls = CLASSES[i % len(CLASSES)]
            argv, what, paths, parity = make_case(i, cls, work, rng)
            cases.append((i, cls, argv, what, paths, parity))

        def one(case):
            return case, common.run(case[2], timeout=30, cwd=work, memory=common.MEMORY_LIMIT)

        with ThreadPoolExecutor(2) as pool:
            for (i, cls, argv, what, paths, parity), o in pool.map(one, cases):
                command = "parity" if parity else "report"
                if parity:
                    kind, ok, detail = judge_parity(o, paths, *parity)
                else:
                    kind, ok, detail = judge_report(o, paths)
                tally.add(f"{cls} ({command})", kind, ok, f"case {i} ({what}): {detail}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tally.finish()


if __name__ == "__main__":
    sys.exit(main())
