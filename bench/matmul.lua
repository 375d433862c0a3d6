-- Single-precision matrix multiply throughput of this LibTorch build (and the BLAS it loads).
local pt = require "partrain"
local cfg = pt.args { n = 1024, reps = 20, threads = 1 }
pt.set_threads(cfg.threads)
local a, b = pt.randn(cfg.n, cfg.n), pt.randn(cfg.n, cfg.n)
a:matmul(b)  -- warm up
local median = require("timing").median_seconds(cfg.reps, function() a:matmul(b) end)
print(("matmul n=%d threads=%d median %.4f s  %.1f GFLOP/s"):format(cfg.n, cfg.threads, median, 2 * cfg.n ^ 3 / median / 1e9))
