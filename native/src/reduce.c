/* Reduction and scaling kernels. inout[i] = op(inout[i], in[i]).
 * Integers wrap on overflow (as numpy does); float16 and bfloat16 are widened to
 * float32 for every operation and rounded back to nearest-even. */
#include <float.h>
#include <math.h>
#include <string.h>

#include "reduce.h"

/* ---- 16-bit float conversions (portable; no compiler extensions) ---- */

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu;
    uint32_t mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0) {
        float f = (float)mantissa * (1.0f / 16777216.0f); /* subnormal: m * 2^-24 */
        return sign ? -f : f;
    }
    if (exponent == 31)
        bits = sign | 0x7f800000u | (mantissa << 13);
    else
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t absx = x & 0x7fffffffu;
    if (absx > 0x7f800000u)
        return (uint16_t)(sign | 0x7e00u); /* NaN */
    if (absx >= 0x477ff000u)
        return (uint16_t)(sign | 0x7c00u); /* rounds to infinity */
    if (absx < 0x38800000u) { /* below the smallest normal half: subnormal or zero */
        float a;
        memcpy(&a, &absx, sizeof a);
        return (uint16_t)(sign | (uint32_t)nearbyintf(a * 16777216.0f));
    }
    absx += 0xfffu + ((absx >> 13) & 1u); /* round to nearest even at bit 13 */
    return (uint16_t)(sign | ((absx - (112u << 23)) >> 13));
}

static inline float bf16_to_float(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even at bit 16; a NaN keeps its top bits and is made quiet (rounding
 * could carry it into an infinity). A select, not a branch, so that loops over it
 * vectorise; the NaN test is a signed compare because SSE2 has no unsigned one. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
    uint32_t quiet_nan = (x >> 16) | 0x40u;
    int is_nan = (int32_t)(x & 0x7fffffffu) > (int32_t)0x7f800000;
    return (uint16_t)(is_nan ? quiet_nan : rounded);
}

/* ---- 16-bit floats in AVX2 registers: the only architecture-specific code ----
 * f16_vector_* and bf16_vector_* run the vector part of a loop and return how many
 * elements they did: a multiple of 8 (float16) or 16 (bfloat16), or 0 where the CPU lacks
 * AVX2 and F16C, or off x86. The scalar code above does the rest, to the same bits.
 * (bfloat16's scalar code vectorises by itself with SSE2, but at a third of memory speed:
 * GCC narrows 32 to 16 bits with long shuffle chains, and the vectors are half as wide.) */

enum { COL_SUM, COL_MIN, COL_MAX, COL_PROD }; /* the columns of the kernel table */

typedef size_t (*vector_fn)(uint16_t *a, const uint16_t *b, size_t n);

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define AVX2_TARGET __attribute__((target("avx2,f16c")))

/* Asked at every call: a load and a test, against 8+ elements of work. cpu_init is
 * idempotent, and needed should this ever run from a constructor. */
static int avx2_usable(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}

/* The scalar operations on vectors. OP_MIN(a, b) is b < a ? b : a, which is minps(b, a)
 * exactly, NaNs and signed zeros too. Of two NaNs x86 passes on the first operand's; C
 * leaves the order open, and GCC compiled the scalar float16 code as b + a (the _BA forms)
 * and the bfloat16 code as a + b: the vector code follows each, so it gives the scalar
 * code's bits and body and tail agree. */
#define V_SUM(x, y) _mm256_add_ps(x, y)
#define V_PROD(x, y) _mm256_mul_ps(x, y)
#define V_SUM_BA(x, y) _mm256_add_ps(y, x)
#define V_PROD_BA(x, y) _mm256_mul_ps(y, x)
#define V_MIN(x, y) _mm256_min_ps(y, x)
#define V_MAX(x, y) _mm256_max_ps(y, x)

static AVX2_TARGET inline __m256 f16_load8(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* vcvtps2ph rounds like float_to_half except for NaNs, whose payload it keeps: they become
 * the default quiet NaN of their sign first, which it narrows to float_to_half's sign|0x7e00. */
static AVX2_TARGET inline void f16_store8(uint16_t *p, __m256 x) {
    __m256 is_nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    __m256 sign = _mm256_and_ps(x, _mm256_set1_ps(-0.0f));
    __m256 quiet = _mm256_or_ps(sign, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)));
    __m256 x_or_quiet = _mm256_blendv_ps(x, quiet, is_nan);
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(x_or_quiet, _MM_FROUND_TO_NEAREST_INT));
}

static AVX2_TARGET size_t f16_avx2_scale(uint16_t *p, size_t n, float factor) {
    __m256 f = _mm256_set1_ps(factor);
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        f16_store8(p + i, _mm256_mul_ps(f16_load8(p + i), f));
    return i;
}

/* A bfloat16 is the top half of a float32: zeros interleaved below widen it. Unpacking
 * (and packing, below) works within each 128-bit half, so low() holds elements 0-3 and
 * 8-11 of 16, high() 4-7 and 12-15, and the pack puts them back in order. */
static AVX2_TARGET inline __m256 bf16_low(__m256i v) {
    return _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), v));
}

static AVX2_TARGET inline __m256 bf16_high(__m256i v) {
    return _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), v));
}

/* float_to_bf16 on eight lanes, the result left in each lane's top half. */
static AVX2_TARGET inline __m256i bf16_round(__m256 f) {
    __m256i x = _mm256_castps_si256(f);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    __m256i quiet = _mm256_or_si256(x, _mm256_set1_epi32(0x400000));
    __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(rounded, quiet, is_nan);
}

/* An arithmetic shift brings each top half down within int16's range, so the signed
 * saturating pack is exact. */
static AVX2_TARGET inline void bf16_store16(uint16_t *p, __m256 low, __m256 high) {
    __m256i packed = _mm256_packs_epi32(_mm256_srai_epi32(bf16_round(low), 16),
                                        _mm256_srai_epi32(bf16_round(high), 16));
    _mm256_storeu_si256((__m256i *)p, packed);
}

/* One step: a = VOP(a, b) on 8 float16 or 16 bfloat16 elements. */
#define F16_STEP(a, b, VOP) f16_store8(a, VOP(f16_load8(a), f16_load8(b)))
#define BF16_STEP(a, b, VOP)                                                    \
    do {                                                                        \
        __m256i x_ = _mm256_loadu_si256((const __m256i *)(a));                  \
        __m256i y_ = _mm256_loadu_si256((const __m256i *)(b));                  \
        bf16_store16(a, VOP(bf16_low(x_), bf16_low(y_)),                        \
                     VOP(bf16_high(x_), bf16_high(y_)));                        \
    } while (0)

#define AVX2_KERNEL(NAME, STEP, DO_STEP, VOP)                                   \
    static AVX2_TARGET size_t NAME(uint16_t *a, const uint16_t *b, size_t n) {  \
        size_t i = 0;                                                           \
        for (; i + STEP <= n; i += STEP)                                        \
            DO_STEP(a + i, b + i, VOP);                                         \
        return i;                                                               \
    }
#define AVX2_KERNELS(FMT, STEP, DO_STEP, VSUM, VPROD)                           \
    AVX2_KERNEL(FMT##_avx2_sum, STEP, DO_STEP, VSUM)                            \
    AVX2_KERNEL(FMT##_avx2_prod, STEP, DO_STEP, VPROD)                          \
    AVX2_KERNEL(FMT##_avx2_min, STEP, DO_STEP, V_MIN)                           \
    AVX2_KERNEL(FMT##_avx2_max, STEP, DO_STEP, V_MAX)
AVX2_KERNELS(f16, 8, F16_STEP, V_SUM_BA, V_PROD_BA)
AVX2_KERNELS(bf16, 16, BF16_STEP, V_SUM, V_PROD)

static AVX2_TARGET size_t bf16_avx2_scale(uint16_t *p, size_t n, float factor) {
    __m256 f = _mm256_set1_ps(factor);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(p + i));
        bf16_store16(p + i, _mm256_mul_ps(bf16_low(x), f), _mm256_mul_ps(bf16_high(x), f));
    }
    return i;
}

static size_t f16_vector_reduce(int column, uint16_t *a, const uint16_t *b, size_t n) {
    static const vector_fn fns[4] = {f16_avx2_sum, f16_avx2_min, f16_avx2_max, f16_avx2_prod};
    return n < 8 || !avx2_usable() ? 0 : fns[column](a, b, n);
}

static size_t bf16_vector_reduce(int column, uint16_t *a, const uint16_t *b, size_t n) {
    static const vector_fn fns[4] = {bf16_avx2_sum, bf16_avx2_min, bf16_avx2_max,
                                     bf16_avx2_prod};
    return n < 16 || !avx2_usable() ? 0 : fns[column](a, b, n);
}

static size_t f16_vector_scale(uint16_t *p, size_t n, float factor) {
    return n < 8 || !avx2_usable() ? 0 : f16_avx2_scale(p, n, factor);
}

static size_t bf16_vector_scale(uint16_t *p, size_t n, float factor) {
    return n < 16 || !avx2_usable() ? 0 : bf16_avx2_scale(p, n, factor);
}
#else
static size_t f16_vector_reduce(int column, uint16_t *a, const uint16_t *b, size_t n) {
    return 0;
}
static size_t bf16_vector_reduce(int column, uint16_t *a, const uint16_t *b, size_t n) {
    return 0;
}
static size_t f16_vector_scale(uint16_t *p, size_t n, float factor) { return 0; }
static size_t bf16_vector_scale(uint16_t *p, size_t n, float factor) { return 0; }
#endif

/* ---- binary operations on one element ---- */

#define OP_SUM(a, b) ((a) + (b))
#define OP_PROD(a, b) ((a) * (b))
#define OP_MIN(a, b) ((b) < (a) ? (b) : (a))
#define OP_MAX(a, b) ((b) > (a) ? (b) : (a))

/* Integer kernels compute in the unsigned type of the same width so that overflow
 * wraps instead of being undefined behaviour. */
#define INT_KERNEL(NAME, T, U, OP)                                              \
    static void NAME(void *inout, const void *in, size_t n) {                   \
        T *a = (T *)inout;                                                      \
        const T *b = (const T *)in;                                             \
        for (size_t i = 0; i < n; i++)                                          \
            a[i] = (T)OP((U)a[i], (U)b[i]);                                     \
    }
#define CMP_KERNEL(NAME, T, OP)                                                 \
    static void NAME(void *inout, const void *in, size_t n) {                   \
        T *a = (T *)inout;                                                      \
        const T *b = (const T *)in;                                             \
        for (size_t i = 0; i < n; i++)                                          \
            a[i] = OP(a[i], b[i]);                                              \
    }
/* float16 and bfloat16: the vector code where the CPU has it, then the scalar
 * conversions for the tail (or everything). */
#define HALF_KERNEL(NAME, VECTOR, TO_F, FROM_F, OP, COLUMN)                     \
    static void NAME(void *inout, const void *in, size_t n) {                   \
        uint16_t *a = (uint16_t *)inout;                                        \
        const uint16_t *b = (const uint16_t *)in;                               \
        for (size_t i = VECTOR(COLUMN, a, b, n); i < n; i++)                    \
            a[i] = FROM_F(OP(TO_F(a[i]), TO_F(b[i])));                          \
    }

/* The four kernels of one type: sum_SFX, prod_SFX, min_SFX, max_SFX. */
#define INT_KERNELS(SFX, T, U)                                                  \
    INT_KERNEL(sum_##SFX, T, U, OP_SUM)                                         \
    INT_KERNEL(prod_##SFX, T, U, OP_PROD)                                       \
    CMP_KERNEL(min_##SFX, T, OP_MIN)                                            \
    CMP_KERNEL(max_##SFX, T, OP_MAX)
#define FLOAT_KERNELS(SFX, T)                                                   \
    CMP_KERNEL(sum_##SFX, T, OP_SUM)                                            \
    CMP_KERNEL(prod_##SFX, T, OP_PROD)                                          \
    CMP_KERNEL(min_##SFX, T, OP_MIN)                                            \
    CMP_KERNEL(max_##SFX, T, OP_MAX)
#define HALF_KERNELS(SFX, VECTOR, TO_F, FROM_F)                                 \
    HALF_KERNEL(sum_##SFX, VECTOR, TO_F, FROM_F, OP_SUM, COL_SUM)               \
    HALF_KERNEL(prod_##SFX, VECTOR, TO_F, FROM_F, OP_PROD, COL_PROD)            \
    HALF_KERNEL(min_##SFX, VECTOR, TO_F, FROM_F, OP_MIN, COL_MIN)               \
    HALF_KERNEL(max_##SFX, VECTOR, TO_F, FROM_F, OP_MAX, COL_MAX)

/* Signed products: multiply as unsigned (wraps), same bits as a wrapping signed multiply. */
INT_KERNELS(u8, uint8_t, uint32_t)
INT_KERNELS(i8, int8_t, uint32_t)
INT_KERNELS(u16, uint16_t, uint32_t)
INT_KERNELS(i16, int16_t, uint32_t)
INT_KERNELS(i32, int32_t, uint32_t)
INT_KERNELS(i64, int64_t, uint64_t)
FLOAT_KERNELS(f32, float)
FLOAT_KERNELS(f64, double)
HALF_KERNELS(f16, f16_vector_reduce, half_to_float, float_to_half)
HALF_KERNELS(bf16, bf16_vector_reduce, bf16_to_float, float_to_bf16)

/* Rows: dtype; columns: sum, min, max, product (Average reduces as sum). Bool has none. */
static const rs_reduce_fn kernels[RS_UINT16 + 1][4] = {
    [RS_UINT8] = {sum_u8, min_u8, max_u8, prod_u8},
    [RS_INT8] = {sum_i8, min_i8, max_i8, prod_i8},
    [RS_INT32] = {sum_i32, min_i32, max_i32, prod_i32},
    [RS_INT64] = {sum_i64, min_i64, max_i64, prod_i64},
    [RS_FLOAT16] = {sum_f16, min_f16, max_f16, prod_f16},
    [RS_BFLOAT16] = {sum_bf16, min_bf16, max_bf16, prod_bf16},
    [RS_FLOAT32] = {sum_f32, min_f32, max_f32, prod_f32},
    [RS_FLOAT64] = {sum_f64, min_f64, max_f64, prod_f64},
    [RS_INT16] = {sum_i16, min_i16, max_i16, prod_i16},
    [RS_UINT16] = {sum_u16, min_u16, max_u16, prod_u16},
};

/* Codes are appended as dtypes are added (bool sits between), so ranges need care. */
int rs_dtype_movable(int dtype) { return dtype >= RS_UINT8 && dtype <= RS_UINT16; }
int rs_dtype_valid(int dtype) { return rs_dtype_movable(dtype) && dtype != RS_BOOL; }
int rs_dtype_is_integer(rs_dtype_t dtype) {
    return dtype <= RS_INT64 || dtype == RS_INT16 || dtype == RS_UINT16;
}
int rs_op_valid(int op) { return op >= RS_OP_SUM && op <= RS_OP_ADASUM; }

int rs_dtype_is_float(int dtype) {
    return dtype == RS_FLOAT16 || dtype == RS_BFLOAT16 || dtype == RS_FLOAT32 ||
           dtype == RS_FLOAT64;
}

/* Adasum's coefficients come from dot products: they mean nothing for integers. */
int rs_op_takes_dtype(int op, int dtype) {
    return rs_dtype_valid(dtype) && (op != RS_OP_ADASUM || rs_dtype_is_float(dtype));
}

size_t rs_dtype_size(rs_dtype_t dtype) {
    static const size_t sizes[RS_UINT16 + 1] = {1, 1, 4, 8, 2, 2, 4, 8, 1, 2, 2};
    return rs_dtype_movable(dtype) ? sizes[dtype] : 0;
}

rs_reduce_fn rs_reduce_kernel(rs_dtype_t dtype, rs_op_t op) {
    static const int column[5] = {[RS_OP_SUM] = COL_SUM, [RS_OP_AVERAGE] = COL_SUM,
                                  [RS_OP_MIN] = COL_MIN, [RS_OP_MAX] = COL_MAX,
                                  [RS_OP_PRODUCT] = COL_PROD};
    if (!rs_dtype_valid(dtype) || !rs_op_valid(op) || op == RS_OP_ADASUM)
        return NULL; /* Adasum is no element-wise operation (rs_adasum_*) */
    return kernels[dtype][column[op]];
}

rs_status_t rs_reduce_local(void *inout, const void *in, size_t count, rs_dtype_t dtype,
                            rs_op_t op) {
    rs_reduce_fn fn = rs_reduce_kernel(dtype, op);
    if (!fn)
        return RS_ERR_USAGE;
    fn(inout, in, count);
    return RS_OK;
}

/* ---- scaling ---- */

/* The divisor stays wide: cast to int8 it would be 0 at 256 ranks and negative at 128. */
#define INT_DIVIDE(T)                                                           \
    do {                                                                        \
        T *p = (T *)buf;                                                        \
        for (size_t i = 0; i < count; i++)                                      \
            p[i] = (T)((int64_t)p[i] / (int64_t)divisor);                       \
    } while (0)

/* Average of integers: exact integer division, truncated toward zero (a multiply by a
 * rounded 1/n would turn 6/3 into 1.999... and then 1). */
rs_status_t rs_divide_local(void *buf, size_t count, rs_dtype_t dtype, int divisor) {
    if (divisor < 1)
        return RS_ERR_USAGE;
    switch (dtype) {
    case RS_UINT8: INT_DIVIDE(uint8_t); break;
    case RS_INT8: INT_DIVIDE(int8_t); break;
    case RS_INT16: INT_DIVIDE(int16_t); break;
    case RS_UINT16: INT_DIVIDE(uint16_t); break;
    case RS_INT32: INT_DIVIDE(int32_t); break;
    case RS_INT64: INT_DIVIDE(int64_t); break;
    default: return RS_ERR_USAGE;
    }
    return RS_OK;
}

#define INT_SCALE(T)                                                            \
    do {                                                                        \
        T *p = (T *)buf;                                                        \
        for (size_t i = 0; i < count; i++)                                      \
            p[i] = (T)((double)p[i] * factor);                                  \
    } while (0)

rs_status_t rs_scale_local(void *buf, size_t count, rs_dtype_t dtype, double factor) {
    switch (dtype) {
    case RS_UINT8: INT_SCALE(uint8_t); break;
    case RS_INT8: INT_SCALE(int8_t); break;
    case RS_INT16: INT_SCALE(int16_t); break;
    case RS_UINT16: INT_SCALE(uint16_t); break;
    case RS_INT32: INT_SCALE(int32_t); break;
    case RS_INT64: INT_SCALE(int64_t); break;
    case RS_FLOAT32: {
        float *p = (float *)buf, f = (float)factor;
        for (size_t i = 0; i < count; i++)
            p[i] *= f;
        break;
    }
    case RS_FLOAT64: {
        double *p = (double *)buf;
        for (size_t i = 0; i < count; i++)
            p[i] *= factor;
        break;
    }
    case RS_FLOAT16: {
        uint16_t *p = (uint16_t *)buf;
        for (size_t i = f16_vector_scale(p, count, (float)factor); i < count; i++)
            p[i] = float_to_half(half_to_float(p[i]) * (float)factor);
        break;
    }
    case RS_BFLOAT16: {
        uint16_t *p = (uint16_t *)buf;
        for (size_t i = bf16_vector_scale(p, count, (float)factor); i < count; i++)
            p[i] = float_to_bf16(bf16_to_float(p[i]) * (float)factor);
        break;
    }
    default:
        return RS_ERR_USAGE;
    }
    return RS_OK;
}

/* ---- Adasum's arithmetic (the exchanges are in adasum.c) ---- */

static inline double f32_to_double(float f) { return f; }
static inline double f64_to_double(double f) { return f; }
static inline float double_to_f32(double d) { return (float)d; }
static inline double double_to_f64(double d) { return d; }
static inline double f16_to_double(uint16_t h) { return half_to_float(h); }
static inline uint16_t double_to_f16(double d) { return float_to_half((float)d); }
static inline double bf16_to_double(uint16_t b) { return bf16_to_float(b); }
static inline uint16_t double_to_bf16(double d) { return float_to_bf16((float)d); }

/* dots_SFX: dot(a, b), |a|^2, |b|^2 accumulated in double. combine_SFX: out = ca*a + cb*b
 * in double, rounded once; out may be a or b (each element is read before it is written). */
#define ADASUM_KERNELS(SFX, T)                                                  \
    static void dots_##SFX(const void *a, const void *b, size_t n, double s[3]) { \
        const T *x = (const T *)a, *y = (const T *)b;                           \
        double dot = 0, aa = 0, bb = 0;                                         \
        for (size_t i = 0; i < n; i++) {                                        \
            double u = SFX##_to_double(x[i]), v = SFX##_to_double(y[i]);        \
            dot += u * v;                                                       \
            aa += u * u;                                                        \
            bb += v * v;                                                        \
        }                                                                       \
        s[0] = dot;                                                             \
        s[1] = aa;                                                              \
        s[2] = bb;                                                              \
    }                                                                           \
    static void combine_##SFX(void *out, const void *a, const void *b, size_t n, \
                              double ca, double cb) {                           \
        T *o = (T *)out;                                                        \
        const T *x = (const T *)a, *y = (const T *)b;                           \
        for (size_t i = 0; i < n; i++)                                          \
            o[i] = double_to_##SFX(ca * SFX##_to_double(x[i]) +                 \
                                   cb * SFX##_to_double(y[i]));                 \
    }

ADASUM_KERNELS(f16, uint16_t)
ADASUM_KERNELS(bf16, uint16_t)
ADASUM_KERNELS(f32, float)
ADASUM_KERNELS(f64, double)

rs_status_t rs_adasum_dots(const void *a, const void *b, size_t count, rs_dtype_t dtype,
                           double sums[3]) {
    switch (dtype) {
    case RS_FLOAT16: dots_f16(a, b, count, sums); break;
    case RS_BFLOAT16: dots_bf16(a, b, count, sums); break;
    case RS_FLOAT32: dots_f32(a, b, count, sums); break;
    case RS_FLOAT64: dots_f64(a, b, count, sums); break;
    default: return RS_ERR_USAGE;
    }
    return RS_OK;
}

rs_status_t rs_adasum_combine(void *out, const void *a, const void *b, size_t count,
                              rs_dtype_t dtype, const double sums[3]) {
    /* A (nearly) zero vector keeps coefficient 1: adasum(0, b) = b, which is also what a
     * joined rank's zeros must give. */
    double floor = sqrt(DBL_MIN);
    double ca = sums[1] >= floor ? 1.0 - sums[0] / (2.0 * sums[1]) : 1.0;
    double cb = sums[2] >= floor ? 1.0 - sums[0] / (2.0 * sums[2]) : 1.0;
    switch (dtype) {
    case RS_FLOAT16: combine_f16(out, a, b, count, ca, cb); break;
    case RS_BFLOAT16: combine_bf16(out, a, b, count, ca, cb); break;
    case RS_FLOAT32: combine_f32(out, a, b, count, ca, cb); break;
    case RS_FLOAT64: combine_f64(out, a, b, count, ca, cb); break;
    default: return RS_ERR_USAGE;
    }
    return RS_OK;
}
