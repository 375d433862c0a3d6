-- GPT-2 on the Bible corpus with checkpoints, for the checkpoint tests (tests/ckpt/test_ckpt.py).
-- Prints every step's global loss exactly ("step N loss X" with 9 significant digits) and, with
-- --export, writes the final logical weights as .safetensors.
local pt = require "partrain"

local cfg = pt.args {
  steps = 20, tensor = 1, batch = 8, seq = 32, dim = 64, heads = 4, layers = 2, vocab = 255,
  ckpt = "", save_every = 0, full = false, num_kept = 0,
  stop_after = 0,          -- end the run after this many steps (as if it were interrupted)
  export = "",             -- write the final weights here (.safetensors)
  import = "",             -- start from these weights (.safetensors) instead of the seed's
  corpus = "data/kjv.txt",
  die_at = 0, die_rank = 0, -- on the first start only, this rank kills itself (kill -9) at this step
  die_always = false,       -- ... on every start, not only the first
  say_all = false,          -- every rank says where it resumed (rank 0 only by default)
}
pt.set_threads(1)
pt.manual_seed(1)
local mesh = pt.mesh { tensor = cfg.tensor }
if pt.dist.rank() == 0 then print(("start %d"):format(pt.dist.restart_count())) end
local model = pt.models.gpt2 { vocab = cfg.vocab, seq = cfg.seq, dim = cfg.dim, heads = cfg.heads, layers = cfg.layers }
model = pt.parallelize(model, nil, mesh)
if cfg.import ~= "" then pt.ckpt.import_safetensors(model, cfg.import) end
local loss_of = pt.loss_fn(model)
local data = pt.data.text { path = cfg.corpus, seq = cfg.seq, batch = cfg.batch, seed = 7, mesh = mesh }
local opt = pt.optim.adamw(model, { lr = 3e-3, weight_decay = 0.1, clip_grad_norm = 1.0,
  schedule = { kind = "cosine", warmup = 3, total = math.max(cfg.steps, 4) } })

local first = 1
if cfg.ckpt ~= "" then
  local r = pt.ckpt.resume(cfg.ckpt, { model = model, optim = opt, data = data })
  if r then
    first = r.step + 1
    if pt.dist.rank() == 0 or cfg.say_all then
      print(("resumed %s at step %d user %s"):format(r.tag, r.step, tostring(r.user.note)))
    end
  end
end
for step = first, cfg.steps do
  if step == cfg.die_at and pt.dist.rank() == cfg.die_rank and (cfg.die_always or pt.dist.restart_count() == 0) then
    os.execute("kill -9 $PPID")  -- the shell's parent: this rank
  end
  local x, y = data:next()
  local loss = loss_of(model(x), y)
  opt:zero_grad()
  loss:backward()
  opt:step()
  local global = loss:detach():clone()
  mesh:group("data"):all_reduce(global, "mean")
  if pt.dist.rank() == 0 then print(("step %d loss %.9g"):format(step, global:item())) end
  if cfg.ckpt ~= "" and cfg.save_every > 0 and step % cfg.save_every == 0 then
    pt.ckpt.save(cfg.ckpt, { model = model, optim = opt, data = data, step = step, full = cfg.full,
                             num_kept = cfg.num_kept, user = { note = "step " .. step } })
  end
  if step == cfg.stop_after then break end
end
if cfg.export ~= "" then pt.ckpt.export_safetensors(model, cfg.export) end
