// Gated DeltaNet, the recurrent layers of the qwen35 hybrids, and the small glue of their gated attention layers.
// Reference math: engine/cpu/deltanet.py (causal_conv, delta_rule) and engine/models/hybrid.py (the layer), whose
// order of float32 operations the kernels follow where it is cheap to. Contract: kernels/README.md, "deltanet.cu".
//
// One Gated DeltaNet layer over n tokens, after its input projections (matvec / GEMM):
//   gdn_conv_silu        qkv -> mixed = silu(causal depthwise conv1d), the conv state advanced by n tokens
//   gdn_l2norm_gates     q, k heads of mixed L2-normalised in place; beta = sigmoid(b), decay from a, in place
//   gdn_recurrence_dk*   the delta rule, state kept on chip while one block column walks the n tokens
//   gdn_gated_norm       o = RMSNorm(o) * ssm_norm * silu(z), per (token, v head)
// Layouts (float32, one row per token): qkv/mixed [n, C] as [q heads | k heads | v heads], C = 2 H_k Dk + H_v Dv;
// b, a [n, H_v]; z, o [n, H_v Dv]; conv state [K - 1, C] (oldest input first); recurrent state [H_v, Dv, Dk].
#include "pdl.cuh"
#include "common.cuh"

namespace {

constexpr int CONV_TOKENS = 64;  // tokens per gdn_conv_silu block row; >= K - 1, so only block row 0 reads state
constexpr int COLS = 4;          // recurrent state columns per warp
constexpr int REC_WARPS = 4;     // warps per gdn_recurrence block

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }  // exp overflow -> x / inf = -0
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// The delta rule for DK = head_k_dim. Warp w of block (h, cb) owns the COLS state columns j0 = COLS (REC_WARPS cb
// + w) .. +COLS of v head h. The state is stored transposed, st[h, j, i] = S_h[i, j], so a column is DK contiguous
// floats; lane l keeps rows l, l + 32, ... of its columns in registers across the whole walk. Columns of S evolve
// independently given k, q, beta and decay, so warps never talk to each other. With S the state before token t:
//   predicted = (decay S)^T k = decay S^T k,  delta = beta (v - predicted),  S <- decay S + k delta^T,
//   o = S_new^T q = decay S^T q + delta (k . q)
// so one round of warp sums (S^T k and S^T q of each column, and k . q) serves a token. The next token's q, k, v,
// beta and decay are loaded before the current token's sums, hiding their latency behind the shuffles.
template <int DK>
__device__ __forceinline__ void recurrence(const float* __restrict__ mixed, const float* __restrict__ decay,
                                           const float* __restrict__ beta, int n, int H_k, int H_v, int Dv,
                                           int tiled, float* __restrict__ st, float* __restrict__ o) {
    constexpr int M = DK / 32;  // rows of a column per lane
    const int h = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int j0 = (blockIdx.y * REC_WARPS + warp) * COLS;
    if (j0 >= Dv) return;  // Dv % COLS == 0: a warp owns whole columns or none
    const int kh = tiled ? h % H_k : h / (H_v / H_k);  // the k head v head h reads (hybrid.py's module docstring)
    const long long C = 2LL * H_k * DK + (long long)H_v * Dv;
    const float* qp = mixed + (long long)kh * DK + lane;   // row t: + t * C
    const float* kp = qp + (long long)H_k * DK;
    const float* vp = mixed + 2LL * H_k * DK + (long long)h * Dv + j0;
    float* sp = st + ((long long)h * Dv + j0) * DK + lane;  // column c, row 32 m + lane: sp[c * DK + 32 m]

    float S[COLS][M];
#pragma unroll
    for (int c = 0; c < COLS; ++c)
#pragma unroll
        for (int m = 0; m < M; ++m) S[c][m] = sp[c * DK + 32 * m];

    float qn[M], kn[M], vn[COLS], dn = 0.f, bn = 0.f;  // the next token's inputs
    auto load = [&](int t) {
        const long long r = (long long)t * C;
#pragma unroll
        for (int m = 0; m < M; ++m) qn[m] = qp[r + 32 * m], kn[m] = kp[r + 32 * m];
#pragma unroll
        for (int c = 0; c < COLS; ++c) vn[c] = vp[r + c];
        dn = decay[(long long)t * H_v + h];
        bn = beta[(long long)t * H_v + h];
    };
    if (n > 0) load(0);
    for (int t = 0; t < n; ++t) {
        float q[M], k[M], v[COLS];
#pragma unroll
        for (int m = 0; m < M; ++m) q[m] = qn[m], k[m] = kn[m];
#pragma unroll
        for (int c = 0; c < COLS; ++c) v[c] = vn[c];
        const float d = dn, b = bn;
        if (t + 1 < n) load(t + 1);

        float sk[COLS], sq[COLS], kq = 0.f;
#pragma unroll
        for (int c = 0; c < COLS; ++c) {
            sk[c] = 0.f, sq[c] = 0.f;
#pragma unroll
            for (int m = 0; m < M; ++m) sk[c] = fmaf(S[c][m], k[m], sk[c]), sq[c] = fmaf(S[c][m], q[m], sq[c]);
        }
#pragma unroll
        for (int m = 0; m < M; ++m) kq = fmaf(k[m], q[m], kq);
#pragma unroll
        for (int c = 0; c < COLS; ++c) sk[c] = cm::warp_sum(sk[c]), sq[c] = cm::warp_sum(sq[c]);
        kq = cm::warp_sum(kq);

        float mine = 0.f;  // lane c < COLS writes column j0 + c
#pragma unroll
        for (int c = 0; c < COLS; ++c) {
            const float delta = b * (v[c] - d * sk[c]);
            const float out = fmaf(delta, kq, d * sq[c]);
            if (lane == c) mine = out;
#pragma unroll
            for (int m = 0; m < M; ++m) S[c][m] = fmaf(k[m], delta, d * S[c][m]);
        }
        if (lane < COLS) o[(long long)t * H_v * Dv + (long long)h * Dv + j0 + lane] = mine;
    }
#pragma unroll
    for (int c = 0; c < COLS; ++c)
#pragma unroll
        for (int m = 0; m < M; ++m) sp[c * DK + 32 * m] = S[c][m];
}

}  // namespace

// y[t, c] = silu(sum_j w[c, j] * window[t + j, c]) with window = [state; x] (K - 1 + n rows), then state <- the last
// K - 1 rows of window. Block 256 over channels, grid = (ceil(C / 256), ceil(n / CONV_TOKENS)): block (bx, by)
// covers tokens [CONV_TOKENS by, +CONV_TOKENS). Only block row 0 reads the state (a row t + j - (K - 1) < 0 needs
// t < K - 1 <= CONV_TOKENS), and the thread that reads a channel's state is the one that rewrites it, after its
// reads: new row i is window row n + i, which is x row n + i - (K - 1) or old state row n + i > i (not yet
// rewritten, since rows are rewritten in increasing order). x and y must not overlap.
extern "C" __global__ void __launch_bounds__(256)
gdn_conv_silu(const float* __restrict__ x, int n, int C, int K, const float* __restrict__ w, float* state,
              float* __restrict__ y) {
    pdl::begin();
    const int c = blockIdx.x * 256 + threadIdx.x;
    if (c >= C) return;
    const int hist = K - 1, t0 = blockIdx.y * CONV_TOKENS, t1 = min(n, t0 + CONV_TOKENS);
    const float* wc = w + (long long)c * K;
    for (int t = t0; t < t1; ++t) {
        float acc = 0.0f;
        for (int j = 0; j < K; ++j) {
            const int r = t + j - hist;  // row of x, or (r < 0) row hist + r of the state
            const float v = r >= 0 ? x[(long long)r * C + c] : state[(long long)(hist + r) * C + c];
            acc = fmaf(wc[j], v, acc);
        }
        y[(long long)t * C + c] = silu(acc);
    }
    if (blockIdx.y == 0)
        for (int i = 0; i < hist; ++i) {
            const int r = n + i - hist;
            state[(long long)i * C + c] = r >= 0 ? x[(long long)r * C + c] : state[(long long)(n + i) * C + c];
        }
}

// Per token t (grid.x = n, block 256 = 8 warps, a head per warp): the 2 H_k heads of Dk values at the start of row
// t of mixed (q heads, then k heads) become x / max(||x||, eps), q heads also times q_scale (1 / sqrt(Dk)); then
// for each v head h: b[t, h] <- sigmoid(b[t, h]) (beta) and a[t, h] <- exp(ssm_a[h] * softplus(a[t, h] + dt[h]))
// (the decay, in (0, 1) since ssm_a = -exp(A_log) < 0). Row stride of mixed: C floats.
extern "C" __global__ void __launch_bounds__(256)
gdn_l2norm_gates(float* mixed, int C, int H_k, int Dk, float eps, float q_scale, float* b, float* a,
                 const float* __restrict__ ssm_a, const float* __restrict__ dt, int H_v) {
    pdl::begin();
    const int t = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int hh = warp; hh < 2 * H_k; hh += 8) {
        float* p = mixed + (long long)t * C + (long long)hh * Dk;
        float ss = 0.0f;
        for (int i = lane; i < Dk; i += 32) ss = fmaf(p[i], p[i], ss);
        const float norm = fmaxf(sqrtf(cm::warp_sum(ss)), eps);
        const float s = hh < H_k ? q_scale : 1.0f;
        for (int i = lane; i < Dk; i += 32) p[i] = (p[i] / norm) * s;  // each lane rewrites only what it read
    }
    for (int h = threadIdx.x; h < H_v; h += 256) {
        const long long i = (long long)t * H_v + h;
        b[i] = sigmoid(b[i]);
        const float u = a[i] + dt[h];
        const float softplus = fmaxf(u, 0.0f) + log1pf(expf(-fabsf(u)));  // log(1 + e^u) without overflow
        a[i] = expf(ssm_a[h] * softplus);
    }
}

// The gated delta rule over n tokens of one layer (see recurrence above), DK = head_k_dim in {32, 64, 128}.
// Block 128 (REC_WARPS warps), grid = (H_v, ceil(Dv / 16)); Dv % 4 == 0. Tokens are walked in order; state is
// this layer's [H_v, Dv, DK], read once at the start and written once at the end. mixed holds the normalised q, k
// and v (gdn_l2norm_gates); decay, beta [n, H_v]; o [n, H_v Dv] out. tiled: v head h reads k head h % H_k (qwen35
// files), else h / (H_v / H_k) (qwen3next).
#define GDN_RECURRENCE(DK)                                                                                          \
    extern "C" __global__ void __launch_bounds__(128)                                                              \
    gdn_recurrence_dk##DK(const float* __restrict__ mixed, const float* __restrict__ decay,                       \
                          const float* __restrict__ beta, int n, int H_k, int H_v, int Dv, int tiled,             \
                          float* __restrict__ state, float* __restrict__ o) {                                     \
        pdl::begin();                                                                                             \
        recurrence<DK>(mixed, decay, beta, n, H_k, H_v, Dv, tiled, state, o);                                      \
    }
GDN_RECURRENCE(32)
GDN_RECURRENCE(64)
GDN_RECURRENCE(128)

// o[r, :] = (o[r, :] * s) * w * silu(z[r, :]) with s = 1 / sqrt(mean(o[r, :]^2) + eps), for rows r < rows of Dv
// values (one per (token, v head)); o is updated in place. Block 256 (a row per warp), grid.x = ceil(rows / 8).
extern "C" __global__ void __launch_bounds__(256)
gdn_gated_norm(float* o, const float* __restrict__ z, const float* __restrict__ w, float eps, int rows, int Dv) {
    pdl::begin();
    const int r = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (r >= rows) return;  // per warp: the whole warp leaves together
    float* p = o + (long long)r * Dv;
    const float* zr = z + (long long)r * Dv;
    float ss = 0.0f;
    for (int i = lane; i < Dv; i += 32) ss = fmaf(p[i], p[i], ss);
    const float s = 1.0f / sqrtf(cm::warp_sum(ss) / float(Dv) + eps);  // a correctly rounded sqrt, as ops.rmsnorm
    for (int i = lane; i < Dv; i += 32) p[i] = ((p[i] * s) * w[i]) * silu(zr[i]);
}

// Rows of `groups` repeats of up to 4 parts [p0 (w0) | p1 (w1) | p2 (w2) | p3 (w3)], W = w0 + w1 + w2 + w3 floats
// a group, split into part-major outputs: dst_p[t * stride_p + g * w_p + i] = src[t * groups * W + g * W + off_p
// + i] (off_p = w0 + .. + w_{p-1}); parts of width 0 have null outputs. Block 256, grid = (ceil(groups W / 256), n).
// Serves qwen3next's ssm_in (per k head [q | k | v | z]) and ssm_ba (per k head [b | a]), and the gated
// attention's attn_q (per head [q | gate]). src must not overlap the outputs.
extern "C" __global__ void __launch_bounds__(256)
split_groups(const float* __restrict__ src, int groups, int w0, int w1, int w2, int w3, float* __restrict__ d0,
             int s0, float* __restrict__ d1, int s1, float* __restrict__ d2, int s2, float* __restrict__ d3,
             int s3) {
    pdl::begin();
    const int W = w0 + w1 + w2 + w3, t = blockIdx.y;
    const int e = blockIdx.x * 256 + threadIdx.x;
    if (e >= groups * W) return;
    const int g = e / W;
    int i = e - g * W;
    const float v = src[(long long)t * groups * W + e];
    if (i < w0) {
        d0[(long long)t * s0 + (long long)g * w0 + i] = v;
        return;
    }
    i -= w0;
    if (i < w1) {
        d1[(long long)t * s1 + (long long)g * w1 + i] = v;
        return;
    }
    i -= w1;
    if (i < w2) {
        d2[(long long)t * s2 + (long long)g * w2 + i] = v;
        return;
    }
    i -= w2;
    d3[(long long)t * s3 + (long long)g * w3 + i] = v;
}

// x[i] *= sigmoid(g[i]) for i < count: the gated attention's output gate. Block 256, grid ceil(count / 256).
extern "C" __global__ void __launch_bounds__(256) sigmoid_mul(float* x, const float* __restrict__ g, long long count) {
    pdl::begin();
    const long long i = (long long)blockIdx.x * 256 + threadIdx.x;
    if (i < count) x[i] = x[i] * sigmoid(g[i]);
}
