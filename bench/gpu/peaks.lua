-- Dense bfloat16 tensor-core peaks of NVIDIA data-center GPUs, in TFLOP/s, for MFU: NVIDIA's
-- datasheets give the figures with 2:4 sparsity; the dense peak is half of it.
--   H100 SXM5 and H200 SXM: 1,979 sparse -> 989.4 dense (NVIDIA H100 Tensor Core GPU datasheet;
--   NVIDIA H200 Tensor Core GPU datasheet). H100 PCIe: 1,513 -> 756.5. H100 NVL: 1,671 -> 835.5.
--   A100 (SXM and PCIe): 312 dense (NVIDIA A100 Tensor Core GPU datasheet).
local M = {}

-- Most specific first: the device name is matched against each pattern in order.
M.table = {
  { "H100 PCIe", 756.5 }, { "H100 NVL", 835.5 }, { "H100", 989.4 }, { "H200", 989.4 }, { "A100", 312.0 },
}

--- The dense bf16 peak of the device named `name` ("NVIDIA H100 80GB HBM3"), or nil when unknown.
function M.lookup(name)
  for _, entry in ipairs(M.table) do
    if name:find(entry[1], 1, true) then return entry[2] end
  end
  return nil
end

return M
