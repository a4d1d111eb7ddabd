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

#define KERNELS(NAME, BF16, SWIGLU)                                                        \
void NAME##_fwd(int64_t rows, int64_t cols, const void *h1, const void *h3, const float *w, \
                void *a, int threads) {                                                     \
    if (IN_PARALLEL()) threads = 1; /* on a chunk worker (epscale_run_chunks) */          \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                       \
    for (int64_t r = 0; r < rows; r++)                                                      \
        fwd_row(cols, h1, h3, w ? w[r] : 1.0f, a, r * cols, BF16, SWIGLU);                  \
}                                                                                           \
void NAME##_bwd(int64_t rows, int64_t cols, const void *ga, const void *h1, const void *h3, \
                const float *w, float *gw, void *aw, void *gh1, void *gh3, int threads) {   \
    if (IN_PARALLEL()) threads = 1;                                                         \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                       \
    for (int64_t r = 0; r < rows; r++) {                                                    \
        float acc = bwd_row(cols, ga, h1, h3, w ? w[r] : 1.0f, aw, gh1, gh3, r * cols,      \
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
