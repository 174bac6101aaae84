"""The CUDA C of hpctrain's GPU kernels (compiled by CuPy's NVRTC on a GPU, and by NVRTC alone in
``make test`` on a machine without one: ``tests/test_cuda_kernels.py``).

No CUDA header is included: bfloat16 and float16 are 16-bit structs converted by hand (bfloat16
by shifting, rounding to nearest even as ``ml_dtypes`` does; float16 through the PTX ``cvt``
instructions), so the source compiles the same under any NVRTC with no include path. Every
kernel computes in float32 whatever its storage type; suffixes name the storage types
(``f`` float32, ``b`` bfloat16, ``h`` float16). Compiled with ``--fmad=false``: the elementwise
kernels (GELU's polynomial, SGD, Adam) then round each operation as NumPy does, so SGD and Adam
give NumPy's results bit for bit.
"""

from __future__ import annotations

#: Storage types by suffix, and the NumPy dtype names they hold.
TYPES = {"f": "float", "b": "bf16", "h": "f16"}
DTYPE_SUFFIX = {"float32": "f", "bfloat16": "b", "float16": "h"}

#: NVRTC options (the architecture is added by the caller: sm_90 in the CPU check).
OPTIONS = ("--std=c++17", "--fmad=false")

PRELUDE = r"""
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
typedef unsigned short u16;
typedef long long i64;
struct bf16 { u16 x; };
struct f16 { u16 x; };
__device__ __forceinline__ float ld(const float* p, i64 i) { return p[i]; }
__device__ __forceinline__ float ld(const bf16* p, i64 i) { return __uint_as_float(((unsigned)p[i].x) << 16); }
__device__ __forceinline__ float ld(const f16* p, i64 i) {
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(p[i].x)); return f; }
__device__ __forceinline__ void st(float* p, i64 i, float v) { p[i] = v; }
__device__ __forceinline__ void st(bf16* p, i64 i, float v) {
  unsigned u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) { p[i].x = (u16)((u >> 16) | 0x40u); return; }  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  p[i].x = (u16)(u >> 16);
}
__device__ __forceinline__ void st(f16* p, i64 i, float v) {
  u16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v)); p[i].x = h; }

// Block-wide sum and max of one float per thread (blockDim.x a multiple of 32, at most 1024).
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v; }
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v; }
__device__ float block_sum(float v) {
  __shared__ float red[32];
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) red[w] = v;
  __syncthreads();
  v = lane < nw ? red[lane] : 0.0f;
  return warp_sum(v); }
__device__ float block_max(float v) {
  __shared__ float red[32];
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) red[w] = v;
  __syncthreads();
  v = lane < nw ? red[lane] : -INFINITY;
  return warp_max(v); }
// Online softmax pair (max m, sum s of exp(x - m)) merged across a block.
__device__ void block_online(float& m, float& s) {
  float bm = block_max(m);
  s = (m == -INFINITY) ? 0.0f : s * expf(m - bm);
  s = block_sum(s);
  m = bm; }

// Philox4x32-10 (Salmon et al. 2011), the counter-based generator of hpctrain.nn.philox.
__device__ __forceinline__ uint4 philox(uint4 c, uint2 k) {
  for (int r = 0; r < 10; ++r) {
    unsigned lo0 = 0xD2511F53u * c.x, hi0 = __umulhi(0xD2511F53u, c.x);
    unsigned lo1 = 0xCD9E8D57u * c.z, hi1 = __umulhi(0xCD9E8D57u, c.z);
    c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
    k.x += 0x9E3779B9u; k.y += 0xBB67AE85u;
  }
  return c; }
__device__ __forceinline__ unsigned philox_word(i64 i, unsigned seed_lo, unsigned seed_hi) {
  unsigned long long q = (unsigned long long)i >> 2;
  uint4 r = philox(make_uint4((unsigned)q, (unsigned)(q >> 32), 0u, 0u), make_uint2(seed_lo, seed_hi));
  int w = (int)(i & 3);
  return w == 0 ? r.x : (w == 1 ? r.y : (w == 2 ? r.z : r.w)); }
"""

# Kernels over one storage type T (instantiated for f, b, h by INSTANTIATE_T).
PER_TYPE = r"""
// GELU (tanh form) of h = x + bias[col]; with a bias, h is written back into x (what backward reads).
template <typename T> __device__ void gelu_fwd(T* x, const T* bias, T* y, i64 n, int d, float kc, float c) {
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    float h = ld(x, i);
    if (bias) { h = h + ld(bias, i % d); st(x, i, h); }
    float t = h * h; t = t * kc; t = t + c; t = t * h; t = tanhf(t);
    float v = t + 1.0f; v = v * h; st(y, i, v * 0.5f); } }
template <typename T, typename G>
__device__ void gelu_bwd(const T* x, const G* g, G* out, i64 n, float k3c, float c, float kc) {
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    float h = ld(x, i);
    float t = h * h; t = t * kc; t = t + c; t = t * h; t = tanhf(t);
    float a = h * h; a = a * k3c; a = a + c; float b = 1.0f - t * t; a = a * b; a = a * h; a = a + t;
    a = a + 1.0f; a = a * 0.5f; st(out, i, a * ld(g, i)); } }
// LayerNorm over rows of d: one block per row, float32 statistics (two passes, as the NumPy code).
template <typename T> __device__ void ln_fwd(const T* x, const T* w, const T* b, T* y, float* mean, float* rstd,
                                            int d, float eps) {
  i64 row = blockIdx.x; const T* xr = x + row * d; T* yr = y + row * d;
  float s = 0.0f;
  for (int j = threadIdx.x; j < d; j += blockDim.x) s += ld(xr, j);
  float mu = block_sum(s) / d;
  float q = 0.0f;
  for (int j = threadIdx.x; j < d; j += blockDim.x) { float h = ld(xr, j) - mu; q += h * h; }
  float r = 1.0f / sqrtf(block_sum(q) / d + eps);
  for (int j = threadIdx.x; j < d; j += blockDim.x) {
    float h = (ld(xr, j) - mu) * r; st(yr, j, h * ld(w, j) + ld(b, j)); }
  if (threadIdx.x == 0) { mean[row] = mu; rstd[row] = r; } }
template <typename T> __device__ void ln_bwd_rows(const T* g, const T* x, const T* w, const float* mean,
                                                 const float* rstd, T* gx, int d) {
  i64 row = blockIdx.x; const T* gr = g + row * d; const T* xr = x + row * d; T* out = gx + row * d;
  float mu = mean[row], r = rstd[row], a = 0.0f, c = 0.0f;
  for (int j = threadIdx.x; j < d; j += blockDim.x) {
    float gw = ld(gr, j) * ld(w, j); a += gw; c += gw * ((ld(xr, j) - mu) * r); }
  a = block_sum(a) / d; c = block_sum(c) / d;
  for (int j = threadIdx.x; j < d; j += blockDim.x) {
    float xh = (ld(xr, j) - mu) * r; st(out, j, (ld(gr, j) * ld(w, j) - a - xh * c) * r); } }
// The weight and bias gradients' column sums over a chunk of rows (float32 partials, no atomics:
// the same sums in the same order every run).
template <typename T> __device__ void ln_bwd_cols(const T* g, const T* x, const float* mean, const float* rstd,
                                                 float* pw, float* pb, i64 n, int d, int rows) {
  int j = blockIdx.x * blockDim.x + threadIdx.x; if (j >= d) return;
  i64 r0 = (i64)blockIdx.y * rows, r1 = min(r0 + rows, n);
  float sw = 0.0f, sb = 0.0f;
  for (i64 i = r0; i < r1; ++i) {
    float gi = ld(g, i * d + j); sb += gi; sw += gi * ((ld(x, i * d + j) - mean[i]) * rstd[i]); }
  pw[(i64)blockIdx.y * d + j] = sw; pb[(i64)blockIdx.y * d + j] = sb; }
// Causal attention's softmax over rows of T scores (float32, row-major (BH*T, T)): one block per
// row; P = exp(S * scale - lse) below the diagonal, 0 above; lse kept for backward.
template <typename T> __device__ void attn_softmax_fwd(const float* s, T* p, float* lse, int t, float scale) {
  i64 row = blockIdx.x; int i = (int)(row % t); const float* sr = s + row * t; T* pr = p + row * t;
  float m = -INFINITY, z = 0.0f;
  for (int j = threadIdx.x; j <= i; j += blockDim.x) {
    float v = sr[j] * scale; if (v > m) { z = z * expf(m - v) + 1.0f; m = v; } else { z += expf(v - m); } }
  block_online(m, z);
  float l = m + logf(z);
  for (int j = threadIdx.x; j < t; j += blockDim.x) st(pr, j, j <= i ? expf(sr[j] * scale - l) : 0.0f);
  if (threadIdx.x == 0) lse[row] = l; }
// Backward from recomputed scores S and dP = dY V^T: P again, then dS = P (dP - sum(P dP)) scale.
template <typename T> __device__ void attn_softmax_bwd(const float* s, const float* dp, const float* lse, T* p, T* ds,
                                                      int t, float scale) {
  i64 row = blockIdx.x; int i = (int)(row % t); const float* sr = s + row * t; const float* dr = dp + row * t;
  float l = lse[row], acc = 0.0f;
  for (int j = threadIdx.x; j <= i; j += blockDim.x) acc += expf(sr[j] * scale - l) * dr[j];
  float dsum = block_sum(acc);
  // p may alias s and ds may alias dp: each element is read and then written by the same thread.
  for (int j = threadIdx.x; j < t; j += blockDim.x) {
    // above the diagonal s and dp were never computed (the products skip the masked future)
    float pj = j <= i ? expf(sr[j] * scale - l) : 0.0f, dj = j <= i ? dr[j] : 0.0f;
    st(p + row * t, j, pj); st(ds + row * t, j, pj * (dj - dsum) * scale); } }
// Softmax cross-entropy over a row of V logits in one pass (online max and sum): lse, and the
// row's loss (lse - x[target]) times its weight (w null: 1).
template <typename T> __device__ void ce_fwd(const T* x, const i64* target, const float* w, float* lse, float* nll,
                                            i64 v) {
  i64 row = blockIdx.x; const T* xr = x + row * v;
  float m = -INFINITY, z = 0.0f;
  for (i64 j = threadIdx.x; j < v; j += blockDim.x) {
    float a = ld(xr, j); if (a > m) { z = z * expf(m - a) + 1.0f; m = a; } else { z += expf(a - m); } }
  block_online(m, z);
  if (threadIdx.x == 0) {
    float l = m + logf(z); lse[row] = l;
    nll[row] = (l - ld(xr, target[row])) * (w ? w[row] : 1.0f); } }
// The logits' gradient (softmax - onehot) * c written into g (which may be x itself), with
// c = (cdev ? cdev[0] : coef) * (w ? w[row] : 1): a host coefficient or a device one.
template <typename T> __device__ void ce_bwd(const T* x, const i64* target, const float* lse, const float* w,
                                            const float* cdev, float coef, T* g, i64 v) {
  i64 row = blockIdx.x; float l = lse[row], c = (cdev ? cdev[0] : coef) * (w ? w[row] : 1.0f); i64 t = target[row];
  for (i64 j = threadIdx.x; j < v; j += blockDim.x) {
    float p = expf(ld(x, row * v + j) - l); st(g, row * v + j, (p - (j == t ? 1.0f : 0.0f)) * c); } }
// Dropout: keep element i when the top 24 bits of its Philox word are >= thresh; y = x * scale.
template <typename T> __device__ void dropout(const T* x, T* y, i64 n, unsigned seed_lo, unsigned seed_hi,
                                             unsigned thresh, float scale) {
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    bool keep = (philox_word(i, seed_lo, seed_hi) >> 8) >= thresh; st(y, i, keep ? ld(x, i) * scale : 0.0f); } }
// y[i] += bias[i % d]: a Linear's bias over its rows, a residual sum (d = n), the positions'
// embedding over a batch (CuPy's bfloat16 arithmetic is a slow generic loop).
template <typename T> __device__ void bias_add(T* y, const T* b, i64 n, int d) {
  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
    st(y, i, ld(y, i) + ld(b, i % d)); }
// Column sums of g (n, d) over a chunk of rows into float32 partials (cols_add adds them in order).
template <typename T> __device__ void col_part(const T* g, float* part, i64 n, int d, int rows) {
  int j = blockIdx.x * blockDim.x + threadIdx.x; if (j >= d) return;
  i64 r0 = (i64)blockIdx.y * rows, r1 = min(r0 + rows, n);
  float s = 0.0f;
  for (i64 i = r0; i < r1; ++i) s += ld(g, i * d + j);
  part[(i64)blockIdx.y * d + j] = s; }
// Embedding backward: grad[idx[i], :] += g[i, :] (float32 atomics).
template <typename T> __device__ void embed_bwd(const i64* idx, const T* g, float* grad, i64 n, int d) {
  for (i64 k = blockIdx.x * (i64)blockDim.x + threadIdx.x; k < n * d; k += (i64)gridDim.x * blockDim.x) {
    i64 i = k / d; atomicAdd(grad + idx[i] * d + (k - i * d), ld(g, k)); } }
"""

INSTANTIATE_T = r"""
extern "C" __global__ void gelu_fwd_{s}({T}* x, const {T}* b, {T}* y, i64 n, int d, float kc, float c)
  {{ gelu_fwd(x, b, y, n, d, kc, c); }}
extern "C" __global__ void gelu_bwd_{s}(const {T}* x, const {T}* g, {T}* out, i64 n, float k3c, float c, float kc)
  {{ gelu_bwd(x, g, out, n, k3c, c, kc); }}
extern "C" __global__ void ln_fwd_{s}(const {T}* x, const {T}* w, const {T}* b, {T}* y, float* mean, float* rstd,
  int d, float eps) {{ ln_fwd(x, w, b, y, mean, rstd, d, eps); }}
extern "C" __global__ void ln_bwd_rows_{s}(const {T}* g, const {T}* x, const {T}* w, const float* mean,
  const float* rstd, {T}* gx, int d) {{ ln_bwd_rows(g, x, w, mean, rstd, gx, d); }}
extern "C" __global__ void ln_bwd_cols_{s}(const {T}* g, const {T}* x, const float* mean, const float* rstd,
  float* pw, float* pb, i64 n, int d, int rows) {{ ln_bwd_cols(g, x, mean, rstd, pw, pb, n, d, rows); }}
extern "C" __global__ void attn_softmax_fwd_{s}(const float* s, {T}* p, float* lse, int t, float scale)
  {{ attn_softmax_fwd(s, p, lse, t, scale); }}
extern "C" __global__ void attn_softmax_bwd_{s}(const float* s, const float* dp, const float* lse, {T}* p, {T}* ds,
  int t, float scale) {{ attn_softmax_bwd(s, dp, lse, p, ds, t, scale); }}
extern "C" __global__ void ce_fwd_{s}(const {T}* x, const i64* target, const float* w, float* lse, float* nll, i64 v)
  {{ ce_fwd(x, target, w, lse, nll, v); }}
extern "C" __global__ void ce_bwd_{s}(const {T}* x, const i64* target, const float* lse, const float* w,
  const float* cdev, float coef, {T}* g, i64 v) {{ ce_bwd(x, target, lse, w, cdev, coef, g, v); }}
extern "C" __global__ void dropout_{s}(const {T}* x, {T}* y, i64 n, unsigned lo, unsigned hi, unsigned thresh,
  float scale) {{ dropout(x, y, n, lo, hi, thresh, scale); }}
extern "C" __global__ void embed_bwd_{s}(const i64* idx, const {T}* g, float* grad, i64 n, int d)
  {{ embed_bwd(idx, g, grad, n, d); }}
extern "C" __global__ void cols_add_{s}(const float* part, int chunks, int d, {T}* out, int acc) {{
  int j = blockIdx.x * blockDim.x + threadIdx.x; if (j >= d) return;
  float s = 0.0f; for (int c = 0; c < chunks; ++c) s += part[(i64)c * d + j];
  st(out, j, acc ? ld(out, j) + s : s); }}
extern "C" __global__ void bias_add_{s}({T}* y, const {T}* b, i64 n, int d) {{ bias_add(y, b, n, d); }}
extern "C" __global__ void col_part_{s}(const {T}* g, float* part, i64 n, int d, int rows)
  {{ col_part(g, part, n, d, rows); }}
"""

# The optimizers over many tensors in one launch. ``chunks`` lists (tensor, start, stop) per block
# (int64 triples), the pointer tables hold each tensor's arrays; ``hp`` (float32, on the device so
# a captured CUDA graph reads each step's values) holds the step's scalars.
OPTIM = r"""
template <typename G, typename H> __device__ void adam_mt(const i64* chunks, const i64* pp, const i64* gp,
    const i64* mp, const i64* vp, const i64* hp16, const float* hp) {
  i64 tsr = chunks[3 * blockIdx.x], a = chunks[3 * blockIdx.x + 1], e = chunks[3 * blockIdx.x + 2];
  float* p = (float*)pp[tsr]; const G* g = (const G*)gp[tsr]; float* m = (float*)mp[tsr]; float* v = (float*)vp[tsr];
  H* h = (H*)hp16[tsr];
  float decay = hp[0], l2 = hp[1], b1 = hp[2], ob1 = hp[3], b2 = hp[4], ob2 = hp[5], bc2 = hp[6], eps = hp[7],
        step = hp[8];
  for (i64 i = a + threadIdx.x; i < e; i += blockDim.x) {
    float pi = p[i], gi = ld(g, i);
    if (l2 != 0.0f) gi = gi + l2 * pi; else if (decay != 1.0f) pi = pi * decay;
    float mi = m[i] * b1; mi = mi + gi * ob1;
    float vi = v[i] * b2; float s = gi * gi; s = s * ob2; vi = vi + s;
    s = vi / bc2; s = sqrtf(s); s = s + eps; s = mi / s; s = s * step;
    pi = pi - s; p[i] = pi; m[i] = mi; v[i] = vi;
    if (h) st(h, i, pi); } }
template <typename G, typename H> __device__ void sgd_mt(const i64* chunks, const i64* pp, const i64* gp,
    const i64* bp, const i64* hp16, const float* hp) {
  i64 tsr = chunks[3 * blockIdx.x], a = chunks[3 * blockIdx.x + 1], e = chunks[3 * blockIdx.x + 2];
  float* p = (float*)pp[tsr]; const G* g = (const G*)gp[tsr]; float* buf = (float*)bp[tsr]; H* h = (H*)hp16[tsr];
  float lr = hp[0], wd = hp[1], mom = hp[2], nesterov = hp[3];
  for (i64 i = a + threadIdx.x; i < e; i += blockDim.x) {
    float pi = p[i], gi = ld(g, i);
    if (wd != 0.0f) gi = gi + wd * pi;
    if (mom != 0.0f) { float bi = buf[i] * mom; bi = bi + gi; buf[i] = bi; gi = nesterov != 0.0f ? gi + mom * bi : bi; }
    pi = pi - lr * gi; p[i] = pi;
    if (h) st(h, i, pi); } }
"""

# A float32 vector's sum times a scale, in one block of 1024 threads (a loss's batch mean); the
# squared norm of many tensors (float64 partial sums per block of the optimizers' block table, then
# summed in a fixed order: the same sum every run), for the trainer's gradient norm and finite check.
REDUCE = r"""
__device__ double block_sum_d(double v) {
  __shared__ double red_d[32];
  int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (lane == 0) red_d[w] = v;
  __syncthreads();
  v = lane < nw ? red_d[lane] : 0.0;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v; }
template <typename G> __device__ void sumsq_mt(const i64* chunks, const i64* gp, double* part) {
  i64 tsr = chunks[3 * blockIdx.x], a = chunks[3 * blockIdx.x + 1], e = chunks[3 * blockIdx.x + 2];
  const G* g = (const G*)gp[tsr];
  double s = 0.0;
  for (i64 i = a + threadIdx.x; i < e; i += blockDim.x) { double v = (double)ld(g, i); s += v * v; }
  s = block_sum_d(s);
  if (threadIdx.x == 0) part[blockIdx.x] = s; }
extern "C" __global__ void sumsq_mt_f(const i64* c, const i64* g, double* part) { sumsq_mt<float>(c, g, part); }
extern "C" __global__ void sumsq_mt_b(const i64* c, const i64* g, double* part) { sumsq_mt<bf16>(c, g, part); }
extern "C" __global__ void sumsq_mt_h(const i64* c, const i64* g, double* part) { sumsq_mt<f16>(c, g, part); }
extern "C" __global__ void sum_parts(const double* part, i64 n, double* out) {
  double s = 0.0;
  for (i64 i = threadIdx.x; i < n; i += blockDim.x) s += part[i];
  s = block_sum_d(s);
  if (threadIdx.x == 0) out[0] = s; }
extern "C" __global__ void sum_scaled(const float* x, i64 n, float scale, float* out) {
  float s = 0.0f;
  for (i64 i = threadIdx.x; i < n; i += blockDim.x) s += x[i];
  s = block_sum(s);
  if (threadIdx.x == 0) out[0] = s * scale; }
"""

INSTANTIATE_OPTIM = r"""
extern "C" __global__ void adam_mt_{g}{h}(const i64* c, const i64* p, const i64* g, const i64* m, const i64* v,
  const i64* h16, const float* hp) {{ adam_mt<{G}, {H}>(c, p, g, m, v, h16, hp); }}
extern "C" __global__ void sgd_mt_{g}{h}(const i64* c, const i64* p, const i64* g, const i64* b, const i64* h16,
  const float* hp) {{ sgd_mt<{G}, {H}>(c, p, g, b, h16, hp); }}
"""


def source() -> str:
    """The whole translation unit: every kernel for every storage type (one NVRTC compile)."""
    parts = [PRELUDE, PER_TYPE, OPTIM, REDUCE]
    parts += [INSTANTIATE_T.format(s=s, T=t) for s, t in TYPES.items()]
    # The 16-bit copy a master rounds into: float32 (f) stands for "none" (a null pointer table).
    parts += [INSTANTIATE_OPTIM.format(g=g, G=gt, h=h, H=ht) for g, gt in TYPES.items() for h, ht in TYPES.items()]
    return "\n".join(parts)


def kernel_names() -> list[str]:
    """Every ``extern "C"`` kernel of :func:`source`."""
    per_t = ["gelu_fwd", "gelu_bwd", "ln_fwd", "ln_bwd_rows", "ln_bwd_cols", "attn_softmax_fwd", "attn_softmax_bwd",
             "ce_fwd", "ce_bwd", "dropout", "embed_bwd", "cols_add", "bias_add", "col_part"]
    names = [f"{k}_{s}" for s in TYPES for k in per_t] + ["sum_scaled", "sum_parts"]
    names += [f"sumsq_mt_{s}" for s in TYPES]
    names += [f"{k}_mt_{g}{h}" for k in ("adam", "sgd") for g in TYPES for h in TYPES]
    return names
