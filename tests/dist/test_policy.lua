-- Sharding policies: the shipped ones (GPT-2, MLP, the tutorial model) and one written here for a
-- Lua-defined model make training equal to serial training on the global batch (tensor = 2, and
-- tensor = 2 x data = 2 at 4 ranks), within 1e-5 (GPT-2 with dropout: 1e-9, float64); bad policies are refused, each with the
-- policy's file:line, before anything changes.
--   partrain --nproc-per-node 2 tests/dist/test_policy.lua
package.path = "tests/lua/?.lua;examples/simple/?.lua;" .. package.path
local pt = require "partrain"
local P = require "partrain.policy"
local H = require "harness"
local SimpleModel = require "model"
local test, near, eq, ok, raises = H.test, H.near, H.eq, H.ok, H.raises

local args = pt.args { tensor = 2 }
local mesh = pt.mesh { tensor = args.tensor }
local dp = mesh:size("data")
local TOL = 1e-5

-- Every gradient of the parallel model, gathered to its logical shape, equals the serial one.
local function same_gradients(model, serial, what)
  local serial_params = {}
  for name, p in serial:named_parameters() do serial_params[name] = p end
  for name, p in model:named_parameters() do
    local want = serial_params[name]
    ok(want ~= nil, what .. ": " .. name .. " exists in the serial model")
    if want.grad == nil then  -- a parameter the forward does not use (data parallelism syncs it as zeros)
      ok(p.grad == nil or p.grad:abs():max():item() == 0, what .. ": " .. name .. " has no gradient, as in the serial model")
    else
      local g = pt.tp.gather(model, name, p.grad)
      -- Data parallelism syncs the mean of the data ranks' gradients: the global batch's.
      near(g, want.grad, TOL, what .. ": gradient of " .. name)
    end
  end
end

-- Trains `make()` serially on whole global batches and parallelized (policy, then data
-- parallelism) on this rank's slices, from the same weights: the loss each step, every
-- gradient after the first step, and every parameter at the end must agree.
local function equal_to_serial(make, policy, loader, loss_of, steps, opts)
  pt.manual_seed(21)
  local serial = make()
  pt.manual_seed(21)
  local model = pt.parallelize(make(), policy, mesh, opts)
  -- Clipping needs the global norm: split parameters' norms must add up over the tensor group.
  local so = pt.optim.adamw(serial, { lr = 1e-3, clip_grad_norm = 0.5 })
  local po = pt.optim.adamw(model, { lr = 1e-3, clip_grad_norm = 0.5 })
  local serial_loss, parallel_loss = loss_of(serial), loss_of(model)
  local whole, mine = loader(false), loader(true)
  for step = 1, steps do
    local gx, gy = whole:next()
    local x, y = mine:next()
    local ls = serial_loss(serial(gx), gy)
    local lp = parallel_loss(model(x), y)
    local global = lp:detach():clone()
    mesh:group("data"):all_reduce(global, "mean")
    near(global, ls, TOL, "loss at step " .. step)
    ls:backward(); lp:backward()
    if step == 1 then same_gradients(model, serial, "step 1") end
    local ns, np = so:step(), po:step()
    near(np, ns, TOL, "gradient norm at step " .. step)
    so:zero_grad(); po:zero_grad()
  end
  local full, want = model:full_state_dict(), serial:state_dict()
  local names = {}
  for name in pairs(want) do names[#names + 1] = name end
  table.sort(names)
  for _, name in ipairs(names) do near(full[name], want[name], TOL, "parameter " .. name .. " after " .. steps .. " steps") end
  return model, serial
end

local gpt_cfg = { vocab = 256, seq = 16, dim = 32, heads = 4, layers = 2 }
local function gpt_text(shard)
  return pt.data.text { path = "data/kjv.txt", seq = 16, batch = 4, seed = 2, mesh = shard and mesh or nil }
end

-- The logits of the parallel GPT-2 (split along the vocabulary) gathered, against serial ones.
local function same_logits(model, serial)
  local ids = pt.randint(0, gpt_cfg.vocab, { 2, 16 })
  mesh:group("world"):broadcast(ids, 0)
  local logits = pt.tp.gather_from(model(ids), mesh:group("tensor"))
  near(logits, serial(ids), TOL, "forward logits")
end

test("GPT-2 with policies/gpt2 equals serial GPT-2 over 20 AdamW steps (heads, MLP and vocabulary split)", function()
  local model, serial = equal_to_serial(function() return pt.models.gpt2(gpt_cfg) end, nil, gpt_text,
    function(m) return pt.loss_fn(m) end, 20)
  same_logits(model, serial)
  eq(model:get("h.0.attn"):attribute("heads"), 4 / args.tensor, "heads divided by tensor")
  eq(model:get("lm_head"):type(), "ColumnParallelLinear")
  ok(model.lm_head.weight:equal(model.wte.weight), "the output head stays tied to the embedding")
end)

test("GPT-2 with sequence parallelism equals serial GPT-2 over 20 AdamW steps", function()
  local model, serial = equal_to_serial(function() return pt.models.gpt2(gpt_cfg) end, nil, gpt_text,
    function(m) return pt.loss_fn(m) end, 20, { sequence_parallel = true })
  same_logits(model, serial)
  ok(model:forward_replaced(), "the policy replaced GPT-2's forward to split the sequence")
  ok(tostring(model:get("h.0.ln_1")):find("sequence_parallel"), "LayerNorms are sequence-parallel")
  ok(tostring(model:get("h.1.mlp.c_fc")):find("sequence_parallel"), "columns gather the sequence")
end)

-- Dropout on split tensors (a rank's heads' attention weights; under sequence parallelism its
-- positions of the embeddings and of each MLP's output) keeps that part of the mask the whole
-- model draws: a rank whose own mask were drawn the same on every rank would drop the same
-- elements of every part. Each forward is seeded alike, serial and parallel, so in float64 the
-- two agree to rounding. Data-parallel ranks draw masks for their own samples, as every
-- data-parallel trainer does, which no serial run draws: tensor parallelism alone here.
test("GPT-2 with dropout equals serial GPT-2 in float64 over 10 steps, heads split and sequence-parallel", function()
  if dp > 1 then return end
  local cfg = { vocab = 256, seq = 16, dim = 32, heads = 4, layers = 2, dropout = 0.1, dtype = "float64" }
  for _, sp in ipairs { false, true } do
    local what = sp and "sequence-parallel" or "heads split"
    pt.manual_seed(21)
    local serial = pt.models.gpt2(cfg)
    pt.manual_seed(21)
    local model = pt.parallelize(pt.models.gpt2(cfg), nil, mesh, { sequence_parallel = sp })
    local so, po = pt.optim.adamw(serial, { lr = 1e-3 }), pt.optim.adamw(model, { lr = 1e-3 })
    local serial_loss, parallel_loss = pt.loss_fn(serial), pt.loss_fn(model)
    local data = gpt_text(false)
    local dropped = 0
    for step = 1, 10 do
      local x, y = data:next()
      pt.manual_seed(100 + step)
      local ls = serial_loss(serial(x), y)
      pt.manual_seed(100 + step)
      local lp = parallel_loss(model(x), y)
      near(lp, ls, 1e-9, what .. ": loss at step " .. step)
      ls:backward(); lp:backward()
      so:step(); po:step(); so:zero_grad(); po:zero_grad()
      model:eval()
      dropped = dropped + math.abs(parallel_loss(model(x), y):item() - lp:item())
      model:train()
    end
    ok(dropped > 1e-3, what .. ": dropout changed the losses (" .. dropped .. " in all against eval mode)")
    local full, want = model:full_state_dict(), serial:state_dict()
    for name, w in pairs(want) do near(full[name], w, 1e-9, what .. ": parameter " .. name .. " after 10 steps") end
  end
end)

test("GPT-2 with sequence_overlap, the composed LayerNorm and flash_attention equals serial", function()
  local model = equal_to_serial(function() return pt.models.gpt2(gpt_cfg) end, nil, gpt_text,
    function(m) return pt.loss_fn(m) end, 5,
    { sequence_parallel = true, sequence_overlap = true, fused_norm = false, flash_attention = true })
  ok(tostring(model:get("h.0.attn.c_attn")):find("sequence_overlap"), "columns overlap the gather")
  ok(tostring(model:get("ln_f")):find("composed"), "fused_norm = false composes the LayerNorm")
  eq(model:get("h.0.attn"):attribute("flash_attention"), 1, "flash_attention set on every attention")
end)

-- LLaMA with grouped-query attention: 8 query heads over 4 key/value heads (two per group), so
-- every tensor size tested (2, 4) divides both.
local llama_cfg = { vocab = 256, seq = 16, dim = 32, heads = 8, kv_heads = 4, layers = 2, hidden = 48 }

test("LLaMA (GQA) with policies/llama equals serial LLaMA over 20 AdamW steps (heads, kv heads, MLP, vocabulary)", function()
  local model, serial = equal_to_serial(function() return pt.models.llama(llama_cfg) end, nil, gpt_text,
    function(m) return pt.loss_fn(m) end, 20)
  same_logits(model, serial)
  eq(model:get("layers.0.self_attn"):attribute("heads"), 8 / args.tensor, "query heads divided by tensor")
  eq(model:get("layers.0.self_attn"):attribute("kv_heads"), 4 / args.tensor, "key/value heads divided by tensor")
  eq(model:get("layers.1.mlp.down_proj"):type(), "RowParallelLinear")
  eq(model:get("norm"):type(), "ParallelRMSNorm")
  -- Generation over the split model: the cache gives what recomputation gives, and what serial gives.
  local prompt = pt.randint(0, 256, { 2, 5 })
  mesh:group("world"):broadcast(prompt, 0)
  local cached = model:generate(prompt, { max_new = 8, temperature = 0 })
  ok(cached:equal(model:generate(prompt, { max_new = 8, temperature = 0, cache = false })), "split: cache = recompute")
  ok(cached:equal(serial:generate(prompt, { max_new = 8, temperature = 0 })), "split generation equals serial")
  -- A validation loss over the data ranks' slices equals the serial model's over whole batches.
  local function val(shard)
    return pt.data.text { path = "data/kjv.txt", seq = 16, batch = 4, shuffle = false, split = "val",
                          mesh = shard and mesh or nil }
  end
  near(pt.evaluate(model, val(true), { batches = 3 }), pt.evaluate(serial, val(false), { batches = 3 }), TOL,
    "pt.evaluate over the data ranks")
end)

test("LLaMA with sequence parallelism (RMSNorm as a sequence-parallel norm) and a tied head equals serial", function()
  local cfg = {}
  for k, v in pairs(llama_cfg) do cfg[k] = v end
  cfg.tie = true
  local model, serial = equal_to_serial(function() return pt.models.llama(cfg) end, nil, gpt_text,
    function(m) return pt.loss_fn(m) end, 10, { sequence_parallel = true })
  same_logits(model, serial)
  ok(model:forward_replaced(), "the policy replaced LLaMA's forward to split the sequence")
  ok(tostring(model:get("layers.0.input_layernorm")):find("sequence_parallel"), "RMSNorms are sequence-parallel")
  ok(model.lm_head.weight:equal(model.embed_tokens.weight), "the tied head stays tied to the embedding's part")
end)

test("split parameters report their logical shape, split dimension and slices; padding stays invisible", function()
  local t, r = args.tensor, mesh:coord().tensor
  local small = { vocab = 255, seq = 8, dim = 16, heads = 4, layers = 1 }
  pt.manual_seed(3)
  local serial = pt.models.gpt2(small)
  pt.manual_seed(3)
  local model = pt.parallelize(pt.models.gpt2(small), nil, mesh)
  local rows = {}
  for _, row in ipairs(pt.tp.shards(model)) do rows[row.name] = row end
  local qkv = rows["h.0.attn.c_attn.weight"]
  eq(table.concat(qkv.shape, "x"), "48x16"); eq(table.concat(qkv.local_shape, "x"), (48 / t) .. "x16")
  eq(qkv.dim, 0); eq(qkv.fused, 3)
  -- Each rank holds its slice of q, of k and of v.
  local part = 16 / t
  for j = 0, 2 do
    eq(qkv.slices[r + 1][j + 1][1], j * 16 + r * part, "q/k/v slice start")
    eq(qkv.slices[r + 1][j + 1][2], part, "q/k/v slice length")
  end
  eq(table.concat(qkv.ranks, ","), table.concat(mesh:group("tensor"):ranks(), ","), "held by the tensor group")
  eq(rows["h.0.attn.c_proj.weight"].dim, 1, "a row-parallel weight splits its input dimension")
  eq(rows["h.0.attn.c_proj.bias"].dim, nil, "its bias is whole")
  -- The vocabulary (255) is padded to a multiple of t, but the logical shape is 255.
  local wte = rows["wte.weight"]
  eq(table.concat(wte.shape, "x"), "255x16", "logical shape without padding")
  eq(wte.local_shape[1], math.ceil(255 / t), "local rows include the padding")
  local last = wte.slices[t][1]
  eq(last[1] + last[2], 255, "the last rank's slice ends at the logical vocabulary")
  ok(not pt.tp.is_sharded(model, "wpe.weight"), "wpe is whole")
  -- The full state_dict gathers logical tensors equal to the serial model's...
  local full, want = model:full_state_dict(), serial:state_dict()
  local names = {}
  for name in pairs(want) do names[#names + 1] = name end
  table.sort(names)
  for _, name in ipairs(names) do near(full[name], want[name], 0, "full " .. name) end
  -- ...and loads back, each rank keeping its parts.
  local other = pt.parallelize(pt.models.gpt2(small), nil, mesh)
  other:load_full_state_dict(full)
  local mine, theirs = model:state_dict(), other:state_dict()
  for _, name in ipairs(names) do near(theirs[name], mine[name], 0, "reloaded " .. name) end
  raises(function() other:load_full_state_dict({ ["wte.weight"] = pt.zeros(256, 16) }, false) end,
    "'wte.weight' has shape [256, 16] but the model's logical shape is [255, 16]")
end)

test("the MLP and the tutorial's SimpleModel with their shipped policies equal serial", function()
  equal_to_serial(function() return pt.models.mlp { sizes = { 784, 64, 32, 10 } } end, "policies.mlp",
    function(shard) return pt.data.mnist { batch = 16, seed = 2, mesh = shard and mesh or nil } end,
    function() return pt.nn.cross_entropy end, 5)
  local model = equal_to_serial(function() return SimpleModel(256, 16) end, nil,
    function(shard) return pt.data.text { path = "data/kjv.txt", seq = 10, batch = 4, seed = 2, mesh = shard and mesh or nil } end,
    function() return function(out) return out:mean() end end, 5)
  eq(model:get("hidden_layer").weight.shape[1], 16 / args.tensor, "hidden dimension split")
end)

-- A model written here in Lua, and a policy for it written here too.
local Block = pt.nn.Module "TestBlock"
function Block:__init() self.up = pt.nn.Linear(6, 12); self.down = pt.nn.Linear(12, 6) end
function Block:forward(x) return x + self.down(self.up(x):tanh()) end
local Net = pt.nn.Module "TestNet"
function Net:__init() self.a = Block(); self.b = Block(); self.head = pt.nn.Linear(6, 3) end
function Net:forward(x) return self.head(self.b(self.a(x))) end
local net_policy = P.policy {
  name = "testnet", targets = { "TestNet" },
  modules = { TestBlock = { replace = { { "up", P.column {} }, { "down", P.row {} } } } },
}

test("a Lua-defined model with a policy written in the test equals serial", function()
  local model = equal_to_serial(function() return Net() end, net_policy,
    function(shard) return pt.data.mnist { batch = 8, seed = 2, mesh = shard and mesh or nil } end,
    function() return function(out, y) return pt.nn.cross_entropy(out, y) end end, 0)
  eq(model:get("a.up"):type(), "ColumnParallelLinear"); eq(model:get("b.down"):type(), "RowParallelLinear")
  local x = pt.randn(4, 6)
  mesh:group("tensor"):broadcast(x, 0)
  pt.manual_seed(21)
  local serial = Net()
  near(model(x), serial(x), TOL, "forward")
end)

-- The user-policy example of docs/policies.md, read from the page and run as written, on a model
-- of the shape it describes: a Lua attention module declaring its heads (divided by the policy),
-- an RMSNorm as P.norm, an absent gate (ignore_if_missing), a tied vocabulary embedding and head.
local function docs_policy()
  local page = assert(io.open("docs/policies.md")):read("*a")
  local code = page:match("```lua\n(local P = require \"partrain.policy\"\nlocal policy = P.policy {.-\n})\n```")
  assert(code, "docs/policies.md no longer holds the user-policy example")
  return assert(loadstring(code .. "\nreturn policy", "@docs/policies.md"))()
end
local MyAttn = pt.nn.Module "MyAttn"
function MyAttn:__init(dim, heads) self:attribute("heads", heads); self.qkv = pt.nn.Linear(dim, 3 * dim) end
function MyAttn:forward(x) return self.qkv(x):narrow(-1, 0, x.shape[3]) end  -- whole on every rank (not split)
local MyBlock = pt.nn.Module "MyBlock"
function MyBlock:__init(dim)
  self.attn = MyAttn(dim, 4)
  self.norm = pt.nn.RMSNorm(dim)
  self.up, self.down = pt.nn.Linear(dim, 4 * dim), pt.nn.Linear(4 * dim, dim)
end
function MyBlock:forward(x) return self.down(self.up(x):relu()) end  -- the policy's forward, serially too
local MyNet = pt.nn.Module "MyNet"
function MyNet:__init()
  self.embed = pt.nn.Embedding(256, 16)
  self.blocks = pt.nn.ModuleList(MyBlock(16), MyBlock(16))
  self.head = pt.nn.Linear(16, 256, { bias = false })
  self.head.weight = self.embed.weight
end
function MyNet:forward(ids)
  local h = self.embed(ids)
  for _, block in ipairs(self.blocks:children()) do h = h + block(block.norm(h)) + block.attn(h) end
  return self.head(h)
end

test("the user-policy example in docs/policies.md, as written, equals serial (Lua attributes divided, RMSNorm)", function()
  local model = equal_to_serial(function() return MyNet() end, docs_policy(), gpt_text,
    function(m) return pt.loss_fn(m) end, 5)
  local block = model:get("blocks.0")
  eq(block.attn.heads, 4 / args.tensor, "the policy divided the Lua module's heads attribute")
  eq(model:get("blocks.1.norm"):type(), "ParallelRMSNorm")
  eq(model:get("blocks.0.up"):type(), "ColumnParallelLinear")
  eq(model:get("head"):type(), "ColumnParallelLinear")
end)

-- Bad policies: each refused with the policy's file:line, the model left as it was.
local function refused(policy_fn, message, model)
  model = model or pt.models.mlp { sizes = { 8, 6, 4 } }
  local before = tostring(model)
  local err = raises(function() P.apply(model, policy_fn(), mesh, {}) end, message)
  ok(err:find("test_policy.lua:%d+:"), "names the policy's file:line: " .. err)
  eq(tostring(model), before, "nothing changed")
end

test("method replacement: a policy's Lua function becomes a module's forward, built-in or Lua-defined", function()
  local calls = 0
  local policy = P.policy {
    modules = {
      TestBlock = {
        replace = { { "up", P.column {} }, { "down", P.row {} } },
        -- The block without its residual connection, and counting its calls.
        methods = { forward = function(self, x) calls = calls + 1; return self.down(self.up(x):tanh()) end },
      },
      ["head"] = { methods = { forward = function(self, x) return self:own_forward(x) * 2 end } },
    },
  }
  pt.manual_seed(5)
  local serial = Net()
  pt.manual_seed(5)
  -- The replacements change what the model computes (no residual, a doubled head): the probe,
  -- which holds a sharded model to its serial self, would refuse that, so it is off here.
  local model = pt.parallelize(Net(), policy, mesh, { probe = false })
  local x = pt.randn(4, 6)
  mesh:group("world"):broadcast(x, 0)
  local a, b = serial.a, serial.b
  local want = serial.head(b.down(b.up(a.down(a.up(x):tanh())):tanh())) * 2
  near(model(x), want, TOL, "the replaced forwards run, in Lua and through C++")
  eq(calls, 2, "each block's replacement ran once")
  ok(model.head:forward_replaced() and model.a:forward_replaced(), "both report a replaced forward")
  model.head:replace_forward(nil)
  ok(not model.head:forward_replaced(), "replace_forward(nil) restores the module's own")
end)

test("at tensor 1 a policy is checked, not applied", function()
  local single = pt.mesh { data = pt.dist.world_size() }
  local bad = P.policy { modules = { MLP = { replace = { { "7", P.column {} } } } } }
  local err = raises(function() pt.parallelize(pt.models.mlp { sizes = { 8, 6, 4 } }, bad, single) end, "no module '7' in MLP")
  ok(err:find("test_policy.lua:%d+:"), "names the policy's file:line: " .. err)
  local model = pt.parallelize(pt.models.mlp { sizes = { 8, 6, 4 } }, "policies.mlp", single)
  eq(model:get("0"):type(), "Linear", "layers stay serial at tensor 1")
end)

if args.tensor == 2 then  -- the messages below name tensor=2
test("bad policies are refused with file:line before anything changes", function()
  refused(function() return P.policy { modules = { Nothing = { replace = { { "0", P.column {} } } } } } end,
    "modules.Nothing matches no module of MLP")
  refused(function() return P.policy { modules = { MLP = { replace = { { "7", P.column {} } } } } } end,
    "column: no module '7' in MLP")
  refused(function() return P.policy { modules = { MLP = { replace = { { "1", P.column {} } } } } } end,
    "P.column does not fit 1: it is a ReLU, and P.column needs a Linear")
  refused(function() return P.policy { modules = { MLP = { replace = { { "0", P.vocab_embedding {} } } } } } end,
    "P.vocab_embedding does not fit 0: it is a Linear")
  refused(function() return P.policy { modules = { MLP = { replace = { { "0", P.column { fused = 4 } } } } } } end,
    "tensor=2 does not divide 0's output of 6 (4 fused parts")
  refused(function() return P.policy { modules = { MLP = { replace = { { "0", P.row {} } } } } } end,
    "does not divide 0's input of", pt.models.mlp { sizes = { 7, 6, 4 } })
  raises(function() P.column { fused = "3" } end, "P.column option 'fused' must be a number, got string")
  raises(function() P.column { fuse = 3 } end, "P.column has no option 'fuse' (options: fused, gather_output, parts, sequence_parallel)")
  raises(function() P.policy { module = {} } end, "policy has no field 'module'")
  raises(function() P.policy { name = 3, modules = {} } end, "policy field 'name' must be a string, got number")
  raises(function() P.policy { modules = { MLP = { replce = {} } } } end, "modules.MLP has no field 'replce'")
  raises(function() P.policy { modules = { MLP = { replace = { { "0", "column" } } } } } end,
    "modules.MLP.replace[1] must be { \"path\", P.<style> {...}")
  refused(function() return P.policy { targets = { "GPT2" }, modules = { MLP = {} } } end, "policy ? serves GPT2, not MLP")
  refused(function() return P.policy { modules = { MLP = {} }, preprocess = function() error("boom") end } end,
    "preprocess of policy ? failed:")
  local gpt = pt.models.gpt2 { vocab = 256, seq = 8, dim = 12, heads = 3, layers = 1 }
  refused(function() return P.policy { modules = { GPT2Block = { attributes = { ["attn.heads"] = P.divide_by_tensor } } } } end,
    "tensor=2 does not divide h.0.attn.heads=3", gpt)
  refused(function() return P.policy { modules = { GPT2Block = { attributes = { ["attn.width"] = P.divide_by_tensor } } } } end,
    "GPT2Attention has no attribute 'width'", gpt)
  refused(function() return P.policy { modules = { ["h.*.attn"] = { replace = { { "c_q", P.column {} } } } } } end,
    "no module 'h.0.attn.c_q'", gpt)
  refused(function() return P.policy { modules = { MLP = { methods = { backward = function() end } } } } end,
    "methods: MLP is a built-in module; only its forward can be replaced, not 'backward'")
  refused(function() return P.policy { modules = { MLP = { methods = { forward = 3 } } } } end,
    "modules.MLP.methods: 'forward' must map to a function(self, ...)")
  refused(function() return P.policy { modules = function(cfg) error("no such setting") end } end,
    "modules(cfg) of policy ? failed:")
  refused(function() return P.policy { modules = function(cfg) return { MLP = { replace = { { "0", P.norm {} } } } } end } end,
    "P.norm does not fit 0: it is a Linear, and P.norm needs a LayerNorm")
  refused(function() return P.policy { modules = { GPT2Block = { attributes = { ["attn.heads"] = "half" } } } } end,
    "attributes: 'attn.heads' must map to P.divide_by_tensor, a number or a boolean", gpt)
  raises(function() P.apply(pt.models.mlp { sizes = { 8, 6, 4 } }, P.policy { modules = { MLP = {} } }, mesh, { sequence_paralel = true }) end,
    "unknown sharding option 'sequence_paralel' (options: flash_attention, fused_norm, policy_timeout, probe, sequence_overlap, sequence_parallel, tensor_parallel)")
  raises(function() pt.parallelize(pt.models.gpt2 { vocab = 8, seq = 4, dim = 8, heads = 2, layers = 1 }, nil, mesh, { sequence_parallel = 1 }) end,
    "sharding option 'sequence_parallel' must be a boolean, got number")
  raises(function() pt.parallelize(pt.models.gpt2 { vocab = 8, seq = 4, dim = 8, heads = 2, layers = 1 }, nil, mesh, { sequence_overlap = true }) end,
    "sequence_overlap needs sequence_parallel = true")
  local fine = pt.models.mlp { sizes = { 8, 6, 4 } }
  P.apply(fine, P.policy { modules = { MLP = { replace = { { "0", P.column {} }, { "2", P.row {} },
                                                         { "9", P.row {}, ignore_if_missing = true } } } } }, mesh, {})
  eq(fine:get("0"):type(), "ColumnParallelLinear", "ignore_if_missing skips a path that is not there")
  raises(function() pt.parallelize(pt.nn.Linear(2, 2), nil, mesh) end, "no policy is registered for Linear")
end)
end

H.run()
