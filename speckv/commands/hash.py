"""`speckv hash`: print a token list's block hashes, block 0 first, one hex digest per line.

A debugging tool for router authors: the seed comes from PYTHONHASHSEED exactly as the engine's
(unset: a random seed, and the output says so on stderr).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from speckv.hashing.extra_keys import HashInputs, LoRARef
from speckv.hashing.formats import format_for
from speckv.hashing.functions import HASH_ALGOS, get_hash_algo, make_none_hash
from speckv.hashing.request_hasher import hash_prompt


def parse_token_list(text: str) -> list[int]:
    tokens = []
    for piece in text.replace("\n", ",").replace(" ", ",").split(","):
        if not piece:
            continue
        try:
            tokens.append(int(piece))
        except ValueError:
            raise ValueError(f"token {piece!r} is not an integer") from None
        if tokens[-1] < 0:
            raise ValueError(f"token {tokens[-1]} is negative")
    return tokens


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-size", type=int, required=True)
    parser.add_argument("--algo", default="sha256", choices=sorted(HASH_ALGOS))
    parser.add_argument("--lookahead", type=int, default=0, help="L: 0 = legacy hashes")
    parser.add_argument("--cache-salt")
    parser.add_argument("--lora-name")
    parser.add_argument("--lora-path")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--tokens", help="comma-separated token ids")
    source.add_argument("--tokens-file", type=Path, help="token ids separated by , or spaces")


def run(args: argparse.Namespace) -> int:
    if args.block_size <= 0:
        raise ValueError(f"--block-size must be > 0, got {args.block_size}")
    if (args.lora_name is None) != (args.lora_path is None):
        raise ValueError("--lora-name and --lora-path go together")
    text = args.tokens if args.tokens is not None else args.tokens_file.read_text()
    tokens = parse_token_list(text)
    algo = get_hash_algo(args.algo)
    if "PYTHONHASHSEED" not in os.environ:
        print("speckv: PYTHONHASHSEED is unset: hashes use a random seed", file=sys.stderr)
    lora = LoRARef(args.lora_name, args.lora_path) if args.lora_name is not None else None
    inputs = HashInputs(lora=lora, cache_salt=args.cache_salt)
    for block_hash in hash_prompt(algo, make_none_hash(algo), args.block_size,
                                  format_for(args.lookahead), tokens, inputs):
        print(block_hash.hex())
    return 0
