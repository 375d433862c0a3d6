-- The dense bf16 peaks the bench's MFU divides by: partrain's own table (pt.progress's, in
-- bindings/lua/partrain/progress.lua, with its datasheet sources), so the bench and a training
-- run's MFU agree.
local progress = require "partrain.progress"
local M = {}

--- The dense bf16 peak of the device named `name` ("NVIDIA H100 80GB HBM3"), or nil when unknown.
M.lookup = progress.peak_of

return M
