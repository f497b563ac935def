"""Data-plane bench: kvstride store put/get vs raw Mooncake batch calls on the same buffers,
and the embedded store's GB/s.

    python benches/store.py [--keys 128] [--value-kib 512] [--reps 9] [--threads 1]

One process, one master on loopback (started here), the client owns a segment (Mooncake then
copies with memcpy, no TCP).  Values are staged blocks of 2 parts, the same parts on both
sides (the engine's staging on CPU made two parts a value, header room included, until it
staged whole entries: one part since 2026-12-02, ``benches/mooncake_parts.py``).  Baseline:
``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers`` with the same parts and
fresh keys, no header, no hash.  kvstride adds a 64-byte header and (verify=on) an XXH3 of the
payload on put and on get; values are laid out with room for the header in front of each value
(``header_room=True``), so the header rides the first part and a value is two parts on both
sides.  "digests with the copy" is how ``OffloadEngine`` calls it on
a CPU KV cache: the XXH3 is computed by the gather that copies the blocks into staging (put)
and checked by the scatter that copies them out (get), so the store call itself only writes
and checks headers; ``benches/engine.py`` times that whole path.  Ratio = raw time / kvstride
time (goal >= 0.95).

"MAC" rows: a store with a deployment secret: the payload digest is a keyed tag
(AEGIS-128X2-MAC) and the header carries a keyed MAC over key, length and tag; "tags with the
copy" is again the engine's path (the tag rides the gather / scatter). The "gather" rows time
what rides the copy: ``_save_rows`` copying the same values into staging alone, with the XXH3-64,
and with the keyed tag.

"whole" rows: the engine's path on a CPU KV cache end to end, against raw Mooncake plus a plain
copy in the same run: a save is the gather from the "KV cache" into staging then the put; a
load is the get into staging then the scatter out of it. Raw: ``_copy_regions`` + the raw batch
call; XXH3 / MAC: ``_save_rows`` / ``_load_rows`` (digest or tag riding the copy) + the store
call with ``digests=`` / ``digests_out=``. Same threads on both sides (rayon's pool for the
copies, Mooncake's for the transfer). Staging is a ``StagingPool`` laid out piece-major, as the
engine's was before it staged whole entries: the raw baseline's without header room (as the
engine staged before), kvstride's with it; "raw + copy, header room layout" is the raw path on
kvstride's staging (what the layout alone changes), "header part of its own" kvstride's path as
it was before (three parts a value).
"""

import argparse
import os
import platform
import statistics
import time

import numpy as np

from _dataplane import load

stores = load("stores")
store_format = load("stores.base")  # the value format's digests, as the gather computes them


def med(ts):
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=128)
    ap.add_argument("--value-kib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--whole-only", action="store_true",
                    help="only the whole save/load rows, with two stores (verify=on, MAC) and the raw calls on "
                    "the MAC store's client: fewer segments in the process, steadier Mooncake times")
    a = ap.parse_args()
    n, size = a.keys, a.value_kib * 1024
    half = size // 2
    room = store_format.HEADER_BYTES
    row = room + size  # a value and the room for its header before it
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, n * row, dtype=np.uint8)
    dst = np.zeros(n * row, dtype=np.uint8)

    def payload_parts(buf):
        return [[(buf.ctypes.data + i * row + room, half), (buf.ctypes.data + i * row + room + half, half)] for i in range(n)]

    def with_room(parts):
        return [[(a - room, m + room), *rest] for (a, m), *rest in parts]

    def payloads(buf):
        return buf.reshape(n, row)[:, room:]

    parts_src, parts_dst = payload_parts(src), payload_parts(dst)
    values_src, values_dst = with_room(parts_src), with_room(parts_dst)
    total = n * size
    rows = []

    master = stores.start_master()
    try:
        seg = 4 * total + (64 << 20)
        verifies = (True,) if a.whole_only else (True, False)
        ms = {v: stores.MooncakeStore(master, segment_bytes=seg, verify=v, fingerprint=b"benchfp0") for v in verifies}
        secret = bytes(range(32))
        ms["mac"] = stores.MooncakeStore(master, segment_bytes=seg, fingerprint=b"benchfp0", secret=secret)
        raw = ms["mac" if a.whole_only else True].client
        for s in ms.values():
            s.register_buffer(src.ctypes.data, src.nbytes)
            s.register_buffer(dst.ctypes.data, dst.nbytes)
        it = [0]

        def keys(tag):
            it[0] += 1
            return [f"{tag}-{it[0]}-{i}" for i in range(n)]

        def cleanup(ks):
            raw.batch_remove(ks, True)

        res = {}
        digests = np.array(store_format._hash_many(parts_src), dtype=np.uint64)  # what the gather yields
        tags = np.array(ms["mac"].mac_secret.payload_tags([store_format._views(p) for p in parts_src]), dtype=np.uint64)
        names = ("raw", "verify=on", "verify=on, digests with the copy", "verify=off", "MAC", "MAC, tags with the copy")
        for _ in range(0 if a.whole_only else a.reps):
            for name in names:
                ks = keys(name)
                ptrs = [[p for p, _ in ps] for ps in parts_src]
                sz = [[s for _, s in ps] for ps in parts_src]
                t = time.perf_counter()
                store = ms["mac"] if name.startswith("MAC") else ms[True]
                want = tags if name.startswith("MAC") else digests
                if name == "raw":
                    rc = raw.batch_put_from_multi_buffers(ks, ptrs, sz)
                    assert all(x == 0 for x in rc), rc[:4]
                elif name == "MAC":
                    st = store.put(ks, values_src, header_room=True)
                    assert all(x is stores.Status.OK for x in st)
                elif name.endswith("copy"):
                    st = store.put(ks, values_src, digests=want, header_room=True)
                    assert all(x is stores.Status.OK for x in st)
                else:
                    st = ms[name.startswith("verify=on")].put(ks, values_src, header_room=True)
                    assert all(x is stores.Status.OK for x in st)
                tp = time.perf_counter() - t
                dptrs = [[p for p, _ in ps] for ps in parts_dst]
                t = time.perf_counter()
                if name == "raw":
                    rc = raw.batch_get_into_multi_buffers(ks, dptrs, sz)
                    assert all(x == size for x in rc), rc[:4]
                elif name == "MAC":
                    st = store.get(ks, values_dst, header_room=True)
                    assert all(x is stores.Status.OK for x in st)
                elif name.endswith("copy"):
                    got = [0] * n
                    st = store.get(ks, values_dst, digests_out=got, header_room=True)
                    assert all(x is stores.Status.OK for x in st) and got == want.tolist()
                else:
                    st = ms[name.startswith("verify=on")].get(ks, values_dst, header_room=True)
                    assert all(x is stores.Status.OK for x in st)
                tg = time.perf_counter() - t
                assert np.array_equal(payloads(src)[0], payloads(dst)[0])
                res.setdefault(name, ([], []))
                res[name][0].append(tp)
                res[name][1].append(tg)
                cleanup(ks)
        for name in names if res else ():
            rp, rg = med(res["raw"][0]), med(res["raw"][1])
            p, g = med(res[name][0]), med(res[name][1])
            rows.append((f"Mooncake put ({name})", p, rp / p))
            rows.append((f"Mooncake get ({name})", g, rg / g))
        # Whole save / load: gather + put, get + scatter (see the docstring), in the same run.
        from kvstride import _core

        u64 = lambda xs: np.array(xs, dtype=np.uint64)  # noqa: E731
        src_a = u64([a for ps in parts_src for a, _ in ps])  # (the gather rows, below)
        dst_a = u64([a for ps in parts_dst for a, _ in ps])
        lens = u64([m for ps in parts_src for _, m in ps])
        starts = u64(range(0, 2 * n + 1, 2))
        back_to_back = u64([i * size + h * half for i in range(n) for h in (0, 1)])
        kv_src, kv_dst = payloads(src).copy().ravel(), np.zeros(total, np.uint8)  # writer's and reader's blocks
        kv_src_a, kv_dst_a = kv_src.ctypes.data + back_to_back, kv_dst.ctypes.data + back_to_back
        transfer_mod = load("transfer")

        def staged(header_room):
            """A staging pool and each value's payload parts in it, piece-major as
            ``Transfer.stage`` laid blocks out on CPU before whole entries: piece 0 of every
            value (each after the header's room when ``header_room``), then piece 1 of every
            value."""
            row = half + (room if header_room else 0)
            pool = transfer_mod.StagingPool(transfer_mod._round(n * row) + n * half, load_bytes=0, pin=False)
            for s in ms.values():
                pool.register(s.register_buffer)
            first, second = pool.ptr, pool.ptr + transfer_mod._round(n * row)
            return pool, [[(first + i * row + row - half, half), (second + i * half, half)] for i in range(n)]

        plain, with_header_room = staged(False), staged(True)
        # name: (staging, store (None: the raw calls), header_room); the raw baseline on the
        # staging the code before used, and on today's, to show what the layout alone changes.
        whole_paths = {
            "raw + copy": (plain, None, False),
            "raw + copy, header room layout": (with_header_room, None, False),
            "XXH3, digests with the copy": (with_header_room, ms[True], True),
            "MAC, tags with the copy": (with_header_room, ms["mac"], True),
            "MAC, tags with the copy, header part of its own": (plain, ms["mac"], False),
        }
        sz = [[half, half]] * n
        whole = {k: ([], []) for k in whole_paths}
        for _ in range(a.reps):
            for name, ((pool, staged_parts), store, header_room) in whole_paths.items():
                ks = keys("whole " + name)
                staged_a = u64([p for ps in staged_parts for p, _ in ps])
                values = with_room(staged_parts) if header_room else staged_parts
                kv_dst[:] = 0
                t = time.perf_counter()
                if store is None:
                    _core._copy_regions(kv_src_a, staged_a, lens)
                    rc = raw.batch_put_from_multi_buffers(ks, staged_a.reshape(n, 2).tolist(), sz)
                    assert all(x == 0 for x in rc), rc[:4]
                else:
                    d = _core._save_rows(kv_src_a, staged_a, lens, starts, store.mac_secret)
                    st = store.put(ks, values, digests=d, header_room=header_room)
                    assert all(x is stores.Status.OK for x in st)
                tp = time.perf_counter() - t
                pool.tensor.zero_()
                t = time.perf_counter()
                if store is None:
                    rc = raw.batch_get_into_multi_buffers(ks, staged_a.reshape(n, 2).tolist(), sz)
                    assert all(x == size for x in rc), rc[:4]
                    _core._copy_regions(staged_a, kv_dst_a, lens)
                else:
                    got = [0] * n
                    st = store.get(ks, values, digests_out=got, header_room=header_room)
                    ok = _core._load_rows(staged_a, kv_dst_a, lens, starts, u64(got), store.mac_secret)
                    assert all(x is stores.Status.OK for x in st) and ok.all()
                tg = time.perf_counter() - t
                assert np.array_equal(kv_src, kv_dst)
                whole[name][0].append(tp)
                whole[name][1].append(tg)
                cleanup(ks)
        wp, wg = med(whole["raw + copy"][0]), med(whole["raw + copy"][1])
        for name, (tps, tgs) in whole.items():
            rows.append((f"whole save ({name})", med(tps), wp / med(tps)))
            rows.append((f"whole load ({name})", med(tgs), wg / med(tgs)))
        t = time.perf_counter()
        exists = ms[True].exists(keys("nokey"))
        rows.append((f"Mooncake exists ({n} keys, one batch_is_exist)", time.perf_counter() - t, None))
        for s in ms.values():
            s.close()
    finally:
        master.stop()

    # What rides the gather: one _save_rows over the same values into staging (dst).
    secret_obj = _core.StoreSecret(bytes(range(32)))
    gathers = {"copy only": lambda: _core._copy_regions(src_a, dst_a, lens),
               "copy + XXH3-64": lambda: _core._save_rows(src_a, dst_a, lens, starts),
               "copy + keyed tag (AEGIS-128X2-MAC)": lambda: _core._save_rows(src_a, dst_a, lens, starts, secret_obj)}
    gt = {k: [] for k in gathers}
    for _ in range(a.reps):
        for k, f in gathers.items():
            t = time.perf_counter()
            f()
            gt[k].append(time.perf_counter() - t)
    base = med(gt["copy only"])
    for k in gathers:
        rows.append((f"gather ({k})", med(gt[k]), base / med(gt[k])))

    for v in () if a.whole_only else (True, False):
        es = stores.EmbeddedStore(4 * total, verify=v, slot_bytes=size)
        es.register_buffer(src.ctypes.data, src.nbytes)  # raw parts must lie in registered buffers
        es.register_buffer(dst.ctypes.data, dst.nbytes)
        tp, tg = [], []
        for r in range(a.reps):
            ks = [f"e{r}-{i}" for i in range(n)]
            t = time.perf_counter()
            es.put(ks, parts_src)
            tp.append(time.perf_counter() - t)
            t = time.perf_counter()
            st = es.get(ks, parts_dst)
            tg.append(time.perf_counter() - t)
            assert all(x is stores.Status.OK for x in st)
            es.remove(ks)
        rows.append((f"Embedded put (verify={'on' if v else 'off'})", med(tp), None))
        rows.append((f"Embedded get (verify={'on' if v else 'off'})", med(tg), None))

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, loopback, in-process segment (memcpy)")
    print(f"{n} keys x {size // 1024} KiB (2 parts each) = {total / 2**20:.0f} MiB per op, median of {a.reps}")
    print()
    print("| op | median | GB/s | ratio vs raw Mooncake (gather rows: vs copy only; whole rows: vs raw + copy) |")
    print("|---|---|---|---|")
    for name, tm, ratio in rows:
        gbs = "" if "exists" in name else f"{total / tm / 1e9:.2f}"
        print(f"| {name} | {tm * 1e3:.2f} ms | {gbs} | {'' if ratio is None else f'{ratio:.3f}'} |")


if __name__ == "__main__":
    main()
