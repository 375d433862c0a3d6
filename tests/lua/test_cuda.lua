-- pt.cuda and fused AdamW answer for the build they run in: on a CPU build (this machine, CI)
-- is_available() is false, device_count() 0, synchronize() does nothing and the rest raise "CUDA
-- is not available" from the caller's line; fused AdamW runs on the CPU (tests/lua/test_optim.lua
-- compares it with the unfused update). On a CUDA build with a device the same calls report the
-- caching allocator's counters, and fused AdamW on CUDA tracks the unfused update; the experts'
-- grouped matmul equals the loop over experts on whichever device there is.
package.path = "tests/lua/?.lua;" .. package.path
local pt = require "partrain"
local H = require "harness"
local test, ok, eq, raises = H.test, H.ok, H.eq, H.raises
local this_file = debug.getinfo(1, "S").short_src

local cuda = pt.cuda.is_available()

test("pt.cuda: is_available, device_count and synchronize answer without a device", function()
  eq(type(cuda), "boolean", "is_available() is a boolean")
  if not cuda then
    eq(pt.cuda.device_count(), 0, "device_count() without CUDA")
    eq(pt.cuda.synchronize(), nil, "synchronize() without CUDA does nothing")
  else
    ok(pt.cuda.device_count() >= 1, "a CUDA build with a device counts it")
  end
end)

test("pt.cuda: the device calls raise a clear error without CUDA, from the caller's line", function()
  if cuda then return end
  for _, name in ipairs { "current_device", "device_name", "memory_stats", "reset_peak_memory_stats" } do
    local err = raises(function() local r = pt.cuda[name](); return r end, "CUDA is not available", name)
    ok(err:find(this_file, 1, true), name .. ": the error names the script's line: " .. err)
  end
  raises(function() return pt.cuda.memory_stats(0) end, "CUDA is not available", "memory_stats(0)")
end)

test("pt.cuda.memory_stats counts a tensor's bytes on the device (CUDA only)", function()
  if not cuda then return end
  local d = pt.cuda.current_device()
  ok(type(pt.cuda.device_name(d)) == "string" and #pt.cuda.device_name(d) > 0, "device_name")
  pt.cuda.synchronize(d)
  local before = pt.cuda.memory_stats(d)
  local t = pt.zeros({ 1024, 1024 }, { device = "cuda:" .. d })   -- 4 MiB
  local after = pt.cuda.memory_stats("cuda:" .. d)
  eq(after.allocated - before.allocated, 4 * 1024 * 1024, "allocated grows by the tensor's bytes")
  ok(after.reserved >= after.allocated and after.peak_allocated >= after.allocated, "reserved and peak bound it")
  t = nil
  collectgarbage(); collectgarbage()
  pt.cuda.reset_peak_memory_stats(d)
  eq(pt.cuda.memory_stats(d).peak_allocated, pt.cuda.memory_stats(d).allocated, "reset_peak_memory_stats")
end)

local function train(fused)
  pt.manual_seed(4)
  local model = pt.models.mlp { sizes = { 8, 16, 4 } }
  local opt = pt.optim.adamw(model, { lr = 1e-2, weight_decay = 0.1, fused = fused })
  pt.manual_seed(5)
  local x, y = pt.randn(16, 8, { device = pt.device() }), pt.randint(0, 4, { 16 }, { device = pt.device() })
  for _ = 1, 5 do
    opt:zero_grad()
    pt.nn.cross_entropy(model(x), y):backward()
    opt:step()
  end
  return model, opt
end

test("adamw's fused option: bad values refused at the caller's line; the CPU has the kernel", function()
  if cuda and pt.device():find("cuda") then return end
  raises(function() pt.optim.adamw(pt.nn.Linear(2, 2), { fused = "yes" }) end,
         "option 'fused' for adamw must be true, false or \"auto\", got 'yes'")
  raises(function() pt.optim.adam(pt.nn.Linear(2, 2), { fused = true }) end, "fused")
  local _, on = train(true)
  local _, auto = train("auto")
  eq(on:fused(), true, "fused = true updates CPU parameters through the fused kernel")
  eq(auto:fused(), true, "fused = \"auto\" finds the kernel on the CPU")
end)

test("adamw fused on CUDA tracks the unfused update within 1e-5 over 5 steps", function()
  if not (cuda and pt.device():find("cuda")) then return end
  local a, oa = train("auto")
  local b, ob = train(false)
  ok(oa:fused(), "auto chose the fused kernel on CUDA")
  for i, p in ipairs(a:parameters()) do H.near(p, b:parameters()[i], 1e-5, "parameter " .. i) end
end)

-- The experts' grouped matmul on the device: at::_grouped_mm where CUDA takes it (bfloat16 on
-- sm90/sm100 a grouped kernel; float32 a loop of mm), against the loop of per-expert products,
-- values and gradients, with empty experts (first, middle, last) and no rows at all. On the CPU
-- the same checks run on the CPU's path (tests/engine/grouped_test.cpp covers it at length).
test("the grouped matmul on the device equals the loop over experts, empty experts and all", function()
  local device = cuda and ("cuda:" .. pt.cuda.current_device()) or "cpu"
  for _, c in ipairs { { "float32", 1e-5 }, { "bfloat16", 2e-2 } } do
    local dtype, tol = c[1], c[2]
    for _, counts in ipairs { { 0, 5, 0, 11, 0 }, { 16, 0, 0, 16 }, { 0, 0, 0, 0 } } do
      local T = 0
      for _, n in ipairs(counts) do T = T + n end
      local x = pt.randn({ T, 32 }, { device = device }):to(dtype)
      local w = pt.randn({ #counts, 48, 32 }, { device = device }):to(dtype)  -- a [G, out, in] stack
      local function run(fn)
        local xa, wa = x:clone():requires_grad_(), w:clone():requires_grad_()
        local y = fn(xa, wa:transpose(1, 2), counts)
        if T > 0 then (y:float() * y:float()):sum():backward() end
        return y, xa.grad, wa.grad
      end
      local y1, gx1, gw1 = run(pt.nn.grouped_matmul)
      local y2, gx2, gw2 = run(pt.nn.looped_matmul)
      local what = ("%s %s rows %s (%s)"):format(device, dtype, table.concat(counts, ","), pt.nn.grouped_matmul_path(x, w:transpose(1, 2)))
      eq(y1.shape[1], T, what .. ": rows")
      local function close(a, b, name)
        if b == nil then return end
        local d = (a:float() - b:float()):abs():max():item()
        local m = math.max(b:float():abs():max():item(), 1)
        ok(d <= tol * m, ("%s: %s differs by %g (scale %g)"):format(what, name, d, m))
      end
      if T > 0 then
        close(y1, y2, "the output")
        close(gx1, gx2, "x's gradient")
        close(gw1, gw2, "w's gradient")
        for e, n in ipairs(counts) do  -- an expert without rows gets a zero gradient
          if n == 0 then eq(gw1:select(0, e - 1):float():abs():sum():item(), 0, what .. ": expert " .. (e - 1)) end
        end
      end
    end
  end
end)

H.run()
