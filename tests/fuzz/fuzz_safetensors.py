"""Fuzzes pt.ckpt.import_safetensors with malformed .safetensors files made from a tiny GPT-2's
exported weights (Hugging Face's layout): seeded byte flips in the length field, the header and
the data, truncations and extensions, and structured damage of the header (offsets shifted,
swapped, overlapping, fractional, negative or huge; shapes and dtypes changed; keys duplicated,
unknown or missing; names with and without "transformer."; tensors added or removed; metadata;
a header that is no JSON object or nests too deep), beside valid variants (keys reordered,
padding, dtypes converted exactly, mask buffers, a tied lm_head).

A strict reference reader written here, from the safetensors format and the rules of
docs/checkpoints.md, says whether each file is valid for the model and what it holds. All files
go through one partrain process (tests/fuzz/ckpt_batch.lua, restarted after a case that kills
it), which imports each into a model first loaded with decoy weights. A case passes when partrain
accepts exactly the files the reference accepts, with exactly the values the reference reads
(checked on the model exported again), and refuses the others naming the file (and a tensor
when the damage is in one), leaving the decoy weights untouched.

Classes: refused, accepted (a valid file, imported exactly); failures: wrong (a bad file
accepted, or other values), unclear (a valid file refused, or a refusal without its file or
tensor), crash, hang.

Usage: fuzz_safetensors.py PARTRAIN [--seed N] [--cases N]
"""
import json
import math
import os
import random
import re
import shutil
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from fuzz_ckpt import BATCH, BIN, ROOT, SEED, run_batch  # noqa: E402

CASES = common.int_flag("--cases", 320)
SIZES = {"F32": 4, "F64": 8, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U8": 1, "BOOL": 1}
FLOATS = {"F32", "F64", "F16", "BF16"}
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
MAX_ELEMENTS = 1 << 48


class Bad(Exception):
    """The reference's refusal; `tensor` when the damage is in one tensor's entry or bytes."""

    def __init__(self, why, tensor=None):
        super().__init__(why)
        self.tensor = tensor


# ---- The reference reader ------------------------------------------------------------------

class Negative:
    """A JSON integer written with a minus sign (nlohmann keeps it signed: not a size)."""


def parse_int(text):
    value = int(text)
    return Negative() if text.startswith("-") or value >= 1 << 64 else value


def no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise Bad(f"duplicate key {k}")
        out[k] = v
    return out


def unsigned(x):
    return type(x) is int and x >= 0


def decode(dtype, raw):
    """The float values of raw bytes of a floating dtype."""
    if dtype == "F32":
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    if dtype == "F64":
        return list(struct.unpack(f"<{len(raw) // 8}d", raw))
    if dtype == "F16":
        return list(struct.unpack(f"<{len(raw) // 2}e", raw))
    if dtype == "BF16":
        return [struct.unpack("<f", b"\0\0" + raw[i:i + 2])[0] for i in range(0, len(raw), 2)]
    raise ValueError(dtype)


def reference(raw, params):
    """The tensors (name -> (dtype, shape, bytes), HF layout) partrain must import from `raw`, or
    Bad. `params`: the model's names -> shape in the file's (HF) layout."""
    if len(raw) < 8:
        raise Bad("too short")
    n = struct.unpack("<Q", raw[:8])[0]
    if n > len(raw) - 8 or n > 100 << 20:
        raise Bad("header length")
    text = raw[8:8 + n]
    if not text.startswith(b"{") or common.json_depth(text) > 64:
        raise Bad("not an object / too deep")

    def constant(name):
        raise Bad("JSON has no " + name)

    try:
        header = json.loads(text.decode("utf-8"), object_pairs_hook=no_duplicates, parse_int=parse_int,
                            parse_constant=constant)
    except Bad as e:
        raise Bad(str(e), tensor="?") if "duplicate" in str(e) else e
    except (ValueError, UnicodeDecodeError) as e:
        raise Bad(f"not JSON: {e}")
    if not isinstance(header, dict):
        raise Bad("not an object")
    data = raw[8 + n:]
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise Bad("metadata")
            continue
        if name == "" or not isinstance(info, dict) or set(info) - {"dtype", "shape", "data_offsets"} or \
                not {"dtype", "shape", "data_offsets"} <= set(info):
            raise Bad("entry keys", name)
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in SIZES:
            raise Bad("dtype", name)
        if not isinstance(shape, list) or len(shape) > 16 or not all(unsigned(s) and s <= MAX_ELEMENTS for s in shape):
            raise Bad("shape", name)
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(unsigned(o) for o in offsets):
            raise Bad("offsets", name)
        count = 1
        for s in shape:
            count *= s
        if 0 not in shape:
            c = 1
            for s in shape:
                if s > MAX_ELEMENTS // c:
                    raise Bad("shape too large", name)
                c *= s
        b, e = offsets
        if b > e or e > len(data) or e - b != count * SIZES[dtype]:
            raise Bad("offsets do not fit", name)
        entries.append((name, dtype, shape, b, e))
    at = 0
    for name, dtype, shape, b, e in sorted(entries, key=lambda x: (x[3], x[4])):
        if b != at:
            raise Bad("overlap or hole", name)
        at = e
    if at != len(data):
        raise Bad("trailing bytes", "?")
    out = {}
    for name, dtype, shape, b, e in entries:
        key = name[len("transformer."):] if name.startswith("transformer.") else name
        if key in out:
            raise Bad("both names", name)
        blob = data[b:e]
        if dtype == "BOOL" and any(x > 1 for x in blob):
            raise Bad("bool byte", name)
        if key.endswith(CONV1D) and len(shape) != 2:
            raise Bad("Conv1D rank", name)
        out[key] = (dtype, shape, blob)
    # The model's side: a tied lm_head equal to wte, mask buffers dropped, names, shapes, kinds.
    if "wte.weight" in out and "lm_head.weight" in out:
        a, w = out["lm_head.weight"], out["wte.weight"]
        av = decode(a[0], a[2]) if a[0] in FLOATS else list(a[2])
        wv = decode(w[0], w[2]) if w[0] in FLOATS else list(w[2])
        if a[1] != w[1] or any(x != y for x, y in zip(av, wv)):
            raise Bad("lm_head differs", "lm_head.weight")
    out = {k: v for k, v in out.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    for key, (dtype, shape, blob) in out.items():
        if key not in params:
            raise Bad("not in the model", key)
        if shape != params[key]:
            raise Bad("shape", key)
        if dtype not in FLOATS:
            raise Bad("kind", key)
    for key in params:
        if key not in out and key != "lm_head.weight":
            raise Bad("missing", key)
    return out


def read_plain(path):
    """A well-formed file's header and data (no checks: for files partrain wrote)."""
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


# ---- Making files --------------------------------------------------------------------------

def assemble(header, data, pad=True):
    text = header if isinstance(header, (bytes, bytearray)) else json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + data


def tensors_of(header, data):
    """name -> [dtype, shape, bytes], in the file's order."""
    return {k: [v["dtype"], list(v["shape"]), data[v["data_offsets"][0]:v["data_offsets"][1]]]
            for k, v in header.items() if k != "__metadata__"}


def build(tensors, metadata=None, order=None):
    """A valid file from name -> [dtype, shape, bytes], data in `order` (default: as given)."""
    header, data = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for k in order or tensors:
        dtype, shape, blob = tensors[k]
        header[k] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    return header, data


def mutate(cls, base_header, base_data, rng):
    """(bytes, description) of a file of class `cls`, or (special, description) for a path that
    is not a plain file."""
    tensors = tensors_of(base_header, base_data)
    names = list(tensors)
    name = rng.choice(names)
    raw = assemble(base_header, base_data)
    header, data = build(tensors)

    def entry_text(h):
        return json.dumps(h, separators=(",", ":")).encode()

    if cls == "length field":
        b = bytearray(raw)
        b[rng.randrange(8)] ^= rng.randrange(1, 256)
        return bytes(b), "flip"
    if cls == "header bytes":
        b = bytearray(raw)
        n = struct.unpack("<Q", raw[:8])[0]
        at = rng.randrange(8, 8 + n)
        b[at] ^= rng.randrange(1, 256)
        return bytes(b), f"byte {at}"
    if cls == "data bytes":
        b = bytearray(raw)
        at = rng.randrange(len(raw) - len(base_data), len(raw))
        b[at] ^= rng.randrange(1, 256)
        return bytes(b), f"byte {at}"
    if cls == "truncated":
        return raw[:rng.randrange(len(raw))], "truncated"
    if cls == "extended":
        return raw + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 16))), "extended"
    if cls == "offsets":
        what = rng.choice(["shift", "swap", "overlap", "reverse", "float", "negative", "huge", "three", "string"])
        offsets = header[name]["data_offsets"]
        if what == "shift":
            d = rng.choice([-8, -4, -1, 1, 4, 8])
            header[name]["data_offsets"] = [max(0, offsets[0] + d), max(0, offsets[1] + d)]
        elif what == "swap":  # with a tensor of the same size: still valid, other values
            same = [k for k in names if k != name and len(tensors[k][2]) == len(tensors[name][2])]
            other = rng.choice(same) if same else rng.choice(names)
            header[name]["data_offsets"], header[other]["data_offsets"] = header[other]["data_offsets"], offsets
        elif what == "overlap":
            other = rng.choice(names)
            size = offsets[1] - offsets[0]
            header[name]["data_offsets"] = [header[other]["data_offsets"][0], header[other]["data_offsets"][0] + size]
        elif what == "reverse":
            header[name]["data_offsets"] = [offsets[1], offsets[0]]
        elif what == "float":
            header[name]["data_offsets"] = [float(offsets[0]), offsets[1]]
        elif what == "negative":
            header[name]["data_offsets"] = [offsets[0] - (1 << 20), offsets[1]]
        elif what == "huge":
            header[name]["data_offsets"] = [offsets[0], (1 << 64) + 7]
        elif what == "three":
            header[name]["data_offsets"] = offsets + [offsets[1]]
        else:
            header[name]["data_offsets"] = [str(offsets[0]), offsets[1]]
        return assemble(header, data), f"{what} {name}"
    if cls == "shape":
        what = rng.choice(["plus", "minus", "negative", "float", "huge", "dropped", "unit", "not a list", "bool"])
        shape = header[name]["shape"]
        if what == "plus":
            shape[0] += 1
        elif what == "minus":
            shape[-1] -= 1
        elif what == "negative":
            shape[0] = -shape[0]
        elif what == "float":
            shape[0] = float(shape[0])
        elif what == "huge":
            shape[:] = [1 << 40, 1 << 40]
        elif what == "dropped":
            shape.pop()
        elif what == "unit":  # the same bytes, a shape the model does not have
            shape.append(1)
        elif what == "not a list":
            header[name]["shape"] = shape[0]
        else:
            shape[0] = True
        return assemble(header, data), f"{what} {name}"
    if cls == "dtype":
        header[name]["dtype"] = rng.choice(["I32", "F16", "F64", "I64", "U8", "BOOL", "BF16", "f32", "F8", 32, None])
        return assemble(header, data), f"{header[name]['dtype']} {name}"
    if cls == "dtype converted":  # valid: the values re-encoded exactly
        dtype = rng.choice(["F16", "F64", "BF16"])
        values = decode("F32", tensors[name][2])
        if dtype == "F64":
            blob = struct.pack(f"<{len(values)}d", *values)
        elif dtype == "BF16":
            blob = b"".join(tensors[name][2][i + 2:i + 4] for i in range(0, len(tensors[name][2]), 4))
        else:
            blob = struct.pack(f"<{len(values)}e", *[max(-60000.0, min(60000.0, v)) for v in values])
        tensors[name] = [dtype, tensors[name][1], blob]
        return assemble(*build(tensors)), f"{dtype} {name}"
    if cls == "keys":
        what = rng.choice(["tensor twice", "key twice", "unknown key", "missing key", "empty name", "not an object"])
        text = entry_text(header)
        entry = entry_text(header[name])
        if what == "tensor twice":
            text = text[:-1] + b',"' + name.encode() + b'":' + entry + b"}"
        elif what == "key twice":
            text = text.replace(b'"' + name.encode() + b'":{', b'"' + name.encode() + b'":{"dtype":"F32",', 1)
        elif what == "unknown key":
            header[name]["scale"] = 1
            text = entry_text(header)
        elif what == "missing key":
            del header[name][rng.choice(["dtype", "shape", "data_offsets"])]
            text = entry_text(header)
        elif what == "empty name":
            header[""] = header.pop(name)
            text = entry_text(header)
        else:
            header[name] = [header[name]["dtype"]]
            text = entry_text(header)
        return assemble(text, data), f"{what} {name}"
    if cls == "names":
        what = rng.choice(["all prefixed", "prefixed twice", "extra tensor", "missing tensor", "mask buffer",
                           "lm_head tied", "lm_head different", "renamed"])
        if what == "all prefixed":
            tensors = {"transformer." + k: v for k, v in tensors.items()}
        elif what == "prefixed twice":
            tensors["transformer." + name] = list(tensors[name])
        elif what == "extra tensor":
            tensors["h.9.extra.weight"] = ["F32", [2], b"\0" * 8]
        elif what == "missing tensor":
            del tensors[name]
        elif what == "mask buffer":
            tensors["h.0.attn.bias"] = ["F32", [1, 1, 2, 2], struct.pack("<4f", 1, 0, 1, 1)]
        elif what == "lm_head tied":
            tensors["lm_head.weight"] = list(tensors["wte.weight"])
        elif what == "lm_head different":
            blob = bytearray(tensors["wte.weight"][2])
            blob[rng.randrange(len(blob))] ^= 0x40
            tensors["lm_head.weight"] = ["F32", tensors["wte.weight"][1], bytes(blob)]
        else:
            tensors[name + "x"] = tensors.pop(name)
        return assemble(*build(tensors)), f"{what} {name}"
    if cls == "layout":  # valid variants: key order, data order, padding, metadata
        order = names[:]
        rng.shuffle(order)
        header, data = build(tensors, metadata={"format": "pt", "note": "é"}, order=order)
        keys = list(header)
        rng.shuffle(keys)
        text = json.dumps({k: header[k] for k in keys}, separators=(", ", ": ")).encode()
        return assemble(text + b" " * rng.randrange(0, 24), data, pad=False), "reordered"
    if cls == "header structure":
        what = rng.choice(["list", "deep", "not utf-8", "NaN", "metadata number", "metadata list", "empty",
                           "text after", "length zero"])
        if what == "list":
            text = b"[" + entry_text(header) + b"]"
        elif what == "deep":
            text = b'{"x":' + b"[" * 200 + b"]" * 200 + b"}"
        elif what == "not utf-8":
            text = entry_text(header).replace(name.encode(), name.encode() + b"\xff", 1)
        elif what == "NaN":
            text = entry_text(header).replace(b'"data_offsets":[0,', b'"data_offsets":[NaN,', 1)
        elif what == "metadata number":
            header["__metadata__"] = {"format": 1}
            text = entry_text(header)
        elif what == "metadata list":
            header["__metadata__"] = ["pt"]
            text = entry_text(header)
        elif what == "empty":
            text = b"{}"
            data = b""
        elif what == "text after":
            text = entry_text(header) + b" x"
        else:
            return struct.pack("<Q", 0) + data, what
        return assemble(text, data), what
    raise ValueError(cls)


CLASSES = ["length field", "header bytes", "data bytes", "truncated", "extended", "offsets", "shape", "dtype",
           "dtype converted", "keys", "names", "layout", "header structure", "not a file"]


def floats_equal(a, b):
    return a == b or (math.isnan(a) and math.isnan(b))


def judge(path, r, expected, names):
    """(kind, ok, detail) for one file."""
    if r["import"] == "error":
        err = r["error"]
        if not isinstance(expected, Bad):
            return "unclear", False, "a valid file refused: " + err
        if path not in err or common.INTERNAL_LOCATION.search(err.split("stack traceback")[0]):
            return "unclear", False, "the refusal does not name the file: " + err
        if expected.tensor and not any(f"'{n}'" in err for n in names):
            return "unclear", False, f"the damage is in a tensor ({expected.tensor}), the refusal names none: " + err
        if not r["unchanged"]:
            return "wrong", False, "a refused import changed the weights: " + err
        return "refused", True, ""
    if isinstance(expected, Bad):
        return "wrong", False, f"accepted, though {expected} ({expected.tensor})"
    got, data = read_plain(r["export"])
    for key, (dtype, shape, blob) in expected.items():
        if key == "lm_head.weight":
            continue  # tied to wte, which is compared
        info = got.get(key)
        if info is None or info["shape"] != shape:
            return "wrong", False, f"{key}: exported as {info}, expected shape {shape}"
        mine = data[info["data_offsets"][0]:info["data_offsets"][1]]
        if dtype == "F32":
            same = mine == blob
        else:
            same = all(floats_equal(a, b) for a, b in zip(decode("F32", mine), decode(dtype, blob)))
        if not same:
            return "wrong", False, f"{key}: other values than the file holds"
    return "accepted", True, ""


def main():
    tally = common.Tally(f"safetensors (seed {SEED})", kinds=["refused", "accepted", "wrong", "unclear", "crash",
                                                               "hang"])
    rng = random.Random(SEED)
    work = common.scratch_dir("fuzz-safetensors-")
    try:
        made = common.make_with_batch(BIN, BATCH, work, ROOT)
        if made.kind != "accepted":
            print("could not make the base files:", made)
            return 1
        base_header, base_data = read_plain(os.path.join(work, "base.safetensors"))
        params = {k: v["shape"] for k, v in base_header.items() if k != "__metadata__"}
        params["lm_head.weight"] = params["wte.weight"]
        meta, paths = {}, []
        for i in range(CASES):
            cls = CLASSES[i % len(CLASSES)]
            path = os.path.join(work, f"case-{i}.safetensors")
            if cls == "not a file":
                what = common.special_file(path, rng)
                expected, raw = Bad(what), b""
            else:
                raw, what = mutate(cls, base_header, base_data, rng)
                open(path, "wb").write(raw)
                try:
                    expected = reference(raw, params)
                except Bad as e:
                    expected = e
            # The names a refusal may cite: the model's, and any the file's header spells.
            names = set(params) | {m.decode(errors="replace") for m in re.findall(rb'"([^"\\]{1,200})"', raw[:1 << 16])}
            meta[i] = (path, cls, what, expected, names)
            paths.append((i, path))
        classes = {}

        def crashed(i, kind, detail):
            path, cls, what, expected, names = meta[i]
            tally.add(cls, kind, False, f"case {i} ({what}): {detail}")
            classes[i] = kind

        malformed = sum(isinstance(m[3], Bad) for m in meta.values())
        print(f"{malformed} malformed files and {CASES - malformed} valid ones", flush=True)
        results = run_batch("safetensors", work, paths, crashed)
        for i, (path, cls, what, expected, names) in meta.items():
            if i in classes:
                continue
            kind, ok, detail = judge(path, results[i], expected, names)
            tally.add(cls, kind, ok, f"case {i} ({what}): {detail}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tally.finish()


if __name__ == "__main__":
    sys.exit(main())
