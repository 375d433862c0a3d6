"""GPT-2 124M in PyTorch eager, the twin of bench/gpu/gpt2_124m.lua: the same sizes, synthetic
token ids, bfloat16 parameters with float32 master weights kept by hand (as partrain's optimizer
keeps them: gradients cast into the masters, AdamW on the masters, the result cast back; no
torch.autocast), AdamW fused (CPU and CUDA, as partrain's "auto"), scaled_dot_product_attention,
no torch.compile. Prints the same line as the Lua side. PyTorch 2.11 (scripts/setup's .venv):
  python3 bench/gpu/gpt2_124m_torch.py [--device cuda] [--batch 16] [--steps 30] [--warmup 5]
  python3 bench/gpu/gpt2_124m_torch.py --device cpu --tiny
"""
import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

PEAKS = [("H100 PCIe", 756.5), ("H100 NVL", 835.5), ("H100", 989.4), ("H200", 989.4), ("A100", 312.0)]  # peaks.lua


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.c_attn, self.attn_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.c_fc, self.mlp_proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def attention(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.attn_proj(y.transpose(1, 2).reshape(B, T, C))

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, vocab, seq, dim, heads, layers):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.h = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as partrain's GPT-2
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, ids):
        pos = torch.arange(ids.size(1), device=ids.device)
        x = self.wte(ids) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--fused", default="auto", choices=["auto", "true", "false"])
    ap.add_argument("--peak-tflops", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="vocab 512, seq 64, 2 layers of 64, batch 2, 4 + 2 steps")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    if a.tiny:
        a.vocab, a.seq, a.layers, a.dim, a.heads, a.batch, a.steps, a.warmup = 512, 64, 2, 64, 4, 2, 4, 2
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    on_cuda = device.type == "cuda"
    torch.manual_seed(a.seed)
    dtype = getattr(torch, a.dtype)
    model = GPT2(a.vocab, a.seq, a.dim, a.heads, a.layers).to(device=device, dtype=dtype)
    params = list(model.parameters())  # the tied weight once
    n = sum(p.numel() for p in params)
    low = dtype != torch.float32
    masters = [p.detach().float().clone().requires_grad_(True) for p in params] if low else params
    # AdamW's fused kernel: on the CPU and CUDA ("auto" takes it, as partrain's does).
    fused = a.fused != "false"
    extra = {"fused": True} if fused else {}
    opt = torch.optim.AdamW(masters, lr=a.lr, weight_decay=0.1, betas=(0.9, 0.95), **extra)
    batches = []
    for _ in range(4):
        ids = torch.randint(0, a.vocab, (a.batch, a.seq + 1), device=device)
        batches.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))

    def step(i):
        x, y = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        for p in params:
            p.grad = None
        logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, a.vocab), y.view(-1))  # the loss in float32, as partrain's
        loss.backward()
        if low:
            for p, m in zip(params, masters):
                m.grad = p.grad.float()
        opt.step()
        if low:
            with torch.no_grad():
                for p, m in zip(params, masters):
                    p.copy_(m)
        return loss

    def sync():
        if on_cuda:
            torch.cuda.synchronize(device)

    for i in range(a.warmup):
        step(i)
    sync()
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for i in range(a.steps):
        loss = step(a.warmup + i)
    last = loss.item()
    sync()
    seconds = time.perf_counter() - t0
    tokens_per_s = a.batch * a.seq * a.steps / seconds
    flops_per_token = 6 * n + 12 * a.layers * a.dim * a.seq
    name = torch.cuda.get_device_name(device) if on_cuda else "cpu"
    peak = a.peak_tflops or next((v for k, v in PEAKS if k in name), None)
    mfu = f"{tokens_per_s * flops_per_token / (peak * 1e12):.4f}" if peak else "n/a"
    memory = torch.cuda.max_memory_allocated(device) if on_cuda else 0
    print(f"gpt2_124m torch ms_per_step={1000 * seconds / a.steps:.3f} tokens_per_s={tokens_per_s:.1f} mfu={mfu} "
          f"loss={last:.4f} params={n} batch={a.batch} seq={a.seq} dtype={a.dtype} fused_adamw={str(fused).lower()} "
          f"device={name.replace(' ', '_')} peak_tflops={peak or 'n/a'} peak_bytes={memory} torch={torch.__version__}")


if __name__ == "__main__":
    main()
