"""Build hook for the optional native block-hash chain (speckv/hashing/_chainhash.c).

Everything else is configured in pyproject.toml. The extension is optional: when it cannot be
built, speckv installs without it and hashes with the numpy path (same hashes, slower).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "speckv.hashing._chainhash",
            sources=["speckv/hashing/_chainhash.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
