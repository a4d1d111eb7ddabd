/* The element-wise work around the expert GEMMs of epscale's fused expert kernel
 * (epscale/moe/native_kernels.py builds this file with the system C compiler on first
 * use and calls it through ctypes).
 *
 * One pass per chunk instead of the 3 (forward) and ~9 (backward) passes of eager ops:
 * each element is loaded once, computed in fp32, rounded once when stored. Rows are
 * independent, so threads split the rows and the results do not depend on the thread
 * count. Matrices are row-major [rows, cols] and contiguous; w (a gate weight per row,
 * fp32) and gw (its gradient, fp32) may be NULL.
 *
 * Forward  (SwiGLU): a = silu(h1) * h3 * w            (GELU: a = gelu(h1) * w)
 * Backward (SwiGLU): from ga = dL/d(silu(h1) * h3) (before the gate weight):
 *   gw  = sum_c ga * silu(h1) * h3          the gate weight's gradient, fp32
 *   aw  = silu(h1) * h3 * w                 the weighted activation (for dL/dW2)
 *   gh3 = ga * w * silu(h1)
 *   gh1 = ga * w * h3 * s * (1 + h1 * (1 - s)),   s = sigmoid(h1)
 * (GELU: gw = sum ga * gelu(h1), aw = gelu(h1) * w, gh1 = ga * w * gelu'(h1).)
 *
 * exp is a Cody-Waite reduction with a degree-6 polynomial (about 1 ulp in fp32) and
 * erfc the Chebyshev fit of Numerical Recipes (relative error < 1.2e-7): written here so
 * that the compiler can vectorise the loops without -ffast-math, which would break NaN
 * and infinity handling. NaN stays NaN and infinities give what the eager torch ops give,
 * except GELU(+inf): inf here, NaN in eager.
 *
 * bf16 on CPUs with AVX-512 BF16 (built with -march=native there): the rows run through
 * hand-vectorised loops (the *_vec functions) with the same formulas and polynomials.
 * The compiler's version spends most of its instructions on what the hardware does in
 * one: vscalefps builds 2^n * p with overflow to inf and underflow to 0 (no clamping
 * selects), vcvtneps2bf16 rounds to nearest even (no integer rounding sequence). Its one
 * difference: it flushes denormal results to zero (below 1.2e-38, under any bf16
 * tolerance). The generic loops stay for fp32 and other CPUs (and for builds with
 * -DEPSCALE_GENERIC_LOOPS, which the tests compare against).
 */
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#define THREAD_NUM() omp_get_thread_num()
#define IN_PARALLEL() omp_in_parallel()
#else
#define THREAD_NUM() 0
#define IN_PARALLEL() 0
#endif

typedef union { float f; uint32_t u; int32_t i; } bits32;

#define INLINE static inline __attribute__((always_inline))

INLINE float load(const void *p, int64_t i, const int bf16) {
    if (bf16) { bits32 v; v.u = (uint32_t)((const uint16_t *)p)[i] << 16; return v.f; }
    return ((const float *)p)[i];
}

/* fp32 -> bf16, round to nearest even; NaN stays a (quiet) NaN. */
INLINE void store(void *p, int64_t i, float f, const int bf16) {
    if (!bf16) { ((float *)p)[i] = f; return; }
    bits32 v; v.f = f;
    uint32_t rounded = (v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16;
    ((uint16_t *)p)[i] = (uint16_t)(f != f ? (v.u >> 16) | 0x40u : rounded);
}

INLINE float exp_f32(float x) {
    const float hi = 88.7228f, lo = -87.33654f;  /* beyond: inf / 0 */
    float xc = x > hi ? hi : x;                  /* a NaN passes both tests unchanged */
    xc = xc < lo ? lo : xc;
    bits32 t; t.f = xc * 1.44269504088896341f + 12582912.0f;  /* 1.5 * 2^23: round */
    float n = t.f - 12582912.0f;
    int32_t ni = t.i - 0x4B400000;
    float r = xc - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    bits32 scale; scale.u = (uint32_t)(ni + 127) << 23;
    float y = p * scale.f;
    y = x > hi ? __builtin_inff() : y;
    return x < lo ? 0.0f : y;
}

INLINE float sigmoid_f32(float x) { return 1.0f / (1.0f + exp_f32(-x)); }

/* erfc(x), relative error < 1.2e-7 (Numerical Recipes' erfcc). */
INLINE float erfc_f32(float x) {
    float z = x < 0.0f ? -x : x;
    float t = 1.0f / (1.0f + 0.5f * z);
    float p = 0.17087277f;
    p = p * t - 0.82215223f;
    p = p * t + 1.48851587f;
    p = p * t - 1.13520398f;
    p = p * t + 0.27886807f;
    p = p * t - 0.18628806f;
    p = p * t + 0.09678418f;
    p = p * t + 0.37409196f;
    p = p * t + 1.00002368f;
    float ans = t * exp_f32(-z * z - 1.26551223f + t * p);
    return x < 0.0f ? 2.0f - ans : ans;
}

#define SQRT1_2 0.70710678118654752f
#define INV_SQRT_2PI 0.39894228040143268f

INLINE void fwd_row(int64_t cols, const void *h1, const void *h3, float wr, void *a,
                    int64_t o, const int bf16, const int swiglu) {
    #pragma omp simd
    for (int64_t c = o; c < o + cols; c++) {
        float x = load(h1, c, bf16), act;
        if (swiglu) act = x * sigmoid_f32(x) * load(h3, c, bf16);
        else act = 0.5f * x * erfc_f32(-x * SQRT1_2);
        store(a, c, act * wr, bf16);
    }
}

INLINE float bwd_row(int64_t cols, const void *ga, const void *h1, const void *h3, float wr,
                     void *aw, void *gh1, void *gh3, int64_t o, const int bf16, const int swiglu) {
    float acc = 0.0f;
    #pragma omp simd reduction(+:acc)
    for (int64_t c = o; c < o + cols; c++) {
        float g = load(ga, c, bf16), x = load(h1, c, bf16);
        float gwt = g * wr, act;
        if (swiglu) {
            float v3 = load(h3, c, bf16), s = sigmoid_f32(x), silu = x * s;
            act = silu * v3;
            store(gh3, c, gwt * silu, bf16);
            store(gh1, c, gwt * v3 * s * (1.0f + x * (1.0f - s)), bf16);
        } else {
            float cdf = 0.5f * erfc_f32(-x * SQRT1_2);
            act = x * cdf;
            store(gh1, c, gwt * (cdf + x * INV_SQRT_2PI * exp_f32(-0.5f * x * x)), bf16);
        }
        acc += g * act;
        store(aw, c, act * wr, bf16);
    }
    return acc;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512BF16__) && !defined(EPSCALE_GENERIC_LOOPS)
#include <immintrin.h>
#define VEC_BF16 1
#define VL 16  /* fp32 lanes of one vector */

INLINE __mmask16 lanes(int64_t left) {
    return left >= VL ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
}

/* Masked loads and stores only for a row's last, partial vector: on some CPUs (AMD Zen 4)
 * masked stores to memory that is not in cache ran the whole loop 1.3x slower. */
INLINE __m512 load_vec(const void *p, int64_t i, __mmask16 m) {
    const uint16_t *at = (const uint16_t *)p + i;
    __m256i h = m == 0xFFFF ? _mm256_loadu_si256((const __m256i *)at)
                            : _mm256_maskz_loadu_epi16(m, at);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

INLINE void store_vec(void *p, int64_t i, __m512 v, __mmask16 m) {
    uint16_t *at = (uint16_t *)p + i;
    __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    if (m == 0xFFFF) _mm256_storeu_si256((__m256i *)at, h);
    else _mm256_mask_storeu_epi16(at, m, h);
}

/* exp_f32's reduction and polynomial. min/max keep a NaN (it is their second operand);
 * past the clamps 2^n alone over- or underflows, as exp does. */
INLINE __m512 exp_vec(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), _mm512_min_ps(_mm512_set1_ps(89.0f), x));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

INLINE __m512 sigmoid_vec(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.0f);
    return _mm512_div_ps(one, _mm512_add_ps(one, exp_vec(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

/* 0.5 * erfc(-x / sqrt(2)): erfc_f32's fit, vectorised. */
INLINE __m512 gelu_cdf_vec(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 u = _mm512_mul_ps(x, _mm512_set1_ps(-SQRT1_2));
    __m512 z = _mm512_abs_ps(u);
    __m512 t = _mm512_div_ps(one, _mm512_fmadd_ps(_mm512_set1_ps(0.5f), z, one));
    __m512 p = _mm512_set1_ps(0.17087277f);
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.82215223f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.48851587f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-1.13520398f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.27886807f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(-0.18628806f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.09678418f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.37409196f));
    p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.00002368f));
    __m512 e = _mm512_fmadd_ps(t, p, _mm512_fnmadd_ps(z, z, _mm512_set1_ps(-1.26551223f)));
    __m512 ans = _mm512_mul_ps(t, exp_vec(e));
    __mmask16 neg = _mm512_cmp_ps_mask(u, _mm512_setzero_ps(), _CMP_LT_OQ);
    ans = _mm512_mask_sub_ps(ans, neg, _mm512_set1_ps(2.0f), ans);
    return _mm512_mul_ps(_mm512_set1_ps(0.5f), ans);
}

INLINE void fwd_row_vec(int64_t cols, const void *h1, const void *h3, float wr, void *a,
                        int64_t o, const int swiglu) {
    const __m512 w = _mm512_set1_ps(wr);
    for (int64_t c = 0; c < cols; c += VL) {
        __mmask16 m = lanes(cols - c);
        __m512 x = load_vec(h1, o + c, m), act;
        if (swiglu) act = _mm512_mul_ps(_mm512_mul_ps(x, sigmoid_vec(x)), load_vec(h3, o + c, m));
        else act = _mm512_mul_ps(x, gelu_cdf_vec(x));
        store_vec(a, o + c, _mm512_mul_ps(act, w), m);
    }
}

INLINE float bwd_row_vec(int64_t cols, const void *ga, const void *h1, const void *h3, float wr,
                         void *aw, void *gh1, void *gh3, int64_t o, const int swiglu) {
    const __m512 w = _mm512_set1_ps(wr), one = _mm512_set1_ps(1.0f);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < cols; c += VL) {
        __mmask16 m = lanes(cols - c);
        __m512 g = load_vec(ga, o + c, m), x = load_vec(h1, o + c, m);
        __m512 gwt = _mm512_mul_ps(g, w), act;
        if (swiglu) {
            __m512 v3 = load_vec(h3, o + c, m), s = sigmoid_vec(x), silu = _mm512_mul_ps(x, s);
            act = _mm512_mul_ps(silu, v3);
            store_vec(gh3, o + c, _mm512_mul_ps(gwt, silu), m);
            __m512 d = _mm512_fmadd_ps(x, _mm512_sub_ps(one, s), one);  /* 1 + x (1 - s) */
            store_vec(gh1, o + c, _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(gwt, v3), s), d), m);
        } else {
            __m512 cdf = gelu_cdf_vec(x);
            act = _mm512_mul_ps(x, cdf);
            __m512 pdf = exp_vec(_mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(-0.5f), x), x));
            __m512 d = _mm512_fmadd_ps(_mm512_mul_ps(x, _mm512_set1_ps(INV_SQRT_2PI)), pdf, cdf);
            store_vec(gh1, o + c, _mm512_mul_ps(gwt, d), m);
        }
        acc = _mm512_fmadd_ps(g, act, acc);
        store_vec(aw, o + c, _mm512_mul_ps(act, w), m);
    }
    return _mm512_reduce_add_ps(acc);
}
#endif

/* One row: the vector loops for bf16 where the build has them, else the generic ones. */
INLINE void fwd_row_any(int64_t cols, const void *h1, const void *h3, float wr, void *a,
                        int64_t o, const int bf16, const int swiglu) {
#ifdef VEC_BF16
    if (bf16) { fwd_row_vec(cols, h1, h3, wr, a, o, swiglu); return; }
#endif
    fwd_row(cols, h1, h3, wr, a, o, bf16, swiglu);
}

INLINE float bwd_row_any(int64_t cols, const void *ga, const void *h1, const void *h3, float wr,
                         void *aw, void *gh1, void *gh3, int64_t o, const int bf16,
                         const int swiglu) {
#ifdef VEC_BF16
    if (bf16) return bwd_row_vec(cols, ga, h1, h3, wr, aw, gh1, gh3, o, swiglu);
#endif
    return bwd_row(cols, ga, h1, h3, wr, aw, gh1, gh3, o, bf16, swiglu);
}

/* Whether the bf16 rows run the vector loops in this build. */
int epscale_vector_bf16(void) {
#ifdef VEC_BF16
    return 1;
#else
    return 0;
#endif
}

#define KERNELS(NAME, BF16, SWIGLU)                                                        \
void NAME##_fwd(int64_t rows, int64_t cols, const void *h1, const void *h3, const float *w, \
                void *a, int threads) {                                                     \
    if (IN_PARALLEL()) threads = 1; /* on a chunk worker (epscale_run_chunks) */          \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                       \
    for (int64_t r = 0; r < rows; r++)                                                      \
        fwd_row_any(cols, h1, h3, w ? w[r] : 1.0f, a, r * cols, BF16, SWIGLU);                  \
}                                                                                           \
void NAME##_bwd(int64_t rows, int64_t cols, const void *ga, const void *h1, const void *h3, \
                const float *w, float *gw, void *aw, void *gh1, void *gh3, int threads) {   \
    if (IN_PARALLEL()) threads = 1;                                                         \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                       \
    for (int64_t r = 0; r < rows; r++) {                                                    \
        float acc = bwd_row_any(cols, ga, h1, h3, w ? w[r] : 1.0f, aw, gh1, gh3, r * cols,      \
                            BF16, SWIGLU);                                                  \
        if (gw) gw[r] = acc;                                                                \
    }                                                                                       \
}

KERNELS(swiglu_bf16, 1, 1)
KERNELS(swiglu_f32, 0, 1)
KERNELS(gelu_bf16, 1, 0)
KERNELS(gelu_f32, 0, 0)

/* The chunk runner (epscale/moe/chunk_workers.py): the chunks of one fused expert call on
 * the threads of an OpenMP team. Each thread takes the next index of `order` (largest
 * chunk first) and calls fn(chunk, thread) (a Python callback through ctypes) until none
 * is left or a callback returns nonzero, which is returned. Inside the parallel region
 * torch's ops and the kernels above run on their calling thread alone, and the team is
 * torch's own (the process has one libgomp), so no idle team spins beside the workers. */
typedef int (*epscale_chunk_fn)(int64_t chunk, int worker);

int epscale_run_chunks(epscale_chunk_fn fn, const int64_t *order, int64_t n, int workers) {
    int64_t next = 0;
    int status = 0;
    #pragma omp parallel num_threads(workers)
    {
        const int me = THREAD_NUM();
        for (;;) {
            int64_t k;
            int failed;
            #pragma omp atomic read
            failed = status;
            if (failed) break;
            #pragma omp atomic capture
            k = next++;
            if (k >= n) break;
            int r = fn(order[k], me);
            if (r) {
                #pragma omp atomic write
                status = r;
            }
        }
    }
    return status;
}

/* Whether this build has OpenMP (the last flag set builds without it). */
int epscale_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* The ABI version the Python side checks after loading (bump on any signature change). */
int epscale_act_kernels_abi(void) { return 2; }
