# PyTorch DistributedDataParallel on Gloo: the same model, data, batch and optimizer as
# bench/dp.lua, for bench/dp's side-by-side comparison. Run with torch.distributed.run.
import argparse, gzip, os, time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=60)
p.add_argument("--warmup", type=int, default=10)
p.add_argument("--batch", type=int, default=256)
p.add_argument("--hidden", type=int, default=1024)
p.add_argument("--threads", type=int, default=1)
p.add_argument("--bucket_cap_mb", type=float, default=25)
args = p.parse_args()

torch.set_num_threads(args.threads)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()

def idx(path):
    raw = gzip.open(path).read()
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)

root = "/usr/share/datasets/fashion-mnist"
images = torch.from_numpy(idx(f"{root}/train-images-idx3-ubyte.gz").reshape(-1, 784).astype(np.float32) / 255)
labels = torch.from_numpy(idx(f"{root}/train-labels-idx1-ubyte.gz").astype(np.int64))

torch.manual_seed(1)
model = nn.Sequential(nn.Linear(784, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                      nn.Linear(args.hidden, 10))
model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
gen = torch.Generator().manual_seed(1)
order = torch.randperm(len(labels), generator=gen)
local = args.batch // world
position = 0

def step():
    global position
    ids = order[position * args.batch + rank * local: position * args.batch + (rank + 1) * local]
    position += 1
    loss = nn.functional.cross_entropy(model(images[ids]), labels[ids])
    opt.zero_grad()
    loss.backward()
    opt.step()

for _ in range(args.warmup):
    step()
dist.barrier()
t0 = time.perf_counter()
for _ in range(args.steps):
    step()
dist.barrier()
seconds = time.perf_counter() - t0
if rank == 0:
    print(f"ddp world={world} samples_per_s={args.steps * args.batch / seconds:.1f} step_ms={1000 * seconds / args.steps:.2f}")
dist.destroy_process_group()
