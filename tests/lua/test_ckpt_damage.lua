-- Damaged and hostile checkpoint folders in one process: a missing, empty, garbled or escaping
-- `newest`, a damaged newest tag, FIFOs, devices and links where files belong, altered
-- manifests. A resume takes the newest valid checkpoint and says why, a load of the checkpoint
-- it took restores exactly that checkpoint's state, and a save never writes over a checkpoint
-- or through a planted link.
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local test, eq, raises, ok = H.test, H.eq, H.raises, H.ok

local root = os.tmpname()
os.remove(root)
os.execute("mkdir -p '" .. root .. "'")

local function sh(cmd)
  local status = os.execute(cmd)
  assert(status == 0 or status == true, "command failed: " .. cmd)
end

local function exists(path)
  local f = io.open(path, "rb")
  if f then f:close() return true end
  return os.execute("test -e '" .. path .. "' -o -L '" .. path .. "'") == 0
end

local function read(path)
  local f = assert(io.open(path, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end

local function write(path, bytes)
  local f = assert(io.open(path, "wb"))
  f:write(bytes)
  f:close()
end

local function flip(path, at)
  local f = assert(io.open(path, "r+b"))
  f:seek("set", at)
  local b = f:read(1)
  f:seek("set", at)
  f:write(string.char(bit.bxor(b:byte(), 0xff)))
  f:close()
end

-- zlib's CRC-32, to write a `newest` whose checksum is right but whose tag is not.
local crc_table = {}
for i = 0, 255 do
  local c = i
  for _ = 1, 8 do c = bit.band(c, 1) ~= 0 and bit.bxor(0xedb88320, bit.rshift(c, 1)) or bit.rshift(c, 1) end
  crc_table[i] = c
end
local function crc32_of(s)
  local c = 0xffffffff
  for i = 1, #s do c = bit.bxor(crc_table[bit.band(bit.bxor(c, s:byte(i)), 0xff)], bit.rshift(c, 8)) end
  return bit.bnot(c)
end
local function crc32(s) return bit.tohex(crc32_of(s)) end
local function newest_text(tag) return tag .. "\ncrc32 " .. crc32(tag) .. "\n" end
-- Little-endian bytes of a non-negative integer below 2^53 (`n` bytes).
local function le(x, n)
  local out = {}
  for i = 1, n do
    out[i] = string.char(x % 256)
    x = math.floor(x / 256)
  end
  return table.concat(out)
end
-- A format-2 manifest around `payload`, with a correct length and checksum.
local function manifest_of(payload)
  local c = crc32_of(payload)
  local crc = ""
  for i = 0, 3 do crc = crc .. string.char(bit.band(bit.rshift(c, 8 * i), 0xff)) end
  return le(19, 8) .. "partrain-checkpoint" .. le(2, 4) .. le(#payload, 8) .. crc .. payload
end

local function setup(seed)
  pt.manual_seed(seed)
  local model = pt.models.mlp { sizes = { 6, 8, 3 } }
  local opt = pt.optim.adamw(model, { lr = 0.01 })
  local data = pt.data.text { path = "data/kjv.txt", seq = 6, batch = 4, seed = 3 }
  return { model = model, optim = opt, data = data }
end

local function train_step(s)
  local x = s.data:next()
  local loss = pt.nn.cross_entropy(s.model(x:to("float32")), pt.tensor({ 0, 1, 2, 0 }, { dtype = "int64" }))
  s.optim:zero_grad()
  loss:backward()
  s.optim:step()
  return loss:item()
end

-- What a state is, observed: its weights, step count and data position, and the loss and weights
-- of one more step (which the optimizer's moments and the data position drive).
local function observe(s)
  local o = { steps = s.optim:steps(), seen = s.data:samples_seen(), weights = {} }
  for name, p in s.model:named_parameters() do o.weights[name] = p:detach():clone() end
  o.loss = train_step(s)
  o.after = {}
  for name, p in s.model:named_parameters() do o.after[name] = p:detach():clone() end
  return o
end

local function same(got, want, what)
  eq(got.steps, want.steps, what .. ": optimizer steps")
  eq(got.seen, want.seen, what .. ": data position")
  for name, w in pairs(want.weights) do ok(got.weights[name]:equal(w), what .. ": weight " .. name) end
  eq(got.loss, want.loss, what .. ": the next step's loss")
  for name, w in pairs(want.after) do ok(got.after[name]:equal(w), what .. ": weight " .. name .. " after a step") end
end

-- A pristine folder: step-00000002, step-00000004 and step-00000006 of one run, and what each
-- holds (observed on a copy loaded from it).
local pristine = root .. "/pristine"
local want = {}
do
  local s = setup(1)
  for step = 1, 6 do
    train_step(s)
    if step % 2 == 0 then pt.ckpt.save(pristine, { model = s.model, optim = s.optim, data = s.data, step = step }) end
  end
  for _, step in ipairs { 2, 4, 6 } do
    local t = setup(9)
    pt.ckpt.load(pristine, ("step-%08d"):format(step), t)
    want[step] = observe(t)
  end
end

local n = 0
local function copy()
  n = n + 1
  local d = ("%s/case-%d"):format(root, n)
  sh(("cp -r '%s' '%s'"):format(pristine, d))
  return d
end

-- Resumes a fresh state from `dir`: the result, its notes joined, and the state observed.
local function resume(dir)
  local s = setup(7)
  local r = pt.ckpt.resume(dir, s)
  return r, r and table.concat(r.notes, "\n") or "", r and observe(s)
end

local function takes(dir, step, note, what)
  local r, notes, got = resume(dir)
  ok(r, what .. ": resume found nothing")
  eq(r.tag, ("step-%08d"):format(step), what .. ": the tag taken")
  same(got, want[step], what)
  if note then ok(notes:find(note, 1, true), what .. ": notes '" .. notes .. "' lack '" .. note .. "'") end
  return notes
end

test("an intact folder resumes from the newest tag, silently and exactly", function()
  local notes = takes(copy(), 6, nil, "intact")
  eq(notes, "", "no notes")
  local good, problems = pt.ckpt.verify(pristine)
  ok(good, table.concat(problems, "\n"))
end)

test("newest missing, empty, garbage, unchecked, or naming a missing tag: the highest valid step, said", function()
  local d = copy()
  os.remove(d .. "/newest")
  takes(d, 6, "newest' is missing", "missing")
  ok(not select(1, pt.ckpt.verify(d)), "verify flags a missing newest")
  d = copy()
  write(d .. "/newest", "")
  takes(d, 6, "it is empty", "empty")
  d = copy()
  write(d .. "/newest", "\0\1garbage\255")
  takes(d, 6, "is damaged", "garbage")
  d = copy()
  write(d .. "/newest", "step-00000004\n")  -- as format 1 wrote it: no checksum
  takes(d, 6, "no checksum line", "no checksum")
  d = copy()
  write(d .. "/newest", "step-00000004\ncrc32 00000000\n")
  takes(d, 6, "checksum does not match", "wrong checksum")
  d = copy()
  write(d .. "/newest", newest_text("step-00000009"))
  takes(d, 6, "names 'step-00000009', which is not a checkpoint", "a missing tag")
end)

test("newest naming a tag outside the folder is never followed", function()
  local d = copy()
  local other = root .. "/other-" .. n
  local s = setup(5)
  for _ = 1, 9 do train_step(s) end
  pt.ckpt.save(other, { model = s.model, optim = s.optim, data = s.data, step = 50 })
  for _, escape in ipairs { "../other-" .. n .. "/step-00000050", "/tmp", "..", "newest" } do
    write(d .. "/newest", newest_text(escape))
    takes(d, 6, "which is not a tag", "newest = " .. escape)
  end
  write(d .. "/newest", newest_text("step-00000004\nstep-00000006"))  -- a tag with a newline
  takes(d, 6, "damaged", "newest with two lines")
  raises(function() pt.ckpt.load(d, "../other-" .. n .. "/step-00000050", setup(1)) end, "bad checkpoint tag")
end)

test("a damaged newest tag falls back to the previous good one, naming the damage", function()
  local d = copy()
  flip(d .. "/step-00000006/rank-00000.bin", 5)
  local notes = takes(d, 4, "rank-00000.bin' fails its checksum", "a flipped data byte")
  ok(notes:find("falling back to 'step-00000004'", 1, true), notes)
  d = copy()
  flip(d .. "/step-00000006/manifest.bin", 60)
  takes(d, 4, "manifest.bin' fails its checksum", "a flipped manifest byte")
  d = copy()
  os.remove(d .. "/step-00000006/manifest.bin")
  takes(d, 4, "manifest.bin' is missing", "a deleted manifest")
  d = copy()
  os.remove(d .. "/step-00000006/rank-00000.bin")
  takes(d, 4, "rank-00000.bin' is missing", "a deleted data file")
  d = copy()
  flip(d .. "/step-00000006/rank-00000.bin", 5)
  flip(d .. "/step-00000004/manifest.bin", 100)
  takes(d, 2, "falling back", "two damaged tags")
  local good, problems = pt.ckpt.verify(d)
  ok(not good and #problems == 2, "verify names both damaged tags: " .. table.concat(problems, "\n"))
  -- An explicit load of the damaged tag refuses, naming the file and the tensor.
  raises(function() pt.ckpt.load(d, "step-00000006", setup(1)) end, "rank-00000.bin' fails its checksum in tensor")
end)

test("a failed load changes nothing", function()
  local d = copy()
  -- The last tensor's bytes are damaged: everything before it reads fine.
  local size = #read(d .. "/step-00000006/rank-00000.bin")
  flip(d .. "/step-00000006/rank-00000.bin", size - 1)
  local s = setup(1)
  for _ = 1, 2 do train_step(s) end
  local before = { steps = s.optim:steps(), seen = s.data:samples_seen(), weights = {} }
  for name, p in s.model:named_parameters() do before.weights[name] = p:detach():clone() end
  raises(function() pt.ckpt.load(d, "step-00000006", s) end, "fails its checksum")
  eq(s.optim:steps(), before.steps, "optimizer steps unchanged")
  eq(s.data:samples_seen(), before.seen, "data position unchanged")
  for name, p in s.model:named_parameters() do ok(p:equal(before.weights[name]), "weight " .. name .. " unchanged") end
end)

test("every checkpoint damaged: an error listing each, never a fresh start", function()
  local d = copy()
  for _, step in ipairs { 2, 4, 6 } do flip(("%s/step-%08d/rank-00000.bin"):format(d, step), 3) end
  local err = raises(function() pt.ckpt.resume(d, setup(1)) end, "no valid checkpoint in")
  for _, step in ipairs { 2, 4, 6 } do ok(err:find(("step-%08d"):format(step), 1, true), err) end
  ok(err:find("test_ckpt_damage.lua:%d+"), "the error names the caller's line: " .. err)
  local e = root .. "/empty-" .. n
  sh("mkdir -p '" .. e .. "/.step-00000001.tmp'")  -- an interrupted first save
  write(e .. "/notes.txt", "a user's file")
  eq(pt.ckpt.resume(e, setup(1)), nil, "a folder with no checkpoint is a fresh start")
end)

test("FIFOs, devices and links where files belong: refused without hanging", function()
  local d = copy()
  os.remove(d .. "/newest")
  sh("mkfifo '" .. d .. "/newest'")
  takes(d, 6, "newest' is a FIFO", "newest as a FIFO")
  os.remove(d .. "/newest")
  sh("ln -s /dev/zero '" .. d .. "/newest'")
  takes(d, 6, "is a symbolic link", "newest linked to /dev/zero")
  os.remove(d .. "/newest")
  write(d .. "/newest", newest_text("step-00000006"))
  os.remove(d .. "/step-00000006/manifest.bin")
  sh("mkfifo '" .. d .. "/step-00000006/manifest.bin'")
  takes(d, 4, "is a FIFO", "manifest as a FIFO")
  os.remove(d .. "/step-00000006/manifest.bin")
  sh("cp '" .. pristine .. "/step-00000006/manifest.bin' '" .. d .. "/step-00000006/manifest.bin'")
  os.remove(d .. "/step-00000006/rank-00000.bin")
  sh("ln -s /dev/zero '" .. d .. "/step-00000006/rank-00000.bin'")
  takes(d, 4, "is a symbolic link", "a data file linked to /dev/zero")
  os.remove(d .. "/step-00000006/rank-00000.bin")
  sh("mkfifo '" .. d .. "/step-00000006/rank-00000.bin'")
  takes(d, 4, "is a FIFO", "a data file as a FIFO")
  local good, problems = pt.ckpt.verify(d .. "/step-00000006")
  ok(not good and problems[1]:find("FIFO", 1, true), "verify reports the FIFO: " .. tostring(problems[1]))
  -- A tag folder that is a link to a good checkpoint elsewhere is not a tag.
  sh("rm -rf '" .. d .. "/step-00000006'")
  sh("ln -s '" .. pristine .. "/step-00000006' '" .. d .. "/step-00000006'")
  takes(d, 4, "must be a real folder", "a linked tag folder")
  raises(function() pt.ckpt.load(d, "step-00000006", setup(1)) end, "must be a real folder")
end)

test("manifests: another format, truncated, extended, cut in its header", function()
  local d = copy()
  local path = d .. "/step-00000006/manifest.bin"
  local bytes = read(path)
  write(path, bytes:sub(1, 27) .. "\1\0\0\0" .. bytes:sub(32))
  local r = select(2, resume(d))
  ok(r:find("format version 1, which has no checksum", 1, true), r)
  write(path, bytes:sub(1, #bytes - 9))
  ok(select(2, resume(d)):find("truncated or extended", 1, true), "truncated")
  write(path, bytes .. "\0")
  ok(select(2, resume(d)):find("truncated or extended", 1, true), "extended")
  write(path, bytes:sub(1, 20))
  ok(select(2, resume(d)):find("is truncated", 1, true), "cut in its header")
  local good, problems = pt.ckpt.verify(d)
  ok(not good and problems[1]:find("step-00000006", 1, true), table.concat(problems, "\n"))
end)

test("a manifest with a correct checksum but absurd sizes is refused before they are allocated", function()
  local d = copy()
  local path = d .. "/step-00000006/manifest.bin"
  -- step, world, tensor, data, pipeline, zero, then the model type's length: 2^60.
  local head = le(6, 8) .. le(1, 4):rep(5)
  write(path, manifest_of(head .. "\0\0\0\0\0\0\0\16" .. ("x"):rep(40)))
  takes(d, 4, "a container of 1152921504606846976 elements where only 40 bytes are left", "a string of 2^60 bytes")
  -- ... then empty names, counts, the user table "{}", full, and 2^40 tensors.
  local strings = le(0, 8):rep(3) .. le(0, 8) .. le(0, 8) .. le(2, 8) .. "{}" .. "\0"
  write(path, manifest_of(head .. strings .. le(2 ^ 40, 8) .. ("x"):rep(64)))
  takes(d, 4, "a container of 1099511627776 elements", "2^40 tensors")
  -- 64 tensors claimed, 64 bytes there: parsing stops at the first that does not fit.
  write(path, manifest_of(head .. strings .. le(64, 8) .. ("\0"):rep(64)))
  takes(d, 4, "more bytes where", "64 tensors in 64 bytes")
  -- Everything parses, but a tensor's piece lies outside its shape: the shared validation.
  -- A piece: file 0, bytes 0..8, at [3] of size [2], CRC 0; a tensor "model/0.w", Float, shape
  -- [4], whole (dim -1, fused 1), with that one piece; one data file of 8 bytes; no generator.
  local piece = le(0, 4) .. le(0, 8) .. le(8, 8) .. le(1, 8) .. le(3, 8) .. le(1, 8) .. le(2, 8) .. le(0, 4)
  local tensors = le(1, 8) .. le(9, 8) .. "model/0.w" .. le(5, 8) .. "Float" .. le(1, 8) .. le(4, 8) ..
                  le(2 ^ 32 - 1, 4) .. le(1, 8) .. le(1, 8) .. piece
  local files = le(1, 8) .. le(14, 8) .. "rank-00000.bin" .. le(8, 8) .. le(0, 4)
  write(path, manifest_of(head .. strings .. tensors .. files .. le(0, 8)))
  takes(d, 4, "has tensor 'model/0.w' with a piece outside its shape [4]", "a piece outside its tensor")
end)

test("saving over a tag: a valid one is refused unless overwrite, a damaged one is set aside", function()
  local d = copy()
  local s = setup(1)
  pt.ckpt.resume(d, s)
  raises(function() pt.ckpt.save(d, { model = s.model, optim = s.optim, data = s.data, step = 6 }) end,
         "already holds a valid checkpoint; save with overwrite = true")
  takes(d, 6, nil, "the refused save changed nothing")
  train_step(s)
  local tag = pt.ckpt.save(d, { model = s.model, optim = s.optim, data = s.data, step = 6, overwrite = true })
  eq(tag, "step-00000006")
  local again = setup(3)
  pt.ckpt.load(d, "step-00000006", again)
  eq(again.optim:steps(), 7, "the overwritten tag holds the new state")
  ok(select(1, pt.ckpt.verify(d)), "the folder verifies after an overwrite")

  -- newest names a damaged step 6: the resume falls back to step 4, trains on, saves step 6.
  d = copy()
  flip(d .. "/step-00000006/rank-00000.bin", 7)
  local damaged = read(d .. "/step-00000006/rank-00000.bin")
  local r
  s = setup(1)
  r = pt.ckpt.resume(d, s)
  eq(r.tag, "step-00000004")
  for _ = 5, 6 do train_step(s) end
  pt.ckpt.save(d, { model = s.model, optim = s.optim, data = s.data, step = 6 })
  eq(read(d .. "/step-00000006~damaged/rank-00000.bin"), damaged, "the damaged tag is kept, as it was")
  takes(d, 6, nil, "the new step 6")
  local good, problems = pt.ckpt.verify(d)
  ok(good, "a folder with a set-aside tag verifies: " .. table.concat(problems, "\n"))
  eq(#pt.ckpt.tags(d), 3, "the set-aside folder is not a tag")
  -- Damaged twice: a second name.
  flip(d .. "/step-00000006/rank-00000.bin", 7)
  pt.ckpt.save(d, { model = s.model, optim = s.optim, data = s.data, step = 6 })
  ok(exists(d .. "/step-00000006~damaged-2/manifest.bin"), "a second damaged copy is kept under another name")
end)

test("planted links: a save writes through none of them", function()
  local d = copy()
  local victim = root .. "/victim-" .. n
  write(victim, "precious")
  sh("mkdir -p '" .. victim .. "-dir'")
  sh("ln -s '" .. victim .. "' '" .. d .. "/newest.tmp'")
  sh("ln -s '" .. victim .. "-dir' '" .. d .. "/.step-00000008.tmp'")
  sh("ln -s '" .. victim .. "-dir' '" .. d .. "/step-00000010'")
  local s = setup(1)
  pt.ckpt.resume(d, s)
  for _ = 7, 8 do train_step(s) end
  pt.ckpt.save(d, { model = s.model, optim = s.optim, data = s.data, step = 8 })
  eq(read(victim), "precious", "the file a link at newest.tmp points to")
  eq(io.popen("ls -A '" .. victim .. "-dir'"):read("*a"), "", "the folder a link at the scratch folder points to")
  eq(pt.ckpt.newest(d), "step-00000008")
  for _ = 9, 10 do train_step(s) end
  pt.ckpt.save(d, { model = s.model, optim = s.optim, data = s.data, step = 10 })
  eq(io.popen("ls -A '" .. victim .. "-dir'"):read("*a"), "", "the folder a link at the tag points to")
  ok(exists(d .. "/step-00000010~damaged"), "the link was set aside")
  local r = pt.ckpt.resume(d, setup(2))
  eq(r.tag, "step-00000010", "the save in place of the planted link")
  eq(#r.notes, 0, "and it is taken silently")
end)

test("tags: a safe alphabet; names ending in .old or .tmp are ordinary tags", function()
  local d = copy()
  local s = setup(1)
  pt.ckpt.resume(d, s)
  for _, bad in ipairs { "a\nb", "../x", ".hidden", "-x", "a/b", "newest", "a b", "", ("x"):rep(129) } do
    raises(function() pt.ckpt.save(d, { model = s.model, step = 1, tag = bad }) end, "bad checkpoint tag")
  end
  pt.ckpt.save(d, { model = s.model, optim = s.optim, data = s.data, step = 7, tag = "best.old" })
  pt.ckpt.save(d, { model = s.model, optim = s.optim, data = s.data, step = 7, tag = "best.tmp" })
  pt.ckpt.save(d, { model = s.model, optim = s.optim, data = s.data, step = 7, tag = "best" })
  pt.ckpt.save(d, { model = s.model, optim = s.optim, data = s.data, step = 8, tag = "best", overwrite = true })
  for _, tag in ipairs { "best.old", "best.tmp", "best" } do
    ok(select(1, pt.ckpt.verify(d .. "/" .. tag)), tag .. " survives saves of the others")
  end
end)

test("num_kept prunes the oldest valid tags and leaves one with a damaged manifest alone", function()
  local d = copy()
  flip(d .. "/step-00000002/manifest.bin", 50)
  local s = setup(1)
  pt.ckpt.resume(d, s)
  train_step(s)
  pt.ckpt.save(d, { model = s.model, optim = s.optim, data = s.data, step = 7, num_kept = 2 })
  local tags = pt.ckpt.tags(d)
  eq(table.concat(tags, " "), "step-00000006 step-00000007", "the valid tags kept")
  ok(not exists(d .. "/step-00000004"), "step 4 pruned")
  ok(exists(d .. "/step-00000002/manifest.bin"), "the damaged step 2 is kept")
end)

local status = H.run()
os.execute("rm -rf '" .. root .. "'")
return status
