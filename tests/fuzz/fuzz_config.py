#!/usr/bin/env python3
"""Config files given to a script's pt.args (`partrain script.lua --config FILE`), generated
from a seed: valid ones must be read exactly, the rest refused naming the file (and the line,
where the damage is a key written in it), each within bounded time and memory, whatever the file
holds.

Usage: fuzz_config.py PATH/TO/partrain [--seed N] [--cases N]

Every case is its own process (tests/fuzz/config_script.lua), bounded to 20 s and to
common.MEMORY_LIMIT bytes of address space, two at a time. Classes:
  valid        option values written every way Lua allows (expressions, locals and loops,
               escapes, long brackets, comments, \\r\\n line ends, keys in brackets, repeated
               keys): accepted, each value exactly what the driver computed
  unknown key  one key the script does not declare, at a known line (misspelt, of odd bytes,
               quotes and escapes, pattern characters): refused naming FILE:LINE
  wrong value  a value of the wrong type, fractional for an integer, NaN, infinite, 2^60, a
               table or a function, at a known line: refused naming FILE:LINE (nil: accepted)
  deep         constructors, parentheses, unary operators, concatenations, calls, blocks and
               functions nested 10 to 100000 deep: accepted with the right value, or refused
  huge         strings and tables past the memory bound (string.rep, doubling, table.concat,
               string.format, upper/reverse of a long string, a table of millions of entries,
               unpack and byte of a long string): refused naming the file, or accepted when small
  long key     one key of 1 KB to 900 KB in a file of up to 1 MiB, a blank key among lines of
               blanks, a computed long key: refused naming the file (and the line when written)
  C recursion  recursion through string.gsub's callback, table.sort's comparison, methods
               of strings, string.dump, load: refused naming the file, never a C stack overflow
  metatables   setmetatable, getmetatable, raw access, newproxy, debug.setmetatable: refused
  coroutines   coroutine.wrap, create, resume, yield: refused
  endless      while true, repeat, goto, numeric for to math.huge, tail recursion, a table
               grown forever, deep Lua recursion: refused within the bounds
  junk         random bytes, bytecode, NUL bytes, a BOM, bytes flipped in a valid file, a file
               over 1 MiB: refused naming the file, or accepted (then read as valid)
  errors       error() with a table, nil, a number, a megabyte of control bytes, levels 0 and
               2; assert; arithmetic on nil: refused naming the file in one short line
  returns      nil, a number, a function, a list, keys that are not strings, several values,
               nothing: refused naming the file ({} and {}, 5: accepted, the defaults)
  not a file   a FIFO, /dev/zero, a folder, a missing path, an empty file, a link to itself:
               refused naming the file, never waited on
  escapes      _G, getfenv, debug, io, os.exit, require, dofile, jit, package, pcall,
               collectgarbage, rawget, string.find, math.random: refused naming FILE:LINE
"""
import os
import random
import re
import shutil
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

BIN = os.path.realpath(sys.argv[1])
SEED = common.seed_from_argv()
CASES = common.int_flag("--cases", 240)
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config_script.lua")
TIMEOUT = 20
DEFAULTS = {"steps": 3, "lr": 0.5, "name": b"run", "fp16": False}
MAX_CONFIG = 1 << 20  # bytes of a config file partrain reads


# ---- Lua text for values ----------------------------------------------------------------

def lua_bytes(data, rng):
    """A Lua string literal for `data` (bytes): quoted with escapes, or a long bracket."""
    if rng.random() < 0.25 and b"\r" not in data and not data.startswith(b"\n"):
        level = 0
        while b"]" + b"=" * level + b"]" in data or data.endswith(b"]" + b"=" * level):
            level += 1
        return b"[" + b"=" * level + b"[" + data + b"]" + b"=" * level + b"]"
    quote = rng.choice([b'"', b"'"])
    out = bytearray(quote)
    for at, c in enumerate(data):
        ch = bytes([c])
        if ch in (quote, b"\\"):
            out += b"\\" + ch
        elif ch == b"\n":
            out += rng.choice([b"\\n", b"\\\n"])
        elif c < 0x20 or c >= 0x7f or rng.random() < 0.05:
            digit_next = data[at + 1:at + 2].isdigit()  # \49 then 6 would read as \496
            out += rng.choice([b"\\%03d" % c, b"\\x%02x" % c] + ([] if digit_next else [b"\\%d" % c]))
        else:
            out += ch
    return bytes(out + quote)


def integer_expr(rng):
    """(Lua text, value) of an integer below 2^31."""
    n = rng.randrange(0, 100000)
    kind = rng.randrange(10)
    if kind == 0:
        return b"0x%x" % n, n
    if kind == 1:
        k = rng.randrange(0, 20)
        return b"2^%d" % k, 2 ** k
    if kind == 2:
        a, b = rng.randrange(1, 300), rng.randrange(1, 300)
        return b"%d * %d - %d" % (a, b, n % 7), a * b - n % 7
    if kind == 3:
        return b"math.floor(%d.75)" % n, n
    if kind == 4:
        s = bytes(rng.randrange(97, 123) for _ in range(n % 50))
        return b"#" + lua_bytes(s, rng), len(s)
    if kind == 5:
        return b'tonumber("%d")' % n, n
    if kind == 6:
        k = n % 8
        return b"select('#'" + b", 1" * k + b")", k
    if kind == 7:
        return b"%de0" % n, n
    if kind == 8:
        return b"(function() local s = 0 for i = 1, %d do s = s + i end return s end)()" % (n % 300), \
            sum(range(1, n % 300 + 1))
    return b"%d" % n, n


def number_expr(rng):
    """(Lua text, value) of a finite double Lua computes exactly as Python does."""
    kind = rng.randrange(6)
    if kind == 0:
        x = rng.uniform(-1e6, 1e6)
        return repr(x).encode(), x
    if kind == 1:
        a, b = rng.randrange(-1000, 1000), rng.randrange(1, 1000)
        return b"%d / %d" % (a, b), a / b
    if kind == 2:
        e = rng.randrange(-300, 300)
        return b"1e%d" % e, float("1e%d" % e)
    if kind == 3:
        x = rng.randrange(1, 10 ** 6)
        return b"math.sqrt(%d)" % x, x ** 0.5
    if kind == 4:
        return b"-0.0", -0.0
    x = rng.uniform(0, 1)
    return b"%.17g" % x, float(b"%.17g" % x)


def string_expr(rng):
    """(Lua text, value) of a string of any bytes."""
    kind = rng.randrange(6)
    if kind == 0:
        data = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40)))
        return lua_bytes(data, rng), data
    if kind == 1:
        a, b = (bytes(rng.randrange(32, 127) for _ in range(rng.randrange(0, 10))) for _ in range(2))
        return lua_bytes(a, rng) + b" .. " + lua_bytes(b, rng), a + b
    if kind == 2:
        a, k = bytes(rng.randrange(97, 123) for _ in range(rng.randrange(1, 5))), rng.randrange(0, 1000)
        return b"(" + lua_bytes(a, rng) + b"):rep(%d)" % k, a * k
    if kind == 3:
        n = rng.randrange(0, 10 ** 6)
        return b'string.format("%%d-%%s", %d, "x")' % n, b"%d-x" % n
    if kind == 4:
        data = bytes(rng.randrange(65, 91) for _ in range(rng.randrange(0, 20)))
        return b"(" + lua_bytes(data, rng) + b"):lower():reverse()", data.lower()[::-1]
    parts = [bytes(rng.randrange(97, 123) for _ in range(rng.randrange(0, 4))) for _ in range(rng.randrange(1, 5))]
    return b"table.concat({ " + b", ".join(lua_bytes(p, rng) for p in parts) + b" }, '-')", b"-".join(parts)


def boolean_expr(rng):
    v = rng.random() < 0.5
    return rng.choice([b"true" if v else b"false", b"not " + (b"false" if v else b"true"),
                       b"1 < 2" if v else b"2 < 1", b"#'ab' == 2" if v else b"'a' == 'b'"]), v


EXPRS = {"steps": integer_expr, "lr": number_expr, "name": string_expr, "fp16": boolean_expr}


def key_text(key, rng):
    """A way to write the key `key` (a plain name) in a constructor."""
    return rng.choice([key.encode(), b"[ " + lua_bytes(key.encode(), rng) + b" ]", b'["' + key.encode() + b'"]'])


def blank(rng):
    return rng.choice([b" ", b"  ", b"\t", b" --[[ a ]] ", b" --[==[ x ]] ]==] ", b""])


def lines_in(text):
    """The line breaks in `text` as Lua counts them: \n, \r, \r\n and \n\r, one each."""
    return len(re.findall(rb"\r\n|\n\r|\r|\n", text))


class Config:
    """A config file's text built entry by entry, each on a line of its own, so that the line
    where each key is written is known (a value may span lines: a long bracket, an escaped line
    break)."""

    def __init__(self, rng):
        self.rng = rng
        self.eol = rng.choice([b"\n", b"\n", b"\r\n", b"\r"])
        self.lines = []
        if rng.random() < 0.3:
            self.lines.append(b"-- a run's settings")
        if rng.random() < 0.3:
            self.lines += [b"local long = [[", b"{ steps = 99 }", b"]]"]
        if rng.random() < 0.2:
            self.lines.append(b"local n = 0 for i = 1, 10 do n = n + i end")
        self.lines.append(b"return {")
        self.values = dict(DEFAULTS)

    def entry(self, key_bytes, value_bytes):
        """Adds `key_bytes = value_bytes,` on a line of its own; returns the line of its key."""
        sep = self.rng.choice([b",", b";", b","])
        before = blank(self.rng)
        line = 1 + lines_in(self.eol.join(self.lines + [before]))
        self.lines.append(before + key_bytes + blank(self.rng) + b"=" + blank(self.rng) + value_bytes + sep)
        return line

    def valid(self, keys=None):
        """Entries for some of the options, with what they then hold."""
        keys = keys if keys is not None else [k for k in EXPRS if self.rng.random() < 0.7]
        for k in keys:
            text, value = EXPRS[k](self.rng)
            self.entry(key_text(k, self.rng), text)
            self.values[k] = value

    def text(self):
        return self.eol.join(self.lines + [b"}"]) + self.rng.choice([self.eol, b""])


def program(body):
    """A config file whose body is `body` (statements) and which returns {}."""
    return body + b"\nreturn {}\n"


# ---- the classes ------------------------------------------------------------------------
# Each returns (bytes or a callable making the file, expect), where expect may hold "accept"
# (a run may be accepted: the values it must print, or None when it cannot be known), "must"
# (it must be accepted) and "line" (the line a refusal must name).

def c_valid(rng, path):
    c = Config(rng)
    c.valid()
    if rng.random() < 0.2:  # a key set twice: the later entry is what Lua keeps
        text, value = integer_expr(rng)
        c.entry(b"steps", text)
        c.values["steps"] = value
    return c.text(), {"accept": c.values, "must": True}


def odd_key(rng):
    kind = rng.randrange(7)
    if kind == 0:
        return rng.choice([b"stpes", b"learning_rate", b"fp_16", b"Steps", b"nam", b"steps_", b"lrr"])
    if kind == 1:
        return b"[ " + lua_bytes(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 30))), rng) + b" ]"
    if kind == 2:
        return b"[ " + lua_bytes(b"%a.*+-?[]^$()" * rng.randrange(1, 4), rng) + b" ]"
    if kind == 3:
        return b"[ " + lua_bytes(b"\t" * rng.randrange(1, 4), rng) + b" ]"
    if kind == 4:
        return b'["' + b"x" * rng.randrange(41, 2000) + b'"]'
    if kind == 5:
        return b"[ [==[a]]b]==] ]"
    return b"\xc3\xa9t\xc3\xa9"  # a name of UTF-8 bytes, which LuaJIT reads as a name


def c_unknown(rng, path):
    c = Config(rng)
    c.valid()
    line = c.entry(odd_key(rng), b"1")
    c.valid([k for k in EXPRS if rng.random() < 0.3])
    return c.text(), {"line": line}


WRONG = {"steps": [b"2.5", b"'3'", b"true", b"{}", b"0/0", b"1/0", b"-1/0", b"2^53", b"2^60", b"-2^63",
                   b"function() end"],
         "lr": [b"'0.1'", b"false", b"0/0", b"math.huge", b"-math.huge", b"{ 1 }"],
         "name": [b"5", b"true", b"{}", b"function() end"],
         "fp16": [b"'yes'", b"1", b"0", b"{}"]}


def c_wrong(rng, path):
    c = Config(rng)
    key = rng.choice(list(WRONG))
    if rng.random() < 0.08:  # nil: no entry at all, the default stays
        c.entry(key_text(key, rng), b"nil")
        c.valid([k for k in EXPRS if k != key and rng.random() < 0.5])
        return c.text(), {"accept": c.values, "must": True}
    c.valid([k for k in EXPRS if k != key and rng.random() < 0.5])
    line = c.entry(key_text(key, rng), rng.choice(WRONG[key]))
    return c.text(), {"line": line}


def c_deep(rng, path):
    n = rng.choice([10, 100, 150, 199, 200, 201, 250, 1000, 10000, 100000])
    kind = rng.randrange(9)
    if kind == 0:
        return b"return { steps = " + b"(" * n + b"7" + b")" * n + b" }\n", {"accept": dict(DEFAULTS, steps=7)}
    if kind == 1:
        return b"return { steps = " + b"- " * n + b"7 }\n", {"accept": dict(DEFAULTS, steps=7 if n % 2 == 0 else -7)}
    if kind == 2:
        return b"return { fp16 = " + b"not " * n + b"false }\n", {"accept": dict(DEFAULTS, fp16=n % 2 == 1)}
    if kind == 3:
        return b"return { name = " + b" .. ".join([b"'a'"] * n) + b" }\n", {"accept": dict(DEFAULTS, name=b"a" * n)}
    if kind == 4:
        return b"return { x = " + b"{" * n + b"}" * n + b" }\n", {}
    if kind == 5:
        return b"return { steps = " + b"(function() return " * n + b"1" + b" end)()" * n + b" }\n", \
            {"accept": dict(DEFAULTS, steps=1)}
    if kind == 6:
        return b"if true then " * n + b"x = 1 " + b"end " * n + b"\nreturn { steps = 2 }\n", \
            {"accept": dict(DEFAULTS, steps=2)}
    if kind == 7:
        return b"local t = " + b"{ a = " * n + b"5" + b" }" * n + b"\nreturn { steps = t" + b".a" * n + b" }\n", \
            {"accept": dict(DEFAULTS, steps=5)}
    return b"local t = {}\n" + b"t[1] = { t }\n" * min(n, 20000) + b"return { name = 'd' }\n", \
        {"accept": dict(DEFAULTS, name=b"d")}


HUGE = [
    b"local s = string.rep('x', 2^%(k)d)",
    b"local s = ('ab'):rep(2^%(k)d, ',')",
    b"local s = 'x' for i = 1, %(k)d do s = s .. s end",
    b"local s = ('x'):rep(2^%(small)d) local t = {} for i = 1, 2^%(j)d do t[i] = s end local u = table.concat(t)",
    b"local s = ('x'):rep(2^%(small)d) local u = string.format('%%s%%s%%s%%s', s, s, s, s)",
    b"local s = ('x'):rep(2^%(small)d):upper():reverse():lower()",
    b"local t = {} for i = 1, 2^%(k)d do t[i] = i end",
    b"local t = {} for i = 1, 2^%(k)d do t[#t + 1] = tostring(i) end",
    b"local s = ('x'):rep(2^%(small)d) local t = { s:byte(1, -1) }",
    b"local t = {} for i = 1, 2^%(j)d do t[i] = i end local n = select('#', unpack(t))",
    b"local s = string.rep('', 2^40) .. string.rep('x', 0)",
    b"local s = ('x'):rep(2^%(small)d) local t = {} for i = 1, 64 do t[i] = s .. i end",
    b"local s = ('%%099999d'):format(1)",
    b"local s = string.char(unpack({ 65, 66, 67 })):rep(2^%(small)d)",
]


def c_huge(rng, path):
    template = rng.choice(HUGE)
    body = template % {b"k": rng.randrange(8, 42), b"small": rng.randrange(10, 28), b"j": rng.randrange(2, 24)}
    return program(body), {"accept": DEFAULTS}


def c_long_key(rng, path):
    kind = rng.randrange(5)
    size = rng.choice([1000, 50000, 300000, 900000])
    if kind == 0:  # one long key in a bracketed string, alone in the file
        return b"return {\n  steps = 1,\n  [\"" + b"k" * size + b"\"] = 1 }\n", {"line": 3}
    if kind == 1:  # a blank key below a megabyte of blanks (a pattern search of it was quadratic)
        pad = (b" \t" * (size // 2))[: MAX_CONFIG - 100]
        return b"return {\n" + pad + b"\n  [\"\\t\"] = 1 }\n", {"line": 3}
    if kind == 2:  # a long name
        return b"return {\n" + b"a" * size + b" = 1 }\n", {"line": 2}
    if kind == 3:  # a key written by computation: no line holds it
        return b"return { [('k'):rep(%d)] = 1 }\n" % size, {}
    # A long key that a long comment repeats, line after line.
    key = b"z" * min(size, 4000)
    lines = min(200, (MAX_CONFIG - 2 * len(key)) // (len(key) + 8))
    return b"--[[\n" + (key + b" =\n") * lines + b"]]\nreturn {\n  [\"" + key + b"\"] = 2 }\n", {"line": lines + 4}


RECURSION = [
    b"local function f(s) return (s:gsub('.', f)) end\nreturn { name = f('abc') }",
    b"local function f(s) return (string.gsub(s, '.', f)) end\nreturn { name = f('abc') }",
    b"local g = ('x').gsub\nreturn {}",
    b"local t = { 3, 2, 1 }\nlocal function less(a, b) table.sort({ 1, 2 }, less) return a < b end\ntable.sort(t, less)\n"
    b"return {}",
    b"local f = string.dump(function() end)\nreturn {}",
    b"local f = (''):dump()\nreturn {}",
    b"local s = ('a'):rep(40)\nlocal n = s:find(('a*'):rep(30) .. 'b')\nreturn {}",
    b"for w in ('a b c'):gmatch('%a') do end\nreturn {}",
    b"local s = ('x'):match('x')\nreturn {}",
    b"local f = load('return 1')\nreturn {}",
    b"local f = loadstring('return 1')\nreturn {}",
    b"local function f(n) return 1 + f(n + 1) end\nreturn { steps = f(1) }",
    b"local function f(s) return s .. f(s) end\nreturn { name = f('x') }",
    b"local t = setmetatable({}, { __index = function(t, k) return t[k] end })\nreturn { steps = t.x }",
    b"local s = tostring(setmetatable({}, { __tostring = function(t) return tostring(t) end }))\nreturn {}",
    b"local s = string.format('%s', setmetatable({}, { __tostring = function(t) return tostring(t) end }))\n"
    b"return {}",
    b"local function f(s) return (string.rep(s, 2, f)) end\nreturn { name = f('x') }",
    b"table.foreach({ 1 }, function() end)\nreturn {}",
]


def c_recursion(rng, path):
    return rng.choice(RECURSION) + b"\n", {}


def c_metatables(rng, path):
    return rng.choice([
        b"local t = setmetatable({}, {})\nreturn t",
        b"local mt = getmetatable('')\nmt.__index = nil\nreturn {}",
        b"rawset(_G, 'x', 1)\nreturn {}",
        b"local v = rawget({}, 1)\nreturn {}",
        b"local p = newproxy(true)\nreturn {}",
        b"debug.setmetatable(1, { __index = string })\nreturn {}",
        b"local s = ''\nlocal mt = s.__index\nreturn { name = mt }",
    ]) + b"\n", {}


def c_coroutines(rng, path):
    return rng.choice([
        b"local f = coroutine.wrap(function() coroutine.yield(1) end)\nreturn { steps = f() }",
        b"local co = coroutine.create(function() while true do end end)\ncoroutine.resume(co)\nreturn {}",
        b"coroutine.yield()\nreturn {}",
        b"local co = coroutine.running()\nreturn {}",
    ]) + b"\n", {}


def c_endless(rng, path):
    return rng.choice([
        b"while true do end",
        b"repeat local x = 1 until false",
        b"::top:: goto top",
        b"for i = 1, math.huge do end",
        b"local function f() return f() end\nf()",
        b"local t = {} local i = 0 while true do i = i + 1 t[i] = i end",
        b"local s = '' while true do s = s .. 'x' end",
        b"local t = {} while true do t[#t + 1] = ('x'):rep(1000) .. #t end",
        b"local function f(n) if n == 0 then return 0 end return 1 + f(n - 1) end\nlocal x = f(1e7)",
        b"local t = { 1 } for k, v in ipairs(t) do t[k + 1] = v end",
        b"local x = 0 for i = 1, 1e9 do x = x + i end",
    ]) + b"\nreturn {}\n", {}


def c_junk(rng, path):
    kind = rng.randrange(7)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 2000))), {"accept": None}
    if kind == 1:
        return b"\x1bLJ\x02" + bytes(rng.randrange(256) for _ in range(100)), {}
    if kind == 2:
        return b"return { steps = 4 }\x00" + bytes(rng.randrange(256) for _ in range(20)), {}
    if kind == 3:  # LuaJIT skips a UTF-8 byte order mark, as it does a first line that starts with #
        return b"\xef\xbb\xbfreturn { steps = 4 }\n", {"accept": dict(DEFAULTS, steps=4), "must": True}
    if kind == 4:
        return b"x" * (MAX_CONFIG + rng.randrange(1, 1000)), {}
    if kind == 5:
        return b"#!/bin/sh\nreturn { steps = 4 }\n", {"accept": dict(DEFAULTS, steps=4), "must": True}
    c = Config(rng)
    c.valid()
    data = bytearray(c.text())
    for _ in range(rng.randrange(1, 4)):
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    return bytes(data), {"accept": None}


def c_errors(rng, path):
    return rng.choice([
        b"error({})", b"error(nil)", b"error()", b"error(42)", b"error(('\\1\\2\\n'):rep(300000))",
        b"error('plain', 0)", b"error('two up', 2)", b"assert(false)", b"assert(nil, {})", b"local x = nil + 1",
        b"local t = nil\nlocal y = t.x", b"error(('x'):rep(100000))", b"error(true)",
    ]) + b"\nreturn {}\n", {}


def c_returns(rng, path):
    body, ok = rng.choice([
        (b"return nil", False), (b"return 5", False), (b"return function() end", False), (b"return { 1, 2 }", False),
        (b"return { [1] = 2 }", False), (b"return { [true] = 1 }", False), (b"return { [{}] = 1 }", False),
        (b"return { [1.5] = 1 }", False), (b"local x = 1", False), (b"return {}", True), (b"return {}, 5", True),
        (b"return 'steps'", False), (b"return { steps = 1 }, { steps = 2 }", None),
    ])
    if ok is None:
        return body + b"\n", {"accept": dict(DEFAULTS, steps=1), "must": True}
    return body + b"\n", {"accept": DEFAULTS, "must": True} if ok else {}


def c_not_a_file(rng, path):
    what = rng.choice(["fifo", "devzero", "folder", "missing", "empty", "loop", "unreadable"])

    def make():
        if common.make_special(path, "link to itself" if what == "loop" else what):
            return
        if what == "unreadable":
            open(path, "wb").write(b"return { steps = 9 }\n")
            os.chmod(path, 0)
    # Root reads a file whatever its mode.
    if what == "unreadable" and os.getuid() == 0:
        return make, {"accept": dict(DEFAULTS, steps=9), "must": True}
    return make, {}


ESCAPES = [b"local g = _G.os", b"local e = getfenv(0)", b"local d = debug.getinfo(1)", b"local f = io.open('/etc/passwd')",
           b"os.exit(0)", b"local m = require 'partrain'", b"dofile('/etc/passwd')", b"jit.off()",
           b"local p = package.loaded", b"pcall(error)", b"collectgarbage('stop')", b"local v = rawget({}, 1)",
           b"local i = string.find('abc', 'b')", b"local r = math.random()", b"math.randomseed(1)",
           b"local x = xpcall(print, print)", b"print('x')", b"local t = table.foreachi({}, print)"]


def c_escapes(rng, path):
    pad = rng.randrange(0, 4)
    return b"\n" * pad + rng.choice(ESCAPES) + b"\nreturn {}\n", {"line": pad + 1}


CLASSES = [("valid", c_valid), ("unknown key", c_unknown), ("wrong value", c_wrong), ("deep", c_deep),
           ("huge", c_huge), ("long key", c_long_key), ("C recursion", c_recursion), ("metatables", c_metatables),
           ("coroutines", c_coroutines), ("endless", c_endless), ("junk", c_junk), ("errors", c_errors),
           ("returns", c_returns), ("not a file", c_not_a_file), ("escapes", c_escapes)]


# ---- judging ----------------------------------------------------------------------------

def printed(out):
    """{name: value} from the script's VALUE lines."""
    values = {}
    for line in out.splitlines():
        parts = line.split(" ", 3)
        if len(parts) < 3 or parts[0] != "VALUE":
            continue
        name, kind, text = parts[1], parts[2], parts[3] if len(parts) > 3 else ""
        if kind == "number":
            values[name] = float(text)
        elif kind == "string":
            values[name] = bytes.fromhex(text)
        elif kind == "boolean":
            values[name] = text == "true"
    return values


def same(want, got):
    for k, v in want.items():
        g = got.get(k)
        if isinstance(v, bool) or isinstance(v, bytes):
            if g != v:
                return False
        elif g is None or float(g) != float(v) or (v == 0 and str(float(g))[0] != str(float(v))[0]):
            return False
    return len(got) == len(want)


def judge(o, path, expect):
    """(kind, ok, detail) of one run."""
    if o.kind in ("crash", "hang"):
        return o.kind, False, repr(o)
    if o.kind == "accepted":
        if "accept" not in expect:
            return "accepted", False, "accepted, where a refusal was expected: " + o.out[-600:]
        got = printed(o.out)
        if set(got) != set(DEFAULTS):
            return "unclear", False, "accepted, but the script printed no values: " + o.text[-600:]
        if expect["accept"] is not None and not same(expect["accept"], got):
            return "wrong", False, f"read {got}, expected {expect['accept']}"
        return "accepted", True, ""
    first = o.err.split("\n")[0]
    if expect.get("must"):
        return "unclear", False, "refused a valid file: " + o.err[-800:]
    if not first.startswith("partrain: ") or path not in first:
        return "unclear", False, "the refusal's first line does not name the file: " + o.err[-800:]
    if len(first) > 900:
        return "unclear", False, f"a refusal of {len(first)} bytes: " + first[:300]
    if not common.located(o, re.escape(path)):
        return "unclear", False, "a location inside partrain's own Lua: " + o.err[-800:]
    if "line" in expect and f"{path}:{expect['line']}:" not in first:
        return "unclear", False, f"the refusal does not name line {expect['line']}: " + first[:600]
    return "refused", True, ""


def main():
    tally = common.Tally(f"Config files (seed {SEED})", kinds=["refused", "accepted", "wrong", "unclear", "crash", "hang"])
    rng = random.Random(SEED)
    work = common.scratch_dir("fuzz-config-")
    try:
        cases = []
        for i in range(CASES):
            name, make = CLASSES[i % len(CLASSES)]
            path = os.path.join(work, f"case-{i}.lua")
            body, expect = make(rng, path)
            if callable(body):
                body()
            else:
                with open(path, "wb") as f:
                    f.write(body)
            cases.append((i, name, path, expect))

        def one(case):
            i, name, path, expect = case
            o = common.run([BIN, "--threads", "1", SCRIPT, "--config", path], timeout=TIMEOUT, cwd=work,
                           memory=common.MEMORY_LIMIT)
            return case, o

        slowest = (0, None)
        with ThreadPoolExecutor(2) as pool:
            for (i, name, path, expect), o in pool.map(one, cases):
                kind, ok, detail = judge(o, path, expect)
                if o.seconds > slowest[0]:
                    slowest = (o.seconds, f"case {i} ({name})")
                tally.add(name, kind, ok, f"case {i}: {detail}")
        print(f"slowest: {slowest[1]}, {slowest[0]:.1f} s")
    finally:
        for root, dirs, files in os.walk(work):
            for d in dirs + files:
                p = os.path.join(root, d)
                if not os.path.islink(p):
                    try:
                        os.chmod(p, 0o700)
                    except OSError:
                        pass
        shutil.rmtree(work, ignore_errors=True)
    tally.finish()


if __name__ == "__main__":
    sys.exit(main())
