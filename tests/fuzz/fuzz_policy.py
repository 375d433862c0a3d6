"""Fuzzes sharding policies: from a seed, writes a few hundred malformed policies (mutations of the
shipped ones and of policies written for a Lua-defined model: wrong types, unknown fields, maps
for lists, bad paths, wrong styles, missing and extra divisions, bad attributes, patterns with
magic characters, conflicting entries, broken ties, errors and endless loops in preprocess and
postprocess, replaced forwards that recurse or compute something else), each as its own policy
file in one of four forms (`return P.policy {...}`, a local then return, a plain table, modules
as a function of the configuration). tests/fuzz/policy_runner.lua applies them at tensor 2, many
to a job of 2 ranks. Each must be a clear refusal naming the policy's file:line (or, for a plain
table, the script's line) and no line inside partrain's own Lua files, or be accepted and then
train 3 steps exactly like the serial model; never a crash, a hang or different training. A job
that dies or stops is restarted after the case it was running, which counts as a crash or a hang.

  python3 tests/fuzz/fuzz_policy.py build/partrain [--seed N] [--cases N] [--verbose]
"""
import os
import queue
import random
import re
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
RUNNER = os.path.join(ROOT, "tests", "fuzz", "policy_runner.lua")
POLICY_TIMEOUT = 2      # seconds each policy function may take (the sharding option)
CASE_BOUND = 60         # seconds without progress before a job counts as hung

# ---- Policies as data, rendered to Lua ---------------------------------------------------------
# A policy: a list of (field, value). A value is raw Lua text, or for `modules` a list of
# (key, entry); an entry is a list of (field, value) where attributes and methods are lists of
# (key, raw Lua) and replace is a list of items (each a list of raw Lua fields), or raw Lua.

def q(s):
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def gpt2_policy():
    return [
        ("name", q("gpt2")),
        ("targets", '{ "GPT2" }'),
        ("modules", [
            ("GPT2Block", [
                ("attributes", [(q("attn.n_head"), "P.divide_by_tensor")]),
                ("replace", [[q("ln_1"), "P.norm {}"], [q("attn.c_attn"), "P.column { fused = 3 }"],
                             [q("attn.c_proj"), "P.row {}"], [q("ln_2"), "P.norm {}"],
                             [q("mlp.c_fc"), "P.column {}"], [q("mlp.c_proj"), "P.row {}"]]),
            ]),
            ("GPT2", [
                ("replace", [[q("wte"), "P.vocab_embedding {}"], [q("ln_f"), "P.norm {}"],
                             [q("lm_head"), "P.vocab_head {}"]]),
            ]),
        ]),
        ("postprocess", 'function(model, cfg) P.tie(model, "lm_head.weight", "wte.weight") end'),
    ]


def mlp_policy():
    return [("name", q("mlp")), ("targets", '{ "MLP" }'),
            ("modules", [("MLP", [("replace", [[q("0"), "P.column {}"], [q("2"), "P.row {}"]])])])]


def net_policy():
    return [("name", q("net")), ("targets", '{ "FuzzNet" }'),
            ("modules", [("FuzzBlock", [("replace", [[q("up"), "P.column {}"], [q("down"), "P.row {}"]])])])]


def simple_policy():
    return [("name", q("simple")),
            ("modules", [("SimpleModel", [("replace", [[q("hidden_layer"), "P.column {}"],
                                                       [q("final_layer"), "P.row {}"]])])])]


BASES = {"gpt2": gpt2_policy, "mlp": mlp_policy, "net": net_policy, "simple": simple_policy}


def render_entry(entry, ind):
    if isinstance(entry, str):
        return entry
    lines = ["{"]
    for field, value in entry:
        if isinstance(value, str):
            lines.append(f"{ind}  {field} = {value},")
        elif field == "replace":
            lines.append(f"{ind}  replace = {{")
            for item in value:
                lines.append(f"{ind}    {{ " + ", ".join(item) + " },")
            lines.append(f"{ind}  }},")
        else:  # attributes, methods: maps
            lines.append(f"{ind}  {field} = {{")
            for k, v in value:
                lines.append(f"{ind}    [{k}] = {v},")
            lines.append(f"{ind}  }},")
    lines.append(ind + "}")
    return "\n".join(lines)


def render_modules(modules, ind):
    if isinstance(modules, str):
        return modules
    lines = ["{"]
    for key, entry in modules:
        lines.append(f"{ind}  [{q(key)}] = " + render_entry(entry, ind + "  ") + ",")
    lines.append(ind + "}")
    return "\n".join(lines)


def render(policy, form):
    """The policy file's text, and the line the sharder should name for the policy as a whole."""
    body = []
    for field, value in policy:
        if field == "modules" and not isinstance(value, str):
            text = render_modules(value, "  ")
            if form == "function":
                text = "function(cfg)\n    return " + render_modules(value, "    ") + "\n  end"
            body.append(f"  modules = {text},")
        else:
            body.append(f"  {field} = {value},")
    head = ["-- A fuzzed policy (tests/fuzz/fuzz_policy.py).", 'local P = require "partrain.policy"', ""]
    if form == "plain":
        lines = head + ["return {"] + body + ["}"]
    elif form == "local":
        lines = head + ["local policy = P.policy {"] + body + ["}", "return policy"]
    else:  # "tail" and "function"
        lines = head + ["return P.policy {"] + body + ["}"]
    return "\n".join(lines) + "\n"


# ---- Mutations ---------------------------------------------------------------------------------

def field(policy, name):
    for i, (f, _) in enumerate(policy):
        if f == name:
            return i
    return None


def set_field(policy, name, value):
    i = field(policy, name)
    if i is None:
        policy.append((name, value))
    else:
        policy[i] = (name, value)


def entries(policy):
    i = field(policy, "modules")
    return policy[i][1] if i is not None and not isinstance(policy[i][1], str) else []


def an_entry(policy, rng, kind="replace"):
    """(entry list, index of `kind` in it) of a random module entry that has `kind`, or None."""
    found = [e for _, e in entries(policy) if isinstance(e, list) and any(f == kind for f, _ in e)]
    if not found:
        return None
    e = rng.choice(found)
    return e, next(i for i, (f, _) in enumerate(e) if f == kind)


def replace_items(policy, rng):
    found = an_entry(policy, rng)
    if not found:
        return None
    e, i = found
    return e[i][1] if not isinstance(e[i][1], str) else None


def m_wrong_type(p, rng):
    choice = rng.randrange(12)
    if choice == 0: set_field(p, "name", "3")
    elif choice == 1: set_field(p, "targets", q("GPT2"))
    elif choice == 2: set_field(p, "targets", "{ 3 }")
    elif choice == 3: set_field(p, "modules", rng.choice(["5", q("x"), "true"]))
    elif choice == 4: set_field(p, "preprocess", rng.choice(["1", "{}", q("f")]))
    elif choice == 5: set_field(p, "postprocess", rng.choice(["{}", "true"]))
    elif choice == 6: set_field(p, "pipeline", rng.choice(["3", "{ blocks = 1 }", "{ first = 2 }"]))
    elif choice == 7:
        e = rng.choice(entries(p))[1]
        e.append((rng.choice(["replace", "attributes", "methods"]), rng.choice(["5", q("x"), "true"])))
    else:
        items = replace_items(p, rng)
        if not items:
            return m_wrong_type(p, rng)
        item = rng.choice(items)
        if choice == 8: item[0] = rng.choice(["5", "true", "{}"])
        elif choice == 9: item[1] = rng.choice([q("column"), "5", "P.divide_by_tensor", "P.column"])
        elif choice == 10: item[1] = rng.choice(['P.column { fused = "3" }', "P.row { input_is_parallel = 1 }",
                                                  'P.norm { sequence_parallel = "yes" }', "P.column(3)"])
        else: item.append("ignore_if_missing = " + rng.choice([q("no"), "1", "{}"]))
    return "wrong type"


def m_unknown_field(p, rng):
    choice = rng.randrange(6)
    if choice == 0: p.append((rng.choice(["modlues", "stages", "where", "policy"]), "{}"))
    elif choice == 1: rng.choice(entries(p))[1].append((rng.choice(["replce", "attribute", "method"]), "{}"))
    elif choice == 2:
        items = replace_items(p, rng)
        if not items:
            return m_unknown_field(p, rng)
        rng.choice(items).append(rng.choice(["ignore = true", "if_sequence_parallel = true", "style = 1"]))
    elif choice == 3:
        items = replace_items(p, rng)
        if not items:
            return m_unknown_field(p, rng)
        rng.choice(items)[1] = rng.choice(["P.column { fuse = 3 }", "P.row { gather_output = true }",
                                           "P.vocab_head { pad = true }", "P.norm { eps = 1e-5 }"])
    elif choice == 4: set_field(p, "pipeline", rng.choice(["{ stages = 2 }", '{ blocks = "h", middle = {} }']))
    else: set_field(p, "targets", rng.choice(['{ "GPT2", n = 1 }', '{ [2] = "GPT2" }']))
    return "unknown field"


def m_map_for_list(p, rng):
    choice = rng.randrange(3)
    if choice == 0:
        found = an_entry(p, rng)
        if not found or isinstance(found[0][found[1]][1], str):
            return m_map_for_list(p, rng)
        e, i = found
        e[i] = ("replace", "{ " + ", ".join(f"[{item[0]}] = {item[1]}" for item in e[i][1]) + " }")
    elif choice == 1: set_field(p, "targets", '{ GPT2 = true, MLP = true }')
    else: set_field(p, "pipeline", '{ blocks = "h", first = { wte = true } }')
    return "map for a list"


def m_bad_path(p, rng):
    items = replace_items(p, rng)
    choice = rng.randrange(5)
    if choice == 0 or not items:
        key, entry = rng.choice(entries(p))
        i = entries(p).index((key, entry))
        entries(p)[i] = (rng.choice(["GPT2Blok", "h.9.attn", "MLPP", "head.x", "nothing"]), entry)
    elif choice == 1:
        rng.choice(items)[0] = q(rng.choice(["", "a..b", "x.*", "attn.c_attn.weight", "c_atn", ".", "0.", "h.0"]))
    elif choice == 2:
        item = rng.choice(items)
        item[0] = q(item[0].strip('"') + "_missing")
        item.append("ignore_if_missing = true")
    elif choice == 3:
        found = an_entry(p, rng, "attributes")
        if not found:
            return m_bad_path(p, rng)
        e, i = found
        e[i] = ("attributes", [(q(rng.choice(["attn.nothing.n_head", "nothing", "attn.width", ".n_head"])), "P.divide_by_tensor")])
    else:
        items.append([q(rng.choice(["nothing", "h.0.mlp.c_fc", "attn"])), "P.column {}"])
    return "bad path"


STYLES = ["P.column {}", "P.row {}", "P.norm {}", "P.vocab_embedding {}", "P.vocab_head {}",
          "P.column { fused = 3 }", "P.column { fused = 2 }", "P.column { fused = 0 }", "P.column { fused = 1.5 }",
          "P.column { fused = -3 }", "P.column { gather_output = true }", "P.row { input_is_parallel = false }",
          "P.column { sequence_parallel = true }", "P.row { sequence_parallel = true }", "P.norm { sequence_parallel = true }"]


def m_wrong_style(p, rng):
    items = replace_items(p, rng)
    if not items:
        return m_wrong_style(p, rng) if entries(p) else "wrong style"
    for _ in range(rng.choice([1, 1, 2])):
        rng.choice(items)[1] = rng.choice(STYLES)
    return "wrong style"


def m_division(p, rng):
    found = an_entry(p, rng, "attributes")
    values = ["1", "8", "true", "false", "0", "-2", "2.5", "P.divide_by_tensor", "0/0", "1/0"]
    if not found:  # models without attributes: add one they do not have
        e = rng.choice(entries(p))[1]
        e.append(("attributes", [(q(rng.choice(["heads", "0.heads", "n_head"])), rng.choice(values))]))
        return "attributes"
    e, i = found
    choice = rng.randrange(4)
    if choice == 0: e.pop(i)
    elif choice == 1: e[i] = ("attributes", [(q("attn.n_head"), rng.choice(values))])
    elif choice == 2: e[i] = ("attributes", e[i][1] + [(q(rng.choice(["attn.flash_attention", "attn.heads"])), rng.choice(values))])
    else: e[i] = ("attributes", [(q("attn.n_head"), "P.divide_by_tensor"), (q("attn.heads"), rng.choice(values))])
    return "attributes"


MAGIC = ["%d", "h.%d.attn", "GPT2Block(", "[", "h.+.attn", "^GPT2$", "h.*.attn%", "MLP$", "(.*)", "h.0-attn", "%"]


def m_magic(p, rng):
    if rng.random() < 0.6 or not replace_items(p, rng):
        key, entry = rng.choice(entries(p))
        i = entries(p).index((key, entry))
        entries(p)[i] = (rng.choice(MAGIC), entry)
    else:
        rng.choice(replace_items(p, rng))[0] = q(rng.choice(MAGIC))
    return "magic characters"


def m_missing(p, rng):
    choice = rng.randrange(3)
    if choice == 0:
        items = replace_items(p, rng)
        if not items:
            return m_missing(p, rng)
        items.pop(rng.randrange(len(items)))
    elif choice == 1 and len(entries(p)) > 1:
        entries(p).pop(rng.randrange(len(entries(p))))
    else:
        i = field(p, "postprocess")
        if i is None:
            return m_missing(p, rng) if replace_items(p, rng) else "missing entry"
        p.pop(i)
    return "missing entry"


GLOBS = {"GPT2Block": "h.*", "FuzzBlock": "*"}  # paths that match the modules these types match
OUTER = {"gpt2": ["h.0.attn.c_attn", "h.1.mlp.c_fc", "lm_head"], "mlp": ["0", "2"], "net": ["a.up", "b.down"],
         "simple": ["hidden_layer"]}
KIND = ["gpt2"]  # the model kind of the case being made


def m_extra(p, rng):
    choice = rng.randrange(4)
    key, entry = rng.choice(entries(p))
    if choice == 0 and key in GLOBS:  # the same entry again under a glob matching the same modules
        entries(p).append((GLOBS[key], entry))
    elif choice <= 1:
        items = replace_items(p, rng)
        if not items:
            return m_extra(p, rng)
        items.append(list(rng.choice(items)))
    elif choice == 2:  # a method on a module another entry replaces
        entries(p).append((rng.choice(OUTER[KIND[0]]),
                           [("methods", [(q("forward"), "function(self, x) local y = self:own_forward(x); return y end")])]))
    else:
        entry.append(("methods", [(q(rng.choice(["forward", "backward", "extra"])), "function(self, x) local y = self:own_forward(x); return y end")]))
    return "extra entry"


def m_tie(p, rng):
    body = rng.choice(['P.tie(model, "lm_head.weight", "wpe.weight")', 'P.tie(model, "nothing.weight", "wte.weight")',
                       'P.tie(model, "lm_head.weight", "h.0.ln_1.weight")', 'P.tie(model, "wte.weight", "lm_head.weight")',
                       'P.tie(model, "0.weight", "2.weight")', 'P.tie(model, "lm_head.bias", "wte.weight")',
                       'P.tie(model, "a.up.weight", "b.up.weight")', "P.tie(model, 3, 4)", "P.tie(nil)"])
    set_field(p, "postprocess", f"function(model, cfg) {body} end")
    return "ties"


def m_error(p, rng):
    where = rng.choice(["preprocess", "postprocess", "modules"])
    body = rng.choice(['error("boom")', "local x = nil; x.y = 1", "model:get(3)", 'model:set("nothing.x", model)',
                       "error({})", 'model:set_attribute("x", 1)', "return model.nothing.weight"])
    return put_function(p, where, body, "error in a function")


def m_loop(p, rng):
    where = rng.choice(["preprocess", "postprocess", "modules"])
    body = rng.choice(["while true do end", "while true do pcall(function() for _ = 1, 10 do end end) end",
                       "local n = 0; repeat n = n + 1 until false", "local function f() return f() end; f()"])
    return put_function(p, where, body, "endless loop")


def put_function(p, where, body, cls):
    if where == "modules":
        i = field(p, "modules")
        mods = p[i][1]
        if isinstance(mods, str):
            return cls
        p[i] = ("modules", f"function(cfg)\n    {body}\n    return " + render_modules(mods, "    ") + "\n  end")
    else:
        set_field(p, where, f"function(model, cfg)\n    {body}\n  end")
    return cls


def m_method(p, rng):
    body = rng.choice(["local y = self(x); return y", "local y = self:own_forward(x); return y * 2",
                       "return 42", "local y = self:own_forward(x); return y",
                       "local y = self:own_forward(x):detach(); return y", "error('in forward')",
                       "while true do end"])
    key, entry = rng.choice(entries(p))
    entry.append(("methods", [(q("forward"), f"function(self, x) {body} end")]))
    return "replaced forward"


def m_sequence(p, rng):
    return "sequence parallel"  # the options carry it (see make_case)


MUTATIONS = [m_wrong_type, m_unknown_field, m_map_for_list, m_bad_path, m_wrong_style, m_division, m_magic,
             m_missing, m_extra, m_tie, m_error, m_loop, m_method, m_sequence]
WEIGHTS = [12, 8, 5, 9, 14, 9, 6, 8, 7, 5, 6, 2, 6, 3]


def make_case(rng, i):
    kind = rng.choices(["gpt2", "mlp", "net", "simple"], weights=[6, 2, 2, 1])[0]
    policy = BASES[kind]()
    if rng.random() < 0.05:
        cls = "unchanged"
    else:
        mutation = rng.choices(MUTATIONS, weights=WEIGHTS)[0]
        if mutation in (m_division, m_tie) and kind != "gpt2" and rng.random() < 0.7:
            kind, policy = "gpt2", gpt2_policy()
        KIND[0] = kind
        cls = mutation(policy, rng)
        if rng.random() < 0.15:  # a second mutation
            rng.choices(MUTATIONS, weights=WEIGHTS)[0](policy, rng)
    opts = {"policy_timeout": POLICY_TIMEOUT}
    if cls == "sequence parallel" or (kind == "gpt2" and rng.random() < 0.1):
        opts["sequence_parallel"] = "true"
        if kind == "gpt2" and rng.random() < 0.3:
            policy = [("name", q("shipped"))]  # the shipped GPT-2 policy: accepted with its SP forward
            cls = "sequence parallel"
    form = rng.choices(["tail", "local", "plain", "function"], weights=[5, 2, 2, 2])[0]
    if policy == [("name", q("shipped"))]:
        text = 'return require "policies.gpt2"\n'
        form = "tail"
    else:
        text = render(policy, form)
    return {"id": i, "kind": kind, "class": cls, "form": form, "text": text, "opts": opts}


# ---- Running -----------------------------------------------------------------------------------

def write_cases(cases, folder):
    for c in cases:
        with open(os.path.join(folder, f"case_{c['id']}.lua"), "w") as f:
            f.write(c["text"])
        opts = ", ".join(f"{k} = {v}" for k, v in c["opts"].items())
        with open(os.path.join(folder, f"case_{c['id']}_meta.lua"), "w") as f:
            f.write(f'return {{ kind = "{c["kind"]}", opts = {{ {opts} }} }}\n')


def run_jobs(partrain, folder, n, log):
    """Runs cases 0..n-1 in as few jobs as it can; returns {id: (kind, detail)}."""
    results = {}
    start = 0
    while start < n:
        cmd = [partrain, "--nproc-per-node", "2", "--threads", "1", RUNNER, folder, str(start), str(n - 1)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             errors="replace", start_new_session=True, env=env)
        lines = queue.Queue()
        err_tail = []

        def pump_out():
            for line in p.stdout:
                lines.put(line.rstrip("\n"))
            lines.put(None)

        def pump_err():
            for line in p.stderr:
                err_tail.append(line)
                del err_tail[:-40]

        threading.Thread(target=pump_out, daemon=True).start()
        threading.Thread(target=pump_err, daemon=True).start()
        current, ended = None, False
        while True:
            try:
                line = lines.get(timeout=CASE_BOUND)
            except queue.Empty:
                common.kill_tree(p.pid)
                p.wait()
                stuck = current if current is not None else start
                results[stuck] = ("hang", f"no progress for {CASE_BOUND} s")
                start = stuck + 1
                break
            if line is None:
                p.wait()
                if current is not None and current not in results:  # died inside a case
                    results[current] = ("crash", f"exit {p.returncode}: " + "".join(err_tail)[-1500:])
                    start = current + 1
                elif not ended:  # died between cases, or before the first one
                    stuck = current + 1 if current is not None else start
                    if stuck < n:
                        results[stuck] = ("crash", f"exit {p.returncode} before the case: " + "".join(err_tail)[-1500:])
                    start = stuck + 1
                else:
                    start = n
                break
            m = re.match(r"^START (\d+)$", line)
            if m:
                current = int(m.group(1))
                continue
            m = re.match(r"^CASE (\d+) (\S+) ?(.*)$", line)
            if m:
                results[int(m.group(1))] = (m.group(2) + (" " + m.group(3).split(" ")[0] if m.group(2) == "accepted" else ""),
                                            m.group(3).replace("\\n", "\n"))
                continue
            if line == "DONE":
                ended = True
            elif log:
                print("  " + line, flush=True)
    return results


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    partrain = os.path.abspath(sys.argv[1])
    seed = common.seed_from_argv(1)
    n = common.int_flag("--cases", 220)
    rng = random.Random(seed)
    cases = [make_case(rng, i) for i in range(n)]
    started = time.monotonic()
    tally = common.Tally(f"policies (seed {seed})")
    with tempfile.TemporaryDirectory(prefix="partrain-fuzz-policy-") as folder:
        write_cases(cases, folder)
        results = run_jobs(partrain, folder, n, log=False)
        for c in cases:
            kind, detail = results.get(c["id"], ("crash", "no result"))
            case_file = f"case_{c['id']}.lua"
            what = f"case {c['id']} ({c['kind']}, {c['form']}, {c['opts']}):\n{c['text']}\n-> {kind}: {detail}"
            if "--verbose" in sys.argv:
                print(f"case {c['id']} {c['class']} ({c['kind']}, {c['form']}): {kind}: {detail[:300]}")
            if kind == "refused":
                # Where: the policy file (the script's line for a plain table), never partrain's own.
                place = rf"{re.escape(case_file)}:\d+:" + (r"|policy_runner\.lua:\d+:" if c["form"] == "plain" else "")
                good = re.search(place, detail) and not common.INTERNAL_LOCATION.search(detail.split("stack traceback")[0])
                tally.add(c["class"], "refused" if good else "unclear", bool(good), what)
            elif kind == "accepted same":
                tally.add(c["class"], "accepted", True)
            elif kind.startswith("accepted"):  # trains differently from serial, or fails to train
                tally.add(c["class"], "accepted", False, what)
            else:
                tally.add(c["class"], kind, False, what)
    print(f"{n} cases in {time.monotonic() - started:.0f} s")
    tally.finish()


if __name__ == "__main__":
    main()
