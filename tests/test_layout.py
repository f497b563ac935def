"""kvstride.layout: KV tensors -> byte pieces per block, and refusals."""

import pytest
import torch

import kvdata
from kvstride.layout import MAX_PIECES_PER_TENSOR, KVLayout


def _block_addrs(layout, g, b):
    """Byte intervals of block b of group g according to the layout."""
    out = []
    for p in layout.groups[g].pieces:
        base = layout.storages[p.storage].data_ptr()
        out.append((base + p.offset + b * p.stride, p.size))
    return out


def _covered(t, b):
    """Byte intervals (address, size) covered by block b of tensor t, element by element."""
    sub = t.select(kvdata.block_dim(t), b)
    es = t.element_size()
    idx = torch.arange(sub.numel()).view(sub.shape)
    # address of every element
    offs = torch.zeros(sub.shape, dtype=torch.int64)
    for d in range(sub.dim()):
        shape = [1] * sub.dim()
        shape[d] = sub.shape[d]
        offs = offs + torch.arange(sub.shape[d]).view(shape) * sub.stride(d) * es
    del idx
    starts = (offs.flatten() + sub.data_ptr()).sort().values.tolist()
    return starts, es


@pytest.mark.parametrize("mix", sorted(kvdata.MIXES))
def test_pieces_cover_exactly_each_block(mix):
    kv, groups = kvdata.MIXES[mix]()
    layout = KVLayout(kv, groups)
    for g, names in enumerate(groups):
        for b in (0, layout.groups[g].num_blocks - 1):
            want = set()
            for name in names:
                v = kv[name]
                for t in [v] if isinstance(v, torch.Tensor) else v:
                    starts, es = _covered(t, b)
                    for s in starts:
                        want.update(range(s, s + es))
            got = set()
            for a, n in _block_addrs(layout, g, b):
                got.update(range(a, a + n))
            assert got == want, (mix, g, b)
        assert layout.groups[g].block_bytes == sum(p.size for p in layout.groups[g].pieces)


def test_piece_counts():
    kv, groups = kvdata.flash_attn(layers=2)
    L = KVLayout(kv, groups)
    assert len(L.groups[0].pieces) == 4  # K and V of each layer
    kv, groups = kvdata.blocks_first(layers=2)
    assert len(KVLayout(kv, groups).groups[0].pieces) == 2
    kv, groups = kvdata.cross_layer(layers=3)
    L = KVLayout(kv, groups)
    assert len(L.groups[0].pieces) == 1 and L.groups[0].block_bytes == 3 * 2 * 16 * 2 * 32 * 2
    kv, groups = kvdata.hybrid_mamba(pairs=2)
    L = KVLayout(kv, groups)
    assert [len(g.pieces) for g in L.groups] == [2, 2]  # attention: one page per layer; mamba: conv+ssm merged per layer
    assert L.groups[1].block_bytes == 2 * (3 * 160 * 2 + 4 * 32 * 16 * 4)
    assert len(L.storages) == 2  # each allocation shared by one attention and one Mamba layer
    kv, groups = kvdata.ring_and_big()
    L = KVLayout(kv, groups)
    assert L.groups[0].block_bytes == 2 * 2 * 4 * 2 * 32 * 2
    assert L.groups[1].block_bytes == 2 * 1152 * 16 * 2


def test_num_blocks_explicit_and_inferred():
    kv, groups = kvdata.flash_attn(nb=7)
    assert KVLayout(kv, groups, num_blocks=7).groups[0].num_blocks == 7
    assert KVLayout(kv, groups).groups[0].num_blocks == 7
    with pytest.raises(ValueError, match=r"fa\.0.*\(2, 7, 16, 2, 32\)"):
        KVLayout(kv, groups, num_blocks=9)


def test_refuses_block_dim_innermost_with_name_shape_strides():
    bad = torch.empty(128, 256, dtype=torch.float16).t()  # (256 blocks, 128): block dim innermost
    with pytest.raises(ValueError) as e:
        KVLayout({"weird": bad}, [["weird"]])
    msg = str(e.value)
    assert "weird" in msg and "(256, 128)" in msg and "(1, 256)" in msg
    assert f"more than {MAX_PIECES_PER_TENSOR}" in msg


def test_refuses_broadcast_and_overlap():
    base = torch.empty(8, 1, 64)
    with pytest.raises(ValueError, match="overlap"):
        KVLayout({"bcast": base.expand(8, 4, 64)}, [["bcast"]])
    raw = torch.empty(1000)
    ov = torch.as_strided(raw, (10, 64), (32, 1))  # blocks overlap
    with pytest.raises(ValueError, match=r"ov.*\(10, 64\).*\(32, 1\)"):
        KVLayout({"ov": ov}, [["ov"]])


def test_refuses_mismatched_groups_and_names():
    kv = {"a": torch.empty(8, 4, 4), "b": torch.empty(9, 4, 4)}
    with pytest.raises(ValueError, match=r"'b'.*\(9, 4, 4\).*no block dimension of size 8"):
        KVLayout(kv, [["a", "b"]])
    with pytest.raises(ValueError, match="'zz'"):
        KVLayout(kv, [["zz"]])
    with pytest.raises(ValueError, match="aliases"):
        KVLayout({"a": kv["a"], "a2": kv["a"]}, [["a", "a2"]])
    with pytest.raises(ValueError, match="no layers"):
        KVLayout(kv, [[]])


def test_fingerprint_tracks_geometry_not_addresses():
    a = KVLayout(*kvdata.flash_attn())
    b = KVLayout(*kvdata.flash_attn())
    c = KVLayout(*kvdata.flash_attn(dtype=torch.bfloat16))
    d = KVLayout(*kvdata.flash_attn(bs=32))
    assert a.fingerprint() == b.fingerprint() and len(a.fingerprint()) == 8
    assert a.fingerprint() != c.fingerprint()
    assert a.fingerprint() != d.fingerprint()


def _attention(nb=8, bs=16, heads=4, dim=32, dtype=torch.float16, hnd=False):
    """One attention layer, blocks first, in vLLM's logical (num_blocks, 2, block, heads, dim)
    shape; ``hnd`` allocates heads before tokens in memory, as the HND layout (FlashInfer) does,
    and views it in the same logical shape."""
    if hnd:
        return {"attn": torch.zeros(nb, 2, heads, bs, dim, dtype=dtype).permute(0, 1, 3, 2, 4)}, [["attn"]]
    return {"attn": torch.zeros(nb, 2, bs, heads, dim, dtype=dtype)}, [["attn"]]


def test_fingerprint_tells_memory_layouts_and_kv_dtypes_of_equal_bytes_apart():
    """HND and NHD of the same shape, and an fp8 cache with twice the heads of a bf16 one, have
    blocks of the same bytes: only the fingerprint can keep their values apart."""
    nhd, hnd = KVLayout(*_attention()), KVLayout(*_attention(hnd=True))
    fp8 = KVLayout(*_attention(heads=8, dtype=torch.float8_e4m3fn))
    bf16 = KVLayout(*_attention(dtype=torch.bfloat16))
    assert nhd.block_bytes(0) == hnd.block_bytes(0) == fp8.block_bytes(0) == bf16.block_bytes(0)
    assert len({nhd.fingerprint(), hnd.fingerprint(), fp8.fingerprint(), bf16.fingerprint()}) == 4


def test_fingerprint_does_not_depend_on_the_block_count():
    """Engines with more or less KV memory share values: the block count is no part of a block's
    geometry, in a blocks-first layout and in FlashAttention's (2, num_blocks, ...)."""
    for hnd in (False, True):
        assert KVLayout(*_attention(nb=8, hnd=hnd)).fingerprint() == KVLayout(*_attention(nb=24, hnd=hnd)).fingerprint()
    assert KVLayout(*kvdata.flash_attn(nb=8)).fingerprint() == KVLayout(*kvdata.flash_attn(nb=24)).fingerprint()
    # A heads dimension of 1 moves no byte: its place in memory is no difference.
    assert KVLayout(*_attention(heads=1)).fingerprint() == KVLayout(*_attention(heads=1, hnd=True)).fingerprint()
