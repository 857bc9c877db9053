"""The one hash-seed rule of every command that reproduces block hashes.

`speckv hash`, `speckv events publish-sample` and `speckv route` all take the seed the same
way: `--seed S` when given, else this process's `PYTHONHASHSEED` (the variable the engine
reads for `NONE_HASH`), else an error: an engine without a seed hashes with a random one,
which nobody can reproduce, so guessing one would only print hashes that match nothing.
"""

from __future__ import annotations

import argparse
import os

SEED_HELP = ("the engine's PYTHONHASHSEED string, which seeds NONE_HASH (default: this "
             "process's PYTHONHASHSEED)")


def add_seed_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", default=None, help=SEED_HELP)


def resolve_seed(flag: str | None) -> str:
    """`--seed` if given, else $PYTHONHASHSEED; ValueError when neither is set."""
    if flag is not None:
        return flag
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None:
        raise ValueError(
            "no hash seed: pass --seed or set PYTHONHASHSEED to the engine's value (an engine "
            "without one hashes with a random seed, which cannot be reproduced)"
        )
    return seed
