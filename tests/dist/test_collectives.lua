-- Collectives and the mesh from Lua, at 4 ranks: every operation's result on every rank, sync
-- and async, and the mesh's groups (expert groups included) against Megatron's layout formula.
--   partrain --nproc-per-node 4 tests/dist/test_collectives.lua
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local test, eq, near, raises, ok = H.test, H.eq, H.near, H.raises, H.ok

local rank, world = pt.dist.rank(), pt.dist.world_size()
local W = pt.dist.world()

test("all_reduce: sum, mean, min, max, product; in place; async", function()
  local expect = { sum = 0, min = 1, max = world, product = 1 }
  for r = 1, world do expect.sum = expect.sum + r; expect.product = expect.product * r end
  expect.mean = expect.sum / world
  for _, op in ipairs { "sum", "mean", "min", "max", "product" } do  -- the same order on every rank
    local want = expect[op]
    local t = pt.tensor({ rank + 1, rank + 1 })
    local same = W:all_reduce(t, op)
    ok(rawequal(same, t) or same:equal(t), "returns the tensor it reduced in place")
    near(t, { want, want }, 1e-6, op)
  end
  local t = pt.tensor({ rank + 1 })
  local work = W:all_reduce(t, "sum", { async = true })
  work:wait()
  ok(work:done())
  near(t, { expect.sum }, 1e-6, "async")
  raises(function() W:all_reduce(t, "median") end, "unknown reduce op 'median'")
end)

test("broadcast, all_gather, reduce_scatter, send/recv, barrier", function()
  local b = pt.tensor({ rank * 10 })
  W:broadcast(b, 2)
  near(b, { 20 }, 0, "broadcast from rank 2")
  local parts = W:all_gather(pt.tensor({ rank, rank * rank }))
  eq(#parts, world)
  for r = 0, world - 1 do near(parts[r + 1], { r, r * r }, 0, "part " .. r) end
  local later, work = W:all_gather(pt.tensor({ rank }), { async = true })
  work:wait()
  near(later[world], { world - 1 }, 0, "async all_gather")
  local inputs = {}
  for r = 0, world - 1 do inputs[r + 1] = pt.full({ 2 }, rank * 100 + r) end
  local out = pt.zeros(2)
  W:reduce_scatter(out, inputs, "sum")
  local want = 0
  for r = 0, world - 1 do want = want + r * 100 + rank end
  near(out, { want, want }, 0, "reduce_scatter gives this rank its slice of the sum")
  -- A ring: send to the next rank, receive from the previous one (even ranks send first).
  local next_rank, prev = (rank + 1) % world, (rank - 1) % world
  local got = pt.zeros(1)
  if rank % 2 == 0 then
    W:send(pt.tensor({ rank }), next_rank); W:recv(got, prev)
  else
    W:recv(got, prev); W:send(pt.tensor({ rank }), next_rank)
  end
  near(got, { prev }, 0, "received from the previous rank")
  W:barrier()
  W:barrier({ async = true }):wait()
  raises(function() W:broadcast(b, world) end, "root " .. world .. " is not a group rank")
  raises(function() W:reduce_scatter(out, { out }) end, "needs " .. world .. " inputs (one a rank), got 1")
  raises(function() W:send(b, rank) end, "bad destination")
end)

-- Point to point carries no description of its data: a smaller send had partly filled the
-- receiving tensor and one of another dtype with as many bytes had been reinterpreted, exit 0.
test("a send and its recv that disagree in dtype or element count are refused on the receiving rank, async too", function()
  local peer = rank % 2 == 0 and rank + 1 or rank - 1  -- pairs (0, 1), (2, 3): even ranks send
  if peer >= world then return end
  if rank % 2 == 0 then
    W:send(pt.tensor({ 1, 2, 3, 4 }):double(), peer)  -- 32 bytes, as many as 8 float32
    W:send(pt.tensor({ 1, 2, 3, 4 }), peer)
    W:send(pt.tensor({ 0, 1, 2, 3, 4, 5 }), peer)
    W:send(pt.tensor({ 5, 6 }), peer, { async = true }):wait()
  else
    raises(function() W:recv(pt.zeros(8), peer) end, "it sent 4 float64 elements; this tensor holds 8 float32")
    raises(function() W:recv(pt.zeros(6), peer) end, "it sent 4 float32 elements; this tensor holds 6 float32")
    local grid = W:recv(pt.zeros({ 2, 3 }), peer)
    near(grid, { { 0, 1, 2 }, { 3, 4, 5 } }, 0, "6 elements received as 2 x 3: shapes may differ")
    local work = W:recv(pt.zeros(3), peer, { async = true })
    raises(function() work:wait() end, "it sent 2 float32 elements; this tensor holds 3 float32")
  end
  W:barrier()
end)

-- The flat reduce-scatter and all-gather (a ring on Gloo) against all-reduce-then-slice and
-- all_gather, on the world (4 ranks) and on groups of 2, for sum and mean, three dtypes, and
-- lengths that are not a multiple of the group (padded, as ZeRO pads its buckets).
test("collectives of empty tensors give empty tensors (an all-gather of one killed the rank)", function()
  local parts = W:all_gather(pt.ones({ 0, 4 }))
  eq(#parts, world, "one part a rank")
  for i, p in ipairs(parts) do eq(p.shape[1], 0, "part " .. i .. " is empty"); eq(p.shape[2], 4, "and keeps its width") end
  eq(pt.tp.gather_from(pt.ones({ 2, 0, 4 }), W).shape[3], 4 * world, "pt.tp.gather_from of an empty batch")
  local e = pt.ones({ 0 })
  W:all_reduce(e); W:broadcast(e, 0)
  eq(e:numel(), 0, "all_reduce and broadcast leave it empty")
end)

test("reduce_scatter_flat and all_gather_flat equal all_reduce then slice", function()
  local pairs_group = pt.mesh { tensor = 2 }:group("tensor")
  for _, g in ipairs { W, pairs_group } do
    local p, r = g:size(), g:rank()
    for _, dtype in ipairs { "float32", "float64", "bfloat16" } do
      for _, n in ipairs { 1, 7, 13 } do
        local padded = math.ceil(n / p) * p
        for _, op in ipairs { "sum", "mean" } do
          pt.manual_seed(100 + rank + n)
          local flat = pt.zeros(padded):to(dtype)
          flat:narrow(0, 0, n):copy_(pt.randn(n):to(dtype))
          local whole = flat:to("float64"):clone()  -- the reference
          g:all_reduce(whole, op)
          local direct = flat:clone()  -- bfloat16 on Gloo: reduced by the rings
          g:all_reduce(direct, op)
          near(direct:to("float64"), whole, dtype == "bfloat16" and 2e-2 or 1e-6, "all_reduce " .. dtype)
          -- Left in flight (one all-to-all on Gloo): the part holds the reduction once waited for.
          local copy = flat:clone()
          local later, work = g:reduce_scatter_flat(copy, op, { async = true })
          work:wait()
          local part = g:reduce_scatter_flat(flat, op)
          eq(part.shape[1], padded / p, "part length")
          eq(later.shape[1], padded / p, "part length (async)")
          local want = whole:narrow(0, r * padded / p, padded / p)
          local tol = dtype == "bfloat16" and 2e-2 or (dtype == "float32" and 1e-6 or 1e-12)
          near(part:to("float64"), want:to("float64"), tol, g:name() .. " " .. dtype .. " n=" .. n .. " " .. op)
          near(later:to("float64"), want:to("float64"), tol, g:name() .. " " .. dtype .. " n=" .. n .. " " .. op .. " async")
          -- All-gather the parts back: every rank ends with the whole reduction's own parts.
          g:all_gather_flat(flat)
          local mine = flat:narrow(0, r * padded / p, padded / p)
          ok(mine:equal(part), "own part kept")
          local ref = g:all_gather(part:to("float64"))
          local same = g:all_gather(part:clone())  -- bfloat16 moved as its bytes
          for q = 0, p - 1 do ok(same[q + 1]:to("float64"):equal(ref[q + 1]), "all_gather " .. dtype) end
          local b = part:clone()
          g:broadcast(b, p - 1)
          ok(b:to("float64"):equal(ref[p]), "broadcast " .. dtype)
          for q = 0, p - 1 do
            ok(flat:narrow(0, q * padded / p, padded / p):to("float64"):equal(ref[q + 1]), "part " .. q .. " gathered")
          end
        end
      end
    end
  end
  -- min and max, in flight: every rank's part r combined.
  for _, op in ipairs { "min", "max" } do
    local flat = pt.tensor({ 1, 2, 3, 4, 5, 6, 7, 8 }):narrow(0, 0, world * 2):contiguous() * (rank + 1)
    local part, work = W:reduce_scatter_flat(flat, op, { async = true })
    work:wait()
    local k = op == "min" and 1 or world
    near(part, { (2 * rank + 1) * k, (2 * rank + 2) * k }, 0, op .. " in flight")
  end
  raises(function() W:reduce_scatter_flat(pt.zeros(world + 1)) end, "length is a multiple of " .. world)
  raises(function() W:reduce_scatter_flat(pt.zeros(world + 1), "sum", { async = true }) end, "length is a multiple of " .. world)
  raises(function() W:all_gather_flat(pt.zeros(2, world)) end, "needs a flat tensor")
end)

-- Context parallelism's exchanges on groups of 2, 3 and 4 ranks. Every rank makes every group, in
-- the same order, and gets nil for those it is not in: {0,1} and {2,3} (every rank in one),
-- {3,1,2} (rank 0 outside; group ranks in another order than the global ones) and the world.
local exchange
local function exchange_groups()
  if exchange then return exchange end
  local pair_a, pair_b = pt.dist.new_group({ 0, 1 }), pt.dist.new_group({ 2, 3 })
  local three = pt.dist.new_group({ 3, 1, 2 }, "three")
  exchange = { pair_a or pair_b }
  if three then exchange[#exchange + 1] = three end
  exchange[#exchange + 1] = W
  return exchange
end

test("send_recv: a ring at 2, 3 and 4 ranks gives each rank its previous rank's tensor", function()
  for _, g in ipairs(exchange_groups()) do
    local c, r, members = g:size(), g:rank(), g:ranks()
    local next_rank, prev = (r + 1) % c, (r - 1) % c  -- at c = 2 the same peer both ways
    g:reset_traffic()
    local sent = 0
    for _, dtype in ipairs { "float32", "bfloat16", "int64", "float64" } do
      for step = 1, 2 do  -- messages on one channel arrive in order
        local out = (pt.arange(6):view({ 2, 3 }) + 100 * rank + 10 * step):to(dtype)
        local into = pt.zeros({ 2, 3 }):to(dtype)
        local same = g:send_recv(out, next_rank, into, prev)
        ok(rawequal(same, into) or same:equal(into), "returns the tensor received into")
        local from = members[prev + 1]  -- the sender's global rank
        near(into:double(), (pt.arange(6):view({ 2, 3 }) + 100 * from + 10 * step):to(dtype):double(), 0,
             g:name() .. " " .. dtype .. " step " .. step .. ": from group rank " .. prev)
        sent = sent + out:numel() * ({ float32 = 4, bfloat16 = 2, int64 = 8, float64 = 8 })[dtype]
      end
    end
    -- Another tag is another channel; the shapes may differ (6 elements received as 3 x 2).
    local got = g:send_recv(pt.full({ 6 }, rank), next_rank, pt.zeros({ 3, 2 }), prev, 5)
    near(got, pt.full({ 3, 2 }, members[prev + 1]), 0, g:name() .. " on tag 5")
    sent = sent + 24
    local traffic = g:traffic().send_recv
    eq(traffic.calls, 9, g:name() .. ": send_recv calls counted")
    eq(traffic.bytes, sent, g:name() .. ": send_recv counts the bytes this rank sent")
    eq(g:traffic().send, nil, "a send_recv is not also counted as a send")
    -- The receiving side refuses what disagrees with its tensor, after the exchange.
    raises(function() g:send_recv(pt.ones(4), next_rank, pt.zeros(6), prev) end,
           "send_recv from group rank " .. prev .. " on group '" .. g:name() .. "'")
    raises(function() g:send_recv(pt.ones(4):double(), next_rank, pt.zeros(8), prev) end,
           "it sent 4 float64 elements; this tensor holds 8 float32")
    -- Bad peers are refused at the entry, naming the group, the op and the script's line.
    local e = raises(function() g:send_recv(pt.ones(1), r, pt.zeros(1), prev) end,
                     "send_recv on group '" .. g:name() .. "' (ranks " .. table.concat(members, ",") ..
                     "): bad destination " .. r .. " (expected another group rank than this one")
    ok(e:find("test_collectives.lua:%d+"), "the refusal names the script's line: " .. e)
    raises(function() g:send_recv(pt.ones(1), c, pt.zeros(1), prev) end, "bad destination " .. c)
    raises(function() g:send_recv(pt.ones(1), next_rank, pt.zeros(1), -1) end, "bad source -1")
    raises(function() g:send_recv(pt.ones(2, 2):t(), next_rank, pt.zeros(4), prev) end, "must be contiguous")
    raises(function() g:send_recv(pt.ones(1), next_rank, pt.zeros(1), prev, -2) end, "tag must be in [0, 2^24)")
  end
  W:barrier()
end)

test("all_to_all: slice j of rank r's tensor lands in slice r on rank j, at 2, 3 and 4 ranks", function()
  for _, g in ipairs(exchange_groups()) do
    local c, r = g:size(), g:rank()
    g:reset_traffic()
    for _, dtype in ipairs { "float32", "bfloat16", "int64" } do
      -- (c * 2, 3): slice j (rows 2j, 2j+1) holds 8 * r + j in the row's first element, then the
      -- row's index and its column (small integers: exact in bfloat16).
      local function slices(first, second)
        local rows = {}
        for j = 0, c - 1 do
          for row = 0, 1 do rows[#rows + 1] = { 8 * first(j) + second(j), row, 2 } end
        end
        return pt.tensor(rows):to(dtype)
      end
      local t = slices(function() return r end, function(j) return j end)
      local got = g:all_to_all(t)
      ok(not rawequal(got, t), "a new tensor")
      eq(got.dtype, t.dtype, "the input's dtype")
      near(got:double(), slices(function(j) return j end, function() return r end):double(), 0,
           g:name() .. " " .. dtype .. ": slice j from group rank j")
    end
    local traffic = g:traffic().all_to_all
    eq(traffic.calls, 3, g:name() .. ": all_to_all calls counted")
    eq(traffic.bytes, c * 2 * 3 * (4 + 2 + 8), g:name() .. ": all_to_all counts the input's bytes")
    local empty = g:all_to_all(pt.zeros({ 0, 4 }))
    eq(empty.shape[1] .. "x" .. empty.shape[2], "0x4", "an empty tensor stays empty")
    raises(function() g:all_to_all(pt.zeros(c + 1)) end, "needs a tensor whose dim 0 is a multiple of " .. c)
    raises(function() g:all_to_all(pt.ones(2 * c, 2):t()) end, "all_to_all on group '" .. g:name())
  end
end)

test("all_to_all with row counts: rank r's rows for j land on j in rank order, counts exchanged first", function()
  for _, g in ipairs(exchange_groups()) do
    local c, r = g:size(), g:rank()
    g:reset_traffic()
    -- Rank r sends (r + j) % 3 rows to rank j: some ranks send or receive none. Each row holds
    -- (sender, receiver, index within the pair).
    local rows, counts = {}, {}
    for j = 0, c - 1 do
      counts[j + 1] = (r + j) % 3
      for i = 0, counts[j + 1] - 1 do rows[#rows + 1] = { r, j, i } end
    end
    local t = #rows > 0 and pt.tensor(rows, { dtype = "float64" }) or pt.zeros({ 0, 3 }, { dtype = "float64" })
    local got, arrived = g:all_to_all(t, counts)
    local want, want_counts = {}, {}
    for j = 0, c - 1 do
      want_counts[j + 1] = (j + r) % 3
      for i = 0, want_counts[j + 1] - 1 do want[#want + 1] = { j, r, i } end
    end
    eq(table.concat(arrived, ","), table.concat(want_counts, ","), g:name() .. ": the counts that arrived")
    eq(got.shape[1], #want, g:name() .. ": rows arrived")
    if #want > 0 then near(got, want, 0, g:name() .. ": each sender's rows, in rank order") end
    local traffic = g:traffic().all_to_all
    eq(traffic.calls, 2, g:name() .. ": the counts, then the rows")
    eq(traffic.bytes, c * 8 + #rows * 3 * 8, g:name() .. ": the input's bytes, counts included")
    raises(function() g:all_to_all(pt.zeros({ 2, 3 }), { 1 }) end, "needs one count a rank (" .. c .. ")")
    local bad = {}
    for j = 1, c do bad[j] = 1 end
    raises(function() g:all_to_all(pt.zeros({ 1, 3 }), bad) end, "in_splits sum to " .. c .. " rows, but the tensor has 1")
  end
end)

test("a group of one exchanges with itself", function()
  local solo = pt.dist.new_group({ rank }, "solo")
  eq(solo:size(), 1)
  local got = solo:send_recv(pt.tensor({ 1, 2, 3, 4 }), 0, pt.zeros({ 2, 2 }), 0)
  near(got, { { 1, 2 }, { 3, 4 } }, 0, "send_recv copies into the tensor received into")
  near(solo:all_to_all(pt.tensor({ 5, 6 })), { 5, 6 }, 0, "all_to_all returns a copy")
  local rows, counts = solo:all_to_all(pt.tensor({ { 1, 2 }, { 3, 4 } }), { 2 })
  near(rows, { { 1, 2 }, { 3, 4 } }, 0, "all_to_all with row counts returns a copy")
  eq(counts[1], 2, "... and the count that arrived")
  raises(function() solo:send_recv(pt.ones(1), 1, pt.zeros(1), 0) end, "(a group of one has only group rank 0)")
  raises(function() solo:send_recv(pt.ones(2), 0, pt.zeros(3), 0) end,
         "it sends 2 float32 elements to itself; the tensor received into holds 3 float32")
  eq(next(solo:traffic()), nil, "a group of one moves nothing")
  local named = pt.dist.new_group({ 0, 1 }, "pair")
  eq(named and named:name() or "pair", "pair", "a group made with a name has it")
  eq(pt.dist.new_group({ 0, 1 }) and "made" or nil, rank < 2 and "made" or nil, "nil on the ranks outside it")
  raises(function() pt.dist.new_group({ 0, world }) end, "rank " .. world .. " is outside the world of " .. world)
  raises(function() pt.dist.new_group(0) end, "table of ranks expected, got number")
  raises(function() pt.dist.new_group({ 1, 1 }) end, "rank 1 is listed twice")
end)

test("the mesh follows Megatron's layout and its groups agree with it", function()
  local mesh = pt.mesh { tensor = 2 }
  local c = mesh:coord()
  eq(rank, c.tensor + 2 * (c.data + 2 * c.pipeline), "rank = tensor + T * (data + D * pipeline)")
  eq(mesh:size("tensor"), 2); eq(mesh:size("data"), world / 2); eq(mesh:size("pipeline"), 1)
  eq(table.concat(mesh:group("tensor"):ranks(), ","), table.concat(mesh:ranks("tensor"), ","))
  eq(table.concat(mesh:ranks("tensor", 3), ","), "2,3", "tensor neighbours are adjacent")
  eq(table.concat(mesh:ranks("data", 1), ","), "1,3", "data groups stride by the tensor size")
  eq(table.concat(mesh:ranks("unit", 2), ","), "2,3", "a unit is one tensor x pipeline replica")
  -- A group's collective involves exactly its members.
  local t = pt.tensor({ rank })
  mesh:group("tensor"):all_reduce(t)
  local first = rank - rank % 2
  near(t, { first + first + 1 }, 0, "tensor-group sum")
  eq(mesh:size("zero"), 1, "zero unset: off, zero groups of one")
  raises(function() pt.mesh { tensor = 3 } end, "tensor=3 x pipeline=1 = 3 does not divide the world of " .. world)
  -- Zero groups: n consecutive data ranks; <= 0 the whole data group; one not dividing data is refused.
  local z = pt.mesh { zero = 0 }
  eq(z:size("zero"), world, "zero = 0: the whole data group")
  eq(table.concat(pt.mesh { tensor = 2, zero = 2 }:ranks("zero", 1), ","), "1,3", "zero groups follow the data groups")
  local e = raises(function() pt.mesh { zero = 3 } end, "zero=3 does not divide the data size " .. world)
  ok(e:find("test_collectives.lua:%d+"), "the refusal names the script's line: " .. e)
  raises(function() pt.mesh { tensr = 2 } end, "unknown option 'tensr' for mesh")
  raises(function() mesh:group("experts") end, "unknown group kind 'experts'")
end)

test("a context dimension sits just outside tensor and data_context joins data across it", function()
  local mesh = pt.mesh { context = 2 }
  local c = mesh:coord()
  eq(rank, c.tensor + 1 * (c.context + 2 * (c.data + (world / 2) * c.pipeline)),
    "rank = tensor + T * (context + C * (data + D * pipeline))")
  eq(c.tensor, 0); eq(c.context, rank % 2, "context fastest without tensor"); eq(c.data, math.floor(rank / 2))
  eq(mesh:size("context"), 2); eq(mesh:size("data"), world / 2, "data defaults to world / (T x C x P)")
  eq(mesh:size("data_context"), world, "data_context: every data x context rank of one tensor and pipeline place")
  eq(mesh:size("unit"), 2, "a unit is tensor x context x pipeline")
  eq(table.concat(mesh:ranks("context", 3), ","), "2,3", "context neighbours are adjacent")
  eq(table.concat(mesh:ranks("data", 1), ","), "1,3", "data groups stride by T x C")
  local everyone = {}
  for r = 0, world - 1 do everyone[#everyone + 1] = r end
  eq(table.concat(mesh:group("data_context"):ranks(), ","), table.concat(everyone, ","))
  eq(table.concat(mesh:group("context"):ranks(), ","), table.concat(mesh:ranks("context"), ","))
  -- The context group's collective involves its pair only.
  local t = pt.tensor({ rank })
  mesh:group("context"):all_reduce(t)
  local first = rank - rank % 2
  near(t, { first + first + 1 }, 0, "context-group sum")
  ok(tostring(mesh):find("context=2", 1, true)
    and tostring(mesh):find("data_context: ranks " .. table.concat(everyone, ","), 1, true),
    "print(mesh) shows the context size and the data_context group: " .. tostring(mesh))
  -- Zero groups are consecutive parts of data_context; a size not dividing data x context is refused.
  eq(table.concat(pt.mesh { context = 2, zero = 2 }:ranks("zero", 1), ","), "0,1", "zero = 2: one data rank's context pair")
  eq(pt.mesh { context = 2, zero = 0 }:size("zero"), world, "zero = 0: all of data_context")
  raises(function() pt.mesh { context = 2, zero = 3 } end,
    ("zero=3 does not divide data x context = %d x 2 = %d"):format(world / 2, world))
  raises(function() pt.mesh { tensor = 3, context = 2 } end,
    "tensor=3 x context=2 x pipeline=1 = 6 does not divide the world of " .. world)
  -- Without context the coordinate is 0 and data_context is the data group.
  local plain = pt.mesh { tensor = 2 }
  eq(plain:coord().context, 0); eq(plain:size("context"), 1)
  eq(table.concat(plain:ranks("data_context"), ","), table.concat(plain:ranks("data"), ","))
end)

test("expert groups split data_context: consecutive expert ranks, strided expert_data", function()
  local mesh = pt.mesh { expert = 2 }
  local c = mesh:coord()
  eq(c.expert, rank % 2, "expert = this rank's place in its expert group")
  eq(mesh:size("expert"), 2); eq(mesh:size("expert_data"), world / 2); eq(mesh:size("data"), world, "data unchanged")
  eq(table.concat(mesh:group("expert"):ranks(), ","), table.concat(mesh:ranks("expert"), ","))
  eq(table.concat(mesh:group("expert_data"):ranks(), ","), table.concat(mesh:ranks("expert_data"), ","))
  eq(table.concat(mesh:ranks("expert", 3), ","), "2,3", "expert ranks are consecutive data ranks")
  eq(table.concat(mesh:ranks("expert_data", 1), ","), "1,3", "expert_data strides by the expert size")
  -- Each group's collective involves exactly its members.
  local t = pt.tensor({ rank })
  mesh:group("expert"):all_reduce(t)
  local first = rank - rank % 2
  near(t, { first + first + 1 }, 0, "expert-group sum")
  local same, want = pt.tensor({ rank }), 0
  for r = rank % 2, world - 1, 2 do want = want + r end
  mesh:group("expert_data"):all_reduce(same)
  near(same, { want }, 0, "expert_data-group sum: the ranks holding the same experts")
  ok(tostring(mesh):find("expert=2", 1, true) and tostring(mesh):find("expert_data: ranks", 1, true),
    "print(mesh) shows the expert size and groups: " .. tostring(mesh))
  -- With tensor, expert_tensor joins the tensor groups of an expert group.
  local both = pt.mesh { tensor = 2, expert = 2 }
  eq(table.concat(both:ranks("expert", 1), ","), "1,3", "expert groups keep the tensor coordinate")
  eq(both:size("expert_tensor"), 4)
  local all = pt.tensor({ rank })
  both:group("expert_tensor"):all_reduce(all)
  near(all, { world * (world - 1) / 2 }, 0, "expert_tensor-group sum")
  -- Across context too: expert splits data x context.
  eq(pt.mesh { context = 2, expert = world }:size("expert"), world, "expert = data x context")
  -- Unsplit: expert_data is data_context, and print(mesh) reads as before.
  local plain = pt.mesh { context = 2 }
  eq(plain:coord().expert, 0); eq(plain:size("expert"), 1)
  eq(table.concat(plain:group("expert_data"):ranks(), ","), table.concat(plain:group("data_context"):ranks(), ","))
  ok(not tostring(plain):find("expert", 1, true), "no expert text while unsplit: " .. tostring(plain))
  local e = raises(function() pt.mesh { expert = 3 } end,
    ("expert=3 does not divide data x context = %d (expert ranks are data ranks"):format(world))
  ok(e:find("test_collectives.lua:%d+"), "the refusal names the script's line: " .. e)
  raises(function() pt.mesh { context = 2, expert = 3 } end,
    ("expert=3 does not divide data x context = %d x 2 = %d"):format(world / 2, world))
end)

test("sharded loaders give the ranks of one unit the same slice", function()
  local mesh = pt.mesh { tensor = 2 }
  local data = pt.data.mnist { batch = 8, seed = 3, mesh = mesh }
  local _, y = data:next()
  eq(y.shape[1], 8 / mesh:size("data"))
  local parts = mesh:group("tensor"):all_gather(y)
  ok(parts[1]:equal(parts[2]), "tensor peers read the same samples")
  local across = mesh:group("data"):all_gather(y)
  ok(not across[1]:equal(across[2]), "data peers read different samples")
end)

H.run()
