-- Policies that would split a model wrong are refused at tensor 2, each with the user's file:line
-- and the model left exactly as it was; logits split along the vocabulary are recognized by the
-- plain loss (which then gives the serial loss) and refused by argmax, top-k, softmax and
-- sampling; the vocabulary-parallel loss keeps float64; policy code runs under a time bound.
--   partrain --nproc-per-node 2 --threads 1 tests/dist/test_policy_checks.lua
package.path = "tests/lua/?.lua;tests/dist/?.lua;" .. package.path
local pt = require "partrain"
local P = require "partrain.policy"
local H = require "harness"
local test, near, eq, ok, raises = H.test, H.near, H.eq, H.ok, H.raises

local mesh = pt.mesh { tensor = 2 }
assert(mesh:size("tensor") == 2 and mesh:size("data") == 1, "run on 2 ranks")
local group = mesh:group("tensor")
local HERE = "test_policy_checks.lua"
local GPT = { vocab = 255, seq = 8, dim = 16, heads = 4, layers = 2 }  -- 255: the vocabulary pads

-- A message names a user's file:line and no line inside partrain's own Lua files or C.
local function user_located(err, file)
  ok(err:find((file or HERE):gsub("%.", "%%.") .. ":%d+:"), "names " .. (file or HERE) .. ":line: " .. err)
  ok(not err:find("bindings/lua/partrain/[%w_]+%.lua:%d+:") and not err:find("%[C%]:%-?%d"),
    "names no internal location: " .. err)
end

-- Everything a refused policy must leave as it was: the module objects at every path, every
-- parameter's values, shape and requires_grad, the attributes, replaced forwards, the Lua fields
-- named in `fields`, and the forward on `input`.
local function fingerprint(model, input, fields)
  local f = { tree = tostring(model), modules = {}, params = {}, attrs = {}, forwards = {}, fields = {} }
  for path, m in model:named_modules() do
    f.modules[path] = m
    f.forwards[path] = m:forward_replaced()
    for _, name in ipairs(m:attribute_names()) do f.attrs[path .. ":" .. name] = m:attribute(name) end
  end
  for name, p in model:named_parameters() do f.params[name] = { p:detach():clone(), p.requires_grad } end
  for path, names in pairs(fields or {}) do
    for _, name in ipairs(names) do f.fields[path .. ":" .. name] = model:get(path)[name] end
  end
  model:eval()
  f.out = pt.no_grad(function() return model(input) end)
  model:train()
  return f
end

local function unchanged(model, input, before, what, fields)
  local after = fingerprint(model, input, fields)
  eq(after.tree, before.tree, what .. ": the module tree")
  for path, m in pairs(before.modules) do ok(rawequal(after.modules[path], m), what .. ": the module at '" .. path .. "'") end
  for path in pairs(after.modules) do ok(before.modules[path] ~= nil, what .. ": no module added at '" .. path .. "'") end
  for name, p in pairs(before.params) do
    local q = after.params[name]
    ok(q ~= nil, what .. ": parameter " .. name .. " is there")
    near(q[1], p[1], 0, what .. ": parameter " .. name)
    eq(q[2], p[2], what .. ": requires_grad of " .. name)
  end
  for k, v in pairs(before.attrs) do eq(after.attrs[k], v, what .. ": attribute " .. k) end
  for k, v in pairs(before.forwards) do eq(after.forwards[k], v, what .. ": forward replaced at '" .. k .. "'") end
  for k, v in pairs(before.fields) do ok(rawequal(after.fields[k], v), what .. ": Lua field " .. k) end
  near(after.out, before.out, 0, what .. ": the forward")
end

local function ids(vocab, b, t)
  local x = pt.randint(0, vocab, { b, t })
  group:broadcast(x, 0)
  return x
end

-- The shipped GPT-2 policy's modules, with `edit(modules)` applied to a fresh copy.
local function gpt2_policy(edit, extra)
  local modules = {
    GPT2Block = {
      attributes = { ["attn.n_head"] = P.divide_by_tensor },
      replace = {
        { "ln_1", P.norm {} }, { "attn.c_attn", P.column { fused = 3 } }, { "attn.c_proj", P.row {} },
        { "ln_2", P.norm {} }, { "mlp.c_fc", P.column {} }, { "mlp.c_proj", P.row {} },
      },
    },
    GPT2 = { replace = { { "wte", P.vocab_embedding {} }, { "ln_f", P.norm {} }, { "lm_head", P.vocab_head {} } } },
  }
  if edit then edit(modules) end
  local spec = { name = "gpt2-test", targets = { "GPT2" }, modules = modules,
                 postprocess = function(model) P.tie(model, "lm_head.weight", "wte.weight") end }
  for k, v in pairs(extra or {}) do spec[k] = v end
  return P.policy(spec)
end

-- Refused with `message`, the user's location, and the model exactly as before.
local function refused(make_model, policy, message, opts, input, fields, file)
  local model = make_model()
  input = input or ids(GPT.vocab, 2, 4)
  local before = fingerprint(model, input, fields)
  local err = raises(function() pt.parallelize(model, policy, mesh, opts) end, message)
  user_located(err, file)
  unchanged(model, input, before, message, fields)
  return err
end

local function gpt() pt.manual_seed(7); return pt.models.gpt2(GPT) end

test("GPT-2's policy without the heads division is refused, the model left as it was", function()
  local err = refused(gpt, require "bad_policies.gpt2_no_heads", "divide n_head by the tensor size", nil, nil, nil,
    "bad_policies/gpt2_no_heads.lua")
  ok(err:find("gpt2_no_heads.lua:6:", 1, true), "names the `return P.policy {` line of the file: " .. err)
  ok(err:find("h.0.attn: 4 heads of 4 features make 16, but c_attn gives 8 features of q here", 1, true), err)
  refused(gpt, gpt2_policy(function(m) m.GPT2Block.attributes["attn.n_head"] = 1 end), "1 heads of 4 features make 4")
  refused(gpt, gpt2_policy(function(m) m.GPT2Block.attributes["attn.n_head"] = true end), "1 heads of 4 features make 4")
  refused(gpt, gpt2_policy(function(m) m.GPT2Block.replace[2] = { "attn.c_attn", P.column {} } end),
    "split it with P.column { fused = 3 }")
  refused(gpt, gpt2_policy(function(m) table.remove(m.GPT2Block.replace, 3) end),
    "but c_proj (Linear) takes 16 whole features: split c_proj's input too (P.row)")
  refused(gpt, gpt2_policy(function(m) m.GPT2Block.replace[6] = { "mlp.c_proj", P.row { input_is_parallel = false } } end),
    "c_proj (RowParallelLinear) takes 64 whole features")
  refused(gpt, gpt2_policy(function(m) m.GPT2Block.replace[5] = { "mlp.c_fc", P.column { fused = 2 } } end),
    "a fused split (fused = 2) keeps parts apart")
end)

test("a vocab_head on an inner layer, a split head that is not one, and an untied head are refused", function()
  refused(gpt, gpt2_policy(function(m) m.GPT2Block.replace[5] = { "mlp.c_fc", P.vocab_head {} } end),
    "P.vocab_head fits only GPT2's output head lm_head, not h.0.mlp.c_fc")
  refused(function() return pt.models.gpt2 { vocab = 256, seq = 8, dim = 16, heads = 4, layers = 1 } end,
    gpt2_policy(function(m) m.GPT2.replace[3] = { "lm_head", P.column {} } end), "split logits need P.vocab_head {}")
  refused(gpt, gpt2_policy(nil, { postprocess = function() end }),
    "changes which parameters are tied: the serial GPT2 ties lm_head.weight = wte.weight, the sharded one none")
  -- In a model written in Lua nothing says which layer is the output: the probe finds out.
  local Net = pt.nn.Module "ChecksNet"
  function Net:__init() self.up = pt.nn.Linear(6, 8); self.down = pt.nn.Linear(8, 6); self.head = pt.nn.Linear(6, 10) end
  function Net:forward(x) return self.head(self.down(self.up(x):tanh())) end
  local x = pt.randn(3, 6)
  group:broadcast(x, 0)
  refused(function() pt.manual_seed(3); return Net() end,
    P.policy { modules = { ChecksNet = { replace = { { "up", P.vocab_head {} }, { "down", P.row {} } } } } },
    "its output is not the vocabulary head's split logits", nil, x)
end)

test("malformed and conflicting policies are refused with the user's file:line", function()
  local function mlp() pt.manual_seed(1); return pt.models.mlp { sizes = { 8, 16, 4 } } end
  local x = pt.randn(2, 8)
  group:broadcast(x, 0)
  local function no(message, make_policy)
    local err = raises(make_policy, message)
    user_located(err)
  end
  no("modules.MLP.replace must be a list of { \"path\", P.<style> {...} } entries, but it has the key", function()
    P.policy { modules = { MLP = { replace = { ["0"] = P.column {}, ["2"] = P.row {} } } } } end)
  no("ignore_if_missing must be a boolean, got string", function()
    P.policy { modules = { MLP = { replace = { { "0", P.column {}, ignore_if_missing = "no" } } } } } end)
  no("policy has no field 'modlues'", function() P.policy { modlues = {} } end)
  no("pipeline has no field 'stages'", function() P.policy { modules = { MLP = {} }, pipeline = { stages = 2 } } end)
  no("policy field 'targets' must be a table, got string", function() P.policy { targets = "MLP", modules = { MLP = {} } } end)
  no("policy field 'targets': entry 1 must be a model type (a string), got number", function()
    P.policy { targets = { 3 }, modules = { MLP = {} } } end)
  no("P.column option 'fused' must be a whole number of parts >= 1, got 0", function() P.column { fused = 0 } end)
  no("modules.MLP.attributes: 'x' is set to nan", function() P.policy { modules = { MLP = { attributes = { x = 0 / 0 } } } } end)
  no("policy field 'ties': entry 1 must be a pair of parameter names", function()
    P.policy { modules = { MLP = {} }, ties = { { "0.weight" } } } end)
  refused(mlp, P.policy { modules = { MLP = { replace = { { "0", P.column {} }, { "2", P.row {} } } } },
                          ties = { { "0.weight", "2.wieght" } } }, "ties[1]: '2.wieght' is not a parameter of MLP", nil, x)
  -- Conflicts: found against the model, when applied.
  refused(mlp, P.policy { modules = { MLP = { replace = { { "0", P.column {} }, { "2", P.row {} } } },
                                      ["0"] = { methods = { forward = function(self, y) return self:own_forward(y) end } } } },
    "the method forward of 0 set by modules.0 would be lost: 0 is replaced by modules.MLP.replace[1]", nil, x)
  no("modules.2.replace[1]: the path is empty", function()
    P.policy { modules = { ["2"] = { replace = { { "", P.row {} } } } } } end)
  refused(mlp, P.policy { modules = { MLP = { replace = { { "0", P.column {} }, { "2", P.row {} }, { "0", P.column {} } } } } },
    "0 is changed twice: by modules.MLP.replace[1]", nil, x)
  refused(mlp, P.policy { modules = { ["%d"] = { replace = { { "0", P.column {} } } } } }, "modules.%d matches no module of MLP", nil, x)
  refused(mlp, P.policy { modules = { ["h.[0"] = { replace = { { "0", P.column {} } } } } }, "modules.h.[0 matches no module", nil, x)
  -- Policy files: the tail call `return P.policy {...}` drops the file's frame; the line is found again.
  local err = raises(function() require "bad_policies.targets_string" end, "policy field 'targets' must be a table, got string")
  ok(err:find("bad_policies/targets_string.lua:5:", 1, true), "names the P.policy line of the file: " .. err)
  err = raises(function() require "bad_policies.local_form" end, "policy has no field 'postproces'")
  ok(err:find("bad_policies/local_form.lua:4:", 1, true), "names the P.policy line of the file: " .. err)
  err = refused(mlp, require "bad_policies.magic_key", "modules.%d matches no module of MLP", nil, x, nil, "bad_policies/magic_key.lua")
  ok(err:find("magic_key.lua:7:", 1, true), "names the style's line in the file: " .. err)
  err = refused(mlp, require "bad_policies.plain_table", "modules.MLP.replace must be a list", nil, x, nil, "bad_policies/plain_table.lua")
  -- pt.mesh's errors name this file, not partrain's.
  err = raises(function() pt.mesh { tensor = 3 } end, "tensor")
  user_located(err)
  err = raises(function() pt.mesh { tensr = 2 } end, "unknown option 'tensr'")
  user_located(err)
end)

test("a refused policy leaves the model exactly as it was, whatever step refused it", function()
  local Block = pt.nn.Module "UndoBlock"
  function Block:__init() self.up = pt.nn.Linear(6, 8); self.down = pt.nn.Linear(8, 6); self.scale = 1 end
  function Block:forward(x) return x + self.down(self.up(x):tanh()) * self.scale end
  local Net = pt.nn.Module "UndoNet"
  function Net:__init() self.a = Block(); self.b = Block(); self.head = pt.nn.Linear(6, 4); self.tag = "net" end
  function Net:forward(x) return self.head(self.b(self.a(x))) end
  local function net() pt.manual_seed(4); return Net() end
  local x = pt.randn(3, 6)
  group:broadcast(x, 0)
  local fields = { [""] = { "tag" }, a = { "scale" }, b = { "scale" } }
  local good = { UndoBlock = { replace = { { "up", P.column {} }, { "down", P.row {} } } } }
  -- Everything a preprocess can do to a model, before the refusal.
  local function vandal(model)
    model:set("head", pt.nn.Linear(6, 4))
    pt.no_grad(function() model.a.up.weight:mul_(3) end)
    model.a.down.bias:requires_grad_(false)
    model.b:replace_forward(function(self, y) return y end)
    model.a.scale, model.tag = 5, "changed"
    model.a:register_parameter("extra", pt.zeros(2):requires_grad_(true))
  end
  local function with(spec) spec.modules = spec.modules or good; return P.policy(spec) end
  refused(net, with { preprocess = function(m) vandal(m); error("boom") end }, "preprocess of policy ? failed:", nil, x, fields)
  refused(net, with { preprocess = vandal, modules = { Nothing = { replace = { { "up", P.column {} } } } } },
    "modules.Nothing matches no module", nil, x, fields)
  refused(net, with { preprocess = vandal, modules = function() error("no modules today") end }, "modules(cfg) of policy ? failed:",
    nil, x, fields)
  refused(net, with { postprocess = function(m) vandal(m); error("late") end }, "postprocess of policy ? failed:", nil, x, fields)
  refused(net, with { postprocess = function(m) m.a.up.weight = m.a.down.weight end }, "holds a weight of", nil, x, fields)
  refused(net, with { modules = { UndoBlock = { replace = { { "up", P.column {} }, { "down", P.row {} } },
                                                methods = { forward = function(self, y) return y * 2 end } } } },
    "its output differs from the serial model's", nil, x, fields)
  refused(net, with { postprocess = function(m) vandal(m); while true do end end }, "did not finish within policy_timeout = 1 s",
    { policy_timeout = 1 }, x, fields)
  refused(net, with {}, "unknown option 'bucket_cap'", { bucket_cap = 3 }, x, fields)
end)

test("the probe: on by default, off with probe = false, fed the given input, and invisible to the RNG", function()
  -- A replaced forward that computes something else (each block's output scaled).
  local scaled = { forward = function(self, y) local out = self:own_forward(y); return out * 1.5 end }
  local policy = gpt2_policy(function(m) m.GPT2Block.methods = scaled end)
  refused(gpt, policy, "its output differs from the serial model's on the probe batch")
  local model = pt.parallelize(gpt(), policy, mesh, { probe = false })
  ok(model.h:get("0"):forward_replaced(), "probe = false: accepted")
  -- A given input: a sequence too long for the model is the serial model's failure, named so.
  refused(gpt, gpt2_policy(), "the serial GPT2 fails on the probe input", { probe = ids(GPT.vocab, 1, 9) })
  pt.parallelize(gpt(), gpt2_policy(), mesh, { probe = ids(GPT.vocab, 1, 6) })
  -- The RNG stream after parallelize is the same with and without the probe.
  pt.manual_seed(11); pt.parallelize(pt.models.gpt2(GPT), "policies.gpt2", mesh); local a = pt.randn(4)
  pt.manual_seed(11); pt.parallelize(pt.models.gpt2(GPT), "policies.gpt2", mesh, { probe = false }); local b = pt.randn(4)
  near(a, b, 0, "the same random numbers follow")
end)

test("ranks seeded differently are cut from tensor rank 0's serial model, replicated parameters too", function()
  pt.manual_seed(20 + group:rank())
  local mine = pt.models.gpt2(GPT)
  pt.manual_seed(20)
  local first = pt.models.gpt2(GPT)  -- rank 0's serial model, made on every rank
  local model = pt.parallelize(mine, nil, mesh)
  local x = ids(GPT.vocab, 2, 8)
  near(pt.tp.gather_logits(model(x)), first(x), 1e-5, "the sharded model computes rank 0's serial model")
  near(model.wpe.weight, first.wpe.weight, 0, "a replicated parameter is rank 0's")
  near(model.h:get("0").ln_1.weight, first.h:get("0").ln_1.weight, 0, "a LayerNorm's weight is rank 0's")
end)

test("policy code is bounded in time: an endless preprocess is interrupted, naming where", function()
  local function mlp() return pt.models.mlp { sizes = { 8, 16, 4 } } end
  local x = pt.randn(2, 8)
  group:broadcast(x, 0)
  local line = debug.getinfo(1, "l").currentline + 2
  local policy = P.policy { name = "loop", modules = { MLP = { replace = { { "0", P.column {} }, { "2", P.row {} } } } },
                            preprocess = function() while true do end end }
  local start = pt.time()
  local err = refused(mlp, policy, "preprocess of policy loop failed: did not finish within policy_timeout = 1 s (interrupted at ",
    { policy_timeout = 1 }, x)
  ok(err:find(HERE .. ":" .. line .. ")", 1, true), "names the line it was interrupted at: " .. err)
  ok(pt.time() - start < 30, "interrupted in time")
  ok(jit.status(), "the JIT is back on")
  -- A loop that catches every error still ends.
  refused(mlp, P.policy { modules = { MLP = { replace = { { "0", P.column {} }, { "2", P.row {} } } } },
                          postprocess = function() while true do pcall(function() for _ = 1, 10 do end end) end end },
    "postprocess of policy ? failed: did not finish", { policy_timeout = 1 }, x)
end)

test("plain cross_entropy on vocabulary-split logits gives the serial loss; argmax, topk, softmax, sampling refuse", function()
  pt.manual_seed(5)
  local serial = pt.models.gpt2(GPT)
  pt.manual_seed(5)
  local model = pt.parallelize(pt.models.gpt2(GPT), nil, mesh)
  local x, y = ids(GPT.vocab, 2, 8), ids(GPT.vocab, 2, 8)
  local logits, whole = model(x), serial(x)
  eq(logits.shape[3], 128, "this rank's half of the padded vocabulary")
  near(pt.nn.cross_entropy(logits, y), pt.nn.cross_entropy(whole, y), 1e-5, "plain cross_entropy")
  near(pt.nn.cross_entropy(logits:view(-1, 128), y:view(-1)), pt.nn.cross_entropy(whole, y), 1e-5, "on a view(-1, V/t)")
  near(pt.loss_fn(model)(logits, y), pt.nn.cross_entropy(whole, y), 1e-5, "pt.loss_fn")
  local masked = y:masked_fill(y:lt(100), -100)
  near(pt.nn.cross_entropy(logits, masked), pt.nn.cross_entropy(whole, masked), 1e-5, "with ignored targets")
  raises(function() pt.nn.cross_entropy(logits, masked, { ignore_index = 7 }) end, "target -100 is outside the vocabulary [0, 255)")
  local err = raises(function() pt.nn.cross_entropy(logits:view(2, -1), y:select(1, 0)) end, "use pt.loss_fn(model)")
  user_located(err)
  -- (Not tail calls: a tail call would drop the line these errors name.)
  for name, fn in pairs {
    argmax = function() local r = logits:argmax(-1); return r end,
    topk = function() local r = logits:topk(5); return r end,
    softmax = function() local r = (logits / 0.8):softmax(-1); return r end,
    log_softmax = function() local r = logits:float():log_softmax(2); return r end,
    max = function() local r = logits:max(-1); return r end,
    multinomial = function() local r = logits:select(1, -1):exp():multinomial(1); return r end,
  } do
    err = raises(fn, name .. " over vocabulary-split logits: this rank holds 128 of the 256 vocabulary columns")
    ok(err:find("pt.tp.gather_logits(logits)", 1, true), "says how to gather them: " .. err)
    user_located(err)
  end
  near(logits:softmax(1), logits:softmax(1), 0, "softmax over the positions is each column's own")
  local full = pt.tp.gather_logits(logits)
  near(full, whole, 1e-5, "gathered logits, padding dropped")
  eq(full:argmax(-1):equal(whole:argmax(-1)), true, "argmax of the gathered logits")
  err = raises(function() pt.loss_fn(model)(full, y) end, "are not the split output of GPT2's vocabulary head")
  user_located(err)
end)

test("vocabulary-parallel cross-entropy keeps float64: equal to serial within 1e-12, GPT-2 too", function()
  local vocab = 9
  local whole = pt.randn(6, vocab, { dtype = "float64" })
  group:broadcast(whole, 0)
  local targets = ids(vocab, 1, 6):view(-1)
  local mine = pt.tp.shard(pt.cat({ whole, pt.zeros(6, 1, { dtype = "float64" }) }, 1), 1, group:rank(), 2):detach()
  mine.requires_grad = true
  local serial_in = whole:detach():clone()
  serial_in.requires_grad = true
  local lp = pt.tp.cross_entropy(mine, targets, group, vocab)
  local ls = pt.nn.cross_entropy(serial_in, targets)
  eq(lp.dtype, "float64", "the loss stays float64")
  near(lp, ls, 1e-12, "float64 loss")
  lp:backward(); ls:backward()
  eq(mine.grad.dtype, "float64")
  local want = pt.tp.shard(pt.cat({ serial_in.grad, pt.zeros(6, 1, { dtype = "float64" }) }, 1), 1, group:rank(), 2)
  near(mine.grad, want, 1e-12, "float64 gradient")
  pt.manual_seed(9)
  local serial = pt.models.gpt2(GPT):to("float64")
  pt.manual_seed(9)
  local model = pt.parallelize(pt.models.gpt2(GPT):to("float64"), nil, mesh)
  local x, y = ids(GPT.vocab, 2, 8), ids(GPT.vocab, 2, 8)
  local ls2, lp2 = pt.nn.cross_entropy(serial(x), y), pt.loss_fn(model)(model(x), y)
  eq(lp2.dtype, "float64")
  near(lp2, ls2, 1e-12, "GPT-2 in float64 under tensor 2")
  ls2:backward(); lp2:backward()
  near(pt.tp.gather(model, "h.0.attn.c_attn.weight", model.h:get("0").attn.c_attn.weight.grad),
    serial.h:get("0").attn.c_attn.weight.grad, 1e-10, "a float64 gradient")
end)

H.run()
