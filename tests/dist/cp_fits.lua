-- A GPT-2 trained on long random sequences, each split over the world's ranks as context ranks
-- (one rank: the whole sequence in one process), for tests/dist/test_cp_fits.py.
--   partrain --nproc-per-node 4 --threads 1 tests/dist/cp_fits.lua --seq 2048 --report DIR
-- DIR/rank<N>.json holds the process's peak address space (VmPeak, what RLIMIT_AS bounds) and
-- the bytes LibTorch's allocator held at most during the last step above what it began with.
local pt = require "partrain"
local cfg = pt.args {
  vocab = 256, seq = 2048, dim = 64, heads = 4, layers = 24,
  batch = 1,           -- sequences a step
  mode = "ring",       -- how attention is split: ring or all_to_all
  steps = 2,
  report = "",         -- a folder for each rank's measurements
}
local c = pt.dist.world_size()
local mesh = pt.mesh { context = c }
local group = mesh:group("context")
pt.manual_seed(1)
-- The fused attention kernel keeps O(T) bytes a layer, as the ring does.
local model = pt.models.gpt2 { vocab = cfg.vocab, seq = cfg.seq, dim = cfg.dim, heads = cfg.heads, layers = cfg.layers,
                               flash_attention = true }
model = pt.parallelize(model, "policies.gpt2", mesh, c > 1 and { context = cfg.mode } or nil)
local opt = pt.optim.adamw(model, { lr = 1e-3 })
local activations = 0
for _ = 1, cfg.steps do
  local tokens = pt.randint(0, cfg.vocab, { cfg.batch, cfg.seq + 1 })
  pt.dist.world():broadcast(tokens, 0)
  local x, y = tokens:narrow(1, 0, cfg.seq):contiguous(), tokens:narrow(1, 1, cfg.seq):contiguous()
  x, y = pt.cp.split(x, group), pt.cp.split(y, group)  -- this rank's chunks (B, T / c)
  local before = pt.memory().allocated
  pt.reset_peak_memory()
  model:train_step(x, y)
  activations = pt.memory().allocated_peak - before
  opt:step()
  opt:zero_grad()
end

if cfg.report ~= "" then
  local status = io.open("/proc/self/status")
  local vm_peak = tonumber(status:read("*a"):match("VmPeak:%s*(%d+)")) * 1024
  status:close()
  local f = assert(io.open(("%s/rank%d.json"):format(cfg.report, pt.dist.rank()), "w"))
  f:write(('{"context": %d, "seq": %d, "activations": %d, "vm_peak": %d}\n'):format(c, cfg.seq, activations, vm_peak))
  f:close()
end
