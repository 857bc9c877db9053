/* speckv/csrc/simd.h: the 16-lane fp32 vector type and helpers the native kernels share
 * (speckv/models/common/_rowdot.c, speckv/attention/_decode_attn.c). GCC / clang vector
 * extensions: each kernel compiles them once per instruction set it is built for. */
#ifndef SPECKV_SIMD_H
#define SPECKV_SIMD_H

#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));

/* unaligned 16-float load / store */
#define LOAD16(dst, src) memcpy(&(dst), (src), sizeof(v16))
#define STORE16(dst, src) memcpy((dst), &(src), sizeof(v16))

/* the 16 lanes summed pairwise in a fixed order: lane t + lane t + 8, then t + t + 4, ...
 * (the vector halving and the scalar loop give the same bits) */
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
#define HSUM16(v, out)                                                               \
    do {                                                                             \
        v8 h8_ = __builtin_shufflevector((v), (v), 0, 1, 2, 3, 4, 5, 6, 7) +         \
                 __builtin_shufflevector((v), (v), 8, 9, 10, 11, 12, 13, 14, 15);    \
        v4 h4_ = __builtin_shufflevector(h8_, h8_, 0, 1, 2, 3) +                     \
                 __builtin_shufflevector(h8_, h8_, 4, 5, 6, 7);                      \
        (out) = (h4_[0] + h4_[2]) + (h4_[1] + h4_[3]);                               \
    } while (0)
#else
#define HSUM16(v, out)                                                               \
    do {                                                                             \
        float l_[16];                                                                \
        memcpy(l_, &(v), sizeof(l_));                                                \
        for (int s_ = 8; s_ > 0; s_ >>= 1)                                           \
            for (int t_ = 0; t_ < s_; t_++) l_[t_] += l_[t_ + s_];                   \
        (out) = l_[0];                                                               \
    } while (0)
#endif

/* exp(x) for x <= 0 on a float vector type VT with its int32 twin IT: 2^n * p(r),
 * r = x - n ln2 in [-ln2/2, ln2/2], degree-6 polynomial (relative error ~2e-7); below -87
 * (where expf underflows) 0 */
#define VEXP_AS(VT, IT, x, out)                                                      \
    do {                                                                             \
        VT xc_ = (x);                                                                \
        IT under_ = xc_ < -87.0f;                                                    \
        xc_ = (VT)((IT)xc_ & ~under_) + (VT)((IT)((VT){0} - 87.0f) & under_);        \
        VT t_ = xc_ * 1.44269504088896341f + 0.5f;                                   \
        IT ni_ = __builtin_convertvector(t_, IT); /* toward zero */                  \
        VT nf_ = __builtin_convertvector(ni_, VT);                                   \
        IT gt_ = nf_ > t_;                        /* floor for negatives */          \
        ni_ += gt_;                                                                  \
        nf_ = __builtin_convertvector(ni_, VT);                                      \
        VT r_ = xc_ - nf_ * 0.693359375f + nf_ * 2.12194440e-4f;                     \
        VT p_ = r_ * 1.9875691500e-4f + 1.3981999507e-3f;                            \
        p_ = p_ * r_ + 8.3334519073e-3f;                                             \
        p_ = p_ * r_ + 4.1665795894e-2f;                                             \
        p_ = p_ * r_ + 1.6666665459e-1f;                                             \
        p_ = p_ * r_ + 5.0000001201e-1f;                                             \
        p_ = p_ * (r_ * r_) + r_ + 1.0f;                                             \
        VT scale2_ = (VT)((ni_ + 127) << 23);                                        \
        (out) = (VT)((IT)(p_ * scale2_) & ~under_);                                  \
    } while (0)

#endif
