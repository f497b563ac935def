"""KV-cache tensor sets shaped like vLLM's, for the data-plane tests and benches.

Each builder returns ``(kv_caches, groups)``: layer name -> tensor (or list of Mamba state
tensors), and the layer names of each KV-cache group.
"""

from __future__ import annotations

import torch


def fill_random(tensors, seed: int = 0) -> None:
    """Random bytes in every storage behind ``tensors`` (padding included)."""
    g = torch.Generator().manual_seed(seed)
    seen = set()
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        whole = torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,))
        whole.copy_(torch.randint(0, 256, (st.nbytes(),), dtype=torch.uint8, generator=g))


def flat_tensors(kv_caches):
    out = []
    for name, v in kv_caches.items():
        for j, t in enumerate([v] if isinstance(v, torch.Tensor) else v):
            out.append((name if isinstance(v, torch.Tensor) else f"{name}[{j}]", t))
    return out


def block_dim(t: torch.Tensor) -> int:
    return 1 if (t.dim() == 5 and t.shape[0] == 2) else 0


def block_bytes_of(t: torch.Tensor, b: int) -> torch.Tensor:
    """The bytes of block ``b`` of tensor ``t`` (independent of kvstride's arithmetic)."""
    return t.select(block_dim(t), b).contiguous().view(-1).view(torch.uint8).clone()


def flash_attn(nb=12, bs=16, heads=2, dim=32, layers=2, dtype=torch.float16, prefix="fa"):
    """FlashAttention: (2, num_blocks, block, heads, dim) per layer, one group."""
    kv = {f"{prefix}.{i}": torch.empty(2, nb, bs, heads, dim, dtype=dtype) for i in range(layers)}
    return kv, [list(kv)]


def blocks_first(nb=12, bs=16, heads=2, dim=32, layers=2, dtype=torch.bfloat16, prefix="bf"):
    """FlashInfer-style (num_blocks, 2, block, heads, dim), one group."""
    kv = {f"{prefix}.{i}": torch.empty(nb, 2, bs, heads, dim, dtype=dtype) for i in range(layers)}
    return kv, [list(kv)]


def mla(nb=12, bs=32, dim=576, dtype=torch.bfloat16):
    kv = {"mla.0": torch.empty(nb, bs, dim, dtype=dtype), "mla.1": torch.empty(nb, bs, dim, dtype=dtype)}
    return kv, [list(kv)]


def cpu_layer_slices(nb=16, bs=32, heads=2, dim=32, layers=2):
    """vLLM CPU: one allocation, layer-major slices (KVCacheTensor layer_stride), each
    (num_blocks, heads, block, 2*dim) bf16."""
    raw = torch.empty(layers * nb * heads * bs * 2 * dim, dtype=torch.bfloat16)
    per = nb * heads * bs * 2 * dim
    kv = {f"cpu.{i}": raw[i * per : (i + 1) * per].view(nb, heads, bs, 2 * dim) for i in range(layers)}
    return kv, [list(kv)]


def cross_layer(nb=10, bs=16, heads=2, dim=32, layers=3, dtype=torch.float16):
    """Cross-layer contiguous blocks: block b of every layer is one run (merged to one piece)."""
    page = 2 * bs * heads * dim
    raw = torch.empty(nb, layers, page, dtype=dtype)
    kv = {f"xl.{i}": raw[:, i].view(nb, 2, bs, heads, dim) for i in range(layers)}
    return kv, [list(kv)]


def ring_and_big(nb=8):
    """A 4-token ring buffer group next to a 1152-token attention group."""
    kv = {
        "ring.0": torch.empty(nb, 2, 4, 2, 32, dtype=torch.bfloat16),
        "ring.1": torch.empty(nb, 2, 4, 2, 32, dtype=torch.bfloat16),
        "full.0": torch.empty(2, nb, 1152, 1, 16, dtype=torch.bfloat16),
    }
    return kv, [["ring.0", "ring.1"], ["full.0"]]


def hybrid_mamba(nb=10, bs=64, heads=2, dim=32, pairs=2):
    """vLLM's hybrid allocator: tensor i is shared by attention layer i (group 0) and Mamba
    layer i (group 1).  Attention is re-strided block-major (2, N, bs, h, d) with strides
    (page/2, page, ...); Mamba conv (N, 3, 160) bf16 and SSM (N, 4, 32, 16) fp32 are strided
    views of the same pages (the state is padded up to the page)."""
    page = 2 * bs * heads * dim * 2  # bf16 bytes
    conv_b, ssm_b = 3 * 160 * 2, 4 * 32 * 16 * 4
    assert conv_b + ssm_b <= page
    kv = {}
    for i in range(pairs):
        raw = torch.empty(nb * page, dtype=torch.uint8)
        half = page // 2 // 2  # elements (bf16) in K or V of one block
        attn = torch.as_strided(raw.view(torch.bfloat16), (2, nb, bs, heads, dim), (half, 2 * half, heads * dim, dim, 1))
        conv = torch.as_strided(raw.view(torch.bfloat16), (nb, 3, 160), (page // 2, 160, 1))
        ssm = torch.as_strided(raw.view(torch.float32), (nb, 4, 32, 16), (page // 4, 32 * 16, 16, 1), conv_b // 4 + 0)
        kv[f"attn.{i}"] = attn
        kv[f"mamba.{i}"] = [conv, ssm]
    return kv, [[f"attn.{i}" for i in range(pairs)], [f"mamba.{i}" for i in range(pairs)]]


def mamba_raw_pages(nb=12, page=16384, state=9152):
    """vLLM CPU Mamba layers: raw int8 views (N, 1, 1, state_bytes) with the page stride,
    sharing the allocation with an attention layer (N, 2, 64, 64) bf16."""
    raw = torch.empty(nb * page, dtype=torch.uint8)
    attn = raw.view(torch.bfloat16).view(nb, 2, 64, 64)
    m = torch.as_strided(raw.view(torch.int8), (nb, 1, 1, state), (page, state, state, 1))
    return {"attn": attn, "mamba": m}, [["mamba"], ["attn"]]


def gemma_like(nb=8, bs=32):
    """4 groups (3 sliding-window + 1 full) aliasing one allocation per layer index."""
    raw = torch.empty(nb * 2 * bs * 2 * 32, dtype=torch.float16)
    kv = {f"l{g}": raw.view(2, nb, bs, 2, 32) for g in range(4)}
    return kv, [["l0"], ["l1"], ["l2"], ["l3"]]


MIXES = {
    "flash_attn": flash_attn,
    "blocks_first": blocks_first,
    "mla": mla,
    "cpu_layer_slices": cpu_layer_slices,
    "cross_layer": cross_layer,
    "ring_and_big": ring_and_big,
    "hybrid_mamba": hybrid_mamba,
    "mamba_raw_pages": mamba_raw_pages,
    "gemma_like": gemma_like,
}


def key_of(g: int, b: int, tag: str = "") -> str:
    return f"test{tag}@g{g}@b{b}"


def save_load_round_trip(store, mix: str, *, tag: str = "", seed: int = 0, per_group: int = 4):
    """Save blocks of ``mix`` through ``store``, wipe the KV cache, load them back into
    *other* block ids; return (statuses_put, statuses_get, ok) where ok is byte-exactness."""
    from kvstride.layout import KVLayout
    from kvstride.transfer import StagingPool, Transfer

    kv, groups = MIXES[mix]()
    layout = KVLayout(kv, groups)
    fill_random(layout.storages, seed)
    ng = len(layout.groups)
    src, dst = [], []
    for g in layout.groups:
        ids = [b for b in range(g.num_blocks) if b % ng == g.group]
        k = min(per_group, len(ids) // 2)
        src += [(g.group, b) for b in ids[:k]]
        dst += [(g.group, b) for b in ids[k : 2 * k]]
    want = {}
    for (g, b), (_, d) in zip(src, dst):
        for name in groups[g]:
            v = kv[name]
            for j, t in enumerate([v] if isinstance(v, torch.Tensor) else v):
                want[(name, j, d)] = block_bytes_of(t, b)
    pool = StagingPool(16 << 20)
    pool.register(store.register_buffer)
    tr = Transfer(layout, pool)
    keys = [key_of(g, b, tag) for g, b in src]
    with tr.stage(src) as batch:
        tr.gather(batch).wait()
        put = store.put(keys, batch.all_parts())
    for s in layout.storages:
        s.zero_()
    with tr.stage(dst) as batch:
        got = store.get(keys, batch.all_parts())
        tr.scatter(batch, ok=[s.value == "ok" for s in got]).wait()
    ok = True
    for (name, j, d), w in want.items():
        v = kv[name]
        t = v if isinstance(v, torch.Tensor) else v[j]
        ok &= bool(torch.equal(block_bytes_of(t, d), w))
    return put, got, ok
