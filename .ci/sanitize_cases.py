"""Run every chapter's kernels once on small, ragged inputs: the program compute-sanitizer
(memcheck, racecheck, synccheck) watches on the GPU. Usage: python .ci/sanitize_cases.py [chapter ...]"""

import importlib
import sys

import numpy as np

import kernels  # noqa: F401  (GPU or simulator first)
from kernels import reference as ref


def rand(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def main(only):
    rng = np.random.default_rng(0)
    ran = []

    def want(name):
        return not only or name in only

    def have(module):
        try:
            return importlib.import_module(f"kernels.{module}")
        except ModuleNotFoundError:
            print(f"skip: kernels.{module} does not exist")
            return None

    shapes = [(1, 2, 130, 67, 64), (1, 1, 67, 130, 64), (1, 1, 33, 33, 128), (2, 1, 1, 1, 16)]
    if want("gpu_basics") and (m := have("gpu_basics")):
        for n in (1, 1000, 4097, 1 << 20):
            x = rand(rng, n)
            m.copy(x)
            m.copy(x, items=4)
            m.block_sums(x)
            m.block_maxes(x)                          # the exercises' kernels
            m.scale_add(1.5, x, rand(rng, n))
        ran.append("gpu_basics")
    if want("naive_attention") and (m := have("naive_attention")):
        for b, h, nq, nk, d in shapes:
            for causal in (False, True):
                m.naive_attention(rand(rng, b, h, nq, d), rand(rng, b, h, nk, d), rand(rng, b, h, nk, d), causal=causal)
        # the softmax's long-row path (rows longer than threads x registers are swept three times)
        long_rows = m.Tiles(softmax_threads=32, softmax_regs=1)
        m.naive_attention(rand(rng, 1, 1, 40, 64), rand(rng, 1, 1, 130, 64), rand(rng, 1, 1, 130, 64),
                          causal=True, tiles=long_rows)
        for nq, nk in ((0, 5), (5, 0)):
            m.naive_attention(rand(rng, 1, 1, nq, 16), rand(rng, 1, 1, nk, 16), rand(rng, 1, 1, nk, 16))
        for b, h, nq, nk, d in shapes:                # the first versions (the exercises' kernels)
            m.first_row_softmax(m.first_scores(rand(rng, b, h, nq, d), rand(rng, b, h, nk, d), causal=True))
        ran.append("naive_attention")
    if want("tiled_matmul") and (m := have("tiled_matmul")):
        for (mm, kk, nn) in [(129, 67, 131), (1, 1, 1), (256, 256, 256)]:
            for rung in (1, 2, 3):
                m.matmul(rand(rng, mm, kk), rand(rng, kk, nn), rung=rung)
        # rung 4 (tensor cores): ragged (element copies), aligned (cp.async), both tilings
        for mm, nn, kk in [(130, 70, 50), (128, 136, 96)]:
            a16, b16 = rand(rng, mm, kk).astype(np.float16), rand(rng, kk, nn).astype(np.float16)
            for tiles in (m.MMA_TILES_GPU, (64, 64, 32, 32, 32)):
                m.matmul_tensor_cores(a16, b16, tiles=tiles)
        ran.append("tiled_matmul")
    if want("online_softmax") and (m := have("online_softmax")):
        for shape in [(7, 1), (5, 1000), (3, 4097), (2, 0)]:
            m.softmax(rand(rng, *shape))
            m.first_softmax(rand(rng, *shape))        # the exercise's kernel, one thread a row
        ran.append("online_softmax")
    if want("flash_forward") and (m := have("flash_forward")):
        for b, h, nq, nk, d in shapes:
            for causal in (False, True):
                m.flash_attention(rand(rng, b, h, nq, d), rand(rng, b, h, nk, d), rand(rng, b, h, nk, d), causal=causal)
            m.flash_attention(rand(rng, b, h, nq, d, dtype=np.float16), rand(rng, b, h, nk, d, dtype=np.float16),
                              rand(rng, b, h, nk, d, dtype=np.float16), causal=True)
            for causal in (False, True):              # the ladder's first rungs (the exercises' kernels)
                q, k, v = rand(rng, b, h, nq, d), rand(rng, b, h, nk, d), rand(rng, b, h, nk, d)
                m.row_per_thread_attention(q, k, v, causal=causal)
                m.query_tile_attention(q, k, v, causal=causal)
                m.query_tile_attention(q, k, v, causal=causal, tiles=(17, 8))
        ran.append("flash_forward")
    if want("flash_backward") and (m := have("flash_backward")):
        for b, h, nq, nk, d in shapes:
            for causal in (False, True):
                q, k, v = rand(rng, b, h, nq, d), rand(rng, b, h, nk, d), rand(rng, b, h, nk, d)
                o, lse = ref.attention(q, k, v, causal=causal)
                m.flash_attention_backward(q, k, v, o.astype(np.float32), lse.astype(np.float32),
                                           rand(rng, b, h, nq, d), causal=causal)
                args = (q, k, v, o.astype(np.float32), lse.astype(np.float32), rand(rng, b, h, nq, d))
                m.row_per_thread_backward(*args, causal=causal)          # the ladder's first rungs
                m.shared_tile_backward(*args, causal=causal)
                m.shared_tile_backward(*args, causal=causal, tiles=(17, 8))
        ran.append("flash_backward")
    if want("block_sparse") and (m := have("block_sparse")):
        from kernels.base.masks import BlockMask

        backward = have("block_sparse_backward")
        for b, h, nq, nk, d in shapes[:3]:
            bq = bk = 64
            flags = rng.random((h, -(-nq // bq), -(-nk // bk))) < 0.5
            mask = BlockMask(flags, bq, bk)
            q, k, v = rand(rng, b, h, nq, d), rand(rng, b, h, nk, d), rand(rng, b, h, nk, d)
            for causal in (False, True):
                o, lse = m.block_sparse_attention(q, k, v, mask, causal=causal)
                m.block_sparse_attention(*(x.astype(np.float16) for x in (q, k, v)), mask, causal=causal)
                m.first_block_sparse_attention(q, k, v, mask, causal=causal)      # the exercises' kernels
                m.first_tile_lists(mask, nq, nk, Br=64, Bc=32, causal=causal, batch=b, heads=h)
                for dq_mode in ("atomic", "separate") if backward else ():
                    backward.block_sparse_attention_backward(q, k, v, o, lse, rand(rng, b, h, nq, d), mask,
                                                             causal=causal, dq_mode=dq_mode)
        ran.append("block_sparse")
    if want("flash_tensor_cores") and (m := have("flash_tensor_cores")):
        from kernels.base.mma import bf16_bits

        # d = 100: 128 rows a block; d = 24: the tile copy by column with a chunk past d; GQA (the
        # last two: 4 query heads on 2 KV heads, 3 on 1)
        for b, h, hkv, nq, nk, d in ([(b, h, h, nq, nk, d) for b, h, nq, nk, d in shapes]
                                     + [(1, 1, 1, 200, 130, 100), (1, 1, 1, 77, 291, 24), (2, 4, 2, 70, 150, 64),
                                        (1, 3, 1, 33, 20, 128)]):
            for causal in (False, True):
                q, k, v = rand(rng, b, h, nq, d), rand(rng, b, hkv, nk, d), rand(rng, b, hkv, nk, d)
                m.flash_attention_tc(*(x.astype(np.float16) for x in (q, k, v)), causal=causal)
                m.flash_attention_tc(*(bf16_bits(x).astype(np.uint16) for x in (q, k, v)), causal=causal, bf16=True)
        ran.append("flash_tensor_cores")
    if want("tensor_core_backward") and (m := have("tensor_core_backward")):
        from kernels.base.mma import bf16_bits

        # ragged tiles, d padded (40, 100: odd column pairs; 13: scalar atomics; 24: the tile copy by
        # column with a chunk past d), GQA, Nq != Nk
        for b, h, hkv, nq, nk, d in [(1, 2, 1, 150, 133, 64), (1, 1, 1, 70, 200, 128), (1, 2, 2, 33, 20, 40),
                                     (1, 4, 2, 129, 129, 100), (2, 1, 1, 1, 1, 13), (1, 1, 1, 77, 291, 24)]:
            for causal in (False, True):
                q, do = rand(rng, b, h, nq, d), rand(rng, b, h, nq, d)
                k, v = rand(rng, b, hkv, nk, d), rand(rng, b, hkv, nk, d)
                o, lse = rand(rng, b, h, nq, d), np.full((b, h, nq), 2.0, np.float32)
                m.flash_attention_backward_tc(*(x.astype(np.float16) for x in (q, k, v)), o, lse,
                                              do.astype(np.float16), causal=causal)
                m.flash_attention_backward_tc(*(bf16_bits(x).astype(np.uint16) for x in (q, k, v, o)), lse,
                                              bf16_bits(do).astype(np.uint16), causal=causal, bf16=True)
        ran.append("tensor_core_backward")
    if want("tf32_backward") and (m := have("tf32_backward")):
        # ragged tiles, d padded (13, 100; 13 and 30: d % 4 != 0, element-wise copies, scalar atomics;
        # 24: the tile copy by column with chunks past d), GQA
        for b, h, hkv, nq, nk, d in [(1, 2, 1, 150, 133, 64), (1, 1, 1, 70, 200, 128), (1, 2, 2, 33, 20, 30),
                                     (1, 4, 2, 129, 129, 100), (2, 1, 1, 1, 1, 13), (1, 1, 1, 77, 291, 24)]:
            for causal in (False, True):
                q, do, o = rand(rng, b, h, nq, d), rand(rng, b, h, nq, d), rand(rng, b, h, nq, d)
                k, v = rand(rng, b, hkv, nk, d), rand(rng, b, hkv, nk, d)
                lse = np.full((b, h, nq), 2.0, np.float32)
                for passes in (3, 1):
                    m.flash_attention_backward_tf32(q, k, v, o, lse, do, causal=causal, passes=passes)
        ran.append("tf32_backward")
    if want("flash_tf32") and (m := have("flash_tf32")):
        # d = 128 with 128-row tiles: Q's parts in shared memory; the last three: grouped-query (4 query
        # heads on 2 KV heads; 3 on 1, K and V split as they land; 2 on 1 with 64 query rows: the short heads'
        # 64-row tiles)
        for b, h, hkv, nq, nk, d in ([(b, h, h, nq, nk, d) for b, h, nq, nk, d in shapes]
                                     + [(1, 1, 1, 200, 130, 100), (1, 2, 2, 150, 70, 128),
                                        (2, 4, 2, 300, 150, 64), (1, 3, 1, 33, 20, 128),
                                        (2, 2, 1, 64, 300, 96)]):
            for causal in (False, True):
                q, k, v = rand(rng, b, h, nq, d), rand(rng, b, hkv, nk, d), rand(rng, b, hkv, nk, d)
                for passes in (3, 1):
                    m.flash_attention_tf32(q, k, v, causal=causal, passes=passes)
                m.flash_attention_tf32(q[..., :d - 1].copy(), k[..., :d - 1].copy(), v[..., :d - 1].copy(),
                                       causal=causal)     # d % 4 != 0: the element-wise copies
        # K and V split once first (presplit): through the checked entry, and bare with Q's parts and
        # 16-key tiles, and with 64-row tiles two an SM; odd Nk (a key pair's second key past the end), GQA
        from numba import cuda

        from kernels.base.runtime import ArrayKind
        for b, h, hkv, nq, nk, d in [(1, 2, 2, 130, 67, 64), (1, 1, 1, 33, 33, 128), (2, 4, 2, 150, 71, 128),
                                     (1, 1, 1, 67, 130, 100)]:
            for causal in (False, True):
                q, k, v = (cuda.to_device(rand(rng, b, x, n, d)) for x, n in ((h, nq), (hkv, nk), (hkv, nk)))
                m.forward_checked(ArrayKind(q), q, k, v, causal=causal, scale=d ** -0.5, presplit=True)
                o, lse = cuda.device_array((b * h, nq, d), np.float32), cuda.device_array((b * h, nq), np.float32)
                Br, Bc, _ = m.tf32_tiles(d, nq)
                views = (q.reshape(b * h, nq, d), k.reshape(b * hkv, nk, d), v.reshape(b * hkv, nk, d))
                m.launch_forward(*views, o, lse, d ** -0.5, int(causal), 3, tiles=(Br, min(Bc, 16)), query_parts=True,
                                 presplit=True)
                m.launch_forward(*views, o, lse, d ** -0.5, int(causal), 3, tiles=(64, min(Bc, 16)), min_blocks=2,
                                 query_parts=False, presplit=True)
        # K_j and V_j landed together, and in turn, whichever way tf32_paired would choose; keys split
        # among blocks too; GQA, ragged Nk, d = 100 (chunk by chunk)
        for b, h, hkv, nq, nk, d in [(1, 2, 2, 150, 67, 128), (2, 4, 2, 129, 300, 128), (1, 2, 1, 33, 130, 64),
                                     (1, 1, 1, 70, 45, 100)]:
            for causal in (False, True):
                q, k, v = (cuda.to_device(rand(rng, b, x, n, d)) for x, n in ((h, nq), (hkv, nk), (hkv, nk)))
                for paired, splits in ((True, 1), (True, 3), (False, 1)):
                    m.forward_checked(ArrayKind(q), q, k, v, causal=causal, scale=d ** -0.5, splits=splits,
                                      paired=paired)
        # (Hopper) the products on wgmma, S alone and S with P V, K_j and V_j landed together or in turn,
        # the k-steps in flight four groups a round or two, one k-step a group or two;
        # and every product on mma.sync where the launchers would take wgmma
        from kernels.base.wgmma import has_wgmma
        for b, h, hkv, nq, nk, d in [(1, 2, 2, 150, 67, 128), (2, 4, 2, 129, 300, 64), (1, 1, 1, 70, 45, 100),
                                     (1, 2, 1, 33, 130, 13)]:
            for causal in (False, True):
                q, k, v = (cuda.to_device(rand(rng, b, x, n, d)) for x, n in ((h, nq), (hkv, nk), (hkv, nk)))
                m.forward_checked(ArrayKind(q), q, k, v, causal=causal, scale=d ** -0.5, wgmma=False)
                if not has_wgmma():
                    continue
                o, lse = cuda.device_array((b * h, nq, d), np.float32), cuda.device_array((b * h, nq), np.float32)
                views = (q.reshape(b * h, nq, d), k.reshape(b * hkv, nk, d), v.reshape(b * hkv, nk, d))
                for mode, paired in (("s", False), ("s", True), ("s+pv", True), ("s+pv", False)):
                    m.launch_forward(*views, o, lse, d ** -0.5, int(causal), 3, wgmma=mode, paired=paired, min_blocks=1)
                    if d in (64, 128) and mode == ("s+pv" if d == 64 else "s"):    # every schedule of the k-steps
                        for inflight, chain in ((2, 1), (4, 1), (2, 2), (4, 2)):
                            m.launch_forward(*views, o, lse, d ** -0.5, int(causal), 3, wgmma=mode, paired=paired,
                                             min_blocks=1, inflight=inflight, chain=chain)
                    if d in (64, 128) and mode == "s+pv":    # P V's own schedules, over all of O or half
                        for pv in ((1, 2, d), (2, 1, d // 2), (1, 2, d // 2), (2, 2, d // 2)):
                            m.launch_forward(*views, o, lse, d ** -0.5, int(causal), 3, wgmma=mode, paired=paired,
                                             min_blocks=1, pv_schedule=pv)
        ran.append("flash_tf32")
    if want("decode") and (m := have("decode")):
        # ragged (an empty cache, a length of 1), GQA and MHA, Nq up to 16, causal, fp16 caches;
        # both schedules, stream-K on a small grid so that blocks cross heads and merge
        # (fp16 caches with grouped rows and d = 64 or 128 go through the tensor-core partial)
        for b, hq, hkv, nq, n, d, lengths, dt in [(3, 8, 2, 4, 300, 64, [300, 0, 1], np.float32),
                                                  (2, 4, 4, 1, 1000, 128, None, np.float16),
                                                  (2, 32, 8, 16, 70, 128, [70, 33], np.float32),
                                                  (3, 8, 2, 4, 300, 64, [300, 0, 1], np.float16),
                                                  (2, 32, 8, 1, 500, 128, [500, 33], np.float16)]:
            q, k, v = rand(rng, b, hq, nq, d), rand(rng, b, hkv, n, d, dtype=dt), rand(rng, b, hkv, n, d, dtype=dt)
            for causal in (False, True):
                m.decode_attention(q, k, v, cache_lengths=lengths, causal=causal, schedule="split-k")
                m.decode_attention(q, k, v, cache_lengths=lengths, causal=causal, schedule="split-k", splits=5)
                m.decode_attention(q, k, v, cache_lengths=lengths, causal=causal, schedule="stream-k")
                m.decode_attention(q, k, v, cache_lengths=lengths, causal=causal, schedule="stream-k", blocks=7)
        # the first versions (the exercises' kernels): a block a (query row, split), then the combine
        for b, hq, hkv, nq, n, d, lengths, dt, splits in [(3, 8, 2, 4, 300, 128, [300, 0, 1], np.float32, 5),
                                                          (2, 4, 4, 1, 1000, 64, None, np.float16, 7)]:
            q, k, v = rand(rng, b, hq, nq, d), rand(rng, b, hkv, n, d, dtype=dt), rand(rng, b, hkv, n, d, dtype=dt)
            for causal in (False, True):
                m.first_split_k(q, k, v, cache_lengths=lengths, causal=causal, splits=splits)
        lp = rand(rng, 5, 3, 37)
        lp[0] = -np.inf                               # an empty first piece
        m.combine_partials(rand(rng, 5, 3, 37, 100), lp, rows_per_block=16)
        ran.append("decode")
    if want("tree_attention") and (m := have("tree_attention")):
        # P shards' partials and both reductions: P a power of two and not, P > N (empty shards),
        # d = 128 (several column chunks of O a block), ragged caches, causal, fp16
        for b, hq, hkv, nq, n, d, lengths, dt in [(2, 8, 2, 1, 300, 128, [300, 0], np.float16),
                                                  (1, 4, 4, 3, 70, 64, None, np.float32)]:
            q = rand(rng, b, hq, nq, d)
            k, v = rand(rng, b, hkv, n, d).astype(dt), rand(rng, b, hkv, n, d).astype(dt)
            lens = None if lengths is None else np.array(lengths, np.int32)
            for shards in (1, 6, 8, 100):
                for reduce in ("tree", "flat"):
                    m.tree_decode_attention(q, k, v, shards=shards, reduce=reduce, cache_lengths=lens, causal=True)
        lp = rand(rng, 5, 7, 3)
        lp[1] = -np.inf
        m.tree_reduce_partials(rand(rng, 5, 7, 3, 100), lp, reduce="tree")
        ran.append("tree_attention")
    if want("io_theory"):
        # chapter 10: Algorithm 1's loop order, dropout (forward and both backward kernels) and
        # the M < d^2 algorithm (its b x b products, dynamic shared memory at d = 256)
        kvo, drop, small = have("kv_outer_forward"), have("dropout"), have("small_cache_attention")
        for b, h, nq, nk, d in shapes:
            q, k, v = rand(rng, b, h, nq, d), rand(rng, b, h, nk, d), rand(rng, b, h, nk, d)
            for causal in (False, True):
                if kvo:
                    kvo.kv_outer_attention(q, k, v, causal=causal)
                    kvo.kv_outer_attention(q, k, v, causal=causal, tiles=(17, 8))
                if drop:
                    o, lse = drop.dropout_attention(q, k, v, p=0.1, seed=3, causal=causal)
                    drop.dropout_attention_backward(q, k, v, o, lse, rand(rng, b, h, nq, d), p=0.1, seed=3,
                                                    causal=causal)
                if small:
                    small.small_cache_attention(q, k, v, causal=causal)
                    small.small_cache_attention(q, k, v, causal=causal, tile=16)
        if small:
            for nq, nk in ((70, 130), (139, 139)):
                q, k, v = rand(rng, 1, 2, nq, 256), rand(rng, 1, 2, nk, 256), rand(rng, 1, 2, nk, 256)
                small.small_cache_attention(q, k, v, causal=True)
        ran.append("io_theory")
    if want("mma"):
        # the tensor-core building blocks (kernels/base/mma.py) through their tests' kernels
        import os
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import tests.test_mma as t
        for kind in ("f16", "tf32"):
            t.test_a_mis_mapped_fragment_fails(kind)
        for trans in (False, True):
            t.test_ldmatrix_gives_the_mma_fragments(trans)
        t.test_cp_async_and_wide_words_copy_rows()
        ran.append("mma")
    print("ran:", ", ".join(ran))


if __name__ == "__main__":
    main(set(sys.argv[1:]))
