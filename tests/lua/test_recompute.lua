-- Activation checkpointing (pt.parallelize's recompute = "block"): GPT-2 with dropout and LLaMA
-- give the same loss and the same gradients, bit for bit (dropout replays its masks), while the
-- activations a forward leaves for backward shrink.
local pt = require "partrain"
local H = require "harness"

local function build(family, recompute)
  pt.manual_seed(4)
  local model = family == "gpt2"
      and pt.models.gpt2 { vocab = 256, seq = 64, dim = 64, heads = 4, layers = 4, dropout = 0.1 }
      or pt.models.llama { vocab = 256, seq = 64, dim = 64, heads = 4, kv_heads = 2, layers = 4 }
  return pt.parallelize(model, nil, pt.mesh {}, { recompute = recompute })
end

local x = pt.randint(0, 256, { 8, 64 })
local y = pt.randint(0, 256, { 8, 64 })

-- Loss, gradients and the bytes the forward left allocated (what backward will read).
local function step(model)
  pt.manual_seed(9)
  local before = pt.memory().allocated
  local loss = pt.nn.cross_entropy(model(x), y)
  local held = pt.memory().allocated - before
  loss:backward()
  local grads = {}
  for name, p in model:named_parameters() do grads[name] = p.grad:clone() end
  return loss:item(), grads, held
end

for _, family in ipairs({ "gpt2", "llama" }) do
  H.test(family .. ": recompute = 'block' gives the same loss and gradients with a fraction of the activations", function()
    local l1, g1, m1 = step(build(family, nil))
    local l2, g2, m2 = step(build(family, "block"))
    H.eq(l2, l1, "the loss")
    for name, g in pairs(g1) do H.ok(g2[name]:equal(g), family .. ": the gradient of " .. name) end
    H.ok(m2 < 0.5 * m1, ("activations held after forward: %d bytes with recompute, %d without"):format(m2, m1))
    print(("  %s: activations after forward %.2f MB -> %.2f MB (%.2fx)"):format(family, m1 / 1e6, m2 / 1e6, m2 / m1))
  end)
end

H.test("partrain plan measures the smaller activations of recompute = 'block'", function()
  local bin = assert(os.getenv("PARTRAIN_BIN"), "PARTRAIN_BIN names the partrain executable")
  local script = os.tmpname()
  local f = assert(io.open(script, "w"))
  f:write([[
local pt = require "partrain"
local a = pt.args { recompute = "none" }
local m = pt.parallelize(pt.models.gpt2 { vocab = 256, seq = 128, dim = 128, heads = 4, layers = 4 }, nil, pt.mesh {},
                         { recompute = a.recompute })
local opt = pt.optim.adamw(m, { lr = 1e-3 })
local x = pt.randint(0, 256, { 8, 128 })
pt.nn.cross_entropy(m(x), x):backward()
opt:step()
]])
  f:close()
  local function activations(recompute)
    local p = assert(io.popen(("'%s' plan --world 1 --json '%s' --recompute %s 2>&1"):format(bin, script, recompute)))
    local out = p:read("*a")
    p:close()
    local bytes = out:match('"activation_bytes"%s*:%s*(%d+)')
    H.ok(bytes, "the plan reports activation bytes: " .. out:sub(1, 400))
    return tonumber(bytes)
  end
  local plain, checked = activations("none"), activations("block")
  os.remove(script)
  H.ok(checked < 0.25 * plain, ("plan: activations %d bytes with recompute, %d without"):format(checked, plain))
end)

H.test("recompute refuses what it cannot do", function()
  H.raises(function() pt.parallelize(pt.models.mlp { sizes = { 4, 4 } }, nil, pt.mesh {}, { recompute = "block" }) end,
    "recompute = 'block' needs the blocks of MLP")
  H.raises(function() pt.parallelize(pt.models.mlp { sizes = { 4, 4 } }, nil, pt.mesh {}, { recompute = "layer" }) end,
    "recompute must be 'block' or 'none'")
end)

H.run()
