-- Fuzzes the collectives and the tensor-parallel communication with seeded random tensors: shapes
-- of 0 to 4 dimensions (empty ones and scalars included), sizes 0 to 5, every dtype a script may
-- hand them, reductions, roots and dimensions in and out of range. Every rank draws the same cases
-- (a seeded Lua generator), so the ranks always agree and each case must either work or raise an
-- error naming this file's line; a crash or a hang ends the job, and the test with it. An
-- all-gather of an empty tensor killed the rank before (Gloo divides by the bytes a rank gives).
--   partrain --nproc-per-node 2 --threads 1 --timeout 20 tests/fuzz/fuzz_collectives.lua [--seed 1] [--cases 300]
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local cfg = pt.args { seed = 1, cases = 300, verbose = false }
local W = pt.dist.world()
local world = W:size()
local rng = H.rng(cfg.seed)
local pick = rng.pick

local DTYPES = { "float32", "float64", "bfloat16", "float16", "int64", "int32", "uint8", "bool" }
local function tensor()
  local dims = {}
  for _ = 1, rng.int(0, 4) do dims[#dims + 1] = rng.int(0, 5) end
  local dtype = pick(DTYPES)
  local t = pt.ones(dims, { dtype = "float32" }) * (pt.dist.rank() + 1)
  return t:to(dtype)
end
local function dim() return rng.int(-5, 5) end

local OPS = {
  function(t) return W:all_reduce(t, pick { "sum", "mean", "min", "max", "product", "avg", "xor" }) end,
  function(t) return W:broadcast(t, rng.int(-1, world)) end,
  function(t) return W:all_gather(t) end,
  function(t)
    local parts = {}
    for i = 1, rng.int(world - 1, world + 1) do parts[i] = t:clone() end
    return W:reduce_scatter(t:clone(), parts, pick { "sum", "max", "mean" })
  end,
  function(t) return W:all_gather_flat(t) end,
  function(t) return W:reduce_scatter_flat(t, pick { "sum", "mean" }) end,
  function(t) return pt.tp.copy_to(t, W) end,
  function(t) return pt.tp.reduce_from(t, W) end,
  function(t) return pt.tp.gather_from(t, W) end,
  function(t) return pt.tp.scatter_to(t, W) end,
  function(t) return pt.tp.gather_sequence(t, W) end,
  function(t) return pt.tp.reduce_scatter_sequence(t, W) end,
  function(t) return pt.tp.split_sequence(t, W) end,
  function(t) return pt.tp.dropout(t, pick { 0, 0.5, 1, -0.5 }, pick { true, false }, W, dim()) end,
  function(t) return pt.tp.shard(t, dim(), rng.int(-1, world), world) end,
}

local here = debug.getinfo(1, "S").short_src
local worked, refused, bad = 0, 0, {}
for case = 1, cfg.cases do
  local op = rng.int(1, #OPS)
  local t = tensor()
  local shape = ("%s %s"):format(tostring(t.dtype), table.concat(t.shape, "x"))
  if cfg.verbose then io.stderr:write(("case %d op %d %s\n"):format(case, op, shape)) end
  local ok, err = pcall(OPS[op], t)
  if ok then
    worked = worked + 1
  else
    refused = refused + 1
    -- A refusal names the line of this script that made the call.
    if not tostring(err):find(here, 1, true) then
      bad[#bad + 1] = ("case %d (op %d, %s): %s"):format(case, op, shape, tostring(err):sub(1, 200))
    end
  end
end
-- Every rank ran every case: the world still agrees.
local count = pt.tensor({ worked })
W:all_reduce(count, "sum")
assert(count:item() == world * worked, "the ranks' cases diverged")
print(("fuzz.collectives: seed %d, %d cases: %d worked, %d refused, %d refusals not naming the caller's line"):format(
  cfg.seed, cfg.cases, worked, refused, #bad))
for _, line in ipairs(bad) do print("  " .. line) end
if #bad > 0 then os.exit(1) end
