/* y = x W^T (+ b) with W stored in 16 bits (bf16 or fp16) and everything else in fp32: the linear layers of a
 * decode step on an x86 CPU whose matmul units do not take bf16 (AVX2 + FMA + F16C).
 *
 * A decode step of a few rows is bound by reading the weights, so halving their bytes halves the step, and the
 * widening to fp32 costs one or two instructions per eight weights.
 *
 * The arithmetic of each output y[m][n] is fixed, whatever M, the row grouping, the number of threads or the
 * output chunking: eight fp32 lanes accumulate x[m][k] * W[n][k] by fused multiply-add for k = 0, 8, 16, ... in
 * order (lane j holds k = j mod 8), the lanes are summed as ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), the
 * remaining k < K (K not a multiple of 8) are added one by one in order, then the bias. So a row computed in a
 * batch equals the same row computed alone, bit for bit, and a replay on any thread count gives the same bits.
 * Changing that order changes every stored session's bits: do not.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define BF16 0
#define FP16 1

static inline __m256 widen(const uint16_t *p, const int format) {
  __m128i h = _mm_loadu_si128((const __m128i *)p);
  if (format == FP16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float widen1(uint16_t v, const int format) {
  if (format == FP16) return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(v)));
  union { uint32_t u; float f; } c;
  c.u = ((uint32_t)v) << 16;
  return c.f;
}

static inline float lanes_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* l0+l4, l1+l5, l2+l6, l3+l7 */
  __m128 h = _mm_movehl_ps(s, s);                                                  /* l2+l6, l3+l7, ., . */
  s = _mm_add_ps(s, h);                        /* (l0+l4)+(l2+l6), (l1+l5)+(l3+l7), ., . */
  h = _mm_shuffle_ps(s, s, 1);
  return _mm_cvtss_f32(_mm_add_ss(s, h));
}

/* Where output n's eight weights k..k+7 lie. PLAIN: W[n][k] (row-major (N, K)). BLOCKED: rows in blocks of
 * eight, and within a block the eight rows' weights k..k+7 side by side (128 bytes per k-step), so one thread
 * reads its part of the matrix front to back as one stream (needs K and N multiples of 8). The layout changes
 * where the weights are read from, never the order of the arithmetic. */
#define PLAIN 0
#define BLOCKED 1

static inline const uint16_t *at(const uint16_t *w, int64_t K, int64_t n, int64_t k, const int layout) {
  if (layout == BLOCKED) return w + (n >> 3) * 8 * K + k * 8 + (n & 7) * 8;
  return w + n * K + k;
}

/* MB rows from m0 times NB outputs from n0; MB * NB accumulators stay in registers. */
static inline __attribute__((always_inline)) void block(const float *x, const uint16_t *w, const float *bias,
                                                        float *y, int64_t K, int64_t N, int64_t m0, int64_t n0,
                                                        const int MB, const int NB, const int format,
                                                        const int layout) {
  __m256 acc[4][8];
  for (int a = 0; a < MB; a++)
    for (int b = 0; b < NB; b++) acc[a][b] = _mm256_setzero_ps();
  const int64_t K8 = K & ~(int64_t)7;
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 wv[8];
    for (int b = 0; b < NB; b++) wv[b] = widen(at(w, K, n0 + b, k, layout), format);
    for (int a = 0; a < MB; a++) {
      __m256 xv = _mm256_loadu_ps(x + (m0 + a) * K + k);
      for (int b = 0; b < NB; b++) acc[a][b] = _mm256_fmadd_ps(xv, wv[b], acc[a][b]);
    }
  }
  for (int a = 0; a < MB; a++)
    for (int b = 0; b < NB; b++) {
      float s = lanes_sum(acc[a][b]);
      for (int64_t k = K8; k < K; k++) s = fmaf(x[(m0 + a) * K + k], widen1(w[(n0 + b) * K + k], format), s);
      if (bias) s += bias[n0 + b];
      y[(m0 + a) * N + n0 + b] = s;
    }
}

/* Rows in groups of up to four; each group walks the chunk's outputs NB at a time, then one at a time. */
#define WALK(MB, NB)                                                                                \
  {                                                                                                 \
    int64_t n = n0;                                                                                 \
    for (; n + (NB) <= n1; n += (NB)) block(x, w, bias, y, K, N, m, n, MB, NB, format, layout);     \
    for (; n < n1; n++) block(x, w, bias, y, K, N, m, n, MB, 1, format, layout);                    \
  }

/* One row against whole blocks of eight outputs, the weights read as one stream: block(x, ..., 1, 8, ...)'s
 * arithmetic, with the addresses stepped instead of computed (one stream per thread is what the M=1 step is
 * bound by). */
static inline __attribute__((always_inline)) void stream(const float *x, const uint16_t *w, const float *bias,
                                                         float *y, int64_t K, int64_t n0, int64_t n1,
                                                         const int format) {
  for (int64_t n = n0; n < n1; n += 8) {
    const uint16_t *p = w + n * K;
    __m256 acc[8];
    for (int b = 0; b < 8; b++) acc[b] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8, p += 64) {
      __m256 xv = _mm256_loadu_ps(x + k);
      for (int b = 0; b < 8; b++) acc[b] = _mm256_fmadd_ps(xv, widen(p + b * 8, format), acc[b]);
    }
    for (int b = 0; b < 8; b++) {
      float s = lanes_sum(acc[b]);
      if (bias) s += bias[n + b];
      y[n + b] = s;
    }
  }
}

static inline __attribute__((always_inline)) void chunk(const float *x, const uint16_t *w, const float *bias,
                                                        float *y, int64_t M, int64_t K, int64_t N, int64_t n0,
                                                        int64_t n1, const int format, const int layout) {
  if (layout == BLOCKED && M == 1) {
    stream(x, w, bias, y, K, n0, n1, format);
    return;
  }
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) WALK(4, 2)
  switch (M - m) {
    case 3: WALK(3, 2) break;
    case 2: WALK(2, 4) break;
    case 1: WALK(1, 8) break;
    default: break;
  }
}

/* x (M, K) fp32, w (N, K) 16-bit in ``layout``, bias (N) fp32 or NULL, y (M, N) fp32; all contiguous. Returns 0,
 * or -1 for a format or layout it does not take. */
int linear16(const float *x, const uint16_t *w, const float *bias, float *y, int64_t M, int64_t K, int64_t N,
             int format, int layout, int threads) {
  if ((format != BF16 && format != FP16) || (layout != PLAIN && layout != BLOCKED)) return -1;
  if (layout == BLOCKED && ((K & 7) || (N & 7))) return -1;
  /* outputs per chunk: about 128 KiB of weights, so a chunk read by the first row group stays in L2 for the
   * next ones (a multiple of 8, 8 to 64: whole blocks) */
  int64_t per = (128 * 1024) / (2 * (K > 0 ? K : 1));
  per = per < 8 ? 8 : (per > 64 ? 64 : per & ~(int64_t)7);
  const int64_t chunks = (N + per - 1) / per;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t c = 0; c < chunks; c++) {
    const int64_t n0 = c * per, n1 = n0 + per < N ? n0 + per : N;
    if (format == FP16 && layout == BLOCKED)
      chunk(x, w, bias, y, M, K, N, n0, n1, FP16, BLOCKED);
    else if (format == FP16)
      chunk(x, w, bias, y, M, K, N, n0, n1, FP16, PLAIN);
    else if (layout == BLOCKED)
      chunk(x, w, bias, y, M, K, N, n0, n1, BF16, BLOCKED);
    else
      chunk(x, w, bias, y, M, K, N, n0, n1, BF16, PLAIN);
  }
  return 0;
}

/* out (n1 - n0, K) fp32 = rows n0..n1 of w (N, K) 16-bit in ``layout``, widened exactly: what a prefill chunk's
 * fp32 matmul reads, in one pass (n0 and n1 multiples of 8 for BLOCKED). Returns 0, or -1 as linear16 does. */
int widen16(const uint16_t *w, float *out, int64_t n0, int64_t n1, int64_t K, int format, int layout, int threads) {
  if ((format != BF16 && format != FP16) || (layout != PLAIN && layout != BLOCKED)) return -1;
  if (layout == BLOCKED && ((K & 7) || (n0 & 7) || (n1 & 7))) return -1;
  const int64_t K8 = K & ~(int64_t)7;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t n = n0; n < n1; n++) {
    float *row = out + (n - n0) * K;
    if (format == FP16) {
      for (int64_t k = 0; k < K8; k += 8) _mm256_storeu_ps(row + k, widen(at(w, K, n, k, layout), FP16));
      for (int64_t k = K8; k < K; k++) row[k] = widen1(w[n * K + k], FP16);
    } else {
      for (int64_t k = 0; k < K8; k += 8) _mm256_storeu_ps(row + k, widen(at(w, K, n, k, layout), BF16));
      for (int64_t k = K8; k < K; k++) row[k] = widen1(w[n * K + k], BF16);
    }
  }
  return 0;
}
