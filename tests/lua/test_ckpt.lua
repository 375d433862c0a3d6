-- pt.ckpt in one process: a save and load restore weights, optimizer state, the data position
-- and the user table exactly; num_kept and newest; bad input is refused by name; and the model's
-- configuration is recorded, a model of other heads (same shapes) refused, another dropout not.
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local test, eq, raises, ok = H.test, H.eq, H.raises, H.ok

local dir = os.tmpname()
os.remove(dir)

local function setup(seed)
  pt.manual_seed(seed)
  local model = pt.models.mlp { sizes = { 6, 8, 3 } }
  local opt = pt.optim.adamw(model, { lr = 0.01 })
  local data = pt.data.text { path = "data/kjv.txt", seq = 6, batch = 4, seed = 3 }
  return model, opt, data
end

local function train_step(model, opt, data)
  local x = data:next()
  local loss = pt.nn.cross_entropy(model(x:narrow(1, 0, 6):to("float32")), pt.tensor({ 0, 1, 2, 0 }, { dtype = "int64" }))
  opt:zero_grad()
  loss:backward()
  opt:step()
  return loss:item()
end

test("save then load restores weights, optimizer state, data position and the user table", function()
  local model, opt, data = setup(1)
  for _ = 1, 3 do train_step(model, opt, data) end
  local tag = pt.ckpt.save(dir, { model = model, optim = opt, data = data, step = 3,
                                  user = { best = 0.25, name = "run", tags = { "a", "b" }, nested = { ok = true } } })
  eq(tag, "step-00000003")
  eq(pt.ckpt.newest(dir), tag)
  local want = { train_step(model, opt, data), train_step(model, opt, data) }

  local other, other_opt, other_data = setup(2)
  local r = pt.ckpt.load(dir, { model = other, optim = other_opt, data = other_data })
  eq(r.step, 3)
  eq(r.user.best, 0.25)
  eq(r.user.name, "run")
  eq(r.user.tags[2], "b")
  eq(r.user.nested.ok, true)
  eq(other_opt:steps(), 3)
  local got = { train_step(other, other_opt, other_data), train_step(other, other_opt, other_data) }
  eq(got[1], want[1], "the first step after loading")
  eq(got[2], want[2], "the second step after loading")
end)

-- A run resumed with another batch size: the position is not a whole number of its batches, and
-- the batch holding it is taken again. That had gone unsaid.
test("a data position that is not a whole number of the loader's batches is said, with the samples seen again", function()
  local where = os.tmpname() .. "-batch"
  local model, opt, data = setup(1)
  for _ = 1, 3 do data:next() end  -- 12 samples of batches of 4
  pt.ckpt.save(where, { model = model, optim = opt, data = data, step = 3 })
  local wider = pt.data.text { path = "data/kjv.txt", seq = 6, batch = 8, seed = 3 }
  local r = pt.ckpt.load(where, { model = model, optim = opt, data = wider })
  eq(wider:samples_seen(), 8, "the batch of 8 holding sample 12 is taken again")
  ok(r.notes[1] and r.notes[1]:find("the data position, 12 samples, is not a whole number of this loader's batches of 8", 1, true)
     and r.notes[1]:find("resumes at 8, and 4 samples are seen again", 1, true), "the note: " .. tostring(r.notes[1]))
  local same = pt.data.text { path = "data/kjv.txt", seq = 6, batch = 4, seed = 3 }
  eq(#pt.ckpt.load(where, { model = model, optim = opt, data = same }).notes, 0, "the same batch size: no note")
  os.execute("rm -rf '" .. where .. "'")
end)

test("num_kept keeps the newest tags; resume on an empty folder is nil", function()
  local model, opt = setup(1)
  for step = 10, 14 do pt.ckpt.save(dir, { model = model, optim = opt, step = step, num_kept = 2 }) end
  local tags = pt.ckpt.tags(dir)
  eq(#tags, 2)
  eq(tags[1], "step-00000013")
  eq(tags[2], "step-00000014")
  eq(pt.ckpt.resume(dir .. "-empty", { model = model }), nil)
  local r = pt.ckpt.load(dir, "step-00000013", { model = model })
  eq(r.step, 13)
end)

test("bad input is refused by name", function()
  local model, opt = setup(1)
  raises(function() pt.ckpt.save(dir, { model = model, bogus = 1 }) end, "unknown key 'bogus'")
  raises(function() pt.ckpt.save(dir, { optim = opt }) end, "'model' must be a module")
  raises(function() pt.ckpt.save(dir, { model = model, user = { f = print } }) end, "user.f holds a function")
  raises(function() pt.ckpt.save(dir, { model = model, num_kept = -1 }) end, "num_kept must be >= 0")
  raises(function() pt.ckpt.save(dir, { model = model, tag = "a/b" }) end, "bad checkpoint tag 'a/b'")
  raises(function() pt.ckpt.save(42, { model = model }) end, "folder name expected")
  raises(function() pt.ckpt.load(dir, { model = model, step = 3 }) end, "'step' is a key of save")
  raises(function() pt.ckpt.load(dir, "no-such-tag", { model = model }) end, "no checkpoint 'no-such-tag'")
  raises(function() pt.ckpt.load(dir .. "-empty", { model = model }) end, "no checkpoint in")
  local bigger = pt.models.mlp { sizes = { 6, 9, 3 } }
  raises(function() pt.ckpt.load(dir, { model = bigger }) end, "tensor '0.weight'")
  raises(function() pt.ckpt.load(dir, { model = model, optim = pt.optim.sgd(model, { lr = 0.1 }) }) end,
         "holds adamw state; the optimizer given is sgd")
  ok(true)
end)

test("the model's configuration is saved; a load refuses other heads or activation (same shapes), not another dropout", function()
  local cdir = dir .. "-config"
  local function gpt2(changes)
    local cfg = { vocab = 64, seq = 8, dim = 16, heads = 4, layers = 2 }
    for k, v in pairs(changes or {}) do cfg[k] = v end
    pt.manual_seed(5)
    return pt.models.gpt2(cfg)
  end
  local saved = gpt2()
  pt.ckpt.save(cdir, { model = saved, step = 1 })
  local f = assert(io.open(cdir .. "/step-00000001/summary.txt"))
  local summary = f:read("*a")
  f:close()
  ok(summary:find("model config: vocab=64, seq=8, dim=16, heads=4, layers=2, dropout=0, eps=1e-05, flash_attention=0",
                  1, true), "inspect shows the configuration: " .. summary)
  local other = gpt2 { heads = 2 }
  local before = other:state_dict()["h.0.attn.c_attn.weight"]:clone()
  raises(function() pt.ckpt.load(cdir, { model = other }) end,
         "the checkpoint '" .. cdir .. "/step-00000001' was saved by a GPT2 with heads=4; this one has heads=2")
  ok(other:state_dict()["h.0.attn.c_attn.weight"]:equal(before), "a refused load changes nothing")
  raises(function() pt.ckpt.load(cdir, { model = gpt2 { eps = 1e-6 } }) end, "with eps=1e-05; this one has eps=1e-06")
  local dropped = gpt2 { dropout = 0.1 }
  pt.ckpt.load(cdir, { model = dropped })
  ok(dropped:state_dict()["h.0.attn.c_attn.weight"]:equal(saved:state_dict()["h.0.attn.c_attn.weight"]),
     "a model of dropout 0.1 loads a checkpoint saved at 0")
  -- LLaMA: kv_heads as built (0: heads), so 0 and 4 are one model; rope_base and heads fixed.
  local llama = { vocab = 64, seq = 8, dim = 16, heads = 4, layers = 2 }
  pt.ckpt.save(cdir .. "-llama", { model = pt.models.llama(llama), step = 1 })
  llama.kv_heads = 4
  pt.ckpt.load(cdir .. "-llama", { model = pt.models.llama(llama) })
  llama.rope_base = 500000
  raises(function() pt.ckpt.load(cdir .. "-llama", { model = pt.models.llama(llama) }) end,
         "with rope_base=10000; this one has rope_base=500000")
  llama.rope_base, llama.heads, llama.kv_heads = nil, 8, 8  -- k_proj 8 heads x 2 = 4 x 4 rows: same shapes
  raises(function() pt.ckpt.load(cdir .. "-llama", { model = pt.models.llama(llama) }) end,
         "was saved by a Llama with heads=4; this one has heads=8")
  -- The MLP: its activation is a name, recorded as one (format 9); a dropout other than 0 may
  -- change (whether there is one at all changes the layers' names).
  local function mlp(activation, dropout)
    pt.manual_seed(5)
    return pt.models.mlp { sizes = { 6, 8, 8, 3 }, activation = activation, dropout = dropout or 0.1 }
  end
  pt.ckpt.save(cdir .. "-mlp", { model = mlp(), step = 1 })
  f = assert(io.open(cdir .. "-mlp/step-00000001/summary.txt"))
  summary = f:read("*a")
  f:close()
  ok(summary:find("model config: activation=ReLU", 1, true), "inspect shows the activation: " .. summary)
  local gelu = mlp "GELU"
  before = gelu:state_dict()["0.weight"]:clone()
  raises(function() pt.ckpt.load(cdir .. "-mlp", { model = gelu }) end,
         "was saved by an MLP with activation=ReLU; this one has activation=GELU, which computes another function "
         .. "with the same shapes: build it with activation=ReLU")
  ok(gelu:state_dict()["0.weight"]:equal(before), "a refused load changes nothing")
  pt.ckpt.load(cdir .. "-mlp", { model = mlp("ReLU", 0.25) })
  os.execute("rm -rf '" .. cdir .. "' '" .. cdir .. "-llama' '" .. cdir .. "-mlp'")
end)

-- What would not come back as it was saved is refused at save: a list with holes came back with
-- its values in other slots, NaN and infinity as nil; another model's optimizer was saved as
-- this model's (a step count with no moments).
test("user values that would not round-trip, and another model's optimizer, are refused at save", function()
  local m = pt.models.mlp { sizes = { 4, 8, 2 } }
  local where = os.tmpname() .. "-user"
  raises(function() pt.ckpt.save(where, { model = m, user = { [1] = 1, [3] = 3 } }) end,
    "user is not a list of elements 1 to")
  raises(function() pt.ckpt.save(where, { model = m, user = { 1, 2, x = 3 } }) end, "user is not a list of elements 1 to 2 alone: it also has the key 'x'")
  raises(function() pt.ckpt.save(where, { model = m, user = { x = 0 / 0 } }) end, "user.x is NaN")
  raises(function() pt.ckpt.save(where, { model = m, user = { y = { 1 / 0 } } }) end, "user.y[1] is infinite")
  raises(function() pt.ckpt.save(where, { model = m, optim = pt.optim.adamw(pt.models.mlp { sizes = { 4, 2 } }) }) end,
    "'optim' is not an optimizer of this model (it was made for a MLP)")
  raises(function() pt.ckpt.save(where, { model = m, optim = pt.optim.sgd({ pt.zeros(2):requires_grad_(true) }) }) end,
    "'optim' is not an optimizer of this model (it was made for other tensors)")
  local user = { 1, 2.5, { a = "x", b = { true, false } }, n = nil }
  pt.ckpt.save(where, { model = m, optim = pt.optim.adamw(m:parameters()), user = user })
  local got = pt.ckpt.load(where, nil, { model = m }).user
  eq(got[1], 1, "user[1]"); eq(got[2], 2.5, "user[2]"); eq(got[3].a, "x", "user[3].a")
  eq(got[3].b[1], true, "user[3].b[1]"); eq(got[3].b[2], false, "user[3].b[2]")
  os.execute("rm -rf '" .. where .. "'")
end)

-- A parameter without a gradient on some steps: AdamW skips it there, so its bias correction
-- counts fewer steps than the optimizer. A load had given it the optimizer's count (its weights
-- then moved otherwise than an uninterrupted run's).
local Sometimes = pt.nn.Module "Sometimes"
function Sometimes:__init()
  self.fc = pt.nn.Linear(4, 3); self.extra = pt.nn.Linear(3, 3)
end
function Sometimes:forward(x)
  local h = self.fc(x)
  if self.use_extra then h = self.extra(h) end
  return h
end

test("a parameter unused on some steps resumes with its own AdamW step count, bit for bit (float64)", function()
  local where = os.tmpname() .. "-steps"
  local function make()
    pt.manual_seed(5)
    local m = Sometimes():to("float64")
    return m, pt.optim.adamw(m, { lr = 0.05, weight_decay = 0.1 })
  end
  local function step(m, opt, k)
    pt.manual_seed(100 + k)
    local x, y = pt.randn({ 6, 4 }):double(), pt.randint(0, 3, { 6 })
    m.use_extra = k == 2 or k == 5  -- 'extra' steps on steps 2 and 5 only
    opt:zero_grad()
    pt.nn.cross_entropy(m(x), y):backward()
    opt:step()
  end
  local straight, sopt = make()
  for k = 1, 6 do step(straight, sopt, k) end
  local m, opt = make()
  for k = 1, 3 do step(m, opt, k) end
  local tag = pt.ckpt.save(where, { model = m, optim = opt, step = 3 })
  local summary = io.open(where .. "/" .. tag .. "/summary.txt"):read("a")
  ok(summary:find("parameters that stepped fewer times (no gradient on the others): extra.bias 1, extra.weight 1\n",
                  1, true), "the summary lists extra's 1 step, and fc (every step) not: " .. summary)
  local resumed, ropt = make()
  pt.ckpt.load(where, { model = resumed, optim = ropt })
  for k = 4, 6 do step(resumed, ropt, k) end
  local want = straight:state_dict()
  for name, t in pairs(resumed:state_dict()) do
    ok(t:equal(want[name]), name .. " equals the uninterrupted run's")
  end
  os.execute("rm -rf '" .. where .. "'")
end)

H.run()
os.execute("rm -rf '" .. dir .. "'")
return status
