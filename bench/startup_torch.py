# A Python rank's way to its first training step, for bench/startup: the same small MLP as
# bench/startup.lua, DistributedDataParallel over Gloo when started with torchrun's environment
# (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK), one step on random data, then exit.
import os

import torch
import torch.distributed as dist
import torch.nn as nn

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
distributed = "RANK" in os.environ
if distributed:
    dist.init_process_group("gloo")
torch.manual_seed(1)
model = nn.Sequential(nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, 10))
if distributed:
    model = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 784), torch.randint(0, 10, (32,))
loss = nn.functional.cross_entropy(model(x), y)
opt.zero_grad()
loss.backward()
opt.step()
if distributed:
    dist.destroy_process_group()
