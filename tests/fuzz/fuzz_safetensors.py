"""Fuzzes pt.ckpt.import_safetensors with malformed .safetensors files made from a tiny GPT-2's
exported weights (Hugging Face's layout): seeded byte flips in the length field, the header and
the data, truncations and extensions, and structured damage of the header (offsets shifted,
swapped, overlapping, fractional, negative or huge; shapes and dtypes changed; keys duplicated,
unknown or missing; names with and without "transformer."; tensors added or removed; metadata;
a header that is no JSON object or nests too deep), beside valid variants (keys reordered,
padding, dtypes converted exactly, mask buffers, a tied lm_head). The same damage, and damage of
the experts' numbering, goes to a tiny Mixtral's files (LLaMA with experts: Hugging Face stores
an expert a tensor, experts.M.w1.weight, which partrain stacks into experts.w1): an expert
missing, named twice, out of range, numbered with a sign or a leading zero, of another shape or
dtype, the stack beside its experts; beside valid variants (experts renumbered, every expert of
a tensor converted alike, the stack stored whole, names without "model.").

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

Usage: fuzz_safetensors.py PARTRAIN [--seed N] [--cases N] [--moe-cases N]
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
MOE_CASES = common.int_flag("--moe-cases", 200)
SIZES = {"F32": 4, "F64": 8, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U8": 1, "BOOL": 1}
FLOATS = {"F32", "F64", "F16", "BF16"}
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
MAX_ELEMENTS = 1 << 48


class Family:
    """What the reference knows of a model family's Hugging Face names (engine/models/registry.hpp):
    the prefix an import drops, the Conv1D weights stored [in, out], the buffers it skips, the tied
    pair (tensor, source) and whether experts are stored one tensor an expert."""

    # Mixtral's expert M of a stacked tensor: decimal, no sign or leading zero, at most 18 digits.
    SLICE = re.compile(r"^((?:.*\.)?block_sparse_moe\.experts\.)(0|[1-9][0-9]{0,17})\.(w[123])\.weight$", re.DOTALL)

    def __init__(self, name, prefix, conv1d=(), ignored=(), tied=None, experts=False):
        self.name, self.prefix, self.conv1d, self.ignored, self.tied, self.experts = \
            name, prefix, conv1d, ignored, tied, experts

    def key(self, name):
        """partrain's name of a file's tensor (the prefix dropped)."""
        return name[len(self.prefix):] if name.startswith(self.prefix) else name

    def file_name(self, key):
        """The name an export gives partrain's tensor `key`."""
        if self.name == "gpt2" or key.startswith("lm_head."):
            return key
        return self.prefix + key

    def slice(self, key):
        """(stacked tensor, expert) of a partrain name that is one expert, or None."""
        m = self.SLICE.match(key) if self.experts else None
        return (m.group(1) + m.group(3), int(m.group(2))) if m else None

    @staticmethod
    def slice_key(stacked, index):
        """"...experts.w1", 3 -> "...experts.3.w1.weight"."""
        return f"{stacked[:-2]}{index}.{stacked[-2:]}.weight"


GPT2 = Family("gpt2", "transformer.", conv1d=CONV1D, ignored=(".attn.bias", ".attn.masked_bias"),
              tied=("lm_head.weight", "wte.weight"))
MIXTRAL = Family("mixtral", "model.", ignored=("rotary_emb.inv_freq",), experts=True)


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


def model_stacks(params, fam):
    """The model's stacked tensors: partrain name -> (experts, one expert's shape)."""
    out = {}
    for name, shape in params.items():
        s = fam.slice(fam.key(name))
        if s:
            out[s[0]] = (out.get(s[0], (0, shape))[0] + 1, shape)
    return out


def reference(raw, params, fam):
    """The tensors (name -> (dtype, shape, bytes), HF layout: an expert a tensor) partrain must
    import from `raw`, or Bad. `params`: the model's names -> shape in the file's (HF) layout."""
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
    out, slices = {}, {}  # partrain name -> entry; stacked name -> {expert: (file's name, entry)}
    for name, dtype, shape, b, e in entries:
        key = fam.key(name)
        blob = data[b:e]
        if dtype == "BOOL" and any(x > 1 for x in blob):
            raise Bad("bool byte", name)
        s = fam.slice(key)
        if s:
            if s[1] in slices.setdefault(s[0], {}):
                raise Bad("one expert named twice", name)
            slices[s[0]][s[1]] = (name, (dtype, shape, blob))
            continue
        if key in out:
            raise Bad("both names", name)
        if fam.conv1d and key.endswith(fam.conv1d) and len(shape) != 2:
            raise Bad("Conv1D rank", name)
        out[key] = (dtype, shape, blob)
    # Experts stack: numbered 0..n-1, each once, of one dtype and shape; never beside the stack.
    stacks = {}  # stacked name -> [entry of expert 0, 1, ...]
    for stacked, parts in slices.items():
        if stacked in out:
            raise Bad("the stack and its experts", stacked)
        if sorted(parts) != list(range(len(parts))):
            raise Bad("experts not numbered 0..n-1", stacked)
        first = parts[0][1]
        for i in range(len(parts)):
            if parts[i][1][:2] != first[:2]:
                raise Bad("experts of other dtypes or shapes", parts[i][0])
        stacks[stacked] = [parts[i][1] for i in range(len(parts))]
    # The model's side: a tied tensor equal to its source, buffers dropped, names, shapes, kinds.
    if fam.tied and fam.tied[0] in out and fam.tied[1] in out:
        a, w = out[fam.tied[0]], out[fam.tied[1]]
        av = decode(a[0], a[2]) if a[0] in FLOATS else list(a[2])
        wv = decode(w[0], w[2]) if w[0] in FLOATS else list(w[2])
        if a[1] != w[1] or any(x != y for x, y in zip(av, wv)):
            raise Bad("tied tensor differs", fam.tied[0])
    out = {k: v for k, v in out.items() if not (fam.ignored and k.endswith(fam.ignored))}
    model = model_stacks(params, fam)
    for key in [k for k in out if k in model]:  # a stack stored whole: the model's experts, cut
        dtype, shape, blob = out.pop(key)
        experts, one = model[key]
        if shape != [experts] + one:
            raise Bad("shape", key)
        size = len(blob) // experts
        stacks[key] = [(dtype, one, blob[i * size:(i + 1) * size]) for i in range(experts)]
    result = {}
    for key, (dtype, shape, blob) in out.items():
        if fam.file_name(key) not in params:
            raise Bad("not in the model", key)
        if shape != params[fam.file_name(key)]:
            raise Bad("shape", key)
        if dtype not in FLOATS:
            raise Bad("kind", key)
        result[fam.file_name(key)] = (dtype, shape, blob)
    for stacked, parts in stacks.items():
        if stacked not in model:
            raise Bad("not in the model", stacked)
        if len(parts) != model[stacked][0] or parts[0][1] != model[stacked][1]:
            raise Bad("shape", stacked)
        if parts[0][0] not in FLOATS:
            raise Bad("kind", stacked)
        for i, entry in enumerate(parts):
            result[fam.file_name(Family.slice_key(stacked, i))] = entry
    for name in params:
        if name not in result and not (fam.tied and name == fam.tied[0]):
            raise Bad("missing", name)
    return result


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


def expert_damage(tensors, rng):
    """(tensors, description): a Mixtral's experts numbered, named or shaped otherwise."""
    experts = {}  # stacked name -> {expert: the file's name}
    for name in tensors:
        s = MIXTRAL.slice(MIXTRAL.key(name))
        if s:
            experts.setdefault(s[0], {})[s[1]] = name
    stacked = rng.choice(sorted(experts))
    parts = experts[stacked]
    n = len(parts)
    e = rng.randrange(n)
    name = parts[e]

    def named(index):
        return MIXTRAL.file_name(Family.slice_key(stacked, index))

    what = rng.choice(["missing", "last missing", "twice", "out of range", "far out of range", "leading zero",
                       "signed", "renumbered", "shape", "dtype", "all converted", "stacked", "stack and experts",
                       "w4", "dropped prefix"])
    if what == "missing":
        del tensors[name]
    elif what == "last missing":
        del tensors[parts[n - 1]]
    elif what == "twice":  # the same expert with and without "model."
        tensors[MIXTRAL.key(name)] = list(tensors[name])
    elif what == "out of range":
        tensors[named(n)] = list(tensors[name])
    elif what == "far out of range":
        far = rng.choice([n + 1, 9, 1000, 10 ** 17, 10 ** 18 - 1, 10 ** 18, 10 ** 19, 2 ** 63, 2 ** 64])
        tensors[named(far)] = list(tensors[name])
        what += f" {far}"
    elif what == "leading zero":
        tensors[named(f"0{e}")] = list(tensors[name])
    elif what == "signed":
        tensors[named(rng.choice(["-1", "+1", f"-{e}"]))] = list(tensors[name])
    elif what == "renumbered":  # valid: other experts in each place
        order = list(range(n))
        rng.shuffle(order)
        moved = {named(order[i]): tensors.pop(parts[i]) for i in range(n)}
        tensors.update(moved)
    elif what == "shape":  # the bytes of another shape
        dtype, shape, blob = tensors[name]
        cut = shape[-1] * SIZES[dtype]
        tensors[name] = [dtype, shape[:-2] + [shape[-2] - 1, shape[-1]], blob[:-cut]]
    elif what in ("dtype", "all converted"):  # one expert re-encoded exactly, or all of them (valid)
        for index in ([e] if what == "dtype" else range(n)):
            dtype, shape, blob = tensors[parts[index]]
            values = decode(dtype, blob)
            tensors[parts[index]] = ["F64", shape, struct.pack(f"<{len(values)}d", *values)]
    elif what in ("stacked", "stack and experts"):  # valid: the stack stored whole, as partrain names it
        dtype, shape, _ = tensors[parts[0]]
        whole = b"".join(tensors[parts[i]][2] for i in range(n))
        if what == "stacked":
            for i in range(n):
                del tensors[parts[i]]
        tensors[MIXTRAL.file_name(stacked)] = [dtype, [n] + shape, whole]
    elif what == "w4":
        tensors[name[:-len("w1.weight")] + "w4.weight"] = tensors.pop(name)
    else:  # valid: every expert of one tensor without "model."
        for i in range(n):
            tensors[MIXTRAL.key(parts[i])] = tensors.pop(parts[i])
    return tensors, f"{what} {name}"


def mixtral_names(tensors, name, rng):
    """(tensors, description): the "names" class on a Mixtral's file."""
    what = rng.choice(["all unprefixed", "prefixed twice", "extra tensor", "missing tensor", "rotary buffer",
                       "renamed"])
    if what == "all unprefixed":
        tensors = {MIXTRAL.key(k): v for k, v in tensors.items()}
    elif what == "prefixed twice":
        tensors[MIXTRAL.key(name)] = list(tensors[name])
    elif what == "extra tensor":
        tensors["model.layers.9.extra.weight"] = ["F32", [2], b"\0" * 8]
    elif what == "missing tensor":
        del tensors[name]
    elif what == "rotary buffer":  # older files carry it; partrain computes it
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = ["F32", [2], struct.pack("<2f", 1, 0.01)]
    else:
        tensors[name + "x"] = tensors.pop(name)
    return tensors, f"{what} {name}"


def mutate(cls, base_header, base_data, rng, fam=GPT2):
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
    if cls == "experts":
        return (lambda t, what: (assemble(*build(t)), what))(*expert_damage(tensors, rng))
    if cls == "names" and fam is MIXTRAL:
        return (lambda t, what: (assemble(*build(t)), what))(*mixtral_names(tensors, name, rng))
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


def shown(name):
    """A name as partrain's messages show it: control characters as \\xNN."""
    return "".join(f"\\x{ord(c):02x}" if ord(c) < 0x20 or ord(c) == 0x7f else c for c in name)


def judge(path, r, expected, names, fam):
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
        if fam.tied and key == fam.tied[0]:
            continue  # GPT-2's lm_head: tied to wte, which is compared
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
        # GPT-2's cases, then the Mixtral's (its classes named so), each family in its own batch.
        runs = [(GPT2, "base.safetensors", "safetensors", CLASSES, range(CASES), ""),
                (MIXTRAL, "base_moe.safetensors", "safetensors_moe", CLASSES + ["experts"] * 3,
                 range(CASES, CASES + MOE_CASES), "Mixtral: ")]
        for fam, base, mode, classes_of, cases, label in runs:
            base_header, base_data = read_plain(os.path.join(work, base))
            params = {k: v["shape"] for k, v in base_header.items() if k != "__metadata__"}
            if fam.tied:
                params[fam.tied[0]] = params[fam.tied[1]]
            # The names a refusal may cite: the model's (both ways), its stacks, and any the file
            # spells (both ways: partrain's drops the prefix).
            model_names = set(params) | {fam.key(k) for k in params} | set(model_stacks(params, fam))
            meta, paths = {}, []
            for i in cases:
                cls = classes_of[i % len(classes_of)]
                path = os.path.join(work, f"case-{i}.safetensors")
                if cls == "not a file":
                    what = common.special_file(path, rng)
                    expected, raw = Bad(what), b""
                else:
                    raw, what = mutate(cls, base_header, base_data, rng, fam)
                    open(path, "wb").write(raw)
                    try:
                        expected = reference(raw, params, fam)
                    except Bad as e:
                        expected = e
                spelled = {m.decode(errors="replace") for m in re.findall(rb'"([^"\\]{1,200})"', raw[:1 << 16])}
                spelled |= {shown(n) for n in spelled}
                names = model_names | spelled | {fam.key(n) for n in spelled}
                meta[i] = (path, label + cls, what, expected, names)
                paths.append((i, path))
            classes = {}

            def crashed(i, kind, detail):
                path, cls, what, expected, names = meta[i]
                tally.add(cls, kind, False, f"case {i} ({what}): {detail}")
                classes[i] = kind

            malformed = sum(isinstance(m[3], Bad) for m in meta.values())
            print(f"{fam.name}: {malformed} malformed files and {len(meta) - malformed} valid ones", flush=True)
            results = run_batch(mode, work, paths, crashed)
            for i, (path, cls, what, expected, names) in meta.items():
                if i in classes:
                    continue
                kind, ok, detail = judge(path, results[i], expected, names, fam)
                tally.add(cls, kind, ok, f"case {i} ({what}): {detail}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tally.finish()


if __name__ == "__main__":
    sys.exit(main())
