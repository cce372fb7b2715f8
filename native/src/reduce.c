/* Reduction and scaling kernels. inout[i] = op(inout[i], in[i]).
 * Integers wrap on overflow (as numpy does); float16 and bfloat16 are widened to
 * float32 for every operation and rounded back to nearest-even. */
#include <float.h>
#include <math.h>
#include <string.h>

#include "internal.h"

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

static inline uint16_t float_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((x >> 16) | 0x40u); /* keep NaN a NaN */
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

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
#define HALF_KERNEL(NAME, TO_F, FROM_F, OP)                                     \
    static void NAME(void *inout, const void *in, size_t n) {                   \
        uint16_t *a = (uint16_t *)inout;                                        \
        const uint16_t *b = (const uint16_t *)in;                               \
        for (size_t i = 0; i < n; i++)                                          \
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
#define HALF_KERNELS(SFX, TO_F, FROM_F)                                         \
    HALF_KERNEL(sum_##SFX, TO_F, FROM_F, OP_SUM)                                \
    HALF_KERNEL(prod_##SFX, TO_F, FROM_F, OP_PROD)                              \
    HALF_KERNEL(min_##SFX, TO_F, FROM_F, OP_MIN)                                \
    HALF_KERNEL(max_##SFX, TO_F, FROM_F, OP_MAX)

/* Signed products: multiply as unsigned (wraps), same bits as a wrapping signed multiply. */
INT_KERNELS(u8, uint8_t, uint32_t)
INT_KERNELS(i8, int8_t, uint32_t)
INT_KERNELS(u16, uint16_t, uint32_t)
INT_KERNELS(i16, int16_t, uint32_t)
INT_KERNELS(i32, int32_t, uint32_t)
INT_KERNELS(i64, int64_t, uint64_t)
FLOAT_KERNELS(f32, float)
FLOAT_KERNELS(f64, double)
HALF_KERNELS(f16, half_to_float, float_to_half)
HALF_KERNELS(bf16, bf16_to_float, float_to_bf16)

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
    static const int column[5] = {[RS_OP_SUM] = 0, [RS_OP_AVERAGE] = 0, [RS_OP_MIN] = 1,
                                  [RS_OP_MAX] = 2, [RS_OP_PRODUCT] = 3};
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
        for (size_t i = 0; i < count; i++)
            p[i] = float_to_half(half_to_float(p[i]) * (float)factor);
        break;
    }
    case RS_BFLOAT16: {
        uint16_t *p = (uint16_t *)buf;
        for (size_t i = 0; i < count; i++)
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
