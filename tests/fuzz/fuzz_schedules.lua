-- Fuzzes pipeline schedules through real training at pipeline 2 or 4 (as many ranks): a shipped
-- schedule's lowered plan (gpipe, 1f1b, interleaved, zbh1 or zbh2 with 1 chunk; interleaved, gpipe
-- or zbv, V layout and split backwards, with 2; its sends and receives spelled out) gets one to
-- three seeded mutations (actions swapped, moved within a list or to another rank's, deleted or
-- duplicated; a micro-batch, chunk, peer or op changed; an action written as text or without its
-- chunk; every transfer left out, for lowering to add again; a W added, or a rank's W's all left
-- out so that its backwards run whole; the layout changed; ill-formed entries, holes and keys) and
-- goes to pt.parallelize as the schedule function.
--   * Refused: on both ranks alike, at this file's line, before anything is sent (else the next
--     cases would read its messages, or hang until --timeout ends the job).
--   * Accepted: two train_steps of a float64 GPT-2 whose losses and gradients must equal a shipped
--     schedule's of the same layout (1e-10): whatever the pre-flight check lets through runs right.
-- (tests/lua/test_schedules.lua checks the verdicts themselves against a second validator.)
--   partrain --nproc-per-node 2|4 --threads 1 --timeout 30 tests/fuzz/fuzz_schedules.lua [--seed 1] [--cases 1000]
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local pipeline = require "partrain.pipeline"
local cfg = pt.args { seed = 1, cases = 1000, verbose = false }
local world = pt.dist.world_size()
assert(world == 2 or world == 4, "run at 2 or 4 ranks (pipeline 2 or 4), got " .. world)

local rng = H.rng(cfg.seed)
local pick = rng.pick

local OPS = { "F", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B" }
local COMM = { SEND_F = true, RECV_F = true, SEND_B = true, RECV_B = true }
local copy = H.shallow_copy

-- A shipped schedule's lowered plan as plain tables, and its sizes.
local function base()
  local pp = world
  local chunks = rng.int(1, 2)
  local name = chunks > 1 and pick { "interleaved", "gpipe", "zbv" } or pick { "gpipe", "1f1b", "interleaved", "zbh1", "zbh2" }
  local m = name == "interleaved" and pp * rng.int(1, 2) or rng.int(1, 4)
  local lowered = pipeline.build(name, pp, m, chunks)
  local plan = { layout = lowered.layout }
  for r = 0, pp - 1 do
    plan[r] = {}
    for i, a in ipairs(lowered[r]) do plan[r][i] = copy(a) end
  end
  return plan, pp, m, chunks, name
end

-- The mutations: each changes the plan in place and says what it did.
local function rank_of(plan, pp) local r = rng.int(0, pp - 1); return r, plan[r] end
local MUTATIONS = {
  { 4, function(plan, pp)
    local r, l = rank_of(plan, pp)
    if #l < 2 then return "nothing to swap" end
    local i = rng.int(1, #l - 1)
    l[i], l[i + 1] = l[i + 1], l[i]
    return ("rank %d: swap %d and %d"):format(r, i, i + 1)
  end },
  { 4, function(plan, pp)  -- within its list (3 in 4) or to a rank's list drawn at random
    local r, l = rank_of(plan, pp)
    local s = rng.int(0, 3) > 0 and r or rng.int(0, pp - 1)
    if #l == 0 or type(plan[s]) ~= "table" then return "nothing to move" end
    local i = rng.int(1, #l)
    local a = table.remove(l, i)
    local j = rng.int(1, #plan[s] + 1)
    table.insert(plan[s], j, a)
    return ("rank %d: move %d to rank %d's %d"):format(r, i, s, j)
  end },
  { 2, function(plan, pp)
    local r, l = rank_of(plan, pp)
    if #l < 2 then return "nothing to swap" end
    local i, j = rng.int(1, #l), rng.int(1, #l)
    l[i], l[j] = l[j], l[i]
    return ("rank %d: swap %d and %d"):format(r, i, j)
  end },
  { 1, function(plan, pp)
    local r, l = rank_of(plan, pp)
    if #l == 0 then return "nothing to delete" end
    local i = rng.int(1, #l)
    table.remove(l, i)
    return ("rank %d: delete %d"):format(r, i)
  end },
  { 1, function(plan, pp)
    local r, l = rank_of(plan, pp)
    if #l == 0 then return "nothing to copy" end
    local i, j = rng.int(1, #l), rng.int(1, #l + 1)
    table.insert(l, j, copy(l[i]))
    return ("rank %d: copy %d to %d"):format(r, i, j)
  end },
  { 2, function(plan, pp, m, chunks)
    local r, l = rank_of(plan, pp)
    if #l == 0 then return "nothing to change" end
    local i = rng.int(1, #l)
    if type(l[i]) ~= "table" then return "not a table" end
    local a, field = copy(l[i]), pick { "mb", "chunk", "peer", "op" }
    if field == "mb" then a.mb = rng.int(-1, m)
    elseif field == "chunk" then a.chunk = rng.int(-1, chunks)
    elseif field == "peer" then a.peer = rng.int(-1, pp)
    else
      a.op = pick(OPS)
      if COMM[a.op] and a.peer == nil and rng.int(0, 3) > 0 then a.peer = rng.int(0, pp - 1) end
      if not COMM[a.op] and a.peer ~= nil and rng.int(0, 3) > 0 then a.peer = nil end
    end
    l[i] = a
    return ("rank %d: action %d's %s"):format(r, i, field)
  end },
  { 1, function(plan, pp)  -- the same action as text (valid), or its chunk left out
    local r, l = rank_of(plan, pp)
    if #l == 0 then return "nothing to write" end
    local i = rng.int(1, #l)
    if type(l[i]) ~= "table" then return "not a table" end
    if rng.int(0, 1) == 0 then l[i] = pipeline.format(l[i]) else l[i] = copy(l[i]); l[i].chunk = nil end
    return ("rank %d: action %d as text or without its chunk"):format(r, i)
  end },
  { 1, function(plan)  -- every transfer left out: lowering adds them again
    for r = 0, #plan do
      local l, kept = plan[r], {}
      if type(l) == "table" then
        for _, a in ipairs(l) do if type(a) ~= "table" or not COMM[a.op] then kept[#kept + 1] = a end end
        plan[r] = kept
      end
    end
    return "transfers left out"
  end },
  { 1, function(plan, pp, m, chunks)  -- a W: a second one, one before its B, or a split
    local r, l = rank_of(plan, pp)
    local i, mb, c = rng.int(1, #l + 1), rng.int(0, m - 1), rng.int(0, chunks - 1)
    table.insert(l, i, { op = "W", mb = mb, chunk = c })
    return ("rank %d: W%d.c%d at %d"):format(r, mb, c, i)
  end },
  { 1, function(plan, pp)  -- a rank's W's left out: its backwards run whole (valid)
    local r, l = rank_of(plan, pp)
    local kept = {}
    for _, a in ipairs(l) do if type(a) ~= "table" or a.op ~= "W" then kept[#kept + 1] = a end end
    plan[r] = kept
    return ("rank %d: its W's left out"):format(r)
  end },
  { 1, function(plan)
    local layout = pick { "v", "interleaved", "none", "V" }
    plan.layout = layout ~= "none" and layout or nil
    return "layout " .. layout
  end },
  { 1, function(plan, pp)
    local r, l = rank_of(plan, pp)
    local i = rng.int(1, math.max(#l, 1))
    local what = rng.int(1, 9)
    local function entry() return type(l[i]) == "table" and copy(l[i]) or { op = "F", mb = 0 } end
    if what == 1 then local a = entry(); a.extra = 1; l[i] = a
    elseif what == 2 then local a = entry(); a.mb = 0.5; l[i] = a
    elseif what == 3 then local a = entry(); a.mb = 0 / 0; l[i] = a
    elseif what == 4 then l[i] = pick { 42, true, "F", "F0.c0->1", "SEND_F0.c0<-1", "X0", "" }
    elseif what == 5 then l[#l + 2] = { op = "F", mb = 0, chunk = 0 }
    elseif what == 6 then plan[pp] = {}
    elseif what == 7 then plan.name = 5
    elseif what == 8 then plan[r] = "F0"
    else local a = entry(); a.chunk = 2^53; l[i] = a end
    return ("rank %d: ill-formed (%d)"):format(r, what)
  end },
}
local WEIGHT = 0
for _, m in ipairs(MUTATIONS) do WEIGHT = WEIGHT + m[1] end
local function mutate(plan, pp, m, chunks)
  local done = {}
  for _ = 1, rng.int(1, 3) do
    for r = 0, pp - 1 do if type(plan[r]) ~= "table" then return table.concat(done, "; ") end end
    local w = rng.int(1, WEIGHT)
    for _, mu in ipairs(MUTATIONS) do
      w = w - mu[1]
      if w <= 0 then done[#done + 1] = mu[2](plan, pp, m, chunks); break end
    end
  end
  return table.concat(done, "; ")
end

local here = debug.getinfo(1, "S").short_src
local counts, bad = { accepted = 0, refused = 0 }, {}
local function report(case, what, msg) bad[#bad + 1] = ("case %d (%s): %s"):format(case, what, msg) end

local gpt = { vocab = 16, seq = 4, dim = 8, heads = 2, layers = 2 * world }  -- 2 chunks a rank
local mesh = pt.mesh { pipeline = world }
local batches = {}
for s = 1, 2 do  -- 24 rows: every micro-batch count the cases draw divides them
  local x, y = pt.randint(0, gpt.vocab, { 24, gpt.seq }), pt.randint(0, gpt.vocab, { 24, gpt.seq })
  mesh:group("world"):broadcast(x, 0); mesh:group("world"):broadcast(y, 0)
  batches[s] = { x, y }
end

-- Two train_steps of a fresh float64 GPT-2 under the schedule: each step's loss and gradients.
local function train(schedule, m, chunks)
  pt.manual_seed(3)
  local model = pt.parallelize(pt.models.gpt2(gpt):to("float64"), "policies.gpt2", mesh,
    { schedule = schedule, microbatches = m, chunks = chunks })
  local steps = {}
  for s = 1, 2 do
    model:zero_grad()
    local loss = model:train_step(batches[s][1], batches[s][2])
    local grads = {}
    for n, p in model:named_parameters() do grads[n] = p.grad and p.grad:clone() end
    steps[s] = { loss = loss:item(), grads = grads }
  end
  return steps
end

local references = {}
local function differs(got, want)
  for s = 1, 2 do
    local g, w = got[s], want[s]
    if math.abs(g.loss - w.loss) > 1e-10 * math.max(1, math.abs(w.loss)) then
      return ("step %d: loss %.17g, the shipped schedule's %.17g"):format(s, g.loss, w.loss)
    end
    for n, t in pairs(w.grads) do
      local u = g.grads[n]
      if (u == nil) ~= (t == nil) then return ("step %d: %s has a gradient in one run only"):format(s, n) end
      local err = (u - t):abs():max():item()
      if err > 1e-10 * math.max(1, t:abs():max():item()) then
        return ("step %d: %s's gradient differs by %.3e"):format(s, n, err)
      end
    end
  end
end

-- One case: the mutant is refused at this line, or trains as a shipped schedule of its layout
-- does (any valid order, split or fused, gives the same gradients; the layout decides which
-- stages, so which parameters, a rank holds).
local function check_case(case)
  local plan, pp, m, chunks, name = base()
  local what = ("%s pp=%d m=%d chunks=%d: %s"):format(name, pp, m, chunks, mutate(plan, pp, m, chunks))
  if cfg.verbose then io.stderr:write(("case %d %s\n"):format(case, what)) end
  local v = chunks > 1 and plan.layout == "v"
  local reference = chunks == 1 and "1f1b" or v and "zbv" or "gpipe"
  local key = ("%s/%d/%d"):format(reference, m, chunks)
  references[key] = references[key] or train(reference, m, chunks)
  local ok, got = pcall(train, function() return plan end, m, chunks)
  if ok then
    counts.accepted = counts.accepted + 1
    local diff = differs(got, references[key])
    if diff then report(case, what, "trains differently: " .. diff) end
  else
    counts.refused = counts.refused + 1
    local err = tostring(got)
    if not err:find("^" .. here:gsub("%p", "%%%0") .. ":%d+: pipeline schedule '[^']*': ") then
      report(case, what, "not refused at this file's line as a pipeline schedule: " .. err)
    end
  end
end

for case = 1, cfg.cases do check_case(case) end
local n = pt.tensor({ counts.accepted })  -- every rank ran every case the same way
pt.dist.world():all_reduce(n, "sum")
assert(n:item() == world * counts.accepted, "the ranks' verdicts diverged")
print(("fuzz.schedules: seed %d, %d cases at pipeline %d: %d accepted and trained as a shipped schedule of their layout, %d refused, %d faults"):format(
  cfg.seed, cfg.cases, world, counts.accepted, counts.refused, #bad))
for _, line in ipairs(bad) do print("  " .. line) end
if #bad > 0 then os.exit(1) end
