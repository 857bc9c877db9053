/* speckv.models.common._pointwise: the optional native element-wise steps of a decoder layer.
 *
 * Owns three functions over raw addresses of C-contiguous fp32 buffers (the caller,
 * native_pointwise.py, checks shapes, dtypes and contiguity):
 *
 *     silu_mul(gate, up, out, n)                      out = gate * sigmoid(gate) * up
 *     rms_norm(x, weight, out, rows, dim, eps)        out = weight * (x / sqrt(mean(x^2) + eps))
 *     rope(x, cos, sin, out, tokens, heads, dim)      out = x * cos + rotate_half(x) * sin
 *                                                     (cos, sin: [tokens, dim], one row per token)
 *
 * Eager torch runs each of these as 2-6 separate passes, each a call with its own dispatch and
 * a temporary; at decode the tensors are a few KB and the calls dominate, at prefill the passes
 * over 2-12 MB activations do. One pass each here, with the GIL released. Every output element
 * depends only on its own row (token), so a row's bits do not depend on the rest of its batch.
 * One body per instruction set (AVX-512, AVX2 + FMA, baseline), dispatched once on the CPU it
 * runs on.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
typedef int32_t vi4 __attribute__((vector_size(16)));

#define FN(name, isa) name##_##isa

/* The body for one instruction set: TARGET (the attribute that compiles for it), ISA (the
 * name suffix), VEC / VI / VL (its fp32 vector, the int32 twin, the lanes). */
#define DEFINE_BODY(TARGET, ISA, VEC, VI, VL)                                             \
    static TARGET void FN(silu_mul, ISA)(const float *g, const float *u, float *o, Py_ssize_t n) { \
        for (Py_ssize_t i = 0; i < n; i += VL) {                                           \
            const Py_ssize_t m = n - i < VL ? n - i : VL; /* VL but in the tail */        \
            VEC gv = {0}, uv = {0}, e, one = (VEC){0} + 1.0f;                              \
            if (m == VL) {                                                                 \
                memcpy(&gv, g + i, sizeof(VEC));                                           \
                memcpy(&uv, u + i, sizeof(VEC));                                           \
            } else {                                                                       \
                memcpy(&gv, g + i, sizeof(float) * m);                                     \
                memcpy(&uv, u + i, sizeof(float) * m);                                     \
            }                                                                              \
            VI neg = gv < 0.0f;                                                            \
            VEC minus_abs = (VEC)((VI)gv | ((VI){0} + INT32_MIN)); /* -|g|: sign bit set */  \
            VEXP_AS(VEC, VI, minus_abs, e);                                                \
            /* sigmoid(g) = 1 / (1 + e^-g) for g >= 0, e^g / (1 + e^g) below */           \
            VEC num = (VEC)(((VI)one & ~neg) | ((VI)e & neg));                             \
            VEC r = gv * (num / (one + e)) * uv;                                           \
            if (m == VL)                                                                   \
                memcpy(o + i, &r, sizeof(VEC));                                            \
            else                                                                           \
                memcpy(o + i, &r, sizeof(float) * m);                                      \
        }                                                                                  \
    }                                                                                      \
    static TARGET void FN(rms_norm, ISA)(const float *x, const float *w, float *o, Py_ssize_t rows, \
                                    Py_ssize_t dim, float eps) {                           \
        for (Py_ssize_t r = 0; r < rows; r++) {                                            \
            const float *xr = x + r * dim;                                                 \
            float *orow = o + r * dim;                                                     \
            VEC acc = {0};                                                                 \
            for (Py_ssize_t i = 0; i < dim; i += VL) {                                     \
                const Py_ssize_t m = dim - i < VL ? dim - i : VL;                         \
                VEC xv = {0};                                                              \
                if (m == VL)                                                               \
                    memcpy(&xv, xr + i, sizeof(VEC));                                      \
                else                                                                       \
                    memcpy(&xv, xr + i, sizeof(float) * m);                                \
                acc += xv * xv;                                                            \
            }                                                                              \
            float lanes[VL], ss = 0.0f;                                                    \
            memcpy(lanes, &acc, sizeof(lanes));                                            \
            for (int half = VL / 2; half > 0; half >>= 1)                                  \
                for (int t = 0; t < half; t++) lanes[t] += lanes[t + half];                \
            ss = lanes[0];                                                                 \
            const float inv = 1.0f / sqrtf(ss / (float)dim + eps);                         \
            for (Py_ssize_t i = 0; i < dim; i++) orow[i] = w[i] * (xr[i] * inv);           \
        }                                                                                  \
    }                                                                                      \
    static TARGET void FN(rope, ISA)(const float *x, const float *c, const float *s, float *o,   \
                                Py_ssize_t tokens, Py_ssize_t heads, Py_ssize_t dim) {     \
        const Py_ssize_t half = dim / 2;                                                   \
        for (Py_ssize_t t = 0; t < tokens; t++) {                                          \
            const float *ct = c + t * dim, *st = s + t * dim;                              \
            for (Py_ssize_t h = 0; h < heads; h++) {                                       \
                const float *xr = x + (t * heads + h) * dim;                               \
                float *orow = o + (t * heads + h) * dim;                                   \
                for (Py_ssize_t i = 0; i < half; i++)                                      \
                    orow[i] = xr[i] * ct[i] - xr[i + half] * st[i];                        \
                for (Py_ssize_t i = half; i < dim; i++)                                    \
                    orow[i] = xr[i] * ct[i] + xr[i - half] * st[i];                        \
            }                                                                              \
        }                                                                                  \
    }

DEFINE_BODY(, baseline, vf4, vi4, 4)
#if defined(__x86_64__) && defined(__GNUC__)
DEFINE_BODY(__attribute__((target("avx2,fma"))), avx2, vf8, vi8, 8)
DEFINE_BODY(__attribute__((target("avx512f,fma"))), avx512, v16, vi16, 16)
#endif

typedef struct {
    void (*silu_mul)(const float *, const float *, float *, Py_ssize_t);
    void (*rms_norm)(const float *, const float *, float *, Py_ssize_t, Py_ssize_t, float);
    void (*rope)(const float *, const float *, const float *, float *, Py_ssize_t, Py_ssize_t,
                 Py_ssize_t);
    const char *name;
} Bodies;

static Bodies chosen = {silu_mul_baseline, rms_norm_baseline, rope_baseline, "baseline"};

static PyObject *py_silu_mul(PyObject *self, PyObject *args) {
    unsigned long long g, u, o;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "KKKn", &g, &u, &o, &n)) return NULL;
    if (!g || !u || !o || n < 0) {
        PyErr_SetString(PyExc_ValueError, "silu_mul: null buffer or negative length");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS chosen.silu_mul((const float *)(uintptr_t)g,
                                           (const float *)(uintptr_t)u, (float *)(uintptr_t)o, n);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *py_rms_norm(PyObject *self, PyObject *args) {
    unsigned long long x, w, o;
    Py_ssize_t rows, dim;
    double eps;
    if (!PyArg_ParseTuple(args, "KKKnnd", &x, &w, &o, &rows, &dim, &eps)) return NULL;
    if (!x || !w || !o || rows < 0 || dim <= 0) {
        PyErr_SetString(PyExc_ValueError, "rms_norm: null buffer or bad shape");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS chosen.rms_norm((const float *)(uintptr_t)x,
                                           (const float *)(uintptr_t)w, (float *)(uintptr_t)o,
                                           rows, dim, (float)eps);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *py_rope(PyObject *self, PyObject *args) {
    unsigned long long x, c, s, o;
    Py_ssize_t tokens, heads, dim;
    if (!PyArg_ParseTuple(args, "KKKKnnn", &x, &c, &s, &o, &tokens, &heads, &dim)) return NULL;
    if (!x || !c || !s || !o || tokens < 0 || heads <= 0 || dim <= 0 || dim % 2) {
        PyErr_SetString(PyExc_ValueError, "rope: null buffer or bad shape");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS chosen.rope((const float *)(uintptr_t)x, (const float *)(uintptr_t)c,
                                       (const float *)(uintptr_t)s, (float *)(uintptr_t)o,
                                       tokens, heads, dim);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *instruction_set(PyObject *self, PyObject *args) {
    return PyUnicode_FromString(chosen.name);
}

static PyMethodDef methods[] = {
    {"silu_mul", py_silu_mul, METH_VARARGS, "silu_mul(gate, up, out, n)"},
    {"rms_norm", py_rms_norm, METH_VARARGS, "rms_norm(x, weight, out, rows, dim, eps)"},
    {"rope", py_rope, METH_VARARGS, "rope(x, cos, sin, out, tokens, heads, dim)"},
    {"instruction_set", instruction_set, METH_NOARGS, "the body chosen for this CPU"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pointwise", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pointwise(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) {
        chosen = (Bodies){silu_mul_avx512, rms_norm_avx512, rope_avx512, "avx512"};
    } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        chosen = (Bodies){silu_mul_avx2, rms_norm_avx2, rope_avx2, "avx2"};
    }
#endif
    return PyModule_Create(&module);
}
