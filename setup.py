"""Build hook for the optional native extensions: the block-hash chain
(speckv/hashing/_chainhash.c), the few-row fp32 products (speckv/models/common/_rowdot.c, and
over weights as a checkpoint holds them, GGUF blocks or fp16: speckv/models/common/_blockdot.c),
a decoder layer's element-wise steps (speckv/models/common/_pointwise.c) and the paged attention
of few-token queries (speckv/attention/_decode_attn.c).

Everything else is configured in pyproject.toml. All are optional: when one cannot be built,
speckv installs without it and hashes with the numpy path (same hashes, slower) or computes
its few-row products and attention with torch's kernels.
"""

from setuptools import Extension, setup

SIMD_HEADER = "speckv/csrc/simd.h"


def simd_kernel(name: str, source: str, *depends: str) -> Extension:
    """One of the vector kernels sharing speckv/csrc/simd.h (optional, -O3)."""
    return Extension(name, sources=[source], include_dirs=["speckv/csrc"],
                     depends=[SIMD_HEADER, *depends], extra_compile_args=["-O3"],
                     optional=True)


setup(
    ext_modules=[
        Extension(
            "speckv.hashing._chainhash",
            sources=["speckv/hashing/_chainhash.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        simd_kernel("speckv.attention._decode_attn", "speckv/attention/_decode_attn.c",
                    "speckv/attention/_decode_attn_body.h"),
        simd_kernel("speckv.models.common._rowdot", "speckv/models/common/_rowdot.c"),
        simd_kernel("speckv.models.common._pointwise", "speckv/models/common/_pointwise.c"),
        simd_kernel("speckv.models.common._blockdot", "speckv/models/common/_blockdot.c"),
    ]
)
