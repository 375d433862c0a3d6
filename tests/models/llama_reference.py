"""LLaMA written here in plain PyTorch, as Hugging Face's LlamaForCausalLM computes it (RMSNorm
with float32 statistics, rotate-half rotary embeddings, grouped-query attention by repeating each
key/value head over its group of query heads, a SwiGLU MLP), for partrain's LLaMA to be checked
against; with --experts, Mixtral's sparse MoE block in place of the MLP, as MixtralForCausalLM
computes it, with partrain's router losses. Run with a python3 that has torch (scripts/setup's
.venv/bin/python3):

  llama_reference.py write DIR [MOE]
                                  random weights, seeded, in Hugging Face's sharded layout in DIR
                                  (with experts: one tensor an expert, as Hub Mixtral files)
  llama_reference.py train DIR [--dtype float64] [--steps N] [MOE]
                                  N (10) AdamW steps from DIR's weights on the bytes of data/kjv.txt,
                                  in float32 or float64; prints "loss <step> <value>" a step (the
                                  cross-entropy) and, with experts, "aux <step> <block> <value>" and
                                  "z <step> <block> <value>" for each block's router losses
  MOE: --experts E --top-k K --aux-loss C --z-loss Z (0: the dense MLP)

The MoE block (Mixtral's router, partrain's loss definitions, docs/design/mixture-of-experts.md):
p = softmax(gate(x)) in float32 (float64 for a float64 model) over the E experts; w, idx =
topk(p, K); w /= w.sum(-1); y = sum_j w_j * w2_e(silu(w1_e x) * w3_e x). Per block, over the N
tokens of the batch: aux = C * E * sum_e f_e * P_e, f_e = (slots routed to e) / (N * K) and P_e
the mean of p[:, e]; z = Z * mean_t logsumexp(logits_t)^2. Both are added to the cross-entropy
for the gradient (Hugging Face's aux pools the layers and does not divide by K: partrain's does).
"""
import json
import math
import os
import struct
import sys

import torch

CFG = dict(vocab=256, dim=32, heads=8, kv_heads=4, layers=2, hidden=48, eps=1e-6, rope_base=10000.0,
           experts=0, top_k=2, aux_loss=0.0, z_loss=0.0)
BATCH, SEQ, STEPS, LR, WD = 4, 16, 10, 1e-3, 0.1
DTYPE = torch.float32


def names():
    c = CFG
    hd = c["dim"] // c["heads"]
    out = {"model.embed_tokens.weight": [c["vocab"], c["dim"]], "model.norm.weight": [c["dim"]],
           "lm_head.weight": [c["vocab"], c["dim"]]}
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = [c["dim"]]
        out[p + "post_attention_layernorm.weight"] = [c["dim"]]
        out[p + "self_attn.q_proj.weight"] = [c["heads"] * hd, c["dim"]]
        out[p + "self_attn.k_proj.weight"] = [c["kv_heads"] * hd, c["dim"]]
        out[p + "self_attn.v_proj.weight"] = [c["kv_heads"] * hd, c["dim"]]
        out[p + "self_attn.o_proj.weight"] = [c["dim"], c["heads"] * hd]
        if c["experts"] > 0:  # MixtralForCausalLM's names: each expert's matrices apart
            out[p + "block_sparse_moe.gate.weight"] = [c["experts"], c["dim"]]
            for e in range(c["experts"]):
                out[p + f"block_sparse_moe.experts.{e}.w1.weight"] = [c["hidden"], c["dim"]]
                out[p + f"block_sparse_moe.experts.{e}.w2.weight"] = [c["dim"], c["hidden"]]
                out[p + f"block_sparse_moe.experts.{e}.w3.weight"] = [c["hidden"], c["dim"]]
            continue
        out[p + "mlp.gate_proj.weight"] = [c["hidden"], c["dim"]]
        out[p + "mlp.up_proj.weight"] = [c["hidden"], c["dim"]]
        out[p + "mlp.down_proj.weight"] = [c["dim"], c["hidden"]]
    return out


def write_file(path, tensors):
    """As Python's safetensors writes: sorted names, the header padded to 8 bytes."""
    head, off = {"__metadata__": {"format": "pt"}}, 0
    for k in sorted(tensors):
        nb = tensors[k].numel() * 4
        head[k] = {"dtype": "F32", "shape": list(tensors[k].shape), "data_offsets": [off, off + nb]}
        off += nb
    text = json.dumps(head).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for k in sorted(tensors):
            f.write(tensors[k].contiguous().numpy().tobytes())


def read_file(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    out = {}
    for k, info in header.items():
        if k == "__metadata__":
            continue
        b, e = info["data_offsets"]
        out[k] = torch.frombuffer(bytearray(raw[8 + n + b:8 + n + e]), dtype=torch.float32).reshape(info["shape"])
    return out


def write(d):
    torch.manual_seed(3)
    tensors = {}
    for k, shape in names().items():
        # A gate of larger weights than the projections' routes decisively (no near-ties).
        scale = 0.5 if k.endswith("block_sparse_moe.gate.weight") else 0.05
        tensors[k] = (1 + 0.1 * torch.randn(shape)) if k.endswith("norm.weight") else scale * torch.randn(shape)
    keys = sorted(tensors)
    half = len(keys) // 2
    files = {"model-00001-of-00002.safetensors": keys[:half], "model-00002-of-00002.safetensors": keys[half:]}
    weight_map = {}
    for f, ks in files.items():
        write_file(os.path.join(d, f), {k: tensors[k] for k in ks})
        weight_map.update({k: f for k in ks})
    total = sum(t.numel() * 4 for t in tensors.values())
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def rms_norm(x, w, eps):
    x32 = x if x.dtype == torch.float64 else x.float()  # float32 statistics, float64 kept
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def moe(P, p, x, losses):
    """Mixtral's sparse MoE block on x (B, T, dim), as MixtralSparseMoeBlock computes it; appends
    the block's (aux, z) to `losses`."""
    c = CFG
    E, K = c["experts"], c["top_k"]
    x2 = x.reshape(-1, c["dim"])  # (N, dim)
    logits = x2 @ P[p + "block_sparse_moe.gate.weight"].t()  # (N, E)
    wide = torch.float64 if DTYPE == torch.float64 else torch.float32
    probs = logits.to(wide).softmax(-1)
    w, idx = probs.topk(K, -1)  # (N, K)
    w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
    y = torch.zeros_like(x2)
    for e in range(E):
        token, slot = (idx == e).nonzero(as_tuple=True)
        h = x2[token]
        out = torch.nn.functional.silu(h @ P[p + f"block_sparse_moe.experts.{e}.w1.weight"].t())
        out = (out * (h @ P[p + f"block_sparse_moe.experts.{e}.w3.weight"].t())) @ \
            P[p + f"block_sparse_moe.experts.{e}.w2.weight"].t()
        y = y.index_add(0, token, out * w[token, slot, None])
    # The router losses: f_e counts slots (no gradient), P_e and the z term carry one.
    N = x2.shape[0]
    f = torch.bincount(idx.reshape(-1), minlength=E).to(wide) / (N * K)
    aux = c["aux_loss"] * E * (f * probs.mean(0)).sum()
    z = c["z_loss"] * logits.to(wide).logsumexp(-1).square().mean()
    losses.append((aux, z))
    return y.view(x.shape)


def forward(P, ids, losses=None):
    c = CFG
    B, T = ids.shape
    hd = c["dim"] // c["heads"]
    group = c["heads"] // c["kv_heads"]
    wide = torch.float64 if DTYPE == torch.float64 else torch.float32
    inv_freq = 1.0 / (c["rope_base"] ** (torch.arange(0, hd, 2, dtype=wide) / hd))
    freqs = torch.outer(torch.arange(T, dtype=wide), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(DTYPE), emb.sin().to(DTYPE)
    mask = torch.full((T, T), float("-inf"), dtype=DTYPE).triu(1)
    h = P["model.embed_tokens.weight"][ids]
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        x = rms_norm(h, P[p + "input_layernorm.weight"], c["eps"])
        q = (x @ P[p + "self_attn.q_proj.weight"].t()).view(B, T, c["heads"], hd).transpose(1, 2)
        k = (x @ P[p + "self_attn.k_proj.weight"].t()).view(B, T, c["kv_heads"], hd).transpose(1, 2)
        v = (x @ P[p + "self_attn.v_proj.weight"].t()).view(B, T, c["kv_heads"], hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        # Hugging Face's repeat_kv: key/value head j serves query heads j*group .. j*group+group-1.
        k = k[:, :, None].expand(B, c["kv_heads"], group, T, hd).reshape(B, c["heads"], T, hd)
        v = v[:, :, None].expand(B, c["kv_heads"], group, T, hd).reshape(B, c["heads"], T, hd)
        att = ((q @ k.transpose(-2, -1)) / math.sqrt(hd) + mask).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, c["heads"] * hd)
        h = h + y @ P[p + "self_attn.o_proj.weight"].t()
        x = rms_norm(h, P[p + "post_attention_layernorm.weight"], c["eps"])
        if c["experts"] > 0:
            h = h + moe(P, p, x, losses if losses is not None else [])
            continue
        gate = torch.nn.functional.silu(x @ P[p + "mlp.gate_proj.weight"].t())
        h = h + (gate * (x @ P[p + "mlp.up_proj.weight"].t())) @ P[p + "mlp.down_proj.weight"].t()
    h = rms_norm(h, P["model.norm.weight"], c["eps"])
    return h @ P["lm_head.weight"].t()


def batches():
    data = open("data/kjv.txt", "rb").read(BATCH * (SEQ + 1) * STEPS)
    t = torch.tensor(list(data), dtype=torch.int64).view(STEPS, BATCH, SEQ + 1)
    return [(t[s, :, :SEQ], t[s, :, 1:]) for s in range(STEPS)]


def train(d):
    index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
    P = {}
    for f in sorted(set(index["weight_map"].values())):
        P.update(read_file(os.path.join(d, f)))
    params = {k: v.to(DTYPE).requires_grad_(True) for k, v in P.items()}
    opt = torch.optim.AdamW(params.values(), lr=LR, weight_decay=WD)
    for step, (x, y) in enumerate(batches(), 1):
        router = []  # each MoE block's (aux, z)
        logits = forward(params, x, router)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, CFG["vocab"]), y.reshape(-1))
        opt.zero_grad()
        # The router losses join the gradient; the loss printed is the cross-entropy.
        (loss + sum((aux + z).to(loss.dtype) for aux, z in router)).backward()
        opt.step()
        print(f"loss {step} {loss.item():.17g}", flush=True)
        for i, (aux, z) in enumerate(router):
            print(f"aux {step} layers.{i}.block_sparse_moe {aux.item():.17g}", flush=True)
            print(f"z {step} layers.{i}.block_sparse_moe {z.item():.17g}", flush=True)


if __name__ == "__main__":
    rest = sys.argv[3:]
    moe_flags = {"--experts": ("experts", int), "--top-k": ("top_k", int), "--aux-loss": ("aux_loss", float),
                 "--z-loss": ("z_loss", float)}
    while rest:
        if rest[0] == "--dtype" and len(rest) > 1 and rest[1] in ("float32", "float64"):
            DTYPE = getattr(torch, rest[1])
        elif rest[0] == "--steps" and len(rest) > 1 and rest[1].isdigit() and int(rest[1]) > 0:
            STEPS = int(rest[1])
        elif rest[0] in moe_flags and len(rest) > 1:
            key, kind = moe_flags[rest[0]]
            try:
                CFG[key] = kind(rest[1])
            except ValueError:
                sys.exit(f"llama_reference.py: {rest[0]} takes a number, got {rest[1]!r}")
        else:
            sys.exit(f"llama_reference.py: unknown or bad option {rest[:2]} (expected --dtype float32|float64, "
                     "--steps N, --experts E, --top-k K, --aux-loss C, --z-loss Z)")
        rest = rest[2:]
    {"write": write, "train": train}[sys.argv[1]](sys.argv[2])
