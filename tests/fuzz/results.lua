-- The results file of a batched fuzz runner (ckpt_batch.lua, data_batch.lua): one JSON line a
-- case, flushed as each finishes, so that the driver can restart after a case that kills the
-- process and still read every case before it. Loaded with dofile.
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

return M
