/* speckv/attention/_decode_attn_body.h: the body of _decode_attn.c's kernel, included once per
 * instruction set. The includer defines ISA (a name suffix), TARGET (the function attribute
 * that compiles for it), VEC and VL (the set's native fp32 vector and its lanes: 16 for
 * AVX-512, 8 for AVX2, 4 otherwise) and ACC_VECTORS (how many VEC sums stay in registers).
 *
 * One request at a time; its rows are the (token i, head h) pairs, ordered by the KV head h
 * reads (rep = num_heads / num_kv_heads rows per KV head and token share a K or V slice):
 *
 *     scores   keys in tiles of VL:  P[t] = q[row] * K[j0 + t]   (lane-wise, VL vectors)
 *              s[row][j0 .. j0 + VL) = reduce(P) * scale          (one vector of VL sums)
 *              every row of a tile before the next tile, whose rows are prefetched
 *     softmax  per row over its visible keys [lo, hi); 0 for the other keys of [jlo, slen)
 *     values   rows in groups whose sums fit in registers:
 *              acc[row] += s[row][j] * V[j]  for j = jlo .. slen - 1, in order
 *
 * Each score sums its lanes pairwise in a fixed order and each output row sums its keys in
 * position order, whatever else is in the batch.
 */

#define FN_(name, isa) name##_##isa
#define FN_EXPAND(name, isa) FN_(name, isa)
#define FN(name) FN_EXPAND(name, ISA)
#define INLINE static inline __attribute__((always_inline)) TARGET

/* ask for a cache row's bytes ahead of their use: a request's blocks sit anywhere in the
 * cache, and the hardware prefetcher stops at each block's end */
INLINE void FN(prefetch)(const float *row, Py_ssize_t num_floats) {
    for (Py_ssize_t i = 0; i < num_floats; i += 16) __builtin_prefetch(row + i, 0, 3);
}

/* out[t] = the sum of p[t]'s VL lanes, for t < VL: lanes t and t + VL/2 first, then t and
 * t + VL/4, ... (two vectors' halves merged per step, so VL sums take VL - 1 adds) */
INLINE VEC FN(reduce)(const VEC *p) {
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#if VL == 16
    VEC z[8], w[4], u[2];
    for (int i = 0; i < 8; i++) /* p[2i]'s 8 sums in the low half, p[2i + 1]'s in the high */
        z[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17,
                                       18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15,
                                       24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++) /* four sums for each of p[4i .. 4i + 3] */
        w[i] = __builtin_shufflevector(z[2 * i], z[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16,
                                       17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(z[2 * i], z[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20,
                                       21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++) /* two sums for each of p[8i .. 8i + 7] */
        u[i] = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16,
                                       17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(w[2 * i], w[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18,
                                       19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(u[0], u[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24,
                                   26, 28, 30) +
           __builtin_shufflevector(u[0], u[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25,
                                   27, 29, 31);
#elif VL == 8
    VEC z[4], w[2];
    for (int i = 0; i < 4; i++)
        z[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(p[2 * i], p[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)
        w[i] = __builtin_shufflevector(z[2 * i], z[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
               __builtin_shufflevector(z[2 * i], z[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15);
#else
    VEC z[2];
    for (int i = 0; i < 2; i++)
        z[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 4, 5) +
               __builtin_shufflevector(p[2 * i], p[2 * i + 1], 2, 3, 6, 7);
    return __builtin_shufflevector(z[0], z[1], 0, 2, 4, 6) +
           __builtin_shufflevector(z[0], z[1], 1, 3, 5, 7);
#endif
#else /* no __builtin_shufflevector: the same sums, lane by lane */
    float sums[VL];
    for (int t = 0; t < VL; t++) {
        float l[VL];
        memcpy(l, &p[t], sizeof(l));
        for (int half = VL / 2; half > 0; half >>= 1)
            for (int i = 0; i < half; i++) l[i] += l[i + half];
        sums[t] = l[0];
    }
    VEC out;
    memcpy(&out, sums, sizeof(out));
    return out;
#endif
}

/* s[row * slen + j] = scale * q[row] . K[j] for j in [jlo, slen) and the rows `rows[0 ..
 * nrows)`, whose KV head starts `heads[b]` floats into a cache row; `nd` vectors per head (a
 * constant where inlined with one) */
INLINE void FN(scores)(const Args *a, const Py_ssize_t *offsets, const float *q0,
                       const Py_ssize_t *rows, const Py_ssize_t *heads, Py_ssize_t nrows,
                       Py_ssize_t jlo, Py_ssize_t slen, float *s, Py_ssize_t row_floats,
                       const Py_ssize_t nd) {
    const Py_ssize_t d = nd * VL;
    for (Py_ssize_t j0 = jlo; j0 < slen; j0 += VL) {
        const Py_ssize_t n = slen - j0 < VL ? slen - j0 : VL;
        for (Py_ssize_t t = j0 + VL; t < j0 + 2 * VL && t < slen; t++) { /* the next tile */
            FN(prefetch)(a->k + offsets[t], row_floats);
            FN(prefetch)(a->v + offsets[t], row_floats);
        }
        const float *kt[VL];
        for (Py_ssize_t t = 0; t < VL; t++) /* a short last tile repeats its last key */
            kt[t] = a->k + offsets[t < n ? j0 + t : slen - 1];
        for (Py_ssize_t b = 0; b < nrows; b++) {
            const float *qr = q0 + rows[b] * d;
            VEC qv[MAX_HEAD_DIM / VL], p[VL];
            for (Py_ssize_t c = 0; c < nd; c++) memcpy(&qv[c], qr + c * VL, sizeof(VEC));
            for (Py_ssize_t t = 0; t < VL; t++) {
                const float *kr = kt[t] + heads[b];
                VEC acc = {0};
                for (Py_ssize_t c = 0; c < nd; c++) {
                    VEC kv;
                    memcpy(&kv, kr + c * VL, sizeof(VEC));
                    acc += kv * qv[c];
                }
                p[t] = acc;
            }
            VEC tile = FN(reduce)(p) * a->scale;
            memcpy(s + rows[b] * slen + j0, &tile, sizeof(float) * n);
        }
    }
}

/* out[row] = inv_sum[row] * sum_j s[row][j] V[j] for `rows` (KV heads at `heads`), j in
 * [jlo, slen) in order, as many rows at a time as ACC_VECTORS sums in registers allow */
INLINE void FN(values)(const Args *a, const Py_ssize_t *offsets, const float *s,
                       const Py_ssize_t *rows, const Py_ssize_t *heads, Py_ssize_t nrows,
                       Py_ssize_t jlo, Py_ssize_t slen, const float *inv_sum, float *out0,
                       const Py_ssize_t nd) {
    const Py_ssize_t d = nd * VL;
    const Py_ssize_t group = ACC_VECTORS / nd > 0 ? ACC_VECTORS / nd : 1;
    for (Py_ssize_t b0 = 0; b0 < nrows; b0 += group) {
        const Py_ssize_t nb = nrows - b0 < group ? nrows - b0 : group;
        VEC acc[ACC_VECTORS > MAX_HEAD_DIM / VL ? ACC_VECTORS : MAX_HEAD_DIM / VL];
        for (Py_ssize_t i = 0; i < nb * nd; i++) acc[i] = (VEC){0};
        for (Py_ssize_t j = jlo; j < slen; j++) {
            const float *vj = a->v + offsets[j];
            for (Py_ssize_t b = 0; b < nb; b++) {
                const float p = s[rows[b0 + b] * slen + j];
                const float *vr = vj + heads[b0 + b];
                for (Py_ssize_t c = 0; c < nd; c++) {
                    VEC vv;
                    memcpy(&vv, vr + c * VL, sizeof(VEC));
                    acc[b * nd + c] += vv * p;
                }
            }
        }
        for (Py_ssize_t b = 0; b < nb; b++) {
            const Py_ssize_t row = rows[b0 + b];
            float *o = out0 + row * d;
            for (Py_ssize_t c = 0; c < nd; c++) {
                VEC r = acc[b * nd + c] * inv_sum[row];
                memcpy(o + c * VL, &r, sizeof(VEC));
            }
        }
    }
}

/* the softmax of each row's scores over its visible keys, in place; 0 elsewhere in
 * [jlo, slen) (so the values pass needs no mask); returns nothing, fills inv_sum */
INLINE void FN(softmax)(float *s, Py_ssize_t nrows, const Py_ssize_t *lo, const Py_ssize_t *hi,
                        Py_ssize_t jlo, Py_ssize_t slen, float *inv_sum) {
    for (Py_ssize_t row = 0; row < nrows; row++) {
        float *sr = s + row * slen;
        float mx = -INFINITY, sum = 0.0f;
        for (Py_ssize_t j = lo[row]; j < hi[row]; j++) mx = sr[j] > mx ? sr[j] : mx;
        Py_ssize_t j = lo[row];
        v16 vsum = {0};
        for (; j + 16 <= hi[row]; j += 16) {
            v16 x_, e_;
            LOAD16(x_, sr + j);
            VEXP(x_ - mx, e_);
            STORE16(sr + j, e_);
            vsum += e_;
        }
        if (j < hi[row]) { /* the tail, through a padded vector */
            float tail[16];
            Py_ssize_t n_ = hi[row] - j;
            for (Py_ssize_t t = 0; t < 16; t++) tail[t] = t < n_ ? sr[j + t] - mx : -100.0f;
            v16 x_, e_;
            LOAD16(x_, tail);
            VEXP(x_, e_);
            STORE16(tail, e_);
            for (Py_ssize_t t = 0; t < n_; t++) {
                sr[j + t] = tail[t];
                sum += tail[t];
            }
        }
        float vs;
        HSUM16(vsum, vs);
        inv_sum[row] = 1.0f / (vs + sum);
        for (Py_ssize_t jj = jlo; jj < lo[row]; jj++) sr[jj] = 0.0f;
        for (Py_ssize_t jj = hi[row]; jj < slen; jj++) sr[jj] = 0.0f;
    }
}

INLINE void FN(request)(const Args *a, Py_ssize_t r, Py_ssize_t *offsets, float *s,
                        const Py_ssize_t nd) {
    const Py_ssize_t d = nd * VL, nh = a->num_heads, nkv = a->num_kv_heads, rep = nh / nkv;
    const Py_ssize_t bs = a->block_size, qlen = a->query_lens[r], slen = a->seq_lens[r];
    const Py_ssize_t nrows = qlen * nh, row_stride = nkv * d;
    const int32_t *table = a->tables + r * a->table_width;
    Py_ssize_t lo[MAX_ROWS], hi[MAX_ROWS]; /* the row's visible keys: lo <= j < hi */
    for (Py_ssize_t i = 0; i < qlen; i++) {
        const Py_ssize_t pos = slen - qlen + i;
        for (Py_ssize_t h = 0; h < nh; h++) {
            hi[i * nh + h] = pos + 1;
            lo[i * nh + h] = a->window && pos + 1 > a->window ? pos + 1 - a->window : 0;
        }
    }
    const Py_ssize_t jlo = lo[0]; /* the first token sees the earliest key */
    for (Py_ssize_t j = jlo; j < slen; j++) /* where key j's row starts in the cache */
        offsets[j] = ((Py_ssize_t)table[j / bs] * bs + j % bs) * row_stride;
    const float *q0 = a->q + a->starts[r] * nh * d;
    float *out0 = a->out + a->starts[r] * nh * d;
    float inv_sum[MAX_ROWS];
    Py_ssize_t rows[MAX_ROWS], heads[MAX_ROWS]; /* rows by KV head: a K/V slice read once */
    Py_ssize_t n = 0;
    for (Py_ssize_t g = 0; g < nkv; g++)
        for (Py_ssize_t i = 0; i < qlen; i++)
            for (Py_ssize_t h = g * rep; h < (g + 1) * rep; h++) {
                rows[n] = i * nh + h;
                heads[n++] = g * d;
            }
    FN(scores)(a, offsets, q0, rows, heads, nrows, jlo, slen, s, row_stride, nd);
    FN(softmax)(s, nrows, lo, hi, jlo, slen, inv_sum);
    FN(values)(a, offsets, s, rows, heads, nrows, jlo, slen, inv_sum, out0, nd);
}

/* every request with new tokens; head_dim 64 and 128 compiled with their widths known, others
 * with it read at run time */
static TARGET void FN(attend_all)(const Args *a, float *s, Py_ssize_t *offsets) {
    const Py_ssize_t nd = a->head_dim / VL;
    for (Py_ssize_t r = 0; r < a->num_reqs; r++) {
        if (a->query_lens[r] == 0) continue;
        if (a->head_dim == 64)
            FN(request)(a, r, offsets, s, 64 / VL);
        else if (a->head_dim == 128)
            FN(request)(a, r, offsets, s, 128 / VL);
        else
            FN(request)(a, r, offsets, s, nd);
    }
}

#undef FN_
#undef FN_EXPAND
#undef FN
#undef INLINE
