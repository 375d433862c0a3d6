#!/usr/bin/env python3
"""Fuzzes the dataset readers with seeded damage: IDX files given to pt.data.read_idx (plain and
gzip-compressed), MNIST folders given to pt.data.mnist, and token corpora given to pt.data.text
and pt.data.tokens (bytes of text; llm.c's uint16 files with their 256-int32 header; raw int32
ids), each with reader options drawn from the seed (seq, batch, split, val_fraction, dtype,
header).

Damage: bytes flipped in a header or in the data, files cut short or extended, an IDX file's
type, rank or dimensions rewritten, a gzip stream flipped, cut or followed by trailing bytes or a
second member, llm.c's magic, version and token count changed, negative int32 ids, an empty
file, a FIFO, a folder, a link to /dev/zero, a missing file.

A reference reader written here, from the formats (IDX: big-endian, magic 0 0 type rank, then
the dimensions; gzip as zlib's gzread reads it) and from docs/lua.md's rules for the corpora,
says whether each input is valid and what its loader's first batches hold. All cases go
through one partrain process (tests/fuzz/data_batch.lua, restarted after a case that kills it). A
case passes when partrain accepts exactly the inputs the reference accepts, with exactly the
reference's values, and refuses the others with a message that names the file (for MNIST: its
folder or one of its files) at the script's line.

Classes: refused, accepted; failures: wrong (a bad input accepted, or other values), unclear (a
valid input refused, or a refusal without the file or the line), crash, hang.

Usage: fuzz_data.py PARTRAIN [--seed N] [--cases N]
"""
import gzip
import json
import math
import os
import random
import shutil
import struct
import sys
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

BIN = os.path.abspath(sys.argv[1])
SEED = common.seed_from_argv()
CASES = common.int_flag("--cases", 600)
BATCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data_batch.lua")
MAX_BATCHES = 6  # data_batch.lua reads at most this many batches of a loader

IDX_TYPES = {0x08: ("uint8", "B", 1), 0x09: ("int8", "b", 1), 0x0B: ("int16", "h", 2), 0x0C: ("int32", "i", 4),
             0x0D: ("float32", "f", 4), 0x0E: ("float64", "d", 8)}
LLMC_MAGIC, LLMC_HEADER = 20240520, 1024


class Bad(Exception):
    """The reference's refusal."""


# ---- The reference reader ------------------------------------------------------------------

def gunzip(data):
    """The bytes zlib's gzread gives for a file: a file without gzip's magic as it is; else each
    gzip member in turn, until bytes follow that do not begin another (those it ignores)."""
    if data[:2] != b"\x1f\x8b":
        return data
    out = bytearray()
    while True:
        d = zlib.decompressobj(31)
        try:
            out += d.decompress(data)
        except zlib.error as e:
            raise Bad(f"damaged gzip stream: {e}")
        if not d.eof:
            raise Bad("gzip stream cut short")
        data = d.unused_data
        if data[:2] != b"\x1f\x8b":
            return bytes(out)


def text_of(v):
    """A value as data_batch.lua prints it: %.17g of the double, nan without a sign."""
    return "nan" if v != v else "%.17g" % v


def parse_idx(data):
    """(dtype, dims, values) of an IDX file's bytes, or Bad."""
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise Bad("bad magic")
    if data[2] not in IDX_TYPES:
        raise Bad("unknown type")
    name, code, width = IDX_TYPES[data[2]]
    ndim = data[3]
    if ndim < 1 or len(data) < 4 + 4 * ndim:
        raise Bad("header cut short")
    dims = list(struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim]))
    count = extent = 1
    for d in dims:
        count *= d
        extent *= max(d, 1)
    if extent >= 1 << 63:  # a tensor's sizes and strides are counted in int64, even when one is 0
        raise Bad("dimensions past int64")
    body = data[4 + 4 * ndim:]
    if len(body) != count * width:
        raise Bad(f"{count * width} bytes promised, {len(body)} held")
    return name, dims, list(struct.unpack(f">{count}{code}", body))


def read_idx(raw):
    name, dims, values = parse_idx(gunzip(raw))
    return {"dtype": name, "shape": ",".join(map(str, dims)), "values": ",".join(map(text_of, values))}


def f32(v):
    return struct.unpack("f", struct.pack("f", v))[0]


def batch_text(rows, row_shape_tail, values_x, ys, y_shape_tail):
    """A batch as data_batch.lua writes it: shape;values;shape;values."""
    return ";".join([",".join(map(str, [rows] + row_shape_tail)), ",".join(map(text_of, values_x)),
                     ",".join(map(str, [rows] + y_shape_tail)), ",".join(map(text_of, ys))])


def read_mnist(images_raw, labels_raw, o):
    """The first batches pt.data.mnist gives for a folder holding these two files (None: missing)."""
    if images_raw is None or labels_raw is None:
        raise Bad("a file is missing")
    itype, idims, ivalues = parse_idx(gunzip(images_raw))
    ltype, ldims, lvalues = parse_idx(gunzip(labels_raw))
    if itype != "uint8" or ltype != "uint8":
        raise Bad("MNIST files hold unsigned bytes")
    if len(idims) != 3 or len(ldims) != 1 or idims[0] != ldims[0]:
        raise Bad("images and labels disagree")
    n, pixels, batch = idims[0], idims[1] * idims[2], o["batch"]
    if n < batch:
        raise Bad("batch larger than the dataset")
    out = []
    for b in range(min(n // batch, MAX_BATCHES)):
        rows = range(b * batch, (b + 1) * batch)
        xs = [f32(f32(float(ivalues[r * pixels + p])) / 255.0) for r in rows for p in range(pixels)]
        out.append(batch_text(batch, [pixels], xs, [float(lvalues[r]) for r in rows], []))
    return {"size": n, "batches": out}


def i32(data, at):
    return struct.unpack_from("<i", data, at)[0]


def read_corpus(data, o):
    """The first batches pt.data.text (o.kind == "text") or pt.data.tokens gives for a file of
    these bytes, by docs/lua.md's rules; a batch holding a negative int32 id ends the list with
    "fails" (the loader refuses it when it reads it)."""
    tokens = o["kind"] == "tokens"
    dtype = o.get("dtype", "uint16") if tokens else "uint8"
    header_option = o.get("header", "auto") if tokens else 0
    header = {"auto": -1, "none": 0}.get(header_option, header_option)
    width, code = {"uint8": (1, "B"), "uint16": (2, "H"), "int32": (4, "i")}[dtype]
    size = len(data)
    if size == 0:
        raise Bad("empty")
    stated = -1
    if header == -1:
        header = LLMC_HEADER if size >= 4 and i32(data, 0) == LLMC_MAGIC else 0
    if header == LLMC_HEADER and size >= LLMC_HEADER and i32(data, 0) == LLMC_MAGIC:
        if i32(data, 4) != 1:
            raise Bad("llm.c version")
        if dtype != "uint16":
            raise Bad("llm.c tokens are uint16")
        stated = i32(data, 8)
        if stated < 0:
            raise Bad("negative count")
    if header > size:
        raise Bad("shorter than its header")
    if (size - header) % width:
        raise Bad("not whole tokens")
    count = (size - header) // width
    if stated >= 0 and stated != count:
        raise Bad("count disagrees")
    begin, end = 0.0, 1.0
    fraction = o.get("val_fraction", 0.1)
    if o.get("split", "all") == "train":
        end = 1 - fraction
    elif o.get("split") == "val":
        begin = 1 - fraction
    first = int(begin * count)
    last = count if end >= 1 else int(end * count)
    seq, batch = o["seq"], o["batch"]
    if last - first < seq + 1:
        raise Bad("fewer tokens than seq + 1")
    ids = struct.unpack_from(f"<{count}{code}", data, header)[first:last]
    samples = (last - first - 1) // seq
    if samples < batch:
        raise Bad("batch larger than the dataset")
    out = []
    for b in range(min(samples // batch, MAX_BATCHES)):
        windows = [ids[i * seq:i * seq + seq + 1] for i in range(b * batch, (b + 1) * batch)]
        if any(v < 0 for w in windows for v in w):
            out.append("fails")
            break
        out.append(batch_text(batch, [seq], [float(v) for w in windows for v in w[:-1]],
                              [float(v) for w in windows for v in w[1:]], [seq]))
    return {"size": samples, "batches": out}


# ---- Inputs and their damage ---------------------------------------------------------------

def random_values(rng, type_code, count):
    name, code, width = IDX_TYPES[type_code]
    if name in ("float32", "float64"):
        raw = bytes(rng.randrange(256) for _ in range(count * width))  # any bits: NaN, inf, subnormals
        return raw if rng.random() < 0.5 else struct.pack(f">{count}{code}", *[rng.uniform(-9, 9) for _ in range(count)])
    return bytes(rng.randrange(256) for _ in range(count * width))


def make_idx(rng, type_code=None, dims=None):
    type_code = type_code if type_code is not None else rng.choice(list(IDX_TYPES))
    if dims is None:
        dims = [rng.choice([0, 1, 2, 3, 4, 5]) if rng.random() < 0.1 else rng.randint(1, 5)
                for _ in range(rng.randint(1, 3))]
    count = 1
    for d in dims:
        count *= d
    return bytes([0, 0, type_code, len(dims)]) + struct.pack(f">{len(dims)}I", *dims) + \
        random_values(rng, type_code, count)


def flip(rng, data, lo=0, hi=None):
    hi = len(data) if hi is None else min(hi, len(data))
    if hi <= lo:
        return data
    b = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(lo, hi)
        b[i] = b[i] ^ (1 << rng.randrange(8)) if rng.random() < 0.5 else rng.randrange(256)
    return bytes(b)


def cut(rng, data):
    return data[:rng.randrange(len(data))] if data else data


def extend(rng, data, most=16):
    return data + bytes(rng.randrange(256) for _ in range(rng.randint(1, most)))


def damaged(rng, data, cls, most=16):
    """`data` flipped, cut short or extended, as the class's last word ("... flipped") says."""
    how = cls.rsplit(" ", 1)[-1]
    return {"flipped": flip, "truncated": cut}.get(how, lambda r, d: extend(r, d, most))(rng, data)


def compress(rng, data):
    return gzip.compress(data, compresslevel=rng.choice([0, 1, 6, 9]), mtime=0)


def damage_idx(rng, cls):
    """An IDX file's bytes (maybe compressed) damaged by class `cls`, and what was done."""
    data = make_idx(rng)
    ndim = data[3]
    header = 4 + 4 * ndim
    zipped = rng.random() < 0.5
    what = cls
    if cls == "idx valid":
        pass
    elif cls == "idx header flipped":
        data = flip(rng, data, 0, header)
    elif cls == "idx data flipped":
        data = flip(rng, data, header)
    elif cls == "idx truncated":
        data = cut(rng, data)
    elif cls == "idx extended":
        data = extend(rng, data)
    elif cls == "idx dimensions":
        dims = list(struct.unpack(f">{ndim}I", data[4:header]))
        choice = rng.choice(["huge", "zero", "swap", "other"])
        i = rng.randrange(ndim)
        if choice == "huge":
            dims[i] = rng.choice([1 << 31, (1 << 32) - 1, 1 << 16, 65537])
        elif choice == "zero":
            dims[i] = 0
        elif choice == "swap" and ndim > 1:
            dims.reverse()
        else:
            dims[i] = rng.randint(0, 9)
        if rng.random() < 0.3:  # huge dimensions beside a zero one: no data at all
            dims = [rng.choice([(1 << 32) - 1, 1 << 31, 5]) for _ in range(ndim)]
            dims[rng.randrange(ndim)] = 0
            data = data[:header]
        data = data[:4] + struct.pack(f">{ndim}I", *dims) + data[header:]
        what = f"{cls} {choice}"
    elif cls == "idx type or rank":
        b = bytearray(data)
        b[rng.choice([2, 3])] = rng.choice([0, 1, 4, 0x0A, 0x0F, 0xFF, rng.randrange(256)])
        data = bytes(b)
    if cls.startswith("gz"):
        z = compress(rng, data)
        if cls in ("gz flipped", "gz truncated"):
            z = damaged(rng, z, cls)
        elif cls == "gz extended":
            tail = rng.choice(["garbage", "member", "damaged member", "magic"])
            extra = {"garbage": bytes(rng.randrange(256) for _ in range(rng.randint(1, 20))),
                     "member": compress(rng, bytes(rng.randrange(256) for _ in range(rng.randint(0, 8)))),
                     "damaged member": flip(rng, compress(rng, b"\x00" * rng.randint(1, 8)), 2),
                     "magic": b"\x1f\x8b" + bytes(rng.randrange(256) for _ in range(rng.randint(0, 9)))}[tail]
            z += extra
            what = f"{cls} {tail}"
        return z, what
    return (compress(rng, data) if zipped else data), what + (" (gzip)" if zipped else "")


def lua_string(s):
    return '"' + "".join(c if c.isalnum() or c in "/._- " else "\\%03d" % ord(c) for c in s) + '"'


def lua_table(o):
    parts = []
    for k, v in o.items():
        if isinstance(v, bool):
            text = "true" if v else "false"
        elif isinstance(v, str):
            text = lua_string(v)
        elif isinstance(v, float):
            text = repr(v)
        else:
            text = str(v)
        parts.append(f"{k} = {text}")
    return "{ " + ", ".join(parts) + " }"


IDX_CLASSES = ["idx valid", "idx header flipped", "idx data flipped", "idx truncated", "idx extended",
               "idx dimensions", "idx type or rank", "gz flipped", "gz truncated", "gz extended"]


def case_idx(rng, cls, path):
    if cls == "idx not a file":
        what = common.special_file(path, rng)
        return {"path": path}, Bad(what), what
    raw, what = damage_idx(rng, cls)
    open(path, "wb").write(raw)
    try:
        return {"path": path}, read_idx(raw), what
    except Bad as e:
        return {"path": path}, e, what


def case_mnist(rng, cls, folder):
    os.makedirs(folder)
    split = rng.choice(["train", "test"])
    prefix = os.path.join(folder, "train" if split == "train" else "t10k")
    n = rng.randint(1, 6)
    images = make_idx(rng, 0x08, [n, rng.randint(1, 3), rng.randint(1, 3)])
    labels = make_idx(rng, 0x08, [n])
    what = cls
    if cls == "mnist disagree":
        which = rng.choice(["count", "images rank", "labels rank"])
        if which == "count":
            labels = make_idx(rng, 0x08, [n + rng.choice([-1, 1, 2])] if n > 1 else [2])
        elif which == "images rank":
            images = make_idx(rng, 0x08, [n, rng.randint(1, 4)] if rng.random() < 0.5 else [n, 1, 2, 2])
        else:
            labels = make_idx(rng, 0x08, [n, 1])
        what = f"{cls} {which}"
    elif cls == "mnist type":
        t = rng.choice([0x09, 0x0B, 0x0C, 0x0D, 0x0E])
        if rng.random() < 0.5:
            images = make_idx(rng, t, list(struct.unpack(">3I", images[4:16])))
        else:
            labels = make_idx(rng, t, [n])
        what = f"{cls} {IDX_TYPES[t][0]}"
    files = {"images": images, "labels": labels}
    for k in files:
        files[k] = compress(rng, files[k]) if rng.random() < 0.8 else files[k]
    if cls == "mnist file damaged":
        k = rng.choice(["images", "labels"])
        sub = rng.choice(["idx header flipped", "idx truncated", "idx extended", "gz flipped", "gz truncated"])
        data = files[k]
        if sub.startswith("gz"):
            data = compress(rng, gunzip(data) if data[:2] == b"\x1f\x8b" else data)
            data = damaged(rng, data, sub)
        else:
            plain = gunzip(data)
            plain = (flip(rng, plain, 0, 4 + 4 * plain[3]) if sub == "idx header flipped" else
                     cut(rng, plain) if sub == "idx truncated" else extend(rng, plain, 5))
            data = compress(rng, plain) if rng.random() < 0.5 else plain
        files[k] = data
        what = f"{cls}: {k} {sub}"
    missing = None
    if cls == "mnist missing":
        missing = rng.choice(["images", "labels"])
        what = f"{cls} {missing}"
    for k, data in files.items():
        path = f"{prefix}-{k}-idx{3 if k == 'images' else 1}-ubyte.gz"
        if k == missing:
            if rng.random() < 0.5:
                os.makedirs(path)
            continue
        open(path, "wb").write(data)
    o = {"root": folder, "split": split, "batch": rng.randint(1, n + 1 if rng.random() < 0.2 else n),
         "shuffle": False}
    try:
        expected = read_mnist(None if missing == "images" else files["images"],
                              None if missing == "labels" else files["labels"], o)
    except Bad as e:
        expected = e
    return o, expected, what


def corpus_file(rng, kind):
    """A pristine corpus: ("text" | "llm.c" | "int32" | "uint16"), its bytes and a token count."""
    if kind == "text":
        return bytes(rng.randrange(32, 127) for _ in range(rng.randint(2, 300)))
    count = rng.randint(2, 200)
    if kind == "llm.c":
        head = struct.pack("<3i", LLMC_MAGIC, 1, count) + b"\x00" * (LLMC_HEADER - 12)
        return head + struct.pack(f"<{count}H", *[rng.randrange(65536) for _ in range(count)])
    if kind == "int32":
        ids = [rng.randrange(1 << 31) if rng.random() < 0.9 else rng.randrange(50000) for _ in range(count)]
        if rng.random() < 0.05:
            ids[0] = LLMC_MAGIC  # an int32 corpus whose first id is llm.c's magic number
        return struct.pack(f"<{count}i", *ids)
    return struct.pack(f"<{count}H", *[rng.randrange(65536) for _ in range(count)])


CORPUS_CLASSES = ["corpus valid", "corpus flipped", "corpus truncated", "corpus extended", "corpus llm.c header",
                  "corpus negative ids", "corpus options"]


def case_corpus(rng, cls, path):
    kind = rng.choice(["text", "llm.c", "int32", "uint16"])
    what = f"{cls} ({kind})"
    if cls == "corpus not a file":
        what = common.special_file(path, rng)
        data = None
    else:
        data = corpus_file(rng, kind)
        if cls in ("corpus flipped", "corpus truncated", "corpus extended"):
            data = damaged(rng, data, cls, 5)
        elif cls == "corpus llm.c header":
            data = bytearray(corpus_file(rng, "llm.c"))
            at = rng.choice([0, 4, 8, 12])
            value = rng.choice([0, 2, -1, -(1 << 31), (1 << 31) - 1, LLMC_MAGIC + 1,
                                i32(data, 8) + rng.choice([-1, 1]), rng.randrange(1 << 31)])
            struct.pack_into("<i", data, at, value)
            if rng.random() < 0.2:
                data = data[:rng.randint(4, LLMC_HEADER)]  # cut inside the header
            data = bytes(data)
            kind = "llm.c"
            what = f"{cls}: int32 {at // 4} = {value}"
        elif cls == "corpus negative ids":
            count = rng.randint(2, 100)
            ids = [rng.randrange(1000) for _ in range(count)]
            for _ in range(rng.randint(1, 3)):
                ids[rng.randrange(count)] = rng.choice([-1, -(1 << 31), -7])
            data = struct.pack(f"<{count}i", *ids)
            kind = "int32"
        open(path, "wb").write(data)
    # Options: the reader matching the file, mostly.
    o = {"path": path, "seq": rng.choice([1, 2, 3, 4, 8, 16, 31]), "batch": rng.randint(1, 4), "shuffle": False}
    if kind == "text" and rng.random() < 0.7:
        o["kind"] = "text"
    else:
        o["kind"] = "tokens"
        o["dtype"] = {"text": "uint8", "llm.c": "uint16", "int32": "int32", "uint16": "uint16"}[kind]
        if kind == "uint16" and rng.random() < 0.5:
            del o["dtype"]  # the default
    if rng.random() < 0.5:
        o["split"] = rng.choice(["train", "val", "all"])
        if rng.random() < 0.5:
            o["val_fraction"] = rng.choice([0.5, 0.25, 0.9, 0.01, 0.99, round(rng.uniform(0.01, 0.99), 3)])
    if cls == "corpus options" and o["kind"] == "tokens":
        o["dtype"] = rng.choice(["uint8", "uint16", "int32"])
        o["header"] = rng.choice(["auto", "none", 0, 1, 2, 3, 4, 12, LLMC_HEADER, LLMC_HEADER + 2,
                                  len(data or b""), len(data or b"") + 1])
    elif o["kind"] == "tokens" and rng.random() < 0.2:
        o["header"] = rng.choice(["auto", "none"] + ([LLMC_HEADER] if kind == "llm.c" else [0]))
    if data is None:
        return o, Bad(what), what
    try:
        return o, read_corpus(data, o), what
    except Bad as e:
        return o, e, what


CLASSES = IDX_CLASSES + ["idx not a file", "mnist valid", "mnist disagree", "mnist type", "mnist file damaged",
                         "mnist missing"] + CORPUS_CLASSES + ["corpus not a file"]


# ---- Running and judging -------------------------------------------------------------------

def run_all(work, cases, tally_crash):
    """Runs data_batch.lua over `cases` [(index, reader, options)]; returns {index: result}."""
    return common.run_batched(lambda lst, out: [BIN, "--threads", "1", BATCH, lst, out], work, work, cases,
                              lambda c: f"{c[0]}\t{c[1]}\t{lua_table(c[2])}", tally_crash, "data_batch.lua")


def names_input(message, reader, o):
    """Whether a refusal names the input (for MNIST: its folder or a file in it) at the script's
    line, and no place inside partrain's own Lua."""
    place = o["root"] if reader == "mnist" else o["path"]
    return place in message and "data_batch.lua:" in message and \
        common.INTERNAL_LOCATION.search(message) is None


def numbers(text):
    """A list of values printed with %.17g, as the doubles they name (with the sign of a zero):
    LuaJIT and Python may print an exact tie in the 17th digit either way, and both texts read
    back as the same double."""
    if text == "":
        return []
    return [("nan",) if x.endswith("nan") else (float(x), math.copysign(1, float(x))) for x in text.split(",")]


def same_batch(a, b):
    pa, pb = a.split(";"), b.split(";")
    return len(pa) == len(pb) == 4 and pa[0] == pb[0] and pa[2] == pb[2] and \
        numbers(pa[1]) == numbers(pb[1]) and numbers(pa[3]) == numbers(pb[3])


def judge(reader, o, expected, got):
    """(kind, ok, detail) of one case."""
    if "error" in got and "failed_at" not in got:
        if isinstance(expected, Bad):
            ok = names_input(got["error"], reader, o)
            return ("refused" if ok else "unclear"), ok, got["error"]
        return "unclear", False, f"a valid input refused: {got['error']}"
    if isinstance(expected, Bad):
        return "wrong", False, f"accepted, the reference says {expected}: {json.dumps(got)[:600]}"
    if reader == "idx":
        for k in ("dtype", "shape", "values"):
            if (numbers(got.get(k, "")) != numbers(expected[k])) if k == "values" else got.get(k) != expected[k]:
                return "wrong", False, f"{k}: got {str(got.get(k))[:300]}, expected {expected[k][:300]}"
        return "accepted", True, ""
    if got.get("size") != expected["size"]:
        return "wrong", False, f"size {got.get('size')}, expected {expected['size']}"
    batches = got.get("batches", {})
    batches = [batches[str(b)] for b in range(1, len(batches) + 1)] if isinstance(batches, dict) else []
    want = expected["batches"]
    failing = want[-1] == "fails" if want else False
    if failing:
        want = want[:-1]
        if got.get("failed_at") != len(want) + 1:
            return "wrong", False, f"a batch with a negative id not refused (failed at {got.get('failed_at')})"
        if not names_input(got.get("error", ""), reader, o):
            return "unclear", False, f"the negative id's refusal: {got.get('error')}"
    elif "failed_at" in got:
        return "unclear", False, f"batch {got['failed_at']} refused: {got.get('error')}"
    if len(batches) != len(want) or not all(same_batch(a, b) for a, b in zip(batches, want)):
        first = next((b for b in range(min(len(batches), len(want))) if not same_batch(batches[b], want[b])), None)
        return "wrong", False, (f"{len(batches)} batches, expected {len(want)}" if first is None else
                                f"batch {first + 1}: got {batches[first][:300]}, expected {want[first][:300]}")
    return ("refused" if failing else "accepted"), True, ""


def main():
    tally = common.Tally(f"Dataset files (seed {SEED})", kinds=["refused", "accepted", "wrong", "unclear", "crash",
                                                                "hang"])
    rng = random.Random(SEED)
    work = common.scratch_dir("fuzz-data-")
    start = time.monotonic()
    try:
        meta, cases = {}, []
        for i in range(CASES):
            cls = CLASSES[i % len(CLASSES)]
            path = os.path.join(work, f"case-{i}")
            if cls.startswith("mnist"):
                reader, (o, expected, what) = "mnist", case_mnist(rng, cls, path)
            elif cls.startswith("corpus"):
                reader, (o, expected, what) = "corpus", case_corpus(rng, cls, path)
            else:
                reader, (o, expected, what) = "idx", case_idx(rng, cls, path)
            meta[i] = (cls, what, reader, o, expected)
            cases.append((i, reader, o))

        def crashed(i, kind, detail):
            cls, what = meta[i][:2]
            tally.add(cls, kind, False, f"case {i} ({what}): {detail}")

        results = run_all(work, cases, crashed)
        for i, r in sorted(results.items()):
            cls, what, reader, o, expected = meta[i]
            kind, ok, detail = judge(reader, o, expected, r)
            tally.add(cls, kind, ok, f"case {i} ({what}, {lua_table(o)}): {detail}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{time.monotonic() - start:.1f} s")
    tally.finish()


if __name__ == "__main__":
    main()
