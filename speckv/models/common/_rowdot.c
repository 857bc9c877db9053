/* speckv.models.common._rowdot: the optional native few-row fp32 products y = x W^T (+ b).
 *
 * Owns two functions over raw addresses of C-contiguous fp32 buffers (the callers, `Linear`
 * with native_linear.py and panel_linear.py, check shapes, dtype and contiguity):
 * `rowdot(x, w, b, y, n, k, m)` on W as it is, below, and `panel_dot(x, p, b, y, n, k, m)` on W
 * packed into panels, further down:
 *
 *     x [n, k]   w [m, k] (nn.Linear's weight, row-major)   b [m] or 0   y [n, m] (written)
 *
 * A decode or verification step multiplies 1-4 rows by every weight of the model once: the
 * cost is reading W from memory. torch's kernels read it at about 11 GB/s on one core here,
 * where one core streams a tensor at 17-21 (see native_linear.py). This kernel reads W as one
 * sequential stream, row after row, and dots each row with every row of x while it is in L1
 * (reading several rows of W side by side, as a blocked GEMM does, measured slower):
 *
 *     for each row w_j of W:                            W is read once, front to back
 *         for each chunk of up to 4 rows of x (x_0..x_3):
 *             a_i0 += w_j[c:c+16] * x_i[c:c+16]         c in steps of 32: two accumulators
 *             a_i1 += w_j[c+16:c+32] * x_i[c+16:c+32]   per row of x
 *             y[i][j] = hsum(a_i0 + a_i1) + tail (+ b[j])
 *
 * Each output's summation order depends only on k: one row of x gets the same bits whatever
 * the other rows of its batch are. The GIL is released while it runs. Built with one body
 * per instruction set (AVX-512, AVX2 + FMA, baseline) and dispatched once on the CPU it runs
 * on, so a build runs on any x86-64 CPU; elsewhere the baseline body.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

/* With 2+ rows of x, W is fetched this far ahead as non-temporal: measured on the built-in
 * model's shapes (75 projections, 1 thread), 4 rows 28.6 -> 24.1 ms, 2 rows 22.9 -> 19.2; with
 * one row the prefetch cost more than it saved (17.3 -> 18.4), so none there */
#define W_PREFETCH_FLOATS 1024


/* rows i0 .. i0 + NB - 1 of x against row j of W (pointer wj) */
#define CHUNK(NB)                                                                    \
    {                                                                                \
        v16 a[NB][2];                                                                \
        memset(a, 0, sizeof(a));                                                     \
        for (Py_ssize_t c = 0; c < kv; c += 32) {                                    \
            v16 p, q;                                                                \
            LOAD16(p, wj + c);                                                       \
            LOAD16(q, wj + c + 16);                                                  \
            if (NB > 1) /* W past L1: its lines must not evict the rows of x */      \
                __builtin_prefetch(wj + c + W_PREFETCH_FLOATS, 0, 0);                \
            for (int i = 0; i < NB; i++) {                                           \
                v16 x0, x1;                                                          \
                LOAD16(x0, xc + i * k + c);                                          \
                LOAD16(x1, xc + i * k + c + 16);                                     \
                a[i][0] += p * x0;                                                   \
                a[i][1] += q * x1;                                                   \
            }                                                                        \
        }                                                                            \
        for (int i = 0; i < NB; i++) {                                               \
            v16 sum = a[i][0] + a[i][1];                                             \
            float s;                                                                 \
            HSUM16(sum, s);                                                          \
            for (Py_ssize_t c = kv; c < k; c++) s += wj[c] * xc[i * k + c];          \
            if (b) s += b[j];                                                        \
            y[(i0 + i) * m + j] = s;                                                 \
        }                                                                            \
    }

#define ROWDOT_BODY                                                                  \
    {                                                                                \
        const Py_ssize_t kv = k - k % 32;                                            \
        for (Py_ssize_t j = 0; j < m; j++) {                                         \
            const float *wj = w + j * k;                                             \
            for (Py_ssize_t i0 = 0; i0 < n; i0 += 4) {                               \
                const float *xc = x + i0 * k;                                        \
                switch (n - i0 < 4 ? n - i0 : 4) {                                   \
                    case 1: CHUNK(1) break;                                          \
                    case 2: CHUNK(2) break;                                          \
                    case 3: CHUNK(3) break;                                          \
                    default: CHUNK(4) break;                                         \
                }                                                                    \
            }                                                                        \
        }                                                                            \
    }

/* ---- panels: W re-laid out k-major in tiles of 32 outputs ----------------------------------
 *
 *     P[t][c][0:32] = W[32 t : 32 t + 32, c]        (rows past m: zeros)
 *
 * y[i, 32 t : 32 t + 32] = sum_c x[i, c] * P[t][c]: per c, two vector loads of P serve every row
 * of x (each x[i, c] broadcast), so P is read once as one sequential stream and the rows of x
 * cost a broadcast each, not a vector load per row of W. Each output sums over c in order
 * (one FMA chain), whatever the other rows of its batch. */
#define PANEL_ROWS(NB)                                                               \
    {                                                                                \
        v16 a0[NB], a1[NB];                                                          \
        memset(a0, 0, sizeof(a0));                                                   \
        memset(a1, 0, sizeof(a1));                                                   \
        const float *pp = p + t * k * 32;                                            \
        for (Py_ssize_t c = 0; c < k; c++) {                                         \
            v16 w0, w1;                                                              \
            LOAD16(w0, pp);                                                          \
            LOAD16(w1, pp + 16);                                                     \
            pp += 32;                                                                \
            __builtin_prefetch(pp + 512, 0, 0);                                      \
            for (int i = 0; i < NB; i++) {                                           \
                float xs = x[(i0 + i) * k + c];                                      \
                a0[i] += w0 * xs;                                                    \
                a1[i] += w1 * xs;                                                    \
            }                                                                        \
        }                                                                            \
        for (int i = 0; i < NB; i++) {                                               \
            float out_[32];                                                          \
            STORE16(out_, a0[i]);                                                    \
            STORE16(out_ + 16, a1[i]);                                               \
            float *yr = y + (i0 + i) * m + t * 32;                                   \
            for (Py_ssize_t r = 0; r < width; r++) yr[r] = out_[r] + (b ? b[t * 32 + r] : 0.0f); \
        }                                                                            \
    }

#define PANEL_BODY                                                                   \
    {                                                                                \
        for (Py_ssize_t t = 0; t * 32 < m; t++) {                                    \
            const Py_ssize_t width = m - t * 32 < 32 ? m - t * 32 : 32;              \
            for (Py_ssize_t i0 = 0; i0 < n; i0 += 8) {                               \
                switch (n - i0 < 8 ? n - i0 : 8) {                                   \
                    case 1: PANEL_ROWS(1) break;                                     \
                    case 2: PANEL_ROWS(2) break;                                     \
                    case 3: PANEL_ROWS(3) break;                                     \
                    case 4: PANEL_ROWS(4) break;                                     \
                    case 5: PANEL_ROWS(5) break;                                     \
                    case 6: PANEL_ROWS(6) break;                                     \
                    case 7: PANEL_ROWS(7) break;                                     \
                    default: PANEL_ROWS(8) break;                                    \
                }                                                                    \
            }                                                                        \
        }                                                                            \
    }

typedef void (*rowdot_fn)(const float *, const float *, const float *, float *, Py_ssize_t,
                          Py_ssize_t, Py_ssize_t);

static void rowdot_baseline(const float *x, const float *w, const float *b, float *y,
                            Py_ssize_t n, Py_ssize_t k, Py_ssize_t m) ROWDOT_BODY

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2,fma"))) static void
rowdot_avx2(const float *x, const float *w, const float *b, float *y, Py_ssize_t n,
            Py_ssize_t k, Py_ssize_t m) ROWDOT_BODY

__attribute__((target("avx512f,fma"))) static void
rowdot_avx512(const float *x, const float *w, const float *b, float *y, Py_ssize_t n,
              Py_ssize_t k, Py_ssize_t m) ROWDOT_BODY
#endif

static void panel_baseline(const float *x, const float *p, const float *b, float *y,
                           Py_ssize_t n, Py_ssize_t k, Py_ssize_t m) PANEL_BODY

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2,fma"))) static void
panel_avx2(const float *x, const float *p, const float *b, float *y, Py_ssize_t n,
           Py_ssize_t k, Py_ssize_t m) PANEL_BODY

__attribute__((target("avx512f,fma"))) static void
panel_avx512(const float *x, const float *p, const float *b, float *y, Py_ssize_t n,
             Py_ssize_t k, Py_ssize_t m) PANEL_BODY
#endif

static rowdot_fn chosen = rowdot_baseline;
static rowdot_fn chosen_panel = panel_baseline;
static const char *chosen_name = "baseline";

/* Parse (x, w or panels, b or 0, y, n, k, m) and run `fn` without the GIL. */
static PyObject *run_product(PyObject *args, rowdot_fn fn, const char *name) {
    unsigned long long px, pw, pb, py;
    Py_ssize_t n, k, m;
    if (!PyArg_ParseTuple(args, "KKKKnnn", &px, &pw, &pb, &py, &n, &k, &m)) return NULL;
    /* an empty tensor may have no storage: a null address is fine where nothing is read */
    if (n < 0 || k < 0 || m < 0 || (!px && n && k) || (!pw && m && k) || (!py && n && m)) {
        PyErr_Format(PyExc_ValueError, "%s: negative size or null buffer", name);
        return NULL;
    }
    const float *x = (const float *)(uintptr_t)px, *w = (const float *)(uintptr_t)pw;
    const float *b = (const float *)(uintptr_t)pb;
    float *y = (float *)(uintptr_t)py;
    Py_BEGIN_ALLOW_THREADS fn(x, w, b, y, n, k, m);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *rowdot(PyObject *self, PyObject *args) {
    return run_product(args, chosen, "rowdot");
}

static PyObject *panel_dot(PyObject *self, PyObject *args) {
    return run_product(args, chosen_panel, "panel_dot");
}

static PyObject *instruction_set(PyObject *self, PyObject *args) {
    return PyUnicode_FromString(chosen_name);
}

static PyMethodDef methods[] = {
    {"rowdot", rowdot, METH_VARARGS,
     "rowdot(x_ptr, w_ptr, b_ptr_or_0, y_ptr, n, k, m): y[n, m] = x[n, k] @ w[m, k]^T (+ b)"},
    {"panel_dot", panel_dot, METH_VARARGS,
     "panel_dot(x_ptr, panels_ptr, b_ptr_or_0, y_ptr, n, k, m): y[n, m] = x[n, k] @ W^T (+ b), "
     "W given as panels [ceil(m / 32), k, 32]"},
    {"instruction_set", instruction_set, METH_NOARGS, "the body chosen for this CPU"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rowdot", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rowdot(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) {
        chosen = rowdot_avx512;
        chosen_panel = panel_avx512;
        chosen_name = "avx512";
    } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        chosen = rowdot_avx2;
        chosen_panel = panel_avx2;
        chosen_name = "avx2";
    }
#endif
    return PyModule_Create(&module);
}
