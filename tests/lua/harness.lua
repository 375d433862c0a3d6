-- A small test harness for Lua tests run by `partrain`: register cases with test(name, fn),
-- assert with the helpers below (each failure says what differed), finish with run(), which
-- prints one line a case and "N passed, N failed" and exits non-zero on any failure.
local pt = require "partrain"

local H = { cases = {} }

function H.test(name, fn) H.cases[#H.cases + 1] = { name = name, fn = fn } end

local function fail(msg, level) error(msg, (level or 1) + 2) end

function H.ok(cond, msg) if not cond then fail(msg or "expected a true value") end end

function H.eq(got, want, msg)
  if got ~= want then
    fail(("%s: got %s, want %s"):format(msg or "values differ", tostring(got), tostring(want)))
  end
end

--- |got - want| <= tol * max(1, |want|) for numbers; the same elementwise for tensors.
function H.near(got, want, tol, msg)
  tol = tol or 1e-6
  if pt.is_tensor(got) then
    if not pt.is_tensor(want) then want = pt.tensor(want) end
    H.eq(table.concat(got.shape, "x"), table.concat(want.shape, "x"), (msg or "tensors") .. " (shape)")
    local g, w = got:detach():double(), want:detach():double()
    local err = (g - w):abs():max():item()
    local scale = math.max(1, w:abs():max():item())
    if err > tol * scale then
      fail(("%s: max abs difference %.3e exceeds %.1e"):format(msg or "tensors differ", err, tol * scale))
    end
    return
  end
  if type(got) ~= "number" or math.abs(got - want) > tol * math.max(1, math.abs(want)) then
    fail(("%s: got %s, want %s (tolerance %.1e)"):format(msg or "numbers differ", tostring(got), tostring(want), tol))
  end
end

--- fn must raise an error whose message contains `pattern` (a plain substring).
function H.raises(fn, pattern, msg)
  local ok, err = pcall(fn)
  if ok then fail((msg or "expected an error") .. " containing '" .. pattern .. "', got none") end
  err = tostring(err)
  if not err:find(pattern, 1, true) then
    fail(("%s: error '%s' does not contain '%s'"):format(msg or "wrong error", err, pattern))
  end
  return err
end

--- Every tensor of the state dict `got` near `want`'s of the same name (H.near's tolerance),
--- and at least one of them: what a parallel run's parameters are checked with against serial's.
function H.same_parameters(got, want, tol, what)
  local held = 0
  for name, t in pairs(got) do
    H.near(t, want[name], tol, ("%s: parameter %s"):format(what, name))
    held = held + 1
  end
  H.ok(held > 0, what .. ": holds parameters")
end

--- A table's keys and values in a new table (one level); anything else as it is.
function H.shallow_copy(x)
  if type(x) ~= "table" then return x end
  local t = {}
  for k, v in pairs(x) do t[k] = v end
  return t
end

--- A seeded generator that draws the same sequence on every rank and every platform (a
--- Park-Miller step): rng.int(lo, hi) an integer in [lo, hi], rng.pick(list) an element.
function H.rng(seed)
  local rng = { state = seed }
  function rng.int(lo, hi)
    rng.state = (rng.state * 16807) % 2147483647
    return lo + rng.state % (hi - lo + 1)
  end
  function rng.pick(list) return list[rng.int(1, #list)] end
  return rng
end

function H.run()
  local passed, failed = 0, 0
  for _, case in ipairs(H.cases) do
    local ok, err = xpcall(case.fn, debug.traceback)
    if ok then
      passed = passed + 1
      print("[ OK ] " .. case.name)
    else
      failed = failed + 1
      -- stderr too: under the launcher only rank 0's stdout is shown, every rank's stderr is.
      print("[FAIL] " .. case.name .. "\n" .. tostring(err))
      io.stderr:write("[FAIL] ", case.name, "\n", tostring(err), "\n")
    end
  end
  print(("%d passed, %d failed"):format(passed, failed))
  if failed > 0 then os.exit(1) end
end

return H
