"""Build hook for the optional native extensions: the block-hash chain
(speckv/hashing/_chainhash.c), the few-row fp32 product (speckv/models/common/_rowdot.c), a
decoder layer's element-wise steps (speckv/models/common/_pointwise.c) and the paged attention
of few-token queries (speckv/attention/_decode_attn.c).

Everything else is configured in pyproject.toml. Both are optional: when one cannot be built,
speckv installs without it and hashes with the numpy path (same hashes, slower) or computes
its few-row products and attention with torch's kernels.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "speckv.hashing._chainhash",
            sources=["speckv/hashing/_chainhash.c"],
            extra_compile_args=["-O2"],
            optional=True,
        ),
        Extension(
            "speckv.attention._decode_attn",
            sources=["speckv/attention/_decode_attn.c"],
            include_dirs=["speckv/csrc"],
            depends=["speckv/csrc/simd.h", "speckv/attention/_decode_attn_body.h"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "speckv.models.common._rowdot",
            sources=["speckv/models/common/_rowdot.c"],
            include_dirs=["speckv/csrc"],
            depends=["speckv/csrc/simd.h"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "speckv.models.common._pointwise",
            sources=["speckv/models/common/_pointwise.c"],
            include_dirs=["speckv/csrc"],
            depends=["speckv/csrc/simd.h"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ]
)
