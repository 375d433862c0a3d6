-- pt.progress: a training loop's progress, throughput and model FLOPs utilization (MFU): a live
-- line on rank 0's terminal, pt.log lines (and metrics records) every few steps, memory records
-- after the first step and at the end. pt.flops_per_token: a model's training FLOPs per token.
local core = require "partrain.core"
local raise = core._raise
local live = require "partrain.live"

local progress = {}

-- FLOPs ----------------------------------------------------------------------------------------

-- The sizes flops_per_token needs, from a built-in family's options (the table given to
-- pt.models.gpt2 / llama) or from a serial model's parameters.
local function sizes_of_options(family, o, level)
  local function size(key, fallback)
    local v = o[key]
    if v == nil then v = fallback end
    if type(v) ~= "number" or v % 1 ~= 0 or v < 0 then
      raise(("pt.flops_per_token: %s must be a whole number, got %s"):format(key, tostring(v)), level + 2)  -- size() is a frame more
    end
    return v
  end
  local s = { family = family, vocab = size("vocab"), dim = size("dim"), layers = size("layers") }
  local heads = size("heads")
  if heads == 0 or s.dim % heads ~= 0 then
    raise(("pt.flops_per_token: heads=%d does not divide dim=%d"):format(heads, s.dim), level + 1)
  end
  if family == "llama" then
    local kv = size("kv_heads", 0)
    s.kv_dim = (kv > 0 and kv or heads) * (s.dim / heads)
    local hidden = size("hidden", 0)
    s.hidden = hidden > 0 and hidden or math.floor((math.floor(8 * s.dim / 3) + 31) / 32) * 32
    s.tie = o.tie == true
  end
  return s
end

local function sizes_of_model(model, level)
  local family = core.model_families.family_of(model)
  if not family or (family.name ~= "gpt2" and family.name ~= "llama") then
    raise("pt.flops_per_token: a GPT-2 or LLaMA model (pt.models.gpt2 / llama) or a table of its options expected", level + 1)
  end
  if core.parallel.mesh(model) then
    raise("pt.flops_per_token: this model is parallelized, and a rank holds only its part: count the whole model "
      .. "before pt.parallelize, or pass its options ({ family = \"" .. family.name .. "\", vocab, dim, heads, layers, ... })",
      level + 1)
  end
  local shapes, layers = {}, 0
  local names, params = model:_named_parameters()
  for i, name in ipairs(names) do
    shapes[name] = params[i].shape
    local n = name:match("^h%.(%d+)%.") or name:match("^layers%.(%d+)%.")
    if n then layers = math.max(layers, tonumber(n) + 1) end
  end
  if family.name == "gpt2" then
    local wte = shapes["wte.weight"]
    return { family = "gpt2", vocab = wte[1], dim = wte[2], layers = layers }
  end
  local embed, k = shapes["embed_tokens.weight"], shapes["layers.0.self_attn.k_proj.weight"]
  local gate = shapes["layers.0.mlp.gate_proj.weight"]
  return { family = "llama", vocab = embed[1], dim = embed[2], layers = layers, kv_dim = k and k[1] or embed[2],
           hidden = gate and gate[1] or 0, tie = shapes["lm_head.weight"] == nil }
end

--- The non-embedding parameters a token's forward multiplies by (N of 6N): every weight and
--- bias of the blocks and final norm, and the output head (the vocabulary matrix once, tied or
--- not); position embeddings and an untied token embedding are lookups, not counted.
local function compute_parameters(s)
  local D, L, V = s.dim, s.layers, s.vocab
  if s.family == "gpt2" then
    -- A block: ln_1, ln_2 (2D each), c_attn (3D·D + 3D), attn.c_proj (D·D + D), c_fc (4D·D + 4D),
    -- mlp.c_proj (4D·D + D): 12D² + 13D. Then ln_f (2D) and lm_head (V·D, tied to wte).
    return L * (12 * D * D + 13 * D) + 2 * D + V * D
  end
  -- A block: two RMSNorms (D each), q_proj and o_proj (D·D each), k_proj and v_proj (D·kv_dim
  -- each), gate_proj, up_proj and down_proj (D·hidden each). Then norm (D) and lm_head (V·D).
  return L * (2 * D * D + 2 * D * s.kv_dim + 3 * D * s.hidden + 2 * D) + D + V * D
end

--- pt.flops_per_token(model_or_options, seq [, family]) -> FLOPs, parameters: the training
--- FLOPs (forward and backward) a token of a `seq`-token sequence costs the WHOLE model, as
--- PaLM (appendix B) and nanoGPT's estimate_mfu count them: 6·N + 12·layers·dim·seq, N the
--- parameters counted by compute_parameters above. The first argument is a serial (or deferred)
--- GPT-2 / LLaMA model, or the options table of pt.models.gpt2 / llama with family = "gpt2" or
--- "llama" (a parallelized model holds only its part: count before pt.parallelize).
function progress.flops_per_token(what, seq, level)
  level = level or 1
  if type(seq) ~= "number" or seq % 1 ~= 0 or seq < 1 then
    raise(("pt.flops_per_token: seq (tokens a sequence) must be a whole number >= 1, got %s"):format(tostring(seq)), level + 1)
  end
  local s
  if core.nn.is_module(what) then
    s = sizes_of_model(what, level + 1)
  elseif type(what) == "table" then
    if what.family ~= "gpt2" and what.family ~= "llama" then
      raise(("pt.flops_per_token: family must be \"gpt2\" or \"llama\", got %s"):format(tostring(what.family)), level + 1)
    end
    s = sizes_of_options(what.family, what, level + 1)
  else
    raise("pt.flops_per_token: a GPT-2 or LLaMA model or a table of its options expected, got " .. type(what), level + 1)
  end
  local n = compute_parameters(s)
  return 6 * n + 12 * s.layers * s.dim * seq, n
end

-- Peaks ----------------------------------------------------------------------------------------

-- Dense bfloat16 tensor-core peaks, TFLOP/s a GPU, from NVIDIA's datasheets (the figures there
-- are "with sparsity", twice these): H100 SXM 1,979 / H100 PCIe 1,513 / H100 NVL 1,671 (NVIDIA
-- H100 Tensor Core GPU datasheet), H200 SXM 1,979 / H200 NVL 1,671 (NVIDIA H200 datasheet),
-- A100 624 (NVIDIA A100 Tensor Core GPU datasheet, SXM and PCIe alike). First match wins.
local peaks = {
  { "H100.*PCIe", 756.5 }, { "H100 NVL", 835.5 }, { "H100", 989.4 },
  { "H200 NVL", 835.5 }, { "H200", 989.4 },
  { "A100", 312 },
}

--- The dense bf16 peak in TFLOP/s of a GPU named `name` ("NVIDIA H100 80GB HBM3") from the
--- table above, or nil when the table does not know it.
function progress.peak_of(name)
  for _, p in ipairs(peaks) do
    if name:match(p[1]) then return p[2] end
  end
  return nil
end

--- The dense bf16 peak of this rank's device in TFLOP/s, and the device's name; nil on the CPU
--- or on a GPU the table does not know.
function progress.device_peak()
  local device = tostring(core.device())
  if not device:match("^cuda") then return nil end
  local name = core.cuda.device_name(device)  -- this rank's own GPU (CUDA is up on a CUDA rank)
  return progress.peak_of(name), name
end

-- Progress -------------------------------------------------------------------------------------

local Progress = {}
Progress.__index = Progress

local option_kinds = {
  total = "integer", tokens = "number", flops_per_token = "number", peak_tflops = "number", every = "integer",
  seconds = "number", enabled = "boolean", memory = "boolean", model = "module", experts = "boolean",
}

local function human(x)
  if x >= 1e9 then return ("%.2fG"):format(x / 1e9) end
  if x >= 1e6 then return ("%.2fM"):format(x / 1e6) end
  if x >= 1e3 then return ("%.1fk"):format(x / 1e3) end
  return ("%.1f"):format(x)
end

local function bytes(b)
  if b >= 1e9 then return ("%.2f GB"):format(b / 1e9) end
  return ("%.1f MB"):format(b / 1e6)
end

local function duration(s)
  s = math.max(0, math.floor(s + 0.5))
  if s >= 3600 then return ("%dh%02dm"):format(math.floor(s / 3600), math.floor(s % 3600 / 60)) end
  if s >= 60 then return ("%dm%02ds"):format(math.floor(s / 60), s % 60) end
  return ("%ds"):format(s)
end

--- pt.progress { total, tokens, flops_per_token, peak_tflops, every, seconds, enabled, memory, model, experts }:
--- a progress object for a loop; create it just before the loop, call progress:step(step, fields)
--- once a step on every rank and progress:finish() after the loop (collectives: memory records).
---   total: the last step (for step/total and the ETA); tokens: tokens (or samples) of the GLOBAL
---   batch a step; flops_per_token: the whole model's (pt.flops_per_token); peak_tflops: one
---   device's peak (default: the device table on CUDA; none on the CPU); every: a pt.log line and
---   metrics record every this many steps (and at the first and the last; default 10); seconds:
---   without a terminal, also a line when this long has passed since the last (default 10, 0:
---   never); enabled: false for no live line and no timed lines (also PARTRAIN_PROGRESS=0,
---   partrain --no-progress); memory: false for no memory records (default true); model: the
---   model, whose state each rank holds goes in the memory records (pt.metrics.memory) and,
---   when it has MoE blocks, whose experts' load is written at each logged step
---   (pt.metrics.experts; experts: false for none).
function progress.new(opts, level)
  level = level or 1
  opts = opts or {}
  if type(opts) ~= "table" then raise("pt.progress: a table of options expected, got " .. type(opts), level + 1) end
  for k, v in pairs(opts) do
    local kind = option_kinds[k]
    if not kind then
      local known = {}
      for name in pairs(option_kinds) do known[#known + 1] = name end
      table.sort(known)
      raise(("pt.progress has no option %s (options: %s)"):format(core._key_text(k), table.concat(known, ", ")), level + 1)
    end
    local least = k == "every" and 1 or 0  -- a line every 0 steps means nothing
    local ok = (kind == "boolean" and type(v) == "boolean") or (kind == "module" and core.nn.is_module(v))
      or (type(v) == "number" and v == v and v >= least and v < math.huge and (kind ~= "integer" or v % 1 == 0))
    if not ok then
      raise(("pt.progress: %s must be %s, got %s"):format(k, kind == "boolean" and "true or false"
        or kind == "module" and "a module (the model)"
        or kind == "integer" and ("a whole number >= %d"):format(least) or "a finite number >= 0", tostring(v)), level + 1)
    end
  end
  local self = setmetatable({
    total = opts.total and opts.total > 0 and opts.total or nil,
    tokens = opts.tokens or 0,
    flops_per_token = opts.flops_per_token,
    every = opts.every or 10,
    seconds = opts.seconds or 10,
    memory = opts.memory ~= false,
    model = opts.model,
    experts = opts.experts ~= false,
    enabled = opts.enabled ~= false and os.getenv("PARTRAIN_PROGRESS") ~= "0",
    rank0 = core.dist.rank() == 0,
    world = core.dist.world_size(),
    created = core.now(),
  }, Progress)
  self.peak_tflops = opts.peak_tflops and opts.peak_tflops > 0 and opts.peak_tflops or nil
  if not self.peak_tflops then self.peak_tflops, self.device_name = progress.device_peak() end
  local terminal, columns = live.terminal()
  self.live = self.enabled and self.rank0 and terminal
  self.columns = columns
  local metrics = require "partrain.metrics"
  metrics.describe { peak_tflops = self.peak_tflops, flops_per_token = self.flops_per_token,
                     tokens_per_step = self.tokens > 0 and self.tokens or nil }
  return self
end

-- Throughput figures over `steps` steps that took `seconds`.
function Progress:rates(steps, seconds)
  local r = {}
  if self.tokens > 0 and seconds > 0 then
    r.tokens_per_s = self.tokens * steps / seconds
    if self.flops_per_token then
      r.tflops = r.tokens_per_s * self.flops_per_token / 1e12
      if self.peak_tflops then r.mfu = r.tflops / (self.peak_tflops * self.world) end
    end
  end
  return r
end

function Progress:line(step, fields, r, now)
  local parts = { self.total and ("step %d/%d"):format(step, self.total) or ("step %d"):format(step) }
  local loss = fields.loss
  if core.is_tensor(loss) and loss:numel() == 1 then loss = loss:item() end
  if type(loss) == "number" then parts[#parts + 1] = ("loss %.4f"):format(loss) end
  if r.tokens_per_s then parts[#parts + 1] = human(r.tokens_per_s) .. " tok/s" end
  if r.tflops then parts[#parts + 1] = ("%.3g TFLOP/s"):format(r.tflops) end
  if r.mfu then parts[#parts + 1] = ("MFU %.1f%%"):format(100 * r.mfu) end
  if self.total and self.first_done and step > self.first_step then
    local per_step = (now - self.first_done) / (step - self.first_step)
    parts[#parts + 1] = "ETA " .. duration(per_step * (self.total - step))
  end
  parts[#parts + 1] = "mem " .. bytes(require("partrain.metrics").peak_bytes())
  return table.concat(parts, " | ")
end

--- progress:step(step, fields): after step `step`; fields (loss, lr, ...: numbers, strings,
--- booleans or one-element tensors) are logged with tokens_per_s, tflops, mfu and mem_bytes
--- every `every` steps, at the first step and at `total`. Every rank calls it, each step.
function Progress:step(step, fields)
  if type(step) ~= "number" or step % 1 ~= 0 then
    raise("progress:step: the step (a whole number) expected as argument #1, got " .. tostring(step), 2)
  end
  fields = fields or {}
  if type(fields) ~= "table" then raise("progress:step: fields must be a table, got " .. type(fields), 2) end
  local now = core.now()
  if not self.first_step then
    self.first_step, self.first_done = step, now
    self.last_step, self.last_time = step - 1, self.created
  end
  self.recent = self.recent or { step = self.last_step, time = self.last_time }
  local logged = step == self.first_step or step % self.every == 0 or step == self.total
  local timed = not logged and self.enabled and not self.live and self.rank0 and self.seconds > 0
    and now - (self.printed or self.created) >= self.seconds
  if logged or timed then
    local record = self:rates(step - self.last_step, now - self.last_time)
    if logged and self.model and self.experts then
      -- A collective (on every rank: a logged step is every rank's): the experts record, and
      -- the router's fields in this step's (none for a model without MoE blocks).
      local metrics = require "partrain.metrics"
      for k, v in pairs(metrics.experts(step, self.model) or {}) do record[k] = v end
    end
    for k, v in pairs(fields) do record[k] = v end
    record.step = step
    record.mem_bytes = require("partrain.metrics").peak_bytes()
    local pt = require "partrain"
    local ok, err = pcall(pt.log, record)
    if not ok then pt._rethrow(err, 2) end
    self.last_step, self.last_time, self.printed = step, now, now
  end
  if self.live then
    -- The live line: the rate over the last second or so of steps, redrawn at most ten times a second.
    if logged or step == self.total or not self.drawn or now - self.drawn >= 0.1 then
      local r = self:rates(step - self.recent.step, now - self.recent.time)
      live.show(self:line(step, fields, r, now), self.columns)
      self.drawn = now
    end
  end
  if now - self.recent.time >= 1 then self.recent = { step = step, time = now } end
  if self.memory and step == self.first_step then
    local metrics = require "partrain.metrics"
    metrics.memory(step, self.model)
  end
  self.step_done = step
end

--- progress:finish(): ends the live line with a newline and writes the memory record of the
--- last step (a collective: every rank calls it).
function Progress:finish()
  live.finish()
  if self.memory and self.step_done and self.step_done ~= self.first_step then
    local metrics = require "partrain.metrics"
    metrics.memory(self.step_done, self.model)
  end
end

return progress
