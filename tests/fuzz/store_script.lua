-- The job fuzz_store.py starts on two nodes (one rank each) and attacks through node 0's control
-- store while it waits for node 1: one all-reduce, whose sum rank 0 prints.
local pt = require "partrain"

local t = pt.tensor({ pt.dist.rank() + 1 })
pt.dist.world():all_reduce(t)
print(("SUM %d of %d"):format(t:item(), pt.dist.world_size()))
