-- Data from Lua: Fashion-MNIST through the IDX reader, the byte-level text corpus, pre-tokenized
-- token files (llm.c's and nanoGPT's .bin), train/validation splits, pt.evaluate, and the
-- loader's seeded shuffle and data-parallel slices.
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local test, eq, near, raises, ok = H.test, H.eq, H.near, H.raises, H.ok

test("Fashion-MNIST loads as float images in [0, 1] and int64 labels", function()
  local train = pt.data.mnist { split = "train", batch = 100 }
  local test_set = pt.data.mnist { split = "test", batch = 100 }
  eq(train:size(), 60000); eq(test_set:size(), 10000)
  local x, y = train:next()
  eq(table.concat(x.shape, ","), "100,784"); eq(x.dtype, "float32"); eq(y.dtype, "int64")
  ok(x:min():item() >= 0 and x:max():item() <= 1, "scaled to [0, 1]")
  ok(y:min():item() >= 0 and y:max():item() <= 9, "ten classes")
  eq(train:batches_per_epoch(), 600)
end)

test("the shuffle is reproducible from the seed and changes with seed and epoch", function()
  local function first_labels(seed, epoch)
    local l = pt.data.mnist { batch = 16, seed = seed }
    l:start_epoch(epoch)
    local _, y = l:next()
    return table.concat(y:totable(), ",")
  end
  eq(first_labels(7, 0), first_labels(7, 0), "same seed and epoch")
  ok(first_labels(7, 0) ~= first_labels(8, 0), "another seed")
  ok(first_labels(7, 0) ~= first_labels(7, 1), "another epoch")
  local plain = pt.data.mnist { batch = 4, shuffle = false }
  local _, y = plain:next()
  eq(table.concat(y:totable(), ","), table.concat(pt.data.read_idx(
    "/usr/share/datasets/fashion-mnist/train-labels-idx1-ubyte.gz"):narrow(0, 0, 4):totable(), ","), "unshuffled order is file order")
end)

test("data-parallel slices of a global batch add up to the serial batch", function()
  local serial = pt.data.mnist { batch = 12, seed = 3 }
  local xs, ys = serial:next()
  local parts_x, parts_y = {}, {}
  for r = 0, 2 do
    local l = pt.data.mnist { batch = 12, seed = 3, shard_rank = r, shard_count = 3 }
    local x, y = l:next()
    eq(x.shape[1], 4, "each rank gets batch / shard_count")
    parts_x[#parts_x + 1], parts_y[#parts_y + 1] = x, y
  end
  ok(pt.cat(parts_x):equal(xs) and pt.cat(parts_y):equal(ys), "slices concatenate to the serial batch")
  raises(function() pt.data.mnist { batch = 10, shard_count = 3 } end, "batch=10 does not divide into shard_count=3")
  raises(function() pt.data.mnist { batch = 12, shard_rank = 3, shard_count = 3 } end, "shard_rank=3 must be in [0, shard_count=3)")
end)

test("epochs roll over and batches() walks the rest of one", function()
  local l = pt.data.mnist { split = "test", batch = 4000, drop_last = false, shuffle = false }
  eq(l:batches_per_epoch(), 3)
  local sizes = {}
  for x in l:batches() do sizes[#sizes + 1] = x.shape[1] end
  eq(table.concat(sizes, ","), "4000,4000,2000", "drop_last = false keeps the short batch")
  eq(l:has_next(), false)
  l:next()
  eq(l:epoch(), 1, "next() past the end starts the next epoch")
  eq(l:samples_seen(), 14000)
end)

test("the text corpus gives byte windows with targets shifted by one", function()
  local path = os.tmpname()
  local f = assert(io.open(path, "wb"))
  f:write("abcdefghijklmnopqrstuvwxyz")
  f:close()
  local l = pt.data.text { path = path, seq = 5, batch = 1, shuffle = false }
  eq(l:size(), 5, "(26 - 1) // 5 windows")
  local x, y = l:next()
  eq(pt.data.decode(x), "abcde"); eq(pt.data.decode(y), "bcdef")
  x, y = l:next()
  eq(pt.data.decode(x), "fghij"); eq(pt.data.decode(y), "ghijk")
  eq(x.dtype, "int64")
  eq(pt.data.decode(pt.data.encode("KJV")), "KJV", "encode and decode are inverse")
  os.remove(path)
  raises(function() pt.data.text { path = path, seq = 5 } end, "cannot read the text corpus '" .. path .. "'")
  raises(function() pt.data.text { seq = 5 } end, "needs option 'path'")
end)

test("a missing or damaged IDX file is an error naming the file", function()
  raises(function() pt.data.mnist { root = "/nonexistent" } end,
         "cannot read the dataset file '/nonexistent/train-images-idx3-ubyte.gz'")
  local path = os.tmpname()
  local f = assert(io.open(path, "wb"))
  f:write("\0\0\8\1\0\0\0\10abc")   -- says 10 bytes of uint8 data, holds 3
  f:close()
  raises(function() pt.data.read_idx(path) end, "is truncated or too long")
  f = assert(io.open(path, "wb")); f:write("PK\3\4junk"); f:close()
  raises(function() pt.data.read_idx(path) end, "not an IDX file")
  os.remove(path)
  raises(function() pt.data.mnist { split = "validation" } end, "split must be 'train' or 'test'")
end)

test("MNIST files must hold unsigned bytes: an IDX file of another type is refused, not scaled by 1/255", function()
  local dir = os.tmpname()
  os.remove(dir)
  assert(os.execute("mkdir " .. dir) == 0)
  local function write(name, bytes)
    local f = assert(io.open(dir .. "/" .. name, "wb"))
    f:write(bytes)
    f:close()
  end
  -- Two 1x2 images and two labels, plain IDX (zlib reads a file without gzip's magic as it is).
  write("train-images-idx3-ubyte.gz", "\0\0\8\3\0\0\0\2\0\0\0\1\0\0\0\2\0\255\10\20")
  write("train-labels-idx1-ubyte.gz", "\0\0\8\1\0\0\0\2\3\4")
  local x, y = pt.data.mnist { root = dir, batch = 2, shuffle = false }:next()
  for i, want in ipairs({ 0, 1, 10 / 255, 20 / 255 }) do near(x:reshape({ -1 }):totable()[i], want, 1e-7, "pixel " .. i) end
  eq(table.concat(y:totable(), ","), "3,4", "labels")
  -- The same pixels as int16: 255 would have become 255.0 / 255 * 256 and more.
  write("train-images-idx3-ubyte.gz", "\0\0\11\3\0\0\0\2\0\0\0\1\0\0\0\2\0\0\1\0\0\10\0\20")
  raises(function() pt.data.mnist { root = dir, batch = 2 } end,
         "MNIST images in '" .. dir .. "' hold Short values, not unsigned bytes")
  os.execute("rm -r " .. dir)
end)

test("datasets are read from regular files only: a folder, a FIFO or a device is refused, never waited on", function()
  local dir = os.tmpname()
  os.remove(dir)
  assert(os.execute("mkdir " .. dir .. " && mkfifo " .. dir .. "/fifo") == 0)
  raises(function() pt.data.text { path = dir, seq = 5 } end, "the text corpus '" .. dir .. "' is a folder; a regular file was expected")
  raises(function() pt.data.text { path = dir .. "/fifo", seq = 5 } end, "is a FIFO; a regular file was expected")
  raises(function() pt.data.read_idx(dir .. "/fifo") end, "the dataset file '" .. dir .. "/fifo' is a FIFO")
  raises(function() pt.data.read_idx("/dev/zero") end, "'/dev/zero' is a character device")
  os.execute("rm -r " .. dir)
end)

-- Token files written here: llm.c's layout (256 int32s: magic, version, count; then uint16
-- tokens), raw uint16 (nanoGPT's) and raw int32.
local function le(n, bytes)
  local out = {}
  for i = 1, bytes do out[i] = string.char(math.floor(n / 256 ^ (i - 1)) % 256) end
  return table.concat(out)
end
local function token_file(tokens, width, header)
  local path = os.tmpname()
  local f = assert(io.open(path, "wb"))
  if header then
    f:write(le(20240520, 4), le(header.version or 1, 4), le(header.count or #tokens, 4), string.rep("\0", 1024 - 12))
  end
  for _, t in ipairs(tokens) do f:write(le(t, width)) end
  f:close()
  return path
end
local function ids(n) local t = {} for i = 1, n do t[i] = (i * 7919) % 60000 end return t end

test("pt.data.tokens reads llm.c's .bin (uint16 above 32767 too), raw uint16 and int32, windows shifted by one", function()
  local toks = ids(101)
  for _, case in ipairs({
    { token_file(toks, 2, {}), {} },
    { token_file(toks, 2), { header = "none" } },
    { token_file(toks, 4), { dtype = "int32" } },
  }) do
    local opts = { path = case[1], seq = 4, batch = 2, shuffle = false }
    for k, v in pairs(case[2]) do opts[k] = v end
    local l = pt.data.tokens(opts)
    eq(l:size(), 25, "100 // 4 samples")
    local x, y = l:next()
    eq(table.concat(x:select(0, 1):totable(), ","), table.concat({ toks[5], toks[6], toks[7], toks[8] }, ","))
    eq(table.concat(y:select(0, 0):totable(), ","), table.concat({ toks[2], toks[3], toks[4], toks[5] }, ","))
    eq(x.dtype, "int64")
    os.remove(case[1])
  end
end)

test("split = train / val takes the first and last parts; the position is kept and restored", function()
  local toks = ids(201)
  local path = token_file(toks, 2, {})
  local train = pt.data.tokens { path = path, seq = 4, batch = 1, shuffle = false, split = "train", val_fraction = 0.2 }
  local val = pt.data.tokens { path = path, seq = 4, batch = 1, shuffle = false, split = "val", val_fraction = 0.2 }
  eq(train:size(), 39, "160 train tokens: (160 - 1) // 4 samples")
  eq(val:size(), 10, "41 validation tokens")
  local x = val:next()
  eq(x:select(0, 0):select(0, 0):item(), toks[161], "validation starts at token 160")
  train:next(); train:next()
  local seen = train:samples_seen()
  local a = train:next()
  train:seek(seen)
  ok(train:next():equal(a), "seek(samples_seen) replays the same batch")
  ok(tostring(val):find("tokens%(.*uint16, 41 tokens %[0.8, 1%)"), tostring(val))
  os.remove(path)
end)

test("seek between two batches, an epoch past what the loader counts, and option values out of range are refused", function()
  local toks = ids(201)
  local path = token_file(toks, 2, {})
  local l = pt.data.tokens { path = path, seq = 4, batch = 2, shuffle = false }
  -- seek(3) had landed at 2 and served sample 2 again without a word.
  raises(function() l:seek(3) end, "3 samples do not end a batch of 2 (the loader moves by whole batches): seek to 2 or 4")
  -- Without drop_last the last batch is short: the place after it is the epoch's end (50), not
  -- 48 + 4, which seek would refuse in turn.
  local short = pt.data.tokens { path = path, seq = 4, batch = 4, shuffle = false, drop_last = false }
  raises(function() short:seek(49) end, "49 samples do not end a batch of 4 (the loader moves by whole batches): seek to 48 or 50")
  short:seek(50)
  eq(short:samples_seen(), 50, "the epoch's end is a place seek reaches")
  -- Options with values out of range name the value.
  raises(function() pt.data.tokens { path = path, seq = 4, header = -1 } end, "whole number of bytes >= 0, got -1")
  raises(function() pt.data.tokens { path = path, seq = 4, header = "skip" } end, "whole number of bytes >= 0, got 'skip'")
  raises(function() pt.data.tokens { path = path, seq = 4, batch = 2, shard_count = 0 } end,
         "shard_count must be 1 or more (the data-parallel slices), got 0")
  l:seek(4)
  eq(l:samples_seen(), 4, "a whole number of batches is taken as given")
  -- samples_seen() had wrapped past int64 (epoch 2^62 of 50 samples).
  raises(function() l:start_epoch(2 ^ 62) end, "is past what the loader can count")
  eq(l:samples_seen(), 4, "the refused epoch left the loader where it was")
  os.remove(path)
end)

test("damaged token files are refused, naming the file and the problem", function()
  local toks = ids(50)
  local bad_count = token_file(toks, 2, { count = 49 })
  raises(function() pt.data.tokens { path = bad_count, seq = 4 } end, "states 49 tokens in its header but holds 50")
  local v2 = token_file(toks, 2, { version = 2 })
  raises(function() pt.data.tokens { path = v2, seq = 4 } end, "version 2")
  raises(function() pt.data.tokens { path = bad_count, seq = 4, dtype = "int32" } end, "tokens are uint16")
  local odd = os.tmpname()
  local f = io.open(odd, "wb"); f:write("abc"); f:close()
  raises(function() pt.data.tokens { path = odd, seq = 1, header = "none" } end, "not a whole number of 2-byte tokens")
  raises(function() pt.data.tokens { path = odd, seq = 1, dtype = "int16" } end, "dtype must be 'uint16', 'int32' or 'uint8'")
  raises(function() pt.data.tokens { path = odd, seq = 1, header = -3 } end, "header must be 'auto', 'none'")
  local short = token_file(toks, 2, {})
  raises(function() pt.data.tokens { path = short, seq = 100 } end, "fewer than seq+1")
  raises(function() pt.data.text { path = "data/kjv.txt", split = "test" } end, "split must be 'all', 'train' or 'val'")
  local neg = token_file({ 1, 2, 4294967295, 3, 4 }, 4)
  raises(function() pt.data.tokens { path = neg, seq = 2, batch = 2, dtype = "int32", shuffle = false }:next() end,
    "holds a negative token id")
  -- llm.c's count is an int32: a negative one had skipped the comparison.
  local negative_count = token_file(toks, 2, { count = 2 ^ 32 - 5 })
  raises(function() pt.data.tokens { path = negative_count, seq = 4 } end, "header stating -5 tokens")
  -- A file cut inside llm.c's header had been read as raw tokens, the magic number among them.
  local cut = os.tmpname()
  f = io.open(cut, "wb"); f:write(le(20240520, 4), le(1, 4), le(3, 4), "\1\0"); f:close()
  raises(function() pt.data.tokens { path = cut, seq = 1 } end, "has 14 bytes, fewer than its header of 1024")
  ok(pt.data.tokens { path = cut, seq = 1, batch = 1, header = "none" }, "header = 'none' reads it raw, as asked")
  for _, p in ipairs({ bad_count, v2, odd, neg, short, negative_count, cut }) do os.remove(p) end
end)

test("pt.evaluate's loss must be a function: train_step's loss names are refused, naming the caller's line", function()
  local toks = ids(201)
  local path = token_file(toks, 2, {})
  local l = pt.data.tokens { path = path, seq = 4, batch = 2, shuffle = false }
  local model = pt.models.gpt2 { vocab = 256, seq = 4, dim = 8, heads = 2, layers = 1 }
  -- It had tripped inside the library: "attempt to call upvalue 'loss_of' (a string value)".
  local err = raises(function() pt.evaluate(model, l, { loss = "mse" }) end,
    "pt.evaluate: loss must be a function (output, target) -> loss tensor, such as pt.nn.mse, got string")
  ok(err:find("test_data.lua:%d+: pt.evaluate") and not err:find("raised in", 1, true), err)
  os.remove(path)
end)

test("pt.evaluate averages the loss over a loader's batches without gradients, restoring mode and position", function()
  pt.manual_seed(3)
  local model = pt.nn.Sequential(pt.nn.Embedding(256, 8), pt.nn.Linear(8, 256))
  local val = pt.data.text { path = "data/kjv.txt", seq = 8, batch = 4, shuffle = false, split = "val" }
  val:next()
  local seen = val:samples_seen()
  local got = pt.evaluate(model, val, { batches = 3 })
  local check = pt.data.text { path = "data/kjv.txt", seq = 8, batch = 4, shuffle = false, split = "val" }
  local sum = 0
  for _ = 1, 3 do
    local x, y = check:next()
    sum = sum + pt.nn.cross_entropy(model(x), y):item()
  end
  near(got, sum / 3, 1e-6, "the mean of the batches' losses")
  eq(val:samples_seen(), seen, "the loader's position is restored")
  ok(model:is_training(), "the model is back in training mode")
  for _, p in model:named_parameters() do ok(p.grad == nil, "no gradient was made") end
  raises(function() pt.evaluate(model, val, { batches = 0 }) end, "batches must be a whole number from 1")
  raises(function() pt.evaluate(model, val, { steps = 2 }) end, "no option 'steps'")
  -- At an epoch's end the loader stays at its end: restored by its sample count it had begun the
  -- next epoch, and a `for x, y in loader:batches()` loop around the call never ended.
  val:start_epoch(2)
  local walked = 0
  for _ in val:batches() do
    walked = walked + 1
    if not val:has_next() then pt.evaluate(model, val, { batches = 1 }) end
    if walked > val:batches_per_epoch() then break end
  end
  eq(walked, val:batches_per_epoch(), "evaluating at the epoch's end leaves one epoch walked")
  eq(val:epoch(), 2, "the same epoch")
  eq(val:has_next(), false, "still at its end")
end)

H.run()
