/* speckv.models.common._blockdot: few-row fp32 products y = x W^T (+ b) read from W as a
 * GGUF checkpoint stores it, in blocks of 32 weights with fp32 scales.
 *
 * Owns two functions over raw addresses of C-contiguous buffers (the caller,
 * block_linear.py, checks shapes, dtypes and contiguity):
 *
 *     q4_1_dot(x, q, s, b, y, n, k, m)    W[j, 32 t + i] = s[j, t, 0] * q_i + s[j, t, 1]
 *         q [m, k / 2] uint8: per block of 32, weight i < 16 in the low nibble of byte i,
 *                             weight 16 + i in its high nibble
 *         s [m, k / 32, 2] fp32: (d, min) of each block
 *     q8_0_dot(x, q, s, b, y, n, k, m)    W[j, 32 t + i] = s[j, t] * q_i
 *         q [m, k] int8, s [m, k / 32] fp32
 *     x [n, k] fp32   b [m] fp32 or 0   y [n, m] fp32 (written)   k a multiple of 32
 *
 * Why: a decode step reads every weight of the model once, and the fp32 copy of a Q4_1 model
 * is 6.4x the bytes of its blocks. The scales are the checkpoint's fp16 d and min widened to
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

typedef void (*block_fn)(const float *, const void *, const float *, const float *, float *,
                         Py_ssize_t, Py_ssize_t, Py_ssize_t);

#define SIGNATURE(name)                                                              \
    void name(const float *x, const void *q, const float *s, const float *b, float *y, \
              Py_ssize_t n, Py_ssize_t k, Py_ssize_t m)

static SIGNATURE(q4_1_baseline) Q4_1_BODY
static SIGNATURE(q8_0_baseline) Q8_0_BODY

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2,fma"))) static SIGNATURE(q4_1_avx2) Q4_1_BODY
__attribute__((target("avx2,fma"))) static SIGNATURE(q8_0_avx2) Q8_0_BODY
__attribute__((target("avx512f,fma"))) static SIGNATURE(q4_1_avx512) Q4_1_BODY
__attribute__((target("avx512f,fma"))) static SIGNATURE(q8_0_avx512) Q8_0_BODY
#endif

static block_fn chosen_q4_1 = q4_1_baseline, chosen_q8_0 = q8_0_baseline;
static const char *chosen_name = "baseline";

/* Parse (x, q, s, b or 0, y, n, k, m) and run `fn` without the GIL. */
static PyObject *run_product(PyObject *args, block_fn fn, const char *name) {
    unsigned long long px, pq, ps, pb, py;
    Py_ssize_t n, k, m;
    if (!PyArg_ParseTuple(args, "KKKKKnnn", &px, &pq, &ps, &pb, &py, &n, &k, &m)) return NULL;
    if (n < 0 || k < 0 || m < 0 || k % 32) {
        PyErr_Format(PyExc_ValueError, "%s: negative size or k not a multiple of 32", name);
        return NULL;
    }
    /* an empty tensor may have no storage: a null address is fine where nothing is read */
    if ((!px && n && k) || ((!pq || !ps) && m && k) || (!py && n && m)) {
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
    return run_product(args, chosen_q4_1, "q4_1_dot");
}

static PyObject *q8_0_dot(PyObject *self, PyObject *args) {
    return run_product(args, chosen_q8_0, "q8_0_dot");
}

static PyObject *instruction_set(PyObject *self, PyObject *args) {
    return PyUnicode_FromString(chosen_name);
}

static PyMethodDef methods[] = {
    {"q4_1_dot", q4_1_dot, METH_VARARGS,
     "q4_1_dot(x_ptr, q_ptr, s_ptr, b_ptr_or_0, y_ptr, n, k, m): y[n, m] = x[n, k] @ W^T (+ b), "
     "W in Q4_1 blocks (q [m, k / 2] uint8, s [m, k / 32, 2] fp32)"},
    {"q8_0_dot", q8_0_dot, METH_VARARGS,
     "q8_0_dot(x_ptr, q_ptr, s_ptr, b_ptr_or_0, y_ptr, n, k, m): y[n, m] = x[n, k] @ W^T (+ b), "
     "W in Q8_0 blocks (q [m, k] int8, s [m, k / 32] fp32)"},
    {"instruction_set", instruction_set, METH_NOARGS, "the body chosen for this CPU"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blockdot", NULL, -1, methods};

PyMODINIT_FUNC PyInit__blockdot(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) {
        chosen_q4_1 = q4_1_avx512;
        chosen_q8_0 = q8_0_avx512;
        chosen_name = "avx512";
    } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        chosen_q4_1 = q4_1_avx2;
        chosen_q8_0 = q8_0_avx2;
        chosen_name = "avx2";
    }
#endif
    return PyModule_Create(&module);
}
