-- A projection fused from parts of unequal sizes (q 4 rows, k 2, v 2: grouped-query attention's
-- shape), split over tensor 2, saved, and loaded back whole: driven by test_parts.py.
--   save DIR   (2 ranks) saves the split layer under DIR (and first tries without its mesh)
--   load DIR   (1 rank)  loads DIR's newest into the serial layer and prints the largest difference
local pt = require "partrain"
local mode, dir = arg[1], arg[2]

local function serial()
  pt.manual_seed(7)
  return pt.nn.Sequential(pt.nn.Linear(3, 8))
end

if mode == "save" then
  local mesh = pt.mesh { tensor = 2 }
  local model = serial()
  model["0"] = pt.tp.column(model["0"], mesh:group("tensor"), { parts = { 4, 2, 2 } })
  local ok, err = pcall(pt.ckpt.save, dir, { model = model, step = 1, tag = "no-mesh" })
  print("without a mesh: " .. tostring(err))
  pt.ckpt.save(dir, { model = model, mesh = mesh, step = 1 })
elseif mode == "load" then
  local expected = serial()
  local model = serial()
  pt.no_grad(function()
    for _, p in ipairs(model:parameters()) do p:zero_() end
  end)
  pt.ckpt.load(dir, { model = model })
  local worst = 0
  for name, t in pairs(expected:state_dict()) do
    worst = math.max(worst, (model:state_dict()[name] - t):abs():max():item())
  end
  print(string.format("largest difference %.3g", worst))
end
