-- GPipe: every rank runs all its forwards, then all its backwards (chunk by chunk when a rank has
-- several); simple, but each rank holds the activations of every micro-batch at once.
return function(pp, microbatches, chunks)
  local plan = {}
  for r = 0, pp - 1 do
    local list = {}
    for c = 0, chunks - 1 do
      for m = 0, microbatches - 1 do list[#list + 1] = { op = "F", mb = m, chunk = c } end
    end
    for c = chunks - 1, 0, -1 do
      for m = 0, microbatches - 1 do list[#list + 1] = { op = "B", mb = m, chunk = c } end
    end
    plan[r] = list
  end
  return plan
end
