-- Hugging Face weights into and out of a pipelined model (each stage reads or writes its own
-- tensors): shared by the pipeline tests at pipeline 2, pipeline 2 x data 2 and pipeline 2 x
-- tensor 2. `mesh` must have a pipeline; `opts` are parallelize's.
local pt = require "partrain"
local H = require "harness"
local ok, raises = H.ok, H.raises

return function(mesh, opts, what)
  local gpt = { vocab = 64, seq = 8, dim = 16, heads = 4, layers = 4 }
  local dir = "/tmp/partrain-test-safetensors-stages-" .. (os.getenv("MASTER_PORT") or "0")
  local rank = mesh:rank()
  if rank == 0 then os.execute("rm -rf " .. dir .. " && mkdir -p " .. dir) end
  mesh:group("world"):barrier()
  -- A serial GPT-2's export is what Hugging Face would hand over.
  pt.manual_seed(41)
  local serial = pt.models.gpt2(gpt)
  pt.ckpt.export_safetensors(serial, dir .. "/serial.safetensors")
  -- Imported into a pipelined model built from other weights: every stage's tensors equal the file's.
  pt.manual_seed(42)
  local model = pt.parallelize(pt.models.gpt2(gpt), "policies.gpt2", mesh, opts)
  pt.ckpt.import_safetensors(model, dir .. "/serial.safetensors")
  local want = serial:state_dict()
  for name, t in pairs(model:full_state_dict()) do
    ok(t:equal(want[name]), what .. ": imported " .. name .. " equals the serial model's")
  end
  -- Exported from the stages, gathered into one file: the serial model's file, tensor for tensor.
  pt.ckpt.export_safetensors(model, dir .. "/stages.safetensors")
  pt.manual_seed(43)
  local back = pt.models.gpt2(gpt)
  pt.ckpt.import_safetensors(back, dir .. "/stages.safetensors")
  for name, t in pairs(back:state_dict()) do ok(t:equal(want[name]), what .. ": exported " .. name) end
  -- A file one stage's tensor of which is wrong is refused on every rank, and changes nothing.
  local bad = pt.models.gpt2 { vocab = gpt.vocab, seq = gpt.seq, dim = gpt.dim, heads = gpt.heads, layers = 3 }
  pt.ckpt.export_safetensors(bad, dir .. "/short.safetensors")  -- every rank calls it; rank 0 writes
  local before = model:full_state_dict()
  raises(function() pt.ckpt.import_safetensors(model, dir .. "/short.safetensors") end,
    "the file has no tensor 'h.3.attn.c_attn.bias'")
  for name, t in pairs(model:full_state_dict()) do ok(t:equal(before[name]), what .. ": unchanged " .. name) end
  mesh:group("world"):barrier()
  if rank == 0 then os.execute("rm -rf " .. dir) end
end
