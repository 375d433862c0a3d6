-- 1F1B (PipeDream-flush): rank r warms up with pp-1-r forwards, then alternates one forward and
-- one backward, then drains the remaining backwards; at most pp-r activations are held at once.
return function(pp, microbatches, chunks)
  if chunks ~= 1 then
    error(("1f1b runs one chunk a rank, got chunks=%d (the 'interleaved' schedule runs several)"):format(chunks), 0)
  end
  local plan = {}
  for r = 0, pp - 1 do
    local list, warmup = {}, math.min(pp - 1 - r, microbatches)
    local function F(m) list[#list + 1] = { op = "F", mb = m, chunk = 0 } end
    local function B(m) list[#list + 1] = { op = "B", mb = m, chunk = 0 } end
    for m = 0, warmup - 1 do F(m) end
    for i = 0, microbatches - warmup - 1 do F(warmup + i); B(i) end          -- steady state
    for m = microbatches - warmup, microbatches - 1 do B(m) end              -- cool-down
    plan[r] = list
  end
  return plan
end
