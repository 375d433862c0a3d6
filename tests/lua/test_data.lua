-- Data from Lua: Fashion-MNIST through the IDX reader, the byte-level text corpus, and the
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

H.run()
