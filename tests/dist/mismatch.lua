-- Ranks that disagree on a collective, one way per --mode; run by test_mismatch.py at 2 ranks.
-- Unchecked, pt.dist's blocking calls refuse any but a skip, async ones end clearly (never SIGABRT);
-- with --check-collectives every case is refused naming each rank's call and line.
local pt = require "partrain"
local mode = arg[1]
local W = pt.dist.world()
local r = pt.dist.rank()
local results = {}

if mode == "size" then
  local t = pt.ones(r == 0 and 4 or 1000)
  W:all_reduce(t)                                     -- line 12
elseif mode == "dtype" then
  local t = r == 0 and pt.ones(4) or pt.ones(4):double()
  W:all_reduce(t)                                     -- line 15
elseif mode == "shape" then  -- the same element count, another shape
  local t = r == 0 and pt.ones(2, 3) or pt.ones(3, 2)
  W:all_reduce(t)                                     -- line 18
elseif mode == "op" then
  local t = pt.ones(4) * (r + 1)
  W:all_reduce(t, r == 0 and "sum" or "max")          -- line 21
elseif mode == "skip" then  -- rank 1 skips the first call and makes it up after the second
  local a, b = pt.ones(4), pt.ones(4) * 10
  if r == 0 then W:all_reduce(a) end                  -- line 24
  W:all_reduce(b)                                     -- line 25
  if r == 1 then W:all_reduce(a) end                  -- line 26
  results = { a:sum():item(), b:sum():item() }
elseif mode == "gather" then
  W:all_gather(pt.ones(r == 0 and 3 or 5))            -- line 29
elseif mode == "root" then
  W:broadcast(pt.ones(3), r)                          -- line 31
elseif mode == "library" then  -- a collective inside partrain's own Lua (pt.tp.gather) is named by the user's line
  local model = pt.models.mlp { sizes = { 4, 8, 2 } }
  local mesh = pt.mesh { tensor = 2 }
  pt.parallelize(model, nil, mesh)
  local name = "0.weight"
  if r == 0 then pt.tp.gather(model, name) else mesh:group("tensor"):barrier() end -- line 37
elseif mode == "size_async" then  -- async calls are not checked: Gloo's own failure must still be clear
  local t = pt.ones(r == 0 and 4 or 1000)
  W:all_reduce(t, { async = true }):wait()            -- line 40
elseif mode == "flat_op" then  -- the flat reduce-scatter's op had been left out of the comparison
  W:reduce_scatter_flat(pt.ones(4) * (r + 1), r == 0 and "sum" or "max") -- line 42
elseif mode == "scatter_vs_reduce" then  -- the same bytes moved, but another call: had passed as the same all-reduce
  if r == 0 then W:reduce_scatter(pt.zeros(2), { pt.ones(2), pt.ones(2) }) else W:all_reduce(pt.ones(2, 2)) end -- line 44
else
  error("unknown mode " .. tostring(mode))
end
print("finished " .. mode .. " " .. table.concat(results, " "))
