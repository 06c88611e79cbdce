"""Kernel-choice rules, beside the wrappers they choose between, each with the GPU and shapes it was tuned on.

Model families ask here instead of carrying their own thresholds, so a new GPU or kernel changes one place.
"""

from __future__ import annotations

import os

from engine.errors import InvalidInput, env_int

SMALL_BATCH = 8  # tokens one matvec launch serves (one weight read for all of them: k_matvec.TOKEN_BUCKETS)

# Up to this many tokens, small-batch launches (engine/cuda/small_batch.py: matvec passes of 8, or one tc_matvec
# launch) with the RMSNorm fused; the GEMM past it. One H200 (sm_90, 2026-12-03, scripts/bench_small_batch.py, the
# matmuls of one Qwen3-0.6B Q4_K_M layer): tc_matvec 47 us at n = 16 and 115 at 64, the split-K GEMM 111 and 113,
# matvec passes 76 and 297 (so types without tc_matvec would do better on the GEMM from ~24 tokens: not yet a rule).
# Again after the tc_matvec block shapes of 2026-12-04 (same script, --n 48,64): tc_matvec 103.2 / 104.8 us at 48 /
# 64 tokens, the split-K GEMM 112.2 / 113.0; per matrix the GEMM won only the SwiGLU pair (34.0 against 40.6 at 64).
MATVEC_MAX = 64

# From this many tokens (to MATVEC_MAX), a weight type with a tc_matvec kernel takes one launch of it (every token
# through one weight read, on tensor cores) instead of matvec passes of SMALL_BATCH.
TC_MIN = SMALL_BATCH + 1

# Key splits of the decode attention: a fixed grid for every length; 4096 keys -> 128 per block keeps decode cost
# flat in length (H200, head_dim 128, 2026-11-29). The split + combine forms (8 or more q heads a kv head, MLA) keep
# N_SPLITS, since their combine reads every split; the folded form takes decode_splits. REFLEX_DECODE_SPLITS (1..64,
# attn_combine's limit) sets every count, for comparisons.
N_SPLITS = 32
MAX_SPLITS = 64
# attn_decode blocks resident at once on an H200's 132 SMs, by warps a block (their __launch_bounds__): 3 of 4 warps
# (attn_decode), 2 of 8 (attn_decode_w8)
DECODE_WAVE_BLOCKS = {4: 396, 8: 264}
COMBINE_TAIL = 16384  # partial values (G heads x vd x splits) the last block of a kv head sums after the others


def combine_splits() -> int:
    """Key splits of a split + combine decode (attn_decode with 8 or more q heads a kv head, MLA's mla_attn)."""
    return min(MAX_SPLITS, env_int("REFLEX_DECODE_SPLITS", N_SPLITS, minimum=1))


def decode_warps(G: int, hd: int, vd: int) -> int:
    """Warps of an attn_decode block scoring G q heads of hd / vd dims: 4, or 8 with REFLEX_ATTN_WARPS=8 where G <= 4
    and hd, vd <= 128 (attn_decode_w8's paths), for comparisons. 8 warps take 16-key tiles to 128 keys a split and
    32-key ones to 256 (4: to 64 and 128), and hold 16 warps an SM where a long context fills a wave (4: 12)."""
    warps = env_int("REFLEX_ATTN_WARPS", 4, minimum=1)
    if warps not in DECODE_WAVE_BLOCKS:
        raise InvalidInput(f"REFLEX_ATTN_WARPS must be one of {tuple(DECODE_WAVE_BLOCKS)}, got {warps}")
    return 8 if warps == 8 and w8_takes(G, hd, vd) else 4


def w8_takes(G: int, hd: int, vd: int) -> bool:
    """Whether attn_decode_w8 has a path for G q heads a block of hd / vd dims (the paths that fit its registers)."""
    return G <= 4 and max(hd, vd) <= 128


def decode_splits(H: int, KVH: int, vd: int, hd: int | None = None) -> int:
    """Key splits of attn_decode for H q heads over KVH kv heads of hd / vd dims (hd None: vd). Folded, as many as one
    wave of its blocks holds (KVH x parts x splits <= DECODE_WAVE_BLOCKS[decode_warps]) while the last block's combine
    stays short (its q heads x vd x splits <= COMBINE_TAIL), from N_SPLITS to MAX_SPLITS: a split past the keys returns
    at once, so a short context pays nothing, and a long one reads the cache from every SM. One H200 (2026-12-03,
    scripts/bench_long_context.py, decode tok/s as generate runs it): the Qwen3-0.6B shape (8 kv heads of 2 q heads, vd
    128) with 48-49 splits instead of 32, at 40,900 keys 256 -> 288 (f32 cache) and 297 -> 356 (f16), at 16,384 439 ->
    461 and 489 -> 525, at 64 and 4,096 within 1 %; 64 splits (1.3 waves) 233 at 40,900. The Qwen3.5-0.8B hybrid (2 kv
    heads of 4, vd 256) with 64: 456 -> 526 at 65,535 keys but 672 -> 662 (f32) and 696 -> 669 (f16) at 16,384, where
    its combine of 4 x 256 x 64 partials sits behind every other block: it keeps 32."""
    fold, _, parts = decode_attention(H, KVH)
    if os.environ.get("REFLEX_DECODE_SPLITS") or not fold:
        return combine_splits()
    rows = KVH * parts  # blocks a split
    wave = DECODE_WAVE_BLOCKS[decode_warps(H // rows, vd if hd is None else hd, vd)]
    fits = min(wave // rows, COMBINE_TAIL // (H // rows * vd))
    return min(MAX_SPLITS, max(N_SPLITS, fits))


# One token through a matrix this tall (the LM head) and at most STREAM_MAX_K wide goes through matvec_stream: each
# warp streams 16 rows through a 4-deep ring of shared-memory buffers instead of a block reading 8 rows at once.
# Measured on one H200 (2026-12-01), the Q6_K LM heads through the block matvec: 151936 x 2048 (Qwen3-30B-A3B)
# 175 us = 1.46 TB/s, 151936 x 1024 (Qwen3-0.6B) 132 us = 0.97 TB/s, 248320 x 1024 (Qwen3.5-0.8B) 214 us.
# matvec_stream alone (scripts/stream_bench.py, same day, one H200; Q6_K, 30 launches): 151936 x 2048 137 us; 151936
# x 1024 92 us, or 79 with the kernel that holds 4 groups of x a lane instead of 8 (63 registers instead of ~100:
# twice the warps an SM); 248320 x 1024 142 us, 114 with it. Q8_0 and Q4_K rows took the same time as Q6_K's: the
# kernel is bound by its per-value work, not by bytes.
STREAM_MIN_ROWS = 32768
STREAM_MAX_K = 2048
STREAM_NARROW_K = 1024  # up to this width, matvec_stream_{t}_k1024


def use_stream(rows: int, cols: int, n: int) -> bool:
    """Whether a matvec of n tokens over a rows x cols matrix takes matvec_stream (when its type has one)."""
    return n == 1 and rows >= STREAM_MIN_ROWS and cols <= STREAM_MAX_K


def stream_i16() -> bool:
    """Whether matvec_stream dots in integers with x rounded to 16 bits (matvec_stream16, k_matvec.STREAM16_TYPES)
    rather than in float (REFLEX_STREAM_I16=0, for comparisons). One H200 (2026-12-04): scripts/stream_bench.py, Q6_K
    151936 x 2048 136 -> 109 us, 151936 x 1024 75 -> 65 (the k1024 forms), 248320 x 1024 114 -> 98; engine profile
    steps, 4-layer 30B-A3B shape 0.3502 -> 0.3235 ms (LM head 98.6 us in it), Qwen3-0.6B shape 0.9581 -> 0.9470."""
    return os.environ.get("REFLEX_STREAM_I16", "1") != "0"


def head_argmax() -> bool:
    """Whether a greedy decode step's argmax is folded into its LM head where the head takes matvec_stream (each warp
    atomicMax-es its rows' argmax key into one slot, kernels/argmax_key.cuh, and one thread reads it) rather than a
    block reading the whole row of logits back (sample.cu's argmax_f32; REFLEX_HEAD_ARGMAX=0, for comparisons). On an
    H100 (2026-12-05, the Qwen3-0.6B-shaped Q4_K_M model, two rounds each way): argmax_f32 cost 20.8 us in the step,
    argmax_key 3.1 and the head 59.1 -> 62.1; the decode step 0.752 -> 0.733 ms, engine bench decode 1,226 / 1,227 ->
    1,253 / 1,255 tok/s."""
    return os.environ.get("REFLEX_HEAD_ARGMAX", "1") != "0"


# The MoE FFN of n tokens, k experts a token: up to MOE_MATVEC_ITEMS routed items (n x k) go through the decode expert
# kernels (engine/models/moe_cuda.py, _small: a block a row block of one item's expert, an expert's rows read once
# per item that chose it, from L2 after the first), past it through the grouped GEMM over the rows sorted by expert,
# whose 64-row tiles hold one or two rows each at a few tokens and walk K in a long chain. One H200 (2026-12-04,
# engine bench, warm p50): with 8 tokens as the bound, the 30B-A3B shape's system1 (13 tokens) 20.7 ms and prefill of
# 16 20.7; with 128 items 13.6 and 15.0 (DeepSeek-V2-Lite's 27.1 -> 12.3 and 29.3 -> 14.0); 256 the same; at 512
# items prefill of 64 tokens took 52.3 ms against the GEMM's 28.4, at 1024 prefill of 128 95.5 against 32.1.
MOE_MATVEC_ITEMS = 128


def moe_matvec_tokens(k: int) -> int:
    """The most tokens whose MoE FFN (k experts a token) takes the decode expert kernels: SMALL_BATCH at least, as
    many as keep n x k within MOE_MATVEC_ITEMS (REFLEX_MOE_MATVEC_ITEMS sets the bound, for comparisons)."""
    return max(SMALL_BATCH, env_int("REFLEX_MOE_MATVEC_ITEMS", MOE_MATVEC_ITEMS) // max(k, 1))


def mixed_matvec3() -> bool:
    """Whether one token's q/k/v of two types (a Q4_K_M file's Q4_K q/k beside a Q6_K v: k_matvec.MATVEC3_PAIRS) go
    through one matvec3 launch rather than one a type (REFLEX_MATVEC3_MIXED=0, for comparisons). One H200
    (2026-12-04, engine bench): Qwen3-30B-A3B shape decode 337.8 -> 354.3 tok/s, profiles in kernels/matvec.cu."""
    return os.environ.get("REFLEX_MATVEC3_MIXED", "1") != "0"


def matvec_i16() -> bool:
    """Whether the 1-token matvec, SwiGLU and q/k/v kernels of k_matvec.I16_TYPES round x to 16 bits a group of 8 and
    dot in integers (kernels/quant_i16.cuh) rather than in float (REFLEX_MATVEC_I16=0, for comparisons). Why:
    kernels/matvec.cu, the 16-bit forms."""
    return os.environ.get("REFLEX_MATVEC_I16", "1") != "0"


def use_matvec(n: int) -> bool:
    """Whether n tokens go through matvec passes (True) or the tiled GEMM (False)."""
    return n <= MATVEC_MAX


# Split-K of the prefill GEMM (kernels/gemm_tile.cuh, Split): a block's 64 x 64 tile walks K one 32-value stage at a
# time, ~0.85 us a stage on an H200 whatever n is (2026-12-03, scripts/bench_small_batch.py: 27 us for K = 1024, 67
# for K = 3072, at every n <= 128), so a grid of few tiles leaves the GPU idle behind long chains. Splitting K over
# grid.z until the grid fills the GPU shortens the chains; the last block of a tile sums the partials in a fixed
# order. GEMM_FULL_BLOCKS: resident blocks that fill an H200 (132 SMs x 2, gemm.cu's bound).
GEMM_FULL_BLOCKS = 264
GEMM_MAX_SPLITS = 8


def gemm_splits(blocks: int, k_stages: int) -> int:
    """Splits of K for a GEMM of `blocks` 64 x 64 tiles whose K is k_stages 32-value stages (a split takes whole
    stages): as many as fit in GEMM_FULL_BLOCKS, at most GEMM_MAX_SPLITS (REFLEX_GEMM_SPLIT=0: none)."""
    if os.environ.get("REFLEX_GEMM_SPLIT", "1") == "0":
        return 1
    s = min(GEMM_MAX_SPLITS, GEMM_FULL_BLOCKS // max(blocks, 1), k_stages)
    while s > 1 and k_stages % s:
        s -= 1
    return max(s, 1)


# From PREFILL_TC_MIN tokens, on sm_90, a quantized matmul takes one of kernels/gemm_tc.cu's pipelined TF32 tiles
# (128 tokens x 64 rows, cp.async stages, ldmatrix, mma.sync) rather than gemm.cu's, which dequantizes inside its K
# loop through registers, two stages deep: "pipe" (the default) stages the GGUF rows raw and dequantizes them beside
# the multiply; "dense" dequantizes the weights into a float slab first (a second pass, the slab reserved only when
# named) and multiplies the slab. The same roundings as gemm.cu (tf32 operands, float32 sums in k order).
# REFLEX_PREFILL_GEMM=tile|dense|pipe picks one for comparisons, REFLEX_PREFILL_GEMM_MIN moves the bound. sm_90 only
# (sm_86 / sm_89 lack their 110 KiB of shared memory a block; sm_80 untried). Measured on an H100 (2026-12-05, the
# Qwen3-0.6B shape, engine profile step / engine bench, two interleaved rounds, bench/results/2026-12-05-session26.md):
# 512 tokens tile 11.58 / 11.61 ms, dense 10.22 / 10.23, pipe 10.02 / 10.06 (pp512 45.7k / 45.1k -> 52.2k / 51.8k
# tok/s); 256 tokens 7.36 / 7.30, 6.97 / 6.99, 7.08 / 7.08; 128 tokens 5.07 / 5.12, 5.55 / 5.55, 5.68 / 5.71 (gemm.cu
# wins there: at 128 tokens a matrix gets one row of 128-token blocks, 32 for q, before split-K).
PREFILL_GEMMS = ("tile", "dense", "pipe")
PREFILL_TC_MIN = 256


def prefill_gemm_named() -> str:
    """The prefill GEMM REFLEX_PREFILL_GEMM names (default "pipe"); the dense one's slab is reserved only when it is
    named (k_gemm.reserve)."""
    name = os.environ.get("REFLEX_PREFILL_GEMM", "pipe")
    if name not in PREFILL_GEMMS:
        raise InvalidInput(f"REFLEX_PREFILL_GEMM must be one of {', '.join(PREFILL_GEMMS)}, got {name!r}")
    return name


def prefill_gemm(n: int, major: int) -> str:
    """The GEMM ("tile", "dense" or "pipe") a quantized matmul of n tokens takes on a GPU of compute capability
    `major`."""
    name = prefill_gemm_named()
    if name == "tile" or major < 9 or n < env_int("REFLEX_PREFILL_GEMM_MIN", PREFILL_TC_MIN, minimum=1):
        return "tile"
    return name


def use_tc(n: int) -> bool:
    """Whether n tokens through a weight type that has tc_matvec kernels take one launch of them (REFLEX_TC=0: never,
    for comparisons)."""
    return TC_MIN <= n <= MATVEC_MAX and os.environ.get("REFLEX_TC", "1") != "0"


def tc3() -> bool:
    """Whether q/k/v of a tensor-core batch go through one tcmv3 launch (REFLEX_TC3=0: one tcmv launch a matrix, for
    comparisons). One H200 (2026-12-04, engine bench, two interleaved rounds): the Qwen3-0.6B shape's prefill of 16
    tokens 9,792 / 9,871 -> 10,688 / 10,681 tok/s, of 64 17,112 / 17,135 -> 18,151 / 18,110, warm system1 2.02 / 2.21
    -> 1.80 / 1.76 ms; the Qwen3.5-0.8B shape's prefill of 16 6,520 / 6,709 -> 7,260 / 7,105."""
    return os.environ.get("REFLEX_TC3", "1") != "0"


def passes(n: int) -> list[tuple[int, int]]:
    """(first token, count) of the matvec passes covering n tokens, SMALL_BATCH at a time."""
    return [(at, min(SMALL_BATCH, n - at)) for at in range(0, n, SMALL_BATCH)]


# Up to this many tokens (a short prompt: system1's, or a query after a prefix state), the attention of a batch goes
# through attn_decode with a token per grid.z (each token its own splits of its keys, S // n of the model's S) rather
# than attn_prefill, whose grid is one 32-query tile a head: 16 blocks for Qwen3-0.6B's 16 heads, each streaming every
# key through shared memory, so its cost grows with the context while the decode form's spreads it. One H200
# (2026-12-04, the Qwen3-0.6B shape): `engine profile --batch 13` after 64 tokens, attn_prefill 15.0 us a launch ->
# attn_decode 8.7, the 13-token forward 1.827 -> 1.579 ms; at the start of a sequence (engine bench, two interleaved
# rounds) warm system1 (13 tokens) 1.81 / 1.88 -> 1.75 / 1.78 ms and 1.94 / 1.99 -> 1.99 / 1.95 on another machine,
# but prefill of 16 tokens 10,688 / 10,603 -> 10,403 / 10,224 tok/s (attn_decode 7.9 us a launch there, 16 keys at
# most): the decode form pays where there are few keys to share. One split a token instead of S // n measured the same.
DECODE_TOKENS = 16


def decode_tokens(n: int, splits: int) -> bool:
    """Whether the attention of n tokens takes attn_decode (n of them through partials of `splits` key splits: n <=
    splits) rather than attn_prefill (REFLEX_DECODE_TOKENS=0: never but n = 1, for comparisons)."""
    most = env_int("REFLEX_DECODE_TOKENS", DECODE_TOKENS, minimum=0)
    return n == 1 or n <= min(most, splits)


# Past DECODE_TOKENS, a batch's attention on tensor cores (attn_prefill_tc: 64-query tiles, every operand in split
# tf32 halves, three mma a product) rather than attn_prefill's float32 FMAs, for hd = vd in PREFILL_TC_DIMS on sm_80
# and later (REFLEX_ATTN_TC=0: never, for comparisons). Tuned on an H200, 2026-12-05 (scripts/bench_attention.py,
# engine profile): 512 queries at hd 128 after 0 / 1,536 cached keys 80.4 -> 68.7 / 401 -> 267 us a layer; the 0.6B
# shape's pp512 step 11.82 -> 11.50 ms and 512 after 1,536 20.86 -> 18.29 ms. Not below it: the 13-token system1
# step after 64 took 1.287 -> 1.542 ms on it instead of attn_decode (REFLEX_DECODE_TOKENS=0).
PREFILL_TC_DIMS = (64, 128)


def prefill_tc(hd: int, vd: int, major: int) -> bool:
    """Whether a batch past DECODE_TOKENS with head dims hd / vd, on a GPU of compute capability `major`, takes
    attn_prefill_tc rather than attn_prefill."""
    return os.environ.get("REFLEX_ATTN_TC", "1") != "0" and hd == vd and hd in PREFILL_TC_DIMS and major >= 8


PREFILL_TC_KEY_GROUPS = (1, 2)


def prefill_tc_key_groups() -> int:
    """attn_prefill_tc's key groups a block (REFLEX_ATTN_TC_KEYS, default 2): 2 takes the _k2 entry points, 8 warps a
    block, each half of them on half of every 32-key tile, the halves' softmax merged at the end
    (kernels/attention_prefill_tc.cuh); 1 the 4-warp block. Twice the warps an SM where a block is all an SM has (128
    blocks at 512 tokens and 16 heads: one 4-warp block an SM, every latency exposed). On an H200 (2026-12-05, the
    Qwen3-0.6B shape, two interleaved rounds, bench/results/2026-12-05-h200-session27.md): the kernel at 512 tokens
    69.3 -> 63.6 us after 0 cached keys, 264.5 -> 239.0 after 1,536; the profile step 10.09 / 10.09 -> 9.82 / 9.80 ms
    and 16.75 / 16.74 -> 15.26 / 15.24; engine bench pp512 51.7k / 52.3k -> 53.3k / 53.0k tok/s."""
    groups = env_int("REFLEX_ATTN_TC_KEYS", 2, minimum=1)
    if groups not in PREFILL_TC_KEY_GROUPS:
        raise InvalidInput(f"REFLEX_ATTN_TC_KEYS must be one of {PREFILL_TC_KEY_GROUPS}, got {groups}")
    return groups


BLOCK_HEADS = 4  # q heads an attn_decode block scores at most when a kv head is shared among blocks


def shared_parts(G: int) -> int:
    """The fewest whole blocks among which a kv head's G q heads split, at most BLOCK_HEADS a block."""
    return next(p for p in range(1, G + 1) if G % p == 0 and G // p <= BLOCK_HEADS)


def prefetch_keys() -> bool:
    """Whether attn_decode pulls each block's cache rows into L2 before its wait (kernels/attention_decode.cuh,
    prefetch_keys), so its dependent reads after it meet L2 (REFLEX_ATTN_PREFETCH=0, for comparisons). One H200
    (2026-12-04, engine profile, 64-key context, two rounds): Qwen3-0.6B shape step 0.9551 / 0.9564 -> 0.8939 / 0.8940
    ms (attn_decode's cost in the step, by ablation, 11.8 -> 9.9 us a launch); 4-layer 30B-A3B 0.3276 / 0.3273 ->
    0.3257 / 0.3260."""
    return os.environ.get("REFLEX_ATTN_PREFETCH", "1") != "0"


def decode_attention(H: int, KVH: int) -> tuple[bool, int, int]:
    """(fold, min_chunk, parts) of attn_decode for H q heads over KVH kv heads. Folded, the last block of a row
    combines its splits (one launch) and a split takes 128 keys at least; else 32 splits of ceil(L / 32) keys and an
    attn_combine launch. One block a kv head (parts = 1): folded below 8 q heads a kv head, split + combine from 8.
    Measured on one H200 (2026-12-01, 65-key context): 2 q heads a kv head (Qwen3-0.6B) 8.7 us folded vs 9.8 split +
    combine; 8 a kv head (Qwen3-30B-A3B) in one block 15.9 folded (its 4 kv heads gave 4 blocks; 20.8 with 32 keys a
    split) vs 12.5 split + combine, and 5.9 + 3.6 since attn_decode skips empty key groups and attn_combine sums each
    element over the splits with independent loads (same GPU, later that day). Folded with one active split (L <= 128
    keys here) the block writes out directly: on an H200 (2026-12-02, 64-key context) the 0.6B shape's attn_decode
    9.1 -> 7.2 us a launch, its decode step 1.0917 -> 1.0235 ms.
    REFLEX_ATTN_PARTS=shared splits a kv head's q heads among shared_parts(G) blocks, always folded: on an H200
    (2026-12-04, 4-layer 30B-A3B profile, 65-key context, two rounds) its 8 q heads a kv head in 2 blocks of 4 took
    8.2 us in one launch against 6.0-7.5 + 3.7-4.0 split + combine, yet the step was slower (0.3727 and 0.3731 ms
    against 0.3667 and 0.3668): kept for comparisons, not the default.
    qk_rope_kv stays a launch of its own before it: folded into attn_decode (every block roping its q heads, the
    block of the new key writing its cache row) it was no faster on an H200 (2026-12-01, 64-key context, step of the
    Qwen3-0.6B shape 1.0950 vs 1.0961 ms, Qwen3.5-0.8B 1.1064 vs 1.0944, 30B-A3B 4 layers 0.4289 vs 0.4236): the
    prologue's latency sat on every block's critical path, where the separate launch overlaps its neighbours. Nor
    into the q/k/v matvec3's epilogue (each row block of a head fencing and taking a ticket, the last one reading the
    head back from L2, norming and rotating it; bit-equal to the two launches): on an H100 (2026-12-05, 0.6B shape,
    after 16 tokens, two rounds) the step went 0.7294 / 0.7308 -> 0.7247 / 0.7253 ms but engine bench decode 1225.7 /
    1225.4 -> 1218.9 / 1220.7 tok/s, for 10 more kernels (+14 % of the matvec module). qk_rope_kv's own cost in that
    step, by ablation, is 3.1 us a launch; the fold's tail (fence, ticket, the head from L2) took nearly all of it."""
    G = H // KVH
    parts = shared_parts(G) if os.environ.get("REFLEX_ATTN_PARTS") == "shared" else 1
    return (True, fold_min_chunk(), parts) if G // parts < 8 else (False, 1, parts)


FOLD_MIN_CHUNK = 128


def fold_min_chunk() -> int:
    """Keys a split of the folded attn_decode takes at least (FOLD_MIN_CHUNK; REFLEX_ATTN_MIN_CHUNK for comparisons).
    Up to this many keys the attention is one split of 4 warps, each with a tile of 16 keys up to 64 and of 32 past
    them (twice the chain of dependent reads); a smaller chunk spreads such a context over more blocks but pays the
    folded combine (the ticket, the last block's second pass) that one split skips."""
    return env_int("REFLEX_ATTN_MIN_CHUNK", FOLD_MIN_CHUNK, minimum=1)
