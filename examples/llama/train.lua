-- Trains a byte-level LLaMA (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU) on the
-- King James Bible and prints a sample: the GPT example's script and flags with --model llama.
--   partrain examples/llama/train.lua [--steps 200] [--heads 4 --kv-heads 2] ...
--   partrain --nproc-per-node 2 examples/llama/train.lua --tensor 2 --sequence-parallel
--   partrain --nproc-per-node 4 examples/llama/train.lua --tensor 2 --ckpt ckpt/ --save-every 50
--   partrain --nproc-per-node 2 examples/llama/train.lua --pipeline 2 --schedule 1f1b
LM_DEFAULT_MODEL = "llama"
local here = arg[0]:match("^(.*)/") or "."
arg[0] = here .. "/../gpt/train.lua"  -- the corpus is found from the script's folder
dofile(arg[0])
