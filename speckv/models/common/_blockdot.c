/* speckv.models.common._blockdot: few-row fp32 products y = x W^T (+ b) read from W as a
 * GGUF checkpoint stores it, in blocks of 32 weights with fp32 scales.
 *
 * Owns two functions over raw addresses of C-contiguous buffers (the caller,
 * compact_linear.py, checks shapes, dtypes and contiguity):
 *
 *     q4_1_dot(x, q, s, b, y, n, k, m)    W[j, 32 t + i] = s[j, t, 0] * q_i + s[j, t, 1]
 *         q [m, k / 2] uint8: per block of 32, weight i < 16 in the low nibble of byte i,
 *                             weight 16 + i in its high nibble
 *         s [m, k / 32, 2] fp32: (d, min) of each block
 *     q8_0_dot(x, q, s, b, y, n, k, m)    W[j, 32 t + i] = s[j, t] * q_i
 *         q [m, k] int8, s [m, k / 32] fp32
 *     f16_dot(x, q, 0, b, y, n, k, m)     W[j, i] = q[j, i]
 *         q [m, k] fp16 (an fp16 checkpoint, such as the built-in EAGLE3 head, run in fp32)
 *     x [n, k] fp32   b [m] fp32 or 0   y [n, m] fp32 (written)   k a multiple of 32
 *
 * Why: a decode step reads every weight of the model once, and the fp32 copy of a Q4_1 model
 * is 6.4x the bytes of its blocks (of an fp16 one, 2x). The scales are the checkpoint's fp16 d and min widened to
 * fp32 (exact), and d * q is exact in fp32 (11 + 4 or 8 significant bits), so each weight
 * below has exactly the value the fp32 copy holds: d * q + min rounds once whether computed
 * as one fused multiply-add or as a multiply and an add.
 *
 * Each output sums in the order `_rowdot.rowdot` sums the fp32 copy: per row of x, two
 * accumulators over the 16-weight halves of each block of 32, then the fixed lane reduction,
 * then + b[j]. So a row here has the same bits as `rowdot` gives it on the fp32 weights, and
 * the same bits whatever the other rows of its batch. The GIL is released while it runs;
 * one body per instruction set (AVX-512, AVX2 + FMA, baseline), dispatched once.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

typedef uint8_t vu8x16 __attribute__((vector_size(16)));

/* the 32 weights of block t of row j as two v16 (p: 0..15, h: 16..31) */
#define DEQUANT_Q4_1(p, h)                                                           \
    {                                                                                \
        vu8x16 bytes_;                                                               \
        memcpy(&bytes_, qj + t * 16, 16);                                            \
        const float d_ = sj[2 * t], min_ = sj[2 * t + 1];                            \
        p = __builtin_convertvector(__builtin_convertvector(bytes_ & 15, vi16), v16) \
            * d_ + min_;                                                             \
        h = __builtin_convertvector(__builtin_convertvector(bytes_ >> 4, vi16), v16) \
            * d_ + min_;                                                             \
    }

/* int8 -> int32 through the unsigned widening (q ^ 0x80 is q + 128 as uint8): GCC 12 widens
 * a signed byte vector one lane at a time, an unsigned one in one instruction */
#define DEQUANT_Q8_0(p, h)                                                           \
    {                                                                                \
        vu8x16 lo_, hi_;                                                             \
        memcpy(&lo_, qj + t * 32, 16);                                               \
        memcpy(&hi_, qj + t * 32 + 16, 16);                                          \
        const float d_ = sj[t];                                                      \
        p = __builtin_convertvector(__builtin_convertvector(lo_ ^ 0x80, vi16) - 128, \
                                    v16) * d_;                                       \
        h = __builtin_convertvector(__builtin_convertvector(hi_ ^ 0x80, vi16) - 128, \
                                    v16) * d_;                                       \
    }

/* fp16 weights, 32 per "block" (no scale): widened per instruction set (F16C's vcvtph2ps; the
 * baseline by bits), each to the fp32 value it holds exactly */
#define DEQUANT_F16_AVX512(p, h)                                                     \
    {                                                                                \
        __m512 lo_ = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(qj + 32 * t))); \
        __m512 hi_ = _mm512_cvtph_ps(                                                \
            _mm256_loadu_si256((const __m256i *)(qj + 32 * t + 16)));                \
        memcpy(&p, &lo_, 64);                                                        \
        memcpy(&h, &hi_, 64);                                                        \
    }
#define DEQUANT_F16_AVX2(p, h)                                                       \
    {                                                                                \
        __m256 w_[4];                                                                \
        for (int u_ = 0; u_ < 4; u_++)                                               \
            w_[u_] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(qj + 32 * t + 8 * u_))); \
        memcpy(&p, &w_[0], 64);                                                      \
        memcpy(&h, &w_[2], 64);                                                      \
    }
#define DEQUANT_F16_BASELINE(p, h)                                                   \
    {                                                                                \
        float w_[32];                                                                \
        for (int u_ = 0; u_ < 32; u_++) w_[u_] = half_to_float(qj[32 * t + u_]);     \
        memcpy(&p, w_, 64);                                                          \
        memcpy(&h, w_ + 16, 64);                                                     \
    }

/* IEEE binary16 bits -> the float it is (normals, subnormals, zeros, infinities, NaNs) */
static inline float half_to_float(uint16_t bits) {
    uint32_t sign = (uint32_t)(bits & 0x8000) << 16, exponent = (bits >> 10) & 31;
    uint32_t mantissa = bits & 0x3FF, out;
    if (exponent == 31) {
        out = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent) {
        out = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa) { /* subnormal: mantissa * 2^-24, exact in fp32 */
        float value = (float)mantissa * 5.9604644775390625e-8f;
        memcpy(&out, &value, 4);
        out |= sign;
    } else {
        out = sign;
    }
    float f;
    memcpy(&f, &out, 4);
    return f;
}

/* rows i0 .. i0 + NB - 1 of x against row j of W, its blocks decoded by DEQUANT */
#define BLOCK_CHUNK(NB, DEQUANT)                                                     \
    {                                                                                \
        v16 a[NB][2];                                                                \
        memset(a, 0, sizeof(a));                                                     \
        for (Py_ssize_t t = 0; t < nblocks; t++) {                                   \
            v16 p, h;                                                                \
            DEQUANT(p, h)                                                            \
            for (int i = 0; i < NB; i++) {                                           \
                v16 x0, x1;                                                          \
                LOAD16(x0, xc + i * k + 32 * t);                                     \
                LOAD16(x1, xc + i * k + 32 * t + 16);                                \
                a[i][0] += p * x0;                                                   \
                a[i][1] += h * x1;                                                   \
            }                                                                        \
        }                                                                            \
        for (int i = 0; i < NB; i++) {                                               \
            v16 sum = a[i][0] + a[i][1];                                             \
            float s;                                                                 \
            HSUM16(sum, s);                                                          \
            if (b) s += b[j];                                                        \
            y[(i0 + i) * m + j] = s;                                                 \
        }                                                                            \
    }

/* QTYPE: the element type of q; QROW: bytes of q per row of W; SROW: floats of s per row */
#define BLOCK_BODY(QTYPE, QROW, SROW, DEQUANT)                                       \
    {                                                                                \
        const Py_ssize_t nblocks = k / 32;                                           \
        for (Py_ssize_t j = 0; j < m; j++) {                                         \
            const QTYPE *qj = (const QTYPE *)q + j * (QROW);                         \
            const float *sj = s + j * (SROW);                                        \
            (void)sj; /* fp16 has no scales */                                       \
            for (Py_ssize_t i0 = 0; i0 < n; i0 += 4) {                               \
                const float *xc = x + i0 * k;                                        \
                switch (n - i0 < 4 ? n - i0 : 4) {                                   \
                    case 1: BLOCK_CHUNK(1, DEQUANT) break;                           \
                    case 2: BLOCK_CHUNK(2, DEQUANT) break;                           \
                    case 3: BLOCK_CHUNK(3, DEQUANT) break;                           \
                    default: BLOCK_CHUNK(4, DEQUANT) break;                          \
                }                                                                    \
            }                                                                        \
        }                                                                            \
    }

#define Q4_1_BODY BLOCK_BODY(uint8_t, k / 2, 2 * nblocks, DEQUANT_Q4_1)
#define Q8_0_BODY BLOCK_BODY(int8_t, k, nblocks, DEQUANT_Q8_0)
#define F16_BODY(DEQUANT) BLOCK_BODY(uint16_t, k, 0, DEQUANT)

typedef void (*block_fn)(const float *, const void *, const float *, const float *, float *,
                         Py_ssize_t, Py_ssize_t, Py_ssize_t);

#define SIGNATURE(name)                                                              \
    void name(const float *x, const void *q, const float *s, const float *b, float *y, \
              Py_ssize_t n, Py_ssize_t k, Py_ssize_t m)

static SIGNATURE(q4_1_baseline) Q4_1_BODY
static SIGNATURE(q8_0_baseline) Q8_0_BODY
static SIGNATURE(f16_baseline) F16_BODY(DEQUANT_F16_BASELINE)

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2,fma"))) static SIGNATURE(q4_1_avx2) Q4_1_BODY
__attribute__((target("avx2,fma"))) static SIGNATURE(q8_0_avx2) Q8_0_BODY
__attribute__((target("avx2,fma,f16c"))) static SIGNATURE(f16_avx2) F16_BODY(DEQUANT_F16_AVX2)
__attribute__((target("avx512f,fma"))) static SIGNATURE(q4_1_avx512) Q4_1_BODY
__attribute__((target("avx512f,fma"))) static SIGNATURE(q8_0_avx512) Q8_0_BODY
__attribute__((target("avx512f,fma"))) static SIGNATURE(f16_avx512) F16_BODY(DEQUANT_F16_AVX512)
#endif

static block_fn chosen_q4_1 = q4_1_baseline, chosen_q8_0 = q8_0_baseline,
                chosen_f16 = f16_baseline;
static const char *chosen_name = "baseline";

/* Parse (x, q, s (0 where not `scaled`), b or 0, y, n, k, m) and run `fn` without the GIL. */
static PyObject *run_product(PyObject *args, block_fn fn, const char *name, int scaled) {
    unsigned long long px, pq, ps, pb, py;
    Py_ssize_t n, k, m;
    if (!PyArg_ParseTuple(args, "KKKKKnnn", &px, &pq, &ps, &pb, &py, &n, &k, &m)) return NULL;
    if (n < 0 || k < 0 || m < 0 || k % 32) {
        PyErr_Format(PyExc_ValueError, "%s: negative size or k not a multiple of 32", name);
        return NULL;
    }
    /* an empty tensor may have no storage: a null address is fine where nothing is read */
    if ((!px && n && k) || ((!pq || (scaled && !ps)) && m && k) || (!py && n && m)) {
        PyErr_Format(PyExc_ValueError, "%s: null buffer", name);
        return NULL;
    }
    const float *x = (const float *)(uintptr_t)px, *s = (const float *)(uintptr_t)ps;
    const float *b = (const float *)(uintptr_t)pb;
    const void *q = (const void *)(uintptr_t)pq;
    float *y = (float *)(uintptr_t)py;
    Py_BEGIN_ALLOW_THREADS fn(x, q, s, b, y, n, k, m);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *q4_1_dot(PyObject *self, PyObject *args) {
    return run_product(args, chosen_q4_1, "q4_1_dot", 1);
}

static PyObject *q8_0_dot(PyObject *self, PyObject *args) {
    return run_product(args, chosen_q8_0, "q8_0_dot", 1);
}

static PyObject *f16_dot(PyObject *self, PyObject *args) {
    return run_product(args, chosen_f16, "f16_dot", 0);
}

static PyObject *instruction_set(PyObject *self, PyObject *args) {
    return PyUnicode_FromString(chosen_name);
}

/* For tests: run the named body ("avx512", "avx2", "baseline") where this CPU has it, so one
 * machine checks every body it can run; returns whether it switched. */
static PyObject *select_body(PyObject *self, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    if (!strcmp(name, "baseline")) {
        chosen_q4_1 = q4_1_baseline, chosen_q8_0 = q8_0_baseline, chosen_f16 = f16_baseline;
        chosen_name = "baseline";
        Py_RETURN_TRUE;
    }
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (!strcmp(name, "avx512") && __builtin_cpu_supports("avx512f")) {
        chosen_q4_1 = q4_1_avx512, chosen_q8_0 = q8_0_avx512, chosen_f16 = f16_avx512;
        chosen_name = "avx512";
        Py_RETURN_TRUE;
    }
    if (!strcmp(name, "avx2") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
            && __builtin_cpu_supports("f16c")) {
        chosen_q4_1 = q4_1_avx2, chosen_q8_0 = q8_0_avx2, chosen_f16 = f16_avx2;
        chosen_name = "avx2";
        Py_RETURN_TRUE;
    }
#endif
    Py_RETURN_FALSE;
}

static PyMethodDef methods[] = {
    {"q4_1_dot", q4_1_dot, METH_VARARGS,
     "q4_1_dot(x_ptr, q_ptr, s_ptr, b_ptr_or_0, y_ptr, n, k, m): y[n, m] = x[n, k] @ W^T (+ b), "
     "W in Q4_1 blocks (q [m, k / 2] uint8, s [m, k / 32, 2] fp32)"},
    {"q8_0_dot", q8_0_dot, METH_VARARGS,
     "q8_0_dot(x_ptr, q_ptr, s_ptr, b_ptr_or_0, y_ptr, n, k, m): y[n, m] = x[n, k] @ W^T (+ b), "
     "W in Q8_0 blocks (q [m, k] int8, s [m, k / 32] fp32)"},
    {"f16_dot", f16_dot, METH_VARARGS,
     "f16_dot(x_ptr, w_ptr, 0, b_ptr_or_0, y_ptr, n, k, m): y[n, m] = x[n, k] @ W^T (+ b), "
     "W [m, k] fp16"},
    {"instruction_set", instruction_set, METH_NOARGS, "the body chosen for this CPU"},
    {"select_body", select_body, METH_VARARGS,
     "select_body(name): tests only; run that body where this CPU has it (True if switched)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blockdot", NULL, -1, methods};

PyMODINIT_FUNC PyInit__blockdot(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) {
        chosen_q4_1 = q4_1_avx512;
        chosen_q8_0 = q8_0_avx512;
        chosen_f16 = f16_avx512;
        chosen_name = "avx512";
    } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        chosen_q4_1 = q4_1_avx2;
        chosen_q8_0 = q8_0_avx2;
        if (__builtin_cpu_supports("f16c")) chosen_f16 = f16_avx2;
        chosen_name = "avx2";
    }
#endif
    return PyModule_Create(&module);
}
