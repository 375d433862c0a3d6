"""Seeing experts: a Mixtral-style LLaMA (tests/obs/experts.lua) trained on 2 ranks at expert 2,
pipeline 2 and tensor 2 (and on 4 at expert 2 x tensor 2) writes an experts record a logged step and the router's step fields, and
`partrain report` draws the load as a heat map.
- The records' counts add up to what the batch holds: routed and slots are tokens x top_k x the
  steps a record covers, summed over every rank (tensor ranks counted once, each pipeline stage its
  own blocks); none dropped when dropless; with capacity_factor 0.5 some are, and the fraction is
  dropped / slots, exactly the capacity's when a Lua router sends every token to one expert.
- The step record's moe_dropped_fraction and moe_max_over_mean are the record's; moe_aux_loss is
  the blocks' aux_loss summed. pt.metrics.experts called by the script gives the same fields.
- The page's heat map holds a cell a block, expert and record, each with the record's load over its
  block's mean and a colour that follows it: the expert a router forces hot has the hottest colour
  and the idle ones the coldest. Tampered pages and records fail the same checks.
- Hand-written files: a malformed experts record is refused naming its line, a long run's records
  are thinned, --experts-layer picks a block.
Usage: test_experts.py PATH/TO/partrain"""
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import checks  # noqa: E402
from checks import check, finish  # noqa: E402

BIN = os.path.abspath(sys.argv[1])
SCRIPT = "tests/obs/experts.lua"
tmp = tempfile.mkdtemp(prefix="experts-test-")
HOT, COLD, WHITE = "#b2182b", "#2166ac", "#f7f7f7"   # the heat map's ends (app/report_experts.cpp)
BATCH, SEQ = 4, 8


def train(name, *args, steps=4, ranks=2):
    """Runs the script; returns (exit code, output, the metrics file's records)."""
    path = os.path.join(tmp, name + ".jsonl")
    p = subprocess.run([BIN, "--nproc-per-node", str(ranks), "--threads", "1", "--metrics", path, SCRIPT, "--steps",
                        str(steps)]
                       + list(args), capture_output=True, text=True, timeout=300)
    records = []
    if os.path.exists(path):
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
    return p.returncode, p.stdout + p.stderr, records


def experts_of(records):
    return [r for r in records if r.get("event") == "experts"]


def steps_of(records):
    return {r["step"]: r for r in records if "event" not in r and "step" in r}


def count_problems(events, tokens, top_k, layers=2, dropless=True):
    """What is wrong with the experts records of a run whose steps each route `tokens` tokens."""
    problems = []
    for e in events:
        covered = e["step"] - e.get("since", 0)
        want = tokens * top_k * covered
        if len(e["layers"]) != layers:
            problems.append(f"step {e['step']}: {len(e['layers'])} layers, want {layers}: {e['layers']}")
        for i, path in enumerate(e["layers"]):
            if sum(e["routed"][i]) != want:
                problems.append(f"step {e['step']} {path}: routed sums to {sum(e['routed'][i])}, want {want}")
            if e["slots"][i] != want:
                problems.append(f"step {e['step']} {path}: {e['slots'][i]} slots, want {want}")
            if dropless and e["dropped"][i] != 0:
                problems.append(f"step {e['step']} {path}: {e['dropped'][i]} dropped while dropless")
        fraction = sum(e["dropped"]) / sum(e["slots"])
        if abs(e["dropped_fraction"] - fraction) > 1e-12:
            problems.append(f"step {e['step']}: dropped_fraction {e['dropped_fraction']}, dropped / slots {fraction}")
    return problems


def field_problems(events, steps):
    """The step records' moe_* fields against the experts record of the same step."""
    problems = []
    for e in events:
        rec = steps.get(e["step"])
        if rec is None:
            problems.append(f"no step record at step {e['step']}")
            continue
        worst = max(max(r) / (sum(r) / len(r)) for r in e["routed"])
        want = {"moe_dropped_fraction": sum(e["dropped"]) / sum(e["slots"]), "moe_max_over_mean": worst,
                "moe_aux_loss": sum(e["aux_loss"])}
        for k, v in want.items():
            if k not in rec or abs(rec[k] - v) > 1e-9 * max(1.0, abs(v)):
                problems.append(f"step {e['step']}: {k} = {rec.get(k)}, the record says {v}")
    return problems


# --- The counts, at expert 2 (dropless), pipeline 2 and tensor 2 --------------------------------
code, out, records = train("expert2")
events, steps = experts_of(records), steps_of(records)
check("expert 2: the run writes an experts record each logged step", code == 0 and len(events) == 4,
      f"status {code}, {len(events)} records\n{out[-2000:]}")
tokens = BATCH * 2 * SEQ  # two data ranks (expert 2 splits them), each its own sequences
problems = count_problems(events, tokens, 2)
check("expert 2: each block's routed slots sum to tokens x top_k over both ranks, none dropped", not problems,
      "\n".join(problems))
check("expert 2: the records name both blocks in order",
      events and events[0]["layers"] == ["layers.0.block_sparse_moe", "layers.1.block_sparse_moe"],
      events and events[0]["layers"])
problems = field_problems(events, steps)
check("expert 2: the step records carry moe_aux_loss, moe_dropped_fraction and moe_max_over_mean", not problems,
      "\n".join(problems))
check("expert 2: the load-balancing loss is there (aux_loss > 0 a block) and the load is uneven (max over mean > 1)",
      events and all(a > 0 for e in events for a in e["aux_loss"]) and all(s["moe_max_over_mean"] > 1
                                                                           for s in steps.values()),
      json.dumps(events[:1]))
# The checks can fail: a record one slot short, or a step field off, is caught.
if events:
    bad = json.loads(json.dumps(events))
    bad[1]["routed"][0][0] -= 1
    check("a record one routed slot short fails the count check", count_problems(bad, tokens, 2) != [])
    wrong = {s: dict(r) for s, r in steps.items()}
    wrong[events[0]["step"]]["moe_max_over_mean"] += 0.01
    check("a moe_max_over_mean off by 0.01 fails the field check", field_problems(events, wrong) != [])

code, out, records = train("explicit", "--explicit", "true", "--every", "2", steps=6)
events, steps = experts_of(records), steps_of(records)
check("pt.metrics.experts called every 2 steps: a record at steps 2, 4, 6, each covering two steps (since)",
      code == 0 and [(e["step"], e.get("since")) for e in events] == [(2, None), (4, 2), (6, 4)],
      f"status {code}: {[(e['step'], e.get('since')) for e in events]}\n{out[-2000:]}")
problems = count_problems([dict(e, since=e.get("since", 0)) for e in events], tokens, 2)
problems += field_problems(events, steps)
check("pt.metrics.experts: the counts cover the steps since the last call, and its fields are the record's",
      code == 0 and not problems, "\n".join(problems))

code, out, records = train("pipeline2", "--pipeline", "2", "--expert", "1", steps=2)
events = experts_of(records)
problems = count_problems(events, BATCH * SEQ, 2)
check("pipeline 2: each stage's block counted once, both in the record", code == 0 and len(events) == 2
      and not problems, f"status {code}\n" + "\n".join(problems) + out[-1500:])

code, out, records = train("tensor2", "--tensor", "2", "--expert", "1", steps=2)
events = experts_of(records)
problems = count_problems(events, BATCH * SEQ, 2)
check("tensor 2: the two tensor ranks' identical tokens counted once", code == 0 and len(events) == 2
      and not problems, f"status {code}\n" + "\n".join(problems) + out[-1500:])

code, out, records = train("expert2_tensor2", "--tensor", "2", "--expert", "2", steps=2, ranks=4)
events = experts_of(records)
problems = count_problems(events, BATCH * 2 * SEQ, 2)
check("expert 2 x tensor 2 (4 ranks, each expert split over the tensor ranks): each token counted once",
      code == 0 and len(events) == 2 and not problems, f"status {code}\n" + "\n".join(problems) + out[-1500:])

# --- Capacity ----------------------------------------------------------------------------------
code, out, records = train("capacity", "--capacity", "0.5", steps=3)
events, steps = experts_of(records), steps_of(records)
problems = count_problems(events, tokens, 2, dropless=False) + field_problems(events, steps)
# Each rank's expert takes ceil(0.5 * N * k / E) slots a forward: at most that many a rank kept.
room = 2 * 4 * math.ceil(0.5 * BATCH * SEQ * 2 / 4)
for e in events:
    for i, d in enumerate(e["dropped"]):
        if not 0 < d or e["slots"][i] - d > room:
            problems.append(f"step {e['step']}: {d} dropped of {e['slots'][i]} (at most {room} kept)")
check("capacity_factor 0.5: slots are dropped, no more kept than the capacity holds, the fraction dropped / slots",
      code == 0 and len(events) == 3 and not problems, f"status {code}\n" + "\n".join(problems) + out[-1500:])

code, out, records = train("capacity_hot", "--capacity", "0.5", "--hot", "1", "--top-k", "1", steps=2)
events, steps = experts_of(records), steps_of(records)
# Every token to expert 1: each rank keeps ceil(0.5 * 32 * 1 / 4) = 4 of its 32 slots.
kept = 2 * math.ceil(0.5 * BATCH * SEQ / 4)
want = 1 - kept / (BATCH * 2 * SEQ)
got = [s.get("moe_dropped_fraction") for s in steps.values()]
check(f"one hot expert at capacity 0.5: moe_dropped_fraction is exactly {want} (each rank keeps 4 of 32)",
      code == 0 and got == [want, want] and all(e["dropped_fraction"] == want for e in events),
      f"status {code}: {got}\n{out[-1500:]}")

# --- The heat map ------------------------------------------------------------------------------
CELL = re.compile(r'<rect class="heat" data-file="(\d+)" data-layer="([^"]*)" data-expert="(\d+)" data-step="([^"]*)" '
                  r'data-load="([^"]*)"[^>]* fill="(#[0-9a-f]{6})"')


def report(*args):
    p = subprocess.run([BIN, "report"] + list(args), capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout + p.stderr


def cells(html):
    """(file, layer, expert, step, load, colour) of each heat map cell."""
    out = []
    for f, layer, e, s, load, fill in CELL.findall(html):
        out.append((int(f), layer, int(e), float(s), float(load) if load != "none routed" else None, fill))
    return out


def redness(colour):
    r, _, b = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    return r - b


def load_problems(found, events):
    """Each cell's load against its record's routed / the block's mean, and colours that follow the load."""
    problems, want = [], {}
    for e in events:
        for i, path in enumerate(e["layers"]):
            mean = sum(e["routed"][i]) / len(e["routed"][i])
            for x, r in enumerate(e["routed"][i]):
                want[(path, x, float(e["step"]))] = r / mean
    if len(found) != len(want):
        problems.append(f"{len(found)} cells, want {len(want)}")
    for _, layer, x, s, load, _ in found:
        w = want.get((layer, x, s))
        if w is None or load is None or abs(load - w) > 1e-5 * w:
            problems.append(f"{layer} expert {x} step {s}: load {load}, the record's {w}")
    ordered = sorted(found, key=lambda c: c[4])
    for a, b in zip(ordered, ordered[1:]):
        if b[4] > a[4] and redness(b[5]) < redness(a[5]):
            problems.append(f"load {b[4]} is drawn {b[5]}, less red than load {a[4]}'s {a[5]}")
    if found and (min(redness(c[5]) for c in found) >= 0 or max(redness(c[5]) for c in found) <= 0):
        problems.append("the colours do not spread both sides of the mean's white")
    return problems


def hot_problems(found, hot):
    """Expert `hot` of every block and record drawn the hottest colour, every other one the coldest."""
    problems = [f"{c[1]} expert {c[2]} step {c[3]}: {c[5]}" for c in found if c[5] != (HOT if c[2] == hot else COLD)]
    return problems if found else ["no cells"]


_, _, records = train("natural", steps=6)
natural = os.path.join(tmp, "natural.jsonl")
page = os.path.join(tmp, "natural.html")
code, out = report(natural, "-o", page)
html = open(page).read() if code == 0 else ""
found = cells(html)
events = experts_of(records)
problems = load_problems(found, events)
check("report: a heat map cell a block, expert and record, at the record's load, coloured as the load goes",
      code == 0 and not problems, out + "\n".join(problems[:20]))
check("report: moe_aux_loss, moe_dropped_fraction and moe_max_over_mean are charted",
      all(f'data-field="{f}"' in html for f in ("moe_aux_loss", "moe_dropped_fraction", "moe_max_over_mean")))
if found:
    swapped = [c[:5] + (found[-1 - i][5],) for i, c in enumerate(found)]  # colours in reverse order
    check("a page whose colours do not follow the load fails the same check", load_problems(swapped, events) != [])

_, _, records = train("hot", "--hot", "1", "--top-k", "1", steps=3)
code, out = report(os.path.join(tmp, "hot.jsonl"), "-o", os.path.join(tmp, "hot.html"))
found = cells(open(os.path.join(tmp, "hot.html")).read()) if code == 0 else []
check("report: the expert a Lua router forces hot (4x the mean) is drawn the hottest colour, the idle ones the coldest",
      code == 0 and len(found) == 2 * 4 * 3 and not hot_problems(found, 1),
      out + "\n".join(hot_problems(found, 1)[:10]))
check("a heat map that draws the hot expert as expert 2 fails the same check", hot_problems(found, 2) != [])

# --- Hand-written files: refusals, thinning, one block -----------------------------------------
def write(name, lines):
    path = os.path.join(tmp, name)
    with open(path, "w") as f:
        for r in lines:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


head = {"event": "run", "time": 1767225600.0, "world": 2}
steps_only = [{"step": s, "time": 1767225600.0 + s, "loss": 1.0} for s in range(1, 4)]
for bad, what in [('{"event": "experts", "step": 1, "layers": ["a"]}', "no routed"),
                  ('{"event": "experts", "step": 1, "layers": ["a"], "routed": [[1, "2"]]}', "a count as text"),
                  ('{"event": "experts", "step": 1, "layers": ["a", "b"], "routed": [[1, 2]]}', "fewer rows than layers")]:
    path = write("bad.jsonl", [head] + steps_only[:1] + [bad] + steps_only[1:])
    code, out = report(path, "-o", os.path.join(tmp, "bad.html"))
    check(f"report refuses an experts record with {what}, naming its line", code == 1 and "bad.jsonl:3:" in out, out)

many = [head]
for s in range(1, 3001):
    many.append({"step": s, "loss": 1.0})
    many.append({"event": "experts", "step": s, "layers": ["layers.0.moe", "layers.1.moe"],
                 "routed": [[s, 3000 - s + 1], [1, 1]]})
code, out = report(write("many.jsonl", many), "-o", os.path.join(tmp, "many.html"))
html = open(os.path.join(tmp, "many.html")).read() if code == 0 else ""
found = cells(html)
last = [c for c in found if c[3] == 3000.0]
check("report: 3,000 experts records are thinned to evenly spaced columns, the last among them",
      code == 0 and 0 < len(found) <= 16384 and len(found) < 3000 * 4 and len(last) == 4
      and "records drawn, evenly spaced" in html and os.path.getsize(os.path.join(tmp, "many.html")) < 5e6,
      f"status {code}: {len(found)} cells, {len(last)} at step 3000; {out}")
code, out = report(os.path.join(tmp, "many.jsonl"), "--experts-layer", "layers.1", "-o", os.path.join(tmp, "one.html"))
found = cells(open(os.path.join(tmp, "one.html")).read()) if code == 0 else []
check("report --experts-layer layers.1 draws that block only",
      code == 0 and found and all(c[1] == "layers.1.moe" for c in found), f"status {code}: {out}")
code, out = report(os.path.join(tmp, "many.jsonl"), "--experts-layer", "layers.7", "-o", os.path.join(tmp, "none.html"))
none = open(os.path.join(tmp, "none.html")).read() if code == 0 else ""
check("report --experts-layer naming no block says so on the page", "no MoE block is named" in none,
      f"status {code}: {out}")
if not checks.failures:  # a failure keeps the files to look at
    shutil.rmtree(tmp, ignore_errors=True)
else:
    print("the runs' files are kept in " + tmp)
finish("experts")
