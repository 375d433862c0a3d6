-- Tensor parallelism is serial computation: under the launcher (2 or 4 ranks, tensor = world),
-- each case builds a sharded model from a serial copy's weights and compares forward outputs,
-- gradients (against the matching slices of the serial gradients) and losses over training steps
-- with the serial model run beside it, within 1e-5 (relative, fp32).
--   partrain --nproc-per-node 2 tests/dist/test_tp.lua
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local test, near, eq, ok, raises = H.test, H.near, H.eq, H.ok, H.raises

local mesh = pt.mesh { tensor = pt.dist.world_size() }
local group = mesh:group("tensor")
local t, r = group:size(), group:rank()
local TOL = 1e-5

-- Rank r's slice of `full` along `dim` (of t equal parts).
local function part(full, dim) return pt.tp.shard(full, dim, r, t) end
-- For a fused weight (k parts along dim 0): rank r's slice of every part, stacked.
local function fused_part(full, k)
  local pieces = {}
  for i, piece in ipairs(full:chunk(k, 0)) do pieces[i] = part(piece, 0) end
  return pt.cat(pieces, 0)
end

test("column- then row-parallel MLP equals the serial one: outputs, gradients, 10 steps", function()
  pt.manual_seed(1)
  local serial = pt.nn.Sequential(pt.nn.Linear(8, 16), pt.nn.ReLU(), pt.nn.Linear(16, 4))
  local sharded = pt.nn.Sequential(pt.tp.column(serial:get("0"), group), pt.nn.ReLU(),
                                   pt.tp.row(serial:get("2"), group))
  eq(table.concat(sharded:get("0").weight.shape, ","), (16 / t) .. ",8", "column layer holds out/t rows")
  eq(table.concat(sharded:get("2").weight.shape, ","), "4," .. (16 / t), "row layer holds in/t columns")
  local so, po = pt.optim.sgd(serial, { lr = 0.1, momentum = 0.9 }), pt.optim.sgd(sharded, { lr = 0.1, momentum = 0.9 })
  for step = 1, 10 do
    local x = pt.randn(5, 8)
    group:broadcast(x, 0)                 -- tensor peers see the same input
    local ys, yp = serial(x), sharded(x)
    near(yp, ys, TOL, "forward at step " .. step)
    local ls, lp = (ys ^ 2):mean(), (yp ^ 2):mean()
    ls:backward(); lp:backward()
    if step == 1 then
      near(sharded:get("0").weight.grad, part(serial:get("0").weight.grad, 0), TOL, "column weight grad")
      near(sharded:get("0").bias.grad, part(serial:get("0").bias.grad, 0), TOL, "column bias grad")
      near(sharded:get("2").weight.grad, part(serial:get("2").weight.grad, 1), TOL, "row weight grad")
      near(sharded:get("2").bias.grad, serial:get("2").bias.grad, TOL, "row bias grad (whole)")
    end
    so:step(); so:zero_grad(); po:step(); po:zero_grad()
  end
  near(sharded:get("2").weight, part(serial:get("2").weight, 1), TOL, "row weights after 10 steps")
end)

test("a fused q, k, v column split keeps each head's q, k and v on one rank", function()
  pt.manual_seed(2)
  local serial = pt.nn.Linear(6, 3 * 8)
  local sharded = pt.tp.column(serial, group, { fused = 3 })
  near(sharded.weight, fused_part(serial.weight, 3), 0, "weight slices of q, k and v")
  local x = pt.randn(2, 6)
  local parts = {}
  for i, piece in ipairs(serial(x):chunk(3, -1)) do parts[i] = part(piece, 1) end
  near(sharded(x), pt.cat(parts, -1), TOL, "output: this rank's heads of q, k and v")
  raises(function() pt.tp.column(pt.nn.Linear(6, 3 * 5), group, { fused = 3 }) end, "does not split into tensor=")
end)

test("vocab-parallel embedding and cross-entropy equal the serial ones, padding included", function()
  pt.manual_seed(3)
  local vocab = 10                         -- pads to 12 at tensor=4
  local serial = pt.nn.Embedding(vocab, 6)
  local sharded = pt.tp.vocab_embedding(serial, group)
  local ids = pt.randint(0, vocab, { 3, 5 })
  group:broadcast(ids, 0)
  local es, ep = serial(ids), sharded(ids)
  near(ep, es, TOL, "embedding")
  ep:sum():backward(); es:sum():backward()
  local padded = math.ceil(vocab / t) * t
  local full_grad = pt.cat({ serial.weight.grad, pt.zeros(padded - vocab, 6) }, 0)
  near(sharded.weight.grad, part(full_grad, 0), TOL, "embedding gradient rows (padding rows zero)")

  local logits = pt.randn(4, vocab, { requires_grad = true })
  group:broadcast(logits:detach(), 0)
  local targets = pt.randint(0, vocab, { 4 })
  group:broadcast(targets, 0)
  local padded_logits = pt.cat({ logits:detach(), pt.zeros(4, padded - vocab) }, 1)
  local mine = part(padded_logits, 1):requires_grad_()
  local lp = pt.tp.cross_entropy(mine, targets, group, vocab)
  local ls = pt.nn.cross_entropy(logits, targets)
  near(lp, ls, TOL, "loss without gathering the logits")
  -- int32 ids, as the serial loss takes them (LibTorch's gather had refused them)
  near(pt.tp.cross_entropy(mine, targets:to("int32"), group, vocab), ls, TOL, "int32 targets")
  lp:backward(); ls:backward()
  local full = pt.cat({ logits.grad, pt.zeros(4, padded - vocab) }, 1)
  near(mine.grad, part(full, 1), TOL, "logit gradients")
end)

test("GPT-2 with heads, MLP and vocabulary split equals serial GPT-2 over 5 AdamW steps", function()
  local cfg = { vocab = 256, seq = 16, dim = 32, heads = 4, layers = 2 }   -- byte tokens
  pt.manual_seed(5)
  local serial = pt.models.gpt2(cfg)
  pt.manual_seed(5)
  local model = pt.models.gpt2(cfg)
  for i = 0, cfg.layers - 1 do
    local h = "h." .. i
    model:set(h .. ".attn.c_attn", pt.tp.column(model:get(h .. ".attn.c_attn"), group, { fused = 3 }))
    model:set(h .. ".attn.c_proj", pt.tp.row(model:get(h .. ".attn.c_proj"), group))
    model:get(h .. ".attn"):set_attribute("heads", cfg.heads / t)
    model:set(h .. ".mlp.c_fc", pt.tp.column(model:get(h .. ".mlp.c_fc"), group))
    model:set(h .. ".mlp.c_proj", pt.tp.row(model:get(h .. ".mlp.c_proj"), group))
  end
  model:set("wte", pt.tp.vocab_embedding(model:get("wte"), group))
  model:set("lm_head", pt.tp.column(model:get("lm_head"), group))
  model.lm_head.weight = model.wte.weight   -- the tie, now between the two vocabulary shards
  local so = pt.optim.adamw(serial, { lr = 1e-3 })
  local po = pt.optim.adamw(model, { lr = 1e-3 })
  local data = pt.data.text { path = "data/kjv.txt", seq = cfg.seq, batch = 4, seed = 1 }
  for step = 1, 5 do
    local x, y = data:next()
    local ls = pt.nn.cross_entropy(serial(x), y)
    local lp = pt.tp.cross_entropy(model(x), y, group, cfg.vocab)
    near(lp, ls, TOL, "loss at step " .. step)
    ls:backward(); lp:backward()
    if step == 1 then
      near(model.h["0"].attn.c_attn.weight.grad, fused_part(serial.h["0"].attn.c_attn.weight.grad, 3), TOL, "c_attn grad")
      near(model.h["1"].ln_2.weight.grad, serial.h["1"].ln_2.weight.grad, TOL, "replicated LayerNorm grad")
      near(model.wte.weight.grad, part(serial.wte.weight.grad, 0), TOL, "tied embedding grad")
    end
    so:step(); so:zero_grad(); po:step(); po:zero_grad()
  end
  near(model.h["1"].mlp.c_proj.weight, part(serial.h["1"].mlp.c_proj.weight, 1), TOL, "weights after 5 steps")
  local names = {}
  for path, m in model:named_modules() do if m:type():find("Parallel") then names[#names + 1] = path end end
  eq(#names, 4 * cfg.layers + 2, "every split layer is a parallel module in the tree")
end)

test("sequence parallelism: LayerNorm on a split sequence, then column and row layers, equals serial", function()
  pt.manual_seed(6)
  local D, T = 8, 4 * t
  local ln, fc, proj = pt.nn.LayerNorm(D), pt.nn.Linear(D, 4 * D), pt.nn.Linear(4 * D, D)
  local col = pt.tp.column(fc, group, { sequence_parallel = true })
  local row = pt.tp.row(proj, group, { sequence_parallel = true })
  local ln_sp = pt.nn.LayerNorm(D)
  ln_sp:load_state_dict(ln:state_dict())
  local x = pt.randn(2, T, D, { requires_grad = true })
  group:broadcast(x:detach(), 0)
  -- Serial: x + proj(gelu(fc(ln(x)))). Sequence-parallel: the same on this rank's T/t positions.
  local serial = x + proj(fc(ln(x)):gelu("tanh"))
  local mine = pt.tp.split_sequence(x:detach(), group):requires_grad_()
  local out = mine + row(col(ln_sp(mine)):gelu("tanh"))
  eq(out.shape[2], T / t, "activations stay split along the sequence")
  near(out, part(serial:detach(), 1), TOL, "output: this rank's positions")
  local full = pt.tp.gather_sequence(out, group)
  near(full, serial, TOL, "gathered output")
  serial:pow(2):sum():backward()
  out:pow(2):sum():backward()
  near(mine.grad, part(x.grad, 1), TOL, "input gradient")
  near(col.weight.grad, part(fc.weight.grad, 0), TOL, "column weight gradient")
  -- LayerNorm's parameters saw only this rank's positions: their gradients sum over the group.
  local g = ln_sp.weight.grad:clone()
  group:all_reduce(g)
  near(g, ln.weight.grad, TOL, "LayerNorm weight gradient, summed over the sequence parts")
  raises(function() pt.tp.split_sequence(pt.randn(1, T + 1, D), group) end, "does not split into tensor=")
end)

test("pt.tp.dropout keeps this rank's part of the mask the whole tensor draws", function()
  pt.manual_seed(4)
  local whole = pt.rand({ 2, 8, 4 }, { dtype = "float64" }) + 0.5
  pt.manual_seed(9)
  local want = whole:dropout(0.5)
  pt.manual_seed(9)
  local mine = pt.tp.dropout(part(whole, 1), 0.5, true, group)
  ok(mine:equal(part(want, 1)), "rank " .. r .. "'s part along the sequence")
  pt.manual_seed(9)
  local along = pt.tp.dropout(part(whole, 2), 0.5, true, group, 2)
  ok(along:equal(part(want, 2)), "along dimension 2")
  ok(pt.tp.dropout(whole, 0.5, false, group):equal(whole), "not training: the input")
  raises(function() pt.tp.dropout(whole, 1.5, true, group) end, "p must be in [0, 1), got 1.5")
  raises(function() pt.tp.dropout(whole, 0.5, true, group, 3) end, "dimension 3 of a tensor of 3 dimensions")
  raises(function() pt.tp.dropout(pt.ones({}), 0.5, false, group, 0) end, "dimension 0 of a tensor of 0 dimensions")
end)

test("split parameters are known as split by the layer holding them, and asked by name", function()
  local col = pt.tp.column(pt.nn.Linear(4, 8), group)
  ok(pt.tp.is_sharded(col, "weight"), "a column layer's weight is split")
  ok(not pt.tp.is_sharded(pt.tp.row(pt.nn.Linear(8, 4), group), "bias"), "a row layer's bias is whole")
  raises(function() pt.tp.is_sharded(col.weight) end, "pass the model and the parameter's name")
  raises(function() pt.tp.sharding(col, "wieght") end, "'wieght' is not a parameter of this ColumnParallelLinear")
  -- Unequal parts (grouped-query attention's q, k, v): each split across the group.
  local qkv = pt.tp.column(pt.nn.Linear(4, 4 * t + 2 * t + 2 * t), group, { parts = { 4 * t, 2 * t, 2 * t } })
  local s = pt.tp.sharding(qkv, "weight")
  eq(table.concat(s.parts, ","), table.concat({ 4 * t, 2 * t, 2 * t }, ","))
  eq(s.fused, nil, "unequal parts are not a count of fused parts")
  eq(s.slices[r + 1][2][1], 4 * t + 2 * r, "this rank's slice of the second part")
  local full = pt.tp.gather(qkv, "weight")
  eq(table.concat(full.shape, "x"), (8 * t) .. "x4", "gathered to the logical shape")
  raises(function() pt.tp.column(pt.nn.Linear(4, 8 * t), group, { parts = { 4 * t, 4 * t }, fused = 2 }) end,
    "give fused or parts, not both")
end)

-- A policy's own forward (sequence parallelism's) calls the vocab-parallel embedding without the
-- model's id check: an id outside the vocabulary embedded as zeros on every rank, exit 0.
test("the vocab-parallel embedding refuses an id outside the vocabulary, under sequence parallelism too", function()
  for _, family in ipairs { "gpt2", "llama" } do
    pt.manual_seed(4)
    local cfg = { vocab = 51, seq = 8, dim = 16, heads = 4, layers = 1 }
    local model = pt.parallelize(pt.models[family](cfg), "policies." .. family, mesh, { sequence_parallel = true })
    for _, id in ipairs { 51, 1000, -7 } do
      local ids = pt.tensor({ { 1, 2, id, 3, 4, 5, 6, 7 } }, { dtype = "int64" })
      raises(function() model(ids) end, ("VocabParallelEmbedding: token id %d is out of range for the vocabulary of 51"):format(id))
    end
    ok(model(pt.tensor({ { 1, 2, 50, 3, 4, 5, 6, 7 } }, { dtype = "int64" })), family .. ": ids in range run")
  end
end)


-- Sequence parallelism replaces the model's forward with one written in the shipped policy: an
-- error raised there (by the policy itself, or by the engine below it) had named the policy's
-- line (policies/llama.lua:19), or no line at all, instead of the script's.
test("an error inside a shipped policy's forward names the script's line", function()
  for _, family in ipairs { "gpt2", "llama" } do
    pt.manual_seed(4)
    local cfg = { vocab = 51, seq = 8, dim = 16, heads = 4, layers = 1 }
    local model = pt.parallelize(pt.models[family](cfg), "policies." .. family, mesh, { sequence_parallel = true })
    local here = debug.getinfo(1, "S").short_src .. ":"
    local function line() return here .. debug.getinfo(2, "l").currentline .. ": " end
    local cases = {
      { pt.tensor({ { 1, 2, 99, 3, 4, 5, 6, 7 } }, { dtype = "int64" }), "token id 99 is out of range" },
      { pt.zeros({ 1, 9 }, { dtype = "int64" }), "sequence of 9 tokens is longer than seq=8 (raised in policies/" .. family .. ".lua:" },
    }
    if t > 1 then
      cases[3] = { pt.zeros({ 1, 2 * t - 1 }, { dtype = "int64" }), "does not split into tensor=" .. t .. " equal parts" }
    end
    for _, case in ipairs(cases) do
      local at
      local err = raises(function() at = line(); local out = model(case[1]); return out end, case[2])
      eq(err:sub(1, #at), at, family .. ": the error begins with the script's line: " .. err)
    end
  end
end)

H.run()
