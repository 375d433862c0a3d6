-- pt.ckpt.import_safetensors against malformed files: each is refused with the file, the tensor
-- and the caller's line named, before anything is allocated from its sizes, and a well-formed
-- file (keys in any order, a padded header) still imports exactly.
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local ffi = require "ffi"
local H = require "harness"
local test, eq, raises, ok = H.test, H.eq, H.raises, H.ok

local root = os.tmpname()
os.remove(root)
os.execute("mkdir -p '" .. root .. "'")

local function write(path, bytes)
  local f = assert(io.open(path, "wb"))
  f:write(bytes)
  f:close()
end

local function le64(n)
  local s = {}
  for i = 1, 8 do
    s[i] = string.char(n % 256)
    n = math.floor(n / 256)
  end
  return table.concat(s)
end

local function f32(values) return ffi.string(ffi.new("float[?]", #values, values), 4 * #values) end

-- The model: 0.weight [3, 2] and 0.bias [3], float32.
local function model() return pt.models.mlp { sizes = { 2, 3 } } end
local bias_values, weight_values = { 1, 2, 3 }, { 0.5, -1, 1.5, -2, 2.5, -3 }
local bias, weight = f32(bias_values), f32(weight_values)  -- 12 and 24 bytes

local n = 0
-- Writes a file from a header text and data bytes (the header's length is computed).
local function file(header, data)
  n = n + 1
  local path = ("%s/f%d.safetensors"):format(root, n)
  write(path, le64(#header) .. header .. data)
  return path
end

local function entry(dtype, shape, b, e) return ('{"dtype":"%s","shape":%s,"data_offsets":[%s,%s]}'):format(dtype, shape, b, e) end
local good_header = '{"0.bias":' .. entry("F32", "[3]", 0, 12) .. ',"0.weight":' .. entry("F32", "[3,2]", 12, 36) .. "}"

-- Imports `path` into a fresh model; the error must name the file, `detail`, and this file's line.
local function refused(path, detail, what)
  local err = raises(function() pt.ckpt.import_safetensors(model(), path) end, detail, what)
  ok(err:find(path, 1, true), (what or detail) .. ": the error names the file: " .. err)
  ok(err:find("^[^:]*test_safetensors%.lua:%d+:"), (what or detail) .. ": the error names the caller's line: " .. err)
end

test("a well-formed file imports exactly, whatever its key order and padding", function()
  local header = '{"0.weight":' .. entry("F32", "[3,2]", 12, 36) .. ',"__metadata__":{"format":"pt"},"0.bias":' ..
                 entry("F32", "[3]", 0, 12) .. "}"
  local m = model()
  pt.ckpt.import_safetensors(m, file(header .. "    ", bias .. weight))
  local got = {}
  for name, p in m:named_parameters() do got[name] = p:detach():reshape { -1 }:totable() end
  for i, v in ipairs(bias_values) do eq(got["0.bias"][i], v, "bias " .. i) end
  for i, v in ipairs(weight_values) do eq(got["0.weight"][i], v, "weight " .. i) end
end)

test("offsets: overlapping, reversed, a hole, trailing bytes, past the end, not integers", function()
  refused(file('{"0.bias":' .. entry("F32", "[3]", 0, 12) .. ',"0.weight":' .. entry("F32", "[3,2]", 8, 32) .. "}",
               (bias .. weight):sub(1, 32)), "overlap those of '0.bias'", "overlapping")
  refused(file('{"0.bias":' .. entry("F32", "[3]", 0, 12) .. ',"0.weight":' .. entry("F32", "[3,2]", 36, 12) .. "}",
               bias .. weight), "tensor '0.weight': its data_offsets [36,12] do not fit", "reversed")
  refused(file('{"0.bias":' .. entry("F32", "[3]", 0, 12) .. ',"0.weight":' .. entry("F32", "[3,2]", 16, 40) .. "}",
               bias .. "\0\0\0\0" .. weight), "leaving a hole after '0.bias'", "a hole")
  refused(file('{"0.bias":' .. entry("F32", "[3]", 4, 16) .. ',"0.weight":' .. entry("F32", "[3,2]", 16, 40) .. "}",
               "\0\0\0\0" .. bias .. weight), "tensor '0.bias': its bytes start at 4", "a hole at the start")
  refused(file(good_header, bias .. weight .. "junk"), "4 bytes after its last tensor '0.weight' (trailing garbage)",
          "trailing garbage")
  refused(file('{"0.bias":' .. entry("F32", "[3]", 0, 12) .. ',"0.weight":' .. entry("F32", "[3,2]", 12, 36) .. "}",
               bias .. weight:sub(1, 20)), "tensor '0.weight': its data_offsets [12,36] do not fit", "past the end")
  refused(file('{"0.bias":' .. entry("F32", "[3]", "0.0", 12) .. ',"0.weight":' .. entry("F32", "[3,2]", 12, 36) .. "}",
               bias .. weight), "tensor '0.bias': its data_offsets [0.0,12] are not two non-negative integers", "float")
  refused(file('{"0.bias":' .. entry("F32", "[3]", -12, 0) .. ',"0.weight":' .. entry("F32", "[3,2]", 12, 36) .. "}",
               bias .. weight), "tensor '0.bias': its data_offsets [-12,0]", "negative")
  refused(file('{"0.bias":{"dtype":"F32","shape":[3],"data_offsets":[0,6,12]},"0.weight":' ..
               entry("F32", "[3,2]", 12, 36) .. "}", bias .. weight), "are not two non-negative integers", "three")
end)

test("keys: a tensor twice, a key twice in an entry, unknown or missing keys", function()
  refused(file('{"0.bias":' .. entry("F32", "[3]", 0, 12) .. ',"0.weight":' .. entry("F32", "[3,2]", 12, 36) ..
               ',"0.bias":' .. entry("F32", "[3]", 0, 12) .. "}", bias .. weight),
          "tensor '0.bias' appears twice in the header", "a duplicate tensor")
  refused(file('{"0.bias":{"dtype":"F32","dtype":"I32","shape":[3],"data_offsets":[0,12]},"0.weight":' ..
               entry("F32", "[3,2]", 12, 36) .. "}", bias .. weight), "tensor '0.bias' has the key 'dtype' twice",
          "a duplicate key")
  refused(file('{"0.bias":{"dtype":"F32","shape":[3],"data_offsets":[0,12],"scale":2},"0.weight":' ..
               entry("F32", "[3,2]", 12, 36) .. "}", bias .. weight), "tensor '0.bias': unknown key 'scale'", "unknown")
  refused(file('{"0.bias":{"dtype":"F32","shape":[3]},"0.weight":' .. entry("F32", "[3,2]", 12, 36) .. "}",
               bias .. weight), "tensor '0.bias': it needs dtype, shape and data_offsets", "missing")
  refused(file('{"__metadata__":{"format":1},"0.bias":' .. entry("F32", "[3]", 0, 12) .. ',"0.weight":' ..
               entry("F32", "[3,2]", 12, 36) .. "}", bias .. weight), "__metadata__ entry 'format'", "metadata")
end)

test("dtypes and shapes: wrong kind, unknown, negative, fractional, huge, inconsistent", function()
  refused(file('{"0.bias":' .. entry("I32", "[3]", 0, 12) .. ',"0.weight":' .. entry("F32", "[3,2]", 12, 36) .. "}",
               bias .. weight), "tensor '0.bias' is Int; the model's is Float", "I32 into float")
  refused(file('{"0.bias":' .. entry("F8", "[3]", 0, 12) .. ',"0.weight":' .. entry("F32", "[3,2]", 12, 36) .. "}",
               bias .. weight), "tensor '0.bias': unsupported dtype \"F8\"", "unknown dtype")
  refused(file('{"0.bias":' .. entry("F32", "[-3]", 0, 12) .. ',"0.weight":' .. entry("F32", "[3,2]", 12, 36) .. "}",
               bias .. weight), "tensor '0.bias': its shape [-3]", "negative size")
  refused(file('{"0.bias":' .. entry("F32", "[3.0]", 0, 12) .. ',"0.weight":' .. entry("F32", "[3,2]", 12, 36) .. "}",
               bias .. weight), "tensor '0.bias': its shape [3.0]", "fractional size")
  refused(file('{"0.bias":' .. entry("F32", "[1099511627776,1099511627776]", 0, 12) .. ',"0.weight":' ..
               entry("F32", "[3,2]", 12, 36) .. "}", bias .. weight), "tensor '0.bias': its shape", "huge")
  refused(file('{"0.bias":' .. entry("F32", "[4]", 0, 12) .. ',"0.weight":' .. entry("F32", "[3,2]", 12, 36) .. "}",
               bias .. weight), "tensor '0.bias': its data_offsets [0,12] do not fit its shape [4] (16 bytes)",
          "a shape the offsets do not hold")
  refused(file('{"0.bias":' .. entry("F32", "3", 0, 12) .. ',"0.weight":' .. entry("F32", "[3,2]", 12, 36) .. "}",
               bias .. weight), "tensor '0.bias': its shape is not a list", "a shape that is not a list")
end)

test("a GPT-2 file with both transformer.x and x is refused", function()
  local gpt = pt.models.gpt2 { vocab = 8, seq = 4, dim = 4, heads = 1, layers = 1 }
  local wte = f32 { 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 }
  local path = file('{"transformer.wte.weight":' .. entry("F32", "[8,4]", 0, 128) .. ',"wte.weight":' ..
                    entry("F32", "[8,4]", 128, 256) .. "}", wte .. wte)
  local err = raises(function() pt.ckpt.import_safetensors(gpt, path) end,
                     "has both 'transformer.wte.weight' and 'wte.weight', which name the same tensor 'wte.weight'")
  ok(err:find(path, 1, true), err)
end)

test("the file itself: too short, a header past its end, not JSON, not an object, too deep, not a file", function()
  local path = root .. "/short.safetensors"
  write(path, "abc")
  refused(path, "too short", "shorter than its length field")
  refused(file("", ""), "does not start with '{'", "an empty header")
  path = root .. "/long.safetensors"
  write(path, le64(1e12) .. good_header .. bias .. weight)
  refused(path, "a header of 1000000000000 bytes", "a header length past the end")
  refused(file("{not json", ""), "not JSON", "not JSON")
  refused(file("[1,2]", ""), "does not start with '{'", "a list")
  refused(file("{" .. ("[" .. '"a":'):rep(0) .. '"x":' .. ("["):rep(5000) .. ("]"):rep(5000) .. "}", ""),
          "nested deeper than 64", "deep nesting")
  refused(file('{"0.bias":' .. entry("F32", "[3]", 0, 12) .. "} trailing", bias), "not JSON", "text after the header")
  local fifo = root .. "/fifo.safetensors"
  os.execute("mkfifo '" .. fifo .. "'")
  refused(fifo, "is a FIFO; a regular file was expected", "a FIFO")
  refused("/dev/zero", "is a character device", "/dev/zero")
  local empty = root .. "/empty"
  os.execute("mkdir -p '" .. empty .. "'")
  refused(empty, "holds neither model.safetensors.index.json nor model.safetensors", "a folder without weights")
end)

-- A tensor called __metadata__ had overwritten the header's metadata: a file nothing could read.
-- A NUL byte ends the JSON parser's input: what followed it had gone unread.
test("export refuses a tensor named __metadata__; import refuses a NUL byte in the header", function()
  local M = pt.nn.Module "Meta"
  function M:__init() self:register_parameter("__metadata__", pt.zeros(2)) end
  raises(function() pt.ckpt.export_safetensors(M(), root .. "/meta.safetensors") end,
    "a tensor cannot be named '__metadata__'")
  refused(file(good_header .. "\0garbage", bias .. weight), "has a NUL byte in its safetensors header", "a NUL byte")
  -- An escaped NUL (or another control character) in a name would cut or garble later messages.
  refused(file('{"0.bi\\u0000as":' .. entry("F32", "[3]", 0, 12) .. "}", bias),
          "tensor '0.bi\\x00as': its name holds a control character", "\\u0000 in a name")
end)

-- A header length past the JSON's end: the parser's message quotes what it read, the data's bytes
-- among them; they are shown escaped and cut, never raw.
test("a header that runs into the data shows the bytes the parser read escaped and bounded", function()
  local path = root .. "/overlong.safetensors"
  local header = '{"0.bias":' .. entry("F32", "[3]", 0, 12) .. "}"
  local data = ("\255\254abc"):rep(100)
  write(path, le64(#header + #data) .. header .. data)
  local err = raises(function() pt.ckpt.import_safetensors(pt.models.mlp { sizes = { 2, 3 } }, path) end, "not JSON")
  ok(not err:find("[%z\1-\8\128-\255]"), "no raw data byte in the message: " .. err)
  ok(#err < 1200, "the message is bounded (" .. #err .. " bytes)")
end)

-- An untied LLaMA's lm_head is its own tensor; `partrain ckpt export` had dropped it as a tie.
test("partrain ckpt export keeps an untied LLaMA's lm_head, and drops nothing of a tied one", function()
  local bin = assert(os.getenv("PARTRAIN_BIN"), "PARTRAIN_BIN names the partrain executable")
  for _, tie in ipairs { false, true } do
    pt.manual_seed(2)
    local m = pt.models.llama { vocab = 32, seq = 8, dim = 16, heads = 2, layers = 1, tie = tie }
    local dir, out = root .. "/llama-" .. tostring(tie), root .. "/llama-" .. tostring(tie) .. ".safetensors"
    pt.ckpt.save(dir, { model = m, step = 1 })
    eq(os.execute(("'%s' ckpt export '%s' '%s' > /dev/null"):format(bin, dir, out)), 0, "ckpt export, tie=" .. tostring(tie))
    pt.manual_seed(9)
    local fresh = pt.models.llama { vocab = 32, seq = 8, dim = 16, heads = 2, layers = 1, tie = tie }
    pt.ckpt.import_safetensors(fresh, out)
    local want = m:state_dict()
    for name, t in pairs(fresh:state_dict()) do ok(t:equal(want[name]), "tie=" .. tostring(tie) .. ": " .. name) end
  end
end)

test("Hugging Face's sharded layout: an index and its files, refused when they disagree or lead elsewhere", function()
  local dir = root .. "/sharded"
  os.execute("mkdir -p '" .. dir .. "'")
  write(dir .. "/model-00001-of-00002.safetensors", le64(#('{"0.bias":' .. entry("F32", "[3]", 0, 12) .. "}"))
        .. '{"0.bias":' .. entry("F32", "[3]", 0, 12) .. "}" .. bias)
  write(dir .. "/model-00002-of-00002.safetensors", le64(#('{"0.weight":' .. entry("F32", "[3,2]", 0, 24) .. "}"))
        .. '{"0.weight":' .. entry("F32", "[3,2]", 0, 24) .. "}" .. weight)
  local function index(map) write(dir .. "/model.safetensors.index.json", '{"metadata":{},"weight_map":' .. map .. "}") end
  index('{"0.bias":"model-00001-of-00002.safetensors","0.weight":"model-00002-of-00002.safetensors"}')
  local m = model()
  pt.ckpt.import_safetensors(m, dir)  -- the folder: its index
  eq(table.concat(m:get("0").bias:totable(), ","), "1,2,3", "the bias from the first file")
  eq(m:get("0").weight:select(0, 2):select(0, 1):item(), -3, "the weight from the second")
  local indexed = dir .. "/model.safetensors.index.json"
  index('{"0.bias":"../model-00001-of-00002.safetensors","0.weight":"model-00002-of-00002.safetensors"}')
  refused(indexed, "not a plain file name beside it", "an index leading out of its folder")
  index('{"0.bias":"model-00002-of-00002.safetensors","0.weight":"model-00002-of-00002.safetensors"}')
  refused(indexed, "lacks tensor '0.bias', which the index", "a tensor in another file than the index says")
  index('{"0.weight":"model-00002-of-00002.safetensors"}')
  refused(indexed, "has no tensor '0.bias'", "an index without a parameter")
  write(indexed, '{"weight_map":[1,2]}')
  refused(indexed, "is not a safetensors index", "a weight_map that is not an object")
  write(indexed, '{"weight_map":{"0.bias":"a.safetensors","0.bias":"b.safetensors"}}')
  refused(indexed, "names a tensor twice", "a tensor twice in the weight_map")
  -- A shard that is a link leads out of the folder (it had been imported): refused.
  os.execute("mkdir -p '" .. root .. "/outside' && mv '" .. dir .. "/model-00001-of-00002.safetensors' '" .. root
    .. "/outside/shard.safetensors' && ln -s '" .. root .. "/outside/shard.safetensors' '" .. dir
    .. "/model-00001-of-00002.safetensors'")
  index('{"0.bias":"model-00001-of-00002.safetensors","0.weight":"model-00002-of-00002.safetensors"}')
  raises(function() pt.ckpt.import_safetensors(model(), indexed) end,
    "model-00001-of-00002.safetensors' is a symbolic link", "an index's shard that is a link")
end)

local status = H.run()
os.execute("rm -rf '" .. root .. "'")
return status
