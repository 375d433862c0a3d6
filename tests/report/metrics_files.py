"""Metrics files for the report and parity tests, written the way the shared contract says
(docs/observability.md): a run header, step records, memory and plan records, one JSON object a
line. Imported by test_report.py, test_render.py and test_parity.py."""
import json
import math


def header(script="examples/gpt/train.lua", world=4, **config):
    return {"event": "run", "time": 1767225600.0, "script": script, "world": world,
            "mesh": {"pipeline": 1, "tensor": 2, "data": 2}, "config": config or {"lr": 0.003, "steps": 50},
            "device": "cpu", "peak_tflops": None}


def steps(n, loss=lambda s: 3.0 * math.exp(-s / 30.0) + 1.0, lr=lambda s: 0.003 * min(1.0, s / 10.0),
          tps=lambda s: 12000.0 + 500.0 * math.sin(s / 5.0), every=1):
    out = []
    for s in range(1, n + 1, every):
        out.append({"step": s, "time": 1767225600.0 + s, "loss": loss(s), "lr": lr(s), "tokens_per_s": tps(s)})
    return out


def memory(step, ranks):
    return {"event": "memory", "time": 1767225700.0, "step": step, "ranks": ranks}


def write(path, records, tail=""):
    """Writes records as JSONL, then `tail` as is (a torn line, a bad line)."""
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
        f.write(tail)
    return path
