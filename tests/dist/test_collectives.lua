-- Collectives and the mesh from Lua, at 4 ranks: every operation's result on every rank, sync
-- and async, and the mesh's groups against Megatron's layout formula.
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
  raises(function() mesh:group("expert") end, "unknown group kind 'expert'")
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
