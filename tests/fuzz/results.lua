-- The results file of a batched fuzz runner (ckpt_batch.lua, zero_ckpt_batch.lua, data_batch.lua):
-- one JSON line a case, flushed as each finishes, so that the driver can restart after a case that
-- kills the process and still read every case before it; and the resume outcome the checkpoint
-- runners record alike. Loaded with dofile.
local M = {}

-- A Lua value as JSON: strings with control, quote and backslash bytes escaped (others as they
-- are: the driver reads the file as UTF-8, replacing what is not).
function M.json(v)
  local t = type(v)
  if t == "string" then
    return '"' .. v:gsub('[%c"\\]', function(c) return ("\\u%04x"):format(c:byte()) end) .. '"'
  elseif t == "table" then
    local parts = {}
    for k, x in pairs(v) do parts[#parts + 1] = M.json(tostring(k)) .. ":" .. M.json(x) end
    return "{" .. table.concat(parts, ",") .. "}"
  end
  return tostring(v)
end

-- A function that appends a record to `path`.
function M.open(path)
  local out = assert(io.open(path, "ab"))
  return function(r)
    out:write(M.json(r), "\n")
    out:flush()
  end
end

-- What pt.ckpt.resume made of `path` into the settings `s`, into the record `r`: resume ("ok",
-- "none" or "error"), and for "ok" the tag, its notes and whether the state it left is the one
-- saved at that tag (`want`: tag -> bytes, `state_bytes(resumed)`: the state now). Returns what
-- resume returned (ok, value) for the caller's own checks.
function M.resume(r, path, s, want, state_bytes)
  local ok, resumed = pcall(require("partrain").ckpt.resume, path, s)
  if not ok then
    r.resume = "error"
    r.resume_error = tostring(resumed)
  elseif resumed == nil then
    r.resume = "none"
  else
    r.resume = "ok"
    r.resume_tag = resumed.tag
    r.resume_notes = table.concat(resumed.notes, "\n")
    r.resume_match = want[resumed.tag] ~= nil and state_bytes(resumed) == want[resumed.tag]
  end
  return ok, resumed
end

return M
