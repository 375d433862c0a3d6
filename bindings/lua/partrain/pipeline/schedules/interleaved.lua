-- Interleaved 1F1B (Megatron-LM): each rank holds `chunks` model chunks (virtual stages c*pp + r)
-- and walks micro-batches in groups of pp, chunk after chunk, which divides the bubble by about
-- `chunks`. The order of forwards and backwards is Megatron's; micro-batches must fill whole groups.
return function(pp, microbatches, chunks)
  if microbatches % pp ~= 0 then
    error(("interleaved needs microbatches to be a multiple of pp, got microbatches=%d, pp=%d"):format(microbatches, pp), 0)
  end
  local total = microbatches * chunks       -- (micro-batch, chunk) pairs each rank runs
  -- The k-th forward (backward) of every rank: groups of pp micro-batches, chunk by chunk
  -- (backwards from the last chunk down).
  local function forward(k)
    local group, within = math.floor(k / (pp * chunks)), k % (pp * chunks)
    return { op = "F", mb = group * pp + within % pp, chunk = math.floor(within / pp) }
  end
  local function backward(k)
    local group, within = math.floor(k / (pp * chunks)), k % (pp * chunks)
    return { op = "B", mb = group * pp + within % pp, chunk = chunks - 1 - math.floor(within / pp) }
  end
  local plan = {}
  for r = 0, pp - 1 do
    -- Megatron's warm-up: enough forwards that the first backward's gradient can arrive; with
    -- one group of micro-batches there is no steady state at all.
    local warmup
    if chunks == 1 then warmup = math.min(pp - 1 - r, total)
    elseif microbatches == pp then warmup = total
    else warmup = math.min((pp - r - 1) * 2 + (chunks - 1) * pp, total) end
    local list = {}
    for k = 0, warmup - 1 do list[#list + 1] = forward(k) end
    for k = 0, total - warmup - 1 do list[#list + 1] = forward(warmup + k); list[#list + 1] = backward(k) end
    for k = total - warmup, total - 1 do list[#list + 1] = backward(k) end
    plan[r] = list
  end
  return plan
end
