"""`partrain report` on hand-written metrics files: a run's page holds its charts (loss, learning
rate, tokens/s, memory bars from the newest memory record, other fields), header table and plan;
a torn last line is skipped and a bad line in the middle is refused naming file:line; every string
from the file is escaped (a script named <script>...); two files overlay on the same axes in two
colours with a legend; a file of 300,000 records is drawn with at most 2001 points a series and
its last step kept; one point, a constant series, NaN/null gaps and huge or tiny magnitudes give
finite axes; a run folder's trace.json (or --trace) is drawn as per-rank lanes; missing files,
folders without metrics, FIFOs, files over the cap and files without steps are refused by name.
Usage: test_report.py PATH/TO/partrain"""
import json
import os
import re
import subprocess
import sys
import tempfile
import time

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, ".."))
sys.path.insert(0, here)
from checks import check, finish  # noqa: E402
import metrics_files as mf  # noqa: E402

BIN = os.path.abspath(sys.argv[1])
tmp = tempfile.mkdtemp(prefix="report-test-")


def report(*args, timeout=120):
    p = subprocess.run([BIN, "report"] + list(args), capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def page(path):
    with open(path) as f:
        return f.read()


def paths(html, field):
    """data-file -> the list of (x, y) points of that file's path for `field`."""
    out = {}
    for m in re.finditer(r'<path class="series" data-file="(\d+)" data-field="([^"]*)" d="([^"]*)"', html):
        if m.group(2) == field:
            pts = [(float(a), float(b)) for a, b in re.findall(r"[ML](-?[\d.]+) (-?[\d.]+)", m.group(3))]
            out[int(m.group(1))] = (m.group(3), pts)
    return out


# A full run: header, steps, a memory record, a plan, an extra field.
run = os.path.join(tmp, "run")
os.mkdir(run)
recs = [mf.header(script="<script>alert(1)</script>.lua", lr=0.003, note="a & b")] + mf.steps(50)
recs[10]["grad_norm"] = 1.5
recs[20]["grad_norm"] = 0.5
recs.insert(5, mf.memory(1, [1000, 2000, 3000, 4000]))
recs.append(mf.memory(50, [5 << 30, 6 << 30, 7 << 30, 8 << 30]))
recs.append({"event": "plan", "time": 0, "text": "rank 0: 1.0 GiB <b>bold</b>"})
recs.append({"event": "something_new", "time": 0})  # a kind this reader does not know: ignored
mf.write(os.path.join(run, "metrics.jsonl"), recs)
out = os.path.join(tmp, "run.html")
rc, text = report(run, "-o", out)
check("a run folder's report is written", rc == 0 and os.path.isfile(out), text)
html = page(out) if rc == 0 else ""
check("the page is self-contained: no script, no fetched resource",
      "<script" not in html.lower() and not re.search(r'(src|href)="(https?:)?//', html), html[:2000])
check("the script name from the file is escaped", "&lt;script&gt;alert(1)&lt;/script&gt;.lua" in html, html[:3000])
check("config values are escaped and shown", "a &amp; b" in html and "config.lr" in html)
check("the plan is shown, escaped", "Plan: " in html and "&lt;b&gt;bold&lt;/b&gt;" in html)
for field in ("loss", "lr", "tokens_per_s", "grad_norm"):
    p = paths(html, field)
    check(f"a {field} curve is drawn", 0 in p and len(p[0][1]) >= 2, sorted(p))
loss = paths(html, "loss").get(0, ("", []))[1]
check("the loss curve has one point a step record (50)", len(loss) == 50, len(loss))
check("the loss curve falls left to right (y grows downward in SVG)",
      len(loss) == 50 and loss[0][0] < loss[-1][0] and loss[0][1] < loss[-1][1], loss[:2] + loss[-2:])
bars = re.findall(r'<rect class="bar" data-file="0"[^>]*height="([\d.]+)"', html)
heights = [float(h) for h in bars]
check("memory: a bar a rank from the newest record, growing with the bytes",
      len(heights) == 4 and heights == sorted(heights) and heights[0] > 0, bars)
check("memory: tick labels in GiB", "GiB" in html)
ticks = re.findall(r'class="tick">([^<]*)<', html)
check("axes carry numeric tick labels", len(ticks) > 20 and any(t == "10" for t in ticks), ticks[:30])

# A torn last line (a run killed mid-write) is skipped; a bad line elsewhere names file:line.
torn = mf.write(os.path.join(tmp, "torn.jsonl"), [mf.header()] + mf.steps(5), tail='{"step": 6, "time": 1.0, "lo')
rc, text = report(torn, "-o", os.path.join(tmp, "torn.html"))
check("a torn last line is skipped", rc == 0, text)
if rc == 0:
    h = page(os.path.join(tmp, "torn.html"))
    check("the torn line is not drawn and the page says it was cut short",
          len(paths(h, "loss")[0][1]) == 5 and "cut short" in h)
bad = mf.write(os.path.join(tmp, "bad.jsonl"), [mf.header(), mf.steps(3)[0], "{not json", mf.steps(3)[1]])
rc, text = report(bad, "-o", os.path.join(tmp, "bad.html"))
check("a bad line in the middle is refused with file:line", rc == 1 and f"{bad}:3: not a JSON object" in text, text)
rc, text = report(mf.write(os.path.join(tmp, "arr.jsonl"), [mf.steps(1)[0], "[1, 2]"]), "-o", os.path.join(tmp, "x.html"))
check("a JSON line that is not an object is refused with its line", rc == 1 and "arr.jsonl:2: not a JSON object" in text, text)
# Nesting far below the line-length bound had overflowed the parser's stack (SIGSEGV).
deep = '{"step": 2, "x": ' + "[" * 200000 + "]" * 200000 + "}"
rc, text = report(mf.write(os.path.join(tmp, "deep.jsonl"), [mf.steps(1)[0], deep]), "-o", os.path.join(tmp, "x.html"))
check("a line nested 200,000 deep is refused with its line, not a crash",
      rc == 1 and "deep.jsonl:2: a JSON value nested deeper than 64 levels" in text, (rc, text[-500:]))
rc, text = report(mf.write(os.path.join(tmp, "ok.jsonl"), mf.steps(5)), "-o", os.path.join(tmp, "x.html"), "--trace",
                  mf.write(os.path.join(tmp, "deep.json"), ['{"traceEvents": ' + "[" * 200000 + "]" * 200000 + "}"]))
check("a trace nested 200,000 deep is refused, not a crash", rc == 1 and "nests deeper than 64 levels" in text,
      (rc, text[-500:]))
rc, text = report(mf.write(os.path.join(tmp, "nostep.jsonl"), [{"loss": 1.0}]), "-o", os.path.join(tmp, "x.html"))
check("a record with neither event nor step is refused", rc == 1 and "nostep.jsonl:1: a record with neither" in text, text)
rc, text = report(mf.write(os.path.join(tmp, "strstep.jsonl"), [{"step": "ten", "loss": 1.0}]), "-o", os.path.join(tmp, "x.html"))
check("a step that is not a number is refused", rc == 1 and 'strstep.jsonl:1: "step" is "ten"' in text, text)
rc, text = report(mf.write(os.path.join(tmp, "mem.jsonl"), [mf.steps(1)[0], {"event": "memory", "ranks": "many"}]),
                  "-o", os.path.join(tmp, "x.html"))
check("a memory record without a ranks list is refused", rc == 1 and "mem.jsonl:2: a memory record needs" in text, text)
rc, text = report(mf.write(os.path.join(tmp, "headeronly.jsonl"), [mf.header()]), "-o", os.path.join(tmp, "x.html"))
check("a file with no step records is refused", rc == 1 and "holds no step records" in text, text)

# Two files overlay: both colours, a legend naming each file.
a = mf.write(os.path.join(tmp, "a.jsonl"), [mf.header(lr=0.003)] + mf.steps(30))
b = mf.write(os.path.join(tmp, "b.jsonl"), [mf.header(lr=0.001)] + mf.steps(40, loss=lambda s: 4.0 - s / 20.0))
rc, text = report(a, b, "-o", os.path.join(tmp, "ab.html"))
check("two files make one page", rc == 0, text)
if rc == 0:
    h = page(os.path.join(tmp, "ab.html"))
    p = paths(h, "loss")
    check("both files' loss curves are drawn", sorted(p) == [0, 1] and len(p[0][1]) == 30 and len(p[1][1]) == 40)
    check("in two colours", 'data-file="0" data-field="loss" d="' in h and 'stroke="#1f77b4"' in h and 'stroke="#d62728"' in h)
    check("on shared axes: the longer run reaches further right", p[1][1][-1][0] > p[0][1][-1][0], (p[0][1][-1], p[1][1][-1]))
    legend = re.findall(r'<div class="legend">(.*?)</div>', h)
    check("the legend names both files", legend and a in legend[0] and b in legend[0], legend[:1])
    check("a config value that differs is marked", 'class="differs"' in h)

# A huge file: at most 2001 points a series, the last step kept, read in bounded time.
big = os.path.join(tmp, "big.jsonl")
with open(big, "w") as f:
    f.write(json.dumps(mf.header()) + "\n")
    for s in range(1, 300001):
        f.write('{"step":%d,"time":%d,"loss":%.6f,"lr":0.001}\n' % (s, s, 5.0 - s * 1e-5))
start = time.time()
rc, text = report(big, "-o", os.path.join(tmp, "big.html"), timeout=240)
took = time.time() - start
check(f"300,000 records are read ({took:.1f} s)", rc == 0, text)
if rc == 0:
    h = page(os.path.join(tmp, "big.html"))
    pts = paths(h, "loss")[0][1]
    check(f"downsampled to at most 2001 points a series ({len(pts)})", 1000 <= len(pts) <= 2001, len(pts))
    check("the page stays small (< 1 MB)", len(h) < 1 << 20, len(h))
    check("the page says the charts are thinned", "charts show one record in every 256" in h)
    xs = [x for x, _ in pts]
    check("the points span the whole run, first to last step", xs == sorted(xs) and xs[-1] >= 900, (xs[0], xs[-1]))

# Edge cases: one point, a constant series, NaN/null gaps, huge and tiny magnitudes.
edge = mf.write(os.path.join(tmp, "edge.jsonl"), [
    {"step": 1, "time": 1, "loss": 2.0, "lr": 0.001, "tokens_per_s": 1e300, "tiny": 1e-300},
    {"step": 2, "time": 2, "loss": float("nan"), "lr": 0.001, "tokens_per_s": -1e300, "tiny": 3e-300},
    {"step": 3, "time": 3, "loss": None, "lr": 0.001, "tokens_per_s": 1e300, "tiny": 2e-300},
    {"step": 4, "time": 4, "loss": 1.5, "lr": 0.001, "tokens_per_s": float("inf"), "tiny": 1e-300},
    {"step": 5, "time": 5, "loss": 1.4, "lr": 0.001, "tokens_per_s": 1e300, "tiny": 1e-300}])
one = mf.write(os.path.join(tmp, "one.jsonl"), [{"step": 7, "time": 1, "loss": 2.5}])
rc, text = report(edge, one, "-o", os.path.join(tmp, "edge.html"))
check("NaN, null, infinities, 1e300 and 1e-300 make a page", rc == 0, text)
if rc == 0:
    h = page(os.path.join(tmp, "edge.html"))
    svg_numbers = re.findall(r'\b(?:[xy][12]?|cx|cy|d|height|width)="([^"]*)"', h)
    check("no NaN or infinity reaches the SVG", not any(re.search(r"nan|inf", v, re.I) for v in svg_numbers),
          [v for v in svg_numbers if re.search(r"nan|inf", v, re.I)][:5])
    d = paths(h, "loss")[0][0]
    check("missing losses leave a gap (the path starts twice)", d.count("M") == 2, d)
    check("a lone point is drawn as a dot", '<circle class="series" data-file="1"' in h and
          '<circle class="series" data-file="0"' in h)
    ticks = re.findall(r'class="tick">([^<]*)<', h)
    check("huge and tiny magnitudes get exponent tick labels", any("e+30" in t for t in ticks) and
          any("e-300" in t for t in ticks), ticks)
    check("a constant series (lr) gets a band of ticks around its value",
          any(t in ("0.001", "0.00100") for t in ticks), ticks)

# A pipeline trace: from --trace, or a run folder's trace.json; lanes a rank, boxes a step.
events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}: <stage {r}>"}} for r in range(2)]
for r in range(2):
    t = 100.0 * r
    for mb in range(4):
        events.append({"name": f"F{mb}", "cat": "forward", "ph": "X", "ts": t, "dur": 80.0, "pid": 0, "tid": r})
        t += 100.0
    for mb in range(4):
        events.append({"name": f"B{mb}", "cat": "backward", "ph": "X", "ts": t, "dur": 150.0, "pid": 0, "tid": r})
        t += 170.0
    events.append({"name": "step 1", "cat": "step", "ph": "X", "ts": 0, "dur": t, "pid": 0, "tid": r})
with open(os.path.join(run, "trace.json"), "w") as f:
    json.dump({"traceEvents": events}, f)
rc, text = report(run, "-o", os.path.join(tmp, "trace.html"))
check("a run folder's trace.json is drawn", rc == 0 and "the timeline of" in text, text)
if rc == 0:
    h = page(os.path.join(tmp, "trace.html"))
    boxes = re.findall(r'<rect [^>]*fill="(#4e9a06|#f57900)"', h)
    check("one box a forward and a backward, 2 lanes x 8", len(boxes) == 16, len(boxes))
    check("lanes are named by the trace's rows, escaped", "rank 1: &lt;stage 1&gt;" in h)
with open(os.path.join(tmp, "notrace.json"), "w") as f:
    f.write("{oops")
rc, text = report(a, "--trace", os.path.join(tmp, "notrace.json"), "-o", os.path.join(tmp, "x.html"))
check("a trace that is not JSON is refused by name", rc == 1 and "notrace.json' is not JSON" in text, text)

# Inputs and outputs that are not what they should be.
rc, text = report(os.path.join(tmp, "missing.jsonl"), "-o", os.path.join(tmp, "x.html"))
check("a missing file is named", rc == 1 and "missing.jsonl" in text, text)
os.mkdir(os.path.join(tmp, "empty_run"))
rc, text = report(os.path.join(tmp, "empty_run"), "-o", os.path.join(tmp, "x.html"))
check("a folder without metrics.jsonl is refused", rc == 1 and "holds no metrics.jsonl" in text, text)
fifo = os.path.join(tmp, "fifo.jsonl")
os.mkfifo(fifo)
rc, text = report(fifo, "-o", os.path.join(tmp, "x.html"), timeout=20)
check("a FIFO is refused, never waited on", rc == 1 and "a FIFO; a regular file was expected" in text, text)
huge = os.path.join(tmp, "huge.jsonl")
with open(huge, "w") as f:
    f.truncate(5 << 30)  # sparse: no disk used
rc, text = report(huge, "-o", os.path.join(tmp, "x.html"))
check("a file over the 4 GiB cap is refused before it is read", rc == 1 and "at most 4294967296 are read" in text, text)
rc, text = report(a, "-o", tmp)
check("-o naming a folder is refused", rc == 1 and "is a folder" in text, text)
rc, text = report("-o", os.path.join(tmp, "x.html"))
check("no input is a usage error", rc != 0 and "required" in text, text)

finish("report")
