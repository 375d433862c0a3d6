-- The script fuzz_config.py runs as `partrain config_script.lua --config FILE`: four options
-- of the four kinds, printed once resolved as "VALUE name kind value" lines (numbers with 17
-- digits, strings in hexadecimal), so that the driver can compare them with what it wrote.
local pt = require "partrain"

local cfg = pt.args { steps = 3, lr = pt.args.number(0.5), name = "run", fp16 = false }
for _, k in ipairs { "steps", "lr", "name", "fp16" } do
  local v = cfg[k]
  local shown = type(v) == "number" and ("%.17g"):format(v)
    or type(v) == "string" and v:gsub(".", function(c) return ("%02x"):format(c:byte()) end)
    or tostring(v)
  print(("VALUE %s %s %s"):format(k, type(v), shown))
end
