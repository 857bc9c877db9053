/* speckv.attention._decode_attn: the optional native paged attention of few-token queries.
 *
 * Owns one function, `decode_attention(...)`, over raw addresses of C-contiguous buffers (the
 * caller, native_decode.py, checks shapes, dtypes and contiguity):
 *
 *     q        [num_tokens, num_heads, head_dim] fp32      out  same shape, written
 *     k, v     [num_blocks, block_size, num_kv_heads, head_dim] fp32 (the paged cache)
 *     tables   [num_reqs, table_width] int32 physical block ids
 *     starts, query_lens, seq_lens   [num_reqs] int64 (query_lens[r] == 0: skip request r)
 *
 * A decode or verification step attends 1-8 new tokens per request over its whole context.
 * Gathering the context's blocks into one padded tensor per layer and running a masked SDPA
 * copies every K/V row once more and pays a dozen calls; here each request's K and V blocks are
 * read in place, front to back, once for all its heads and new tokens:
 *
 *     for each request r:                           rows = (token i, head h)
 *         s[row][j] = scale * q[row] . K[j][h's kv head]   j < seq_len (pass over K)
 *         p[row][j] = exp(s - max) / sum, 0 where j is not visible to the row's token
 *         out[row]  = sum_j p[row][j] * V[j][h's kv head]  (pass over V)
 *
 * Token i of request r sits at position seq_len - query_len + i and sees keys j <= that
 * position (and, with a sliding window W, position - j < W), as the SDPA backend's masks.
 * A request's result depends only on its own query, context and block table: the same bits
 * whatever else is in the batch. The GIL is released while it runs. One body per instruction
 * set (AVX-512, AVX2 + FMA, baseline), dispatched once on the CPU it runs on.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

typedef int32_t vi16 __attribute__((vector_size(64)));
#define MAX_ROWS 128 /* query rows per request: query_len * num_heads */
#define MAX_HEAD_DIM 256

typedef struct {
    const float *q, *k, *v;
    const int32_t *tables;
    const int64_t *starts, *query_lens, *seq_lens;
    float *out;
    Py_ssize_t num_reqs, table_width, num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    Py_ssize_t window; /* 0: none */
} Args;

/* exp(x) for x <= 0, 16 lanes: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], degree-6
 * polynomial (relative error ~2e-7); below -87 (where expf underflows) 0 */
#define VEXP(x, out)                                                                 \
    do {                                                                             \
        v16 xc_ = (x);                                                               \
        vi16 under_ = xc_ < -87.0f;                                                  \
        xc_ = (v16)((vi16)xc_ & ~under_) + (v16)((vi16)((v16){0} - 87.0f) & under_); \
        v16 t_ = xc_ * 1.44269504088896341f + 0.5f;                                  \
        vi16 ni_ = __builtin_convertvector(t_, vi16); /* toward zero */              \
        v16 nf_ = __builtin_convertvector(ni_, v16);                                 \
        vi16 gt_ = nf_ > t_;                          /* floor for negatives */      \
        ni_ += gt_;                                                                  \
        nf_ = __builtin_convertvector(ni_, v16);                                     \
        v16 r_ = xc_ - nf_ * 0.693359375f + nf_ * 2.12194440e-4f;                    \
        v16 p_ = r_ * 1.9875691500e-4f + 1.3981999507e-3f;                            \
        p_ = p_ * r_ + 8.3334519073e-3f;                                             \
        p_ = p_ * r_ + 4.1665795894e-2f;                                             \
        p_ = p_ * r_ + 1.6666665459e-1f;                                             \
        p_ = p_ * r_ + 5.0000001201e-1f;                                             \
        p_ = p_ * (r_ * r_) + r_ + 1.0f;                                             \
        v16 scale2_ = (v16)((ni_ + 127) << 23);                                      \
        (out) = (v16)((vi16)(p_ * scale2_) & ~under_);                               \
    } while (0)


/* one request, all its heads: `s` holds num_rows x seq_len scores, `acc` num_rows x head_dim
 * sums; row = token i * num_heads + head h. Positions are visited in order, all heads of one
 * position together: the cache's rows of a block are read front to back. */
#define REQUEST_BODY                                                                 \
    {                                                                                \
        const Py_ssize_t d = a->head_dim, nv = d / 16, nh = a->num_heads;            \
        const Py_ssize_t rep = nh / a->num_kv_heads, bs = a->block_size;             \
        const Py_ssize_t qlen = a->query_lens[r], slen = a->seq_lens[r];             \
        const Py_ssize_t nrows = qlen * nh, row_stride = a->num_kv_heads * d;        \
        const int32_t *table = a->tables + r * a->table_width;                       \
        Py_ssize_t lo[MAX_ROWS], hi[MAX_ROWS]; /* visible keys: lo <= j < hi */      \
        for (Py_ssize_t i = 0; i < qlen; i++) {                                      \
            Py_ssize_t pos = slen - qlen + i;                                        \
            for (Py_ssize_t h = 0; h < nh; h++) {                                    \
                hi[i * nh + h] = pos + 1;                                            \
                lo[i * nh + h] = a->window && pos + 1 > a->window ? pos + 1 - a->window : 0; \
            }                                                                        \
        }                                                                            \
        const float *q0 = a->q + a->starts[r] * nh * d; /* row's query: q0 + row * d */ \
        const Py_ssize_t jlo = lo[0];                                                \
        for (Py_ssize_t j = jlo; j < slen; j++) {                                    \
            const float *kj = a->k + ((Py_ssize_t)table[j / bs] * bs + j % bs) * row_stride; \
            for (Py_ssize_t row = 0; row < nrows; row++) {                           \
                if (j < lo[row] || j >= hi[row]) continue;                           \
                const float *kr = kj + ((row % nh) / rep) * d, *qr = q0 + row * d;   \
                v16 acc_ = {0};                                                      \
                for (Py_ssize_t c = 0; c < nv; c++) {                                \
                    v16 kv_, qv_;                                                    \
                    LOAD16(kv_, kr + c * 16);                                        \
                    LOAD16(qv_, qr + c * 16);                                        \
                    acc_ += kv_ * qv_;                                               \
                }                                                                    \
                float sc;                                                            \
                HSUM16(acc_, sc);                                                    \
                s[row * slen + j] = sc * a->scale;                                   \
            }                                                                        \
        }                                                                            \
        float inv_sum[MAX_ROWS];                                                     \
        for (Py_ssize_t row = 0; row < nrows; row++) {                               \
            float *sr = s + row * slen;                                              \
            float mx = -INFINITY, sum = 0.0f;                                        \
            for (Py_ssize_t j = lo[row]; j < hi[row]; j++) mx = sr[j] > mx ? sr[j] : mx; \
            Py_ssize_t j = lo[row];                                                  \
            v16 vsum = {0};                                                          \
            for (; j + 16 <= hi[row]; j += 16) {                                     \
                v16 x_, e_;                                                          \
                LOAD16(x_, sr + j);                                                  \
                VEXP(x_ - mx, e_);                                                   \
                STORE16(sr + j, e_);                                                 \
                vsum += e_;                                                          \
            }                                                                        \
            if (j < hi[row]) { /* the tail, through a padded vector */               \
                float tail[16];                                                      \
                Py_ssize_t n_ = hi[row] - j;                                         \
                for (Py_ssize_t t = 0; t < 16; t++) tail[t] = t < n_ ? sr[j + t] - mx : -100.0f; \
                v16 x_, e_;                                                          \
                LOAD16(x_, tail);                                                    \
                VEXP(x_, e_);                                                        \
                STORE16(tail, e_);                                                   \
                for (Py_ssize_t t = 0; t < n_; t++) {                                \
                    sr[j + t] = tail[t];                                             \
                    sum += tail[t];                                                  \
                }                                                                    \
            }                                                                        \
            float vs;                                                                \
            HSUM16(vsum, vs);                                                        \
            inv_sum[row] = 1.0f / (vs + sum);                                        \
        }                                                                            \
        memset(acc, 0, sizeof(float) * nrows * d);                                   \
        for (Py_ssize_t j = jlo; j < slen; j++) {                                    \
            const float *vj = a->v + ((Py_ssize_t)table[j / bs] * bs + j % bs) * row_stride; \
            for (Py_ssize_t row = 0; row < nrows; row++) {                           \
                if (j < lo[row] || j >= hi[row]) continue;                           \
                const float *vr = vj + ((row % nh) / rep) * d;                       \
                float p = s[row * slen + j];                                         \
                float *ar = acc + row * d;                                           \
                for (Py_ssize_t c = 0; c < nv; c++) {                                \
                    v16 vv_, av_;                                                    \
                    LOAD16(vv_, vr + c * 16);                                        \
                    LOAD16(av_, ar + c * 16);                                        \
                    av_ += vv_ * p;                                                  \
                    STORE16(ar + c * 16, av_);                                       \
                }                                                                    \
            }                                                                        \
        }                                                                            \
        float *o = a->out + a->starts[r] * nh * d;                                   \
        for (Py_ssize_t row = 0; row < nrows; row++)                                 \
            for (Py_ssize_t c = 0; c < d; c++) o[row * d + c] = acc[row * d + c] * inv_sum[row]; \
    }

#define ALL_BODY                                                                     \
    {                                                                                \
        for (Py_ssize_t r = 0; r < a->num_reqs; r++) {                               \
            if (a->query_lens[r] == 0) continue;                                     \
            REQUEST_BODY                                                             \
        }                                                                            \
    }

typedef void (*attn_fn)(const Args *, float *, float *);

static void attn_baseline(const Args *a, float *s, float *acc) ALL_BODY

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2,fma"))) static void attn_avx2(const Args *a, float *s, float *acc) ALL_BODY

__attribute__((target("avx512f,fma"))) static void attn_avx512(const Args *a, float *s, float *acc) ALL_BODY
#endif

static attn_fn chosen = attn_baseline;
static const char *chosen_name = "baseline";

static PyObject *decode_attention(PyObject *self, PyObject *args) {
    unsigned long long pq, pk, pv, ptab, pst, pql, psl, pout;
    Args a;
    double scale;
    if (!PyArg_ParseTuple(args, "KKKKKKKKnnnnnndn", &pq, &pk, &pv, &ptab, &pst, &pql, &psl,
                          &pout, &a.num_reqs, &a.table_width, &a.num_heads, &a.num_kv_heads,
                          &a.head_dim, &a.block_size, &scale, &a.window))
        return NULL;
    if (a.num_reqs <= 0) Py_RETURN_NONE;
    if (!pq || !pk || !pv || !ptab || !pst || !pql || !psl || !pout || a.num_kv_heads <= 0 ||
        a.num_heads % a.num_kv_heads || a.head_dim <= 0 || a.head_dim % 16 ||
        a.head_dim > MAX_HEAD_DIM || a.block_size <= 0 || a.window < 0) {
        PyErr_SetString(PyExc_ValueError, "decode_attention: bad shapes or null buffer");
        return NULL;
    }
    a.q = (const float *)(uintptr_t)pq;
    a.k = (const float *)(uintptr_t)pk;
    a.v = (const float *)(uintptr_t)pv;
    a.tables = (const int32_t *)(uintptr_t)ptab;
    a.starts = (const int64_t *)(uintptr_t)pst;
    a.query_lens = (const int64_t *)(uintptr_t)pql;
    a.seq_lens = (const int64_t *)(uintptr_t)psl;
    a.out = (float *)(uintptr_t)pout;
    a.scale = (float)scale;
    Py_ssize_t max_scratch = 0;
    for (Py_ssize_t r = 0; r < a.num_reqs; r++) {
        Py_ssize_t qlen = a.query_lens[r], slen = a.seq_lens[r];
        if (qlen < 0 || qlen > slen || qlen * a.num_heads > MAX_ROWS ||
            (qlen && (slen + a.block_size - 1) / a.block_size > a.table_width)) {
            PyErr_SetString(PyExc_ValueError, "decode_attention: a request's lengths do not fit");
            return NULL;
        }
        if (qlen * a.num_heads * slen > max_scratch) max_scratch = qlen * a.num_heads * slen;
    }
    /* scores, then the rows' output sums (MAX_ROWS x MAX_HEAD_DIM) */
    float *s = malloc(sizeof(float) * (max_scratch + MAX_ROWS * MAX_HEAD_DIM));
    if (!s) return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS chosen(&a, s, s + max_scratch);
    Py_END_ALLOW_THREADS free(s);
    Py_RETURN_NONE;
}

static PyObject *instruction_set(PyObject *self, PyObject *args) {
    return PyUnicode_FromString(chosen_name);
}

static PyMethodDef methods[] = {
    {"decode_attention", decode_attention, METH_VARARGS,
     "decode_attention(q, k, v, tables, starts, query_lens, seq_lens, out, num_reqs, "
     "table_width, num_heads, num_kv_heads, head_dim, block_size, scale, window)"},
    {"instruction_set", instruction_set, METH_NOARGS, "the body chosen for this CPU"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_decode_attn", NULL, -1, methods};

PyMODINIT_FUNC PyInit__decode_attn(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) {
        chosen = attn_avx512;
        chosen_name = "avx512";
    } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        chosen = attn_avx2;
        chosen_name = "avx2";
    }
#endif
    return PyModule_Create(&module);
}
