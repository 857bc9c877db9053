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
 * read in place, front to back: scores for all its rows (token i, head h) in tiles of 16 keys,
 * a softmax per row, then the values (see _decode_attn_body.h for the loops). The next tile's
 * rows are prefetched: a request's blocks lie anywhere in the cache, and the hardware
 * prefetcher stops at each block's end.
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

/* exp(x) for x <= 0 on 16 lanes (simd.h) */
#define VEXP(x, out) VEXP_AS(v16, vi16, x, out)

/* the body, once per instruction set (see _decode_attn_body.h), each with its native vector */
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));

#define TARGET
#define ISA baseline
#define VEC vf4
#define VL 4
#define ACC_VECTORS 8
#include "_decode_attn_body.h"
#undef TARGET
#undef ISA
#undef VEC
#undef VL
#undef ACC_VECTORS

#if defined(__x86_64__) && defined(__GNUC__)
#define TARGET __attribute__((target("avx2,fma")))
#define ISA avx2
#define VEC vf8
#define VL 8
#define ACC_VECTORS 12 /* of AVX2's 16 registers: the rest hold a V row and a weight */
#include "_decode_attn_body.h"
#undef TARGET
#undef ISA
#undef VEC
#undef VL
#undef ACC_VECTORS

#define TARGET __attribute__((target("avx512f,fma")))
#define ISA avx512
#define VEC v16
#define VL 16
#define ACC_VECTORS 24 /* of AVX-512's 32 registers: the rest hold a V row and a weight */
#include "_decode_attn_body.h"
#undef TARGET
#undef ISA
#undef VEC
#undef VL
#undef ACC_VECTORS
#endif

typedef void (*attn_fn)(const Args *, float *, Py_ssize_t *);

static attn_fn chosen = attend_all_baseline;
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
    Py_ssize_t max_scores = 0, max_seq_len = 0;
    for (Py_ssize_t r = 0; r < a.num_reqs; r++) {
        Py_ssize_t qlen = a.query_lens[r], slen = a.seq_lens[r];
        if (qlen < 0 || qlen > slen || qlen * a.num_heads > MAX_ROWS ||
            (qlen && (slen + a.block_size - 1) / a.block_size > a.table_width)) {
            PyErr_SetString(PyExc_ValueError, "decode_attention: a request's lengths do not fit");
            return NULL;
        }
        if (qlen * a.num_heads * slen > max_scores) max_scores = qlen * a.num_heads * slen;
        if (slen > max_seq_len) max_seq_len = slen;
    }
    /* scores (rows x keys), then each key's row offset in the cache */
    float *s = malloc(sizeof(float) * max_scores + sizeof(Py_ssize_t) * max_seq_len + 64);
    if (!s) return PyErr_NoMemory();
    Py_ssize_t *offsets = (Py_ssize_t *)(s + max_scores + (16 - max_scores % 16));
    Py_BEGIN_ALLOW_THREADS chosen(&a, s, offsets);
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
        chosen = attend_all_avx512;
        chosen_name = "avx512";
    } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        chosen = attend_all_avx2;
        chosen_name = "avx2";
    }
#endif
    return PyModule_Create(&module);
}
