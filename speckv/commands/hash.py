"""`speckv hash`: print a token list's block hashes, block 0 first, one hex digest per line.

A debugging tool for router authors. The seed follows the rule of every hashing command
(`hash_seed.py`: `--seed`, else PYTHONHASHSEED, else an error). A block is printed once it is
full and its `L` lookahead tokens are known; with fewer tokens the command says how many a
block needs.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from speckv.commands.hash_seed import add_seed_argument, resolve_seed
from speckv.hashing.extra_keys import HashInputs, LoRARef
from speckv.hashing.formats import format_for
from speckv.hashing.functions import HASH_ALGOS, get_hash_algo, make_none_hash
from speckv.hashing.request_hasher import hash_prompt


def parse_token_list(text: str, source: str = "--tokens") -> list[int]:
    """Token ids separated by commas, spaces or newlines; `source` names where they came from
    in the errors (an empty item, a non-integer, a negative id)."""
    text = text.strip()
    if not text:
        return []
    tokens = []
    for position, piece in enumerate(re.split(r"\s*,\s*|\s+", text), 1):
        if not piece:
            raise ValueError(f"{source}: item {position} is empty (two commas in a row, or a "
                             "comma at an end); give one integer token id between commas")
        try:
            token = int(piece)
        except ValueError:
            raise ValueError(f"{source}: token {piece!r} is not an integer") from None
        if token < 0:
            raise ValueError(f"{source}: token {token} is negative; token ids are >= 0")
        tokens.append(token)
    return tokens


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-size", type=int, required=True, help="tokens per block")
    parser.add_argument("--algo", default="sha256", choices=sorted(HASH_ALGOS),
                        help="the engine's block-hash algorithm")
    parser.add_argument("--lookahead", type=int, default=0,
                        help="L successor tokens hashed into each block (0: legacy hashes)")
    add_seed_argument(parser)
    parser.add_argument("--cache-salt", help="the request's cache_salt")
    parser.add_argument("--lora-name", help="the request's LoRA adapter name")
    parser.add_argument("--lora-path", help="the request's LoRA adapter path")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--tokens", help="comma-separated token ids")
    source.add_argument("--tokens-file", type=Path, help="token ids separated by , or spaces")


def run(args: argparse.Namespace) -> int:
    if args.block_size <= 0:
        raise ValueError(f"--block-size must be > 0, got {args.block_size}")
    if args.lookahead < 0:
        raise ValueError(f"--lookahead must be >= 0, got {args.lookahead}")
    if (args.lora_name is None) != (args.lora_path is None):
        raise ValueError("--lora-name and --lora-path go together")
    if args.tokens is not None:
        tokens = parse_token_list(args.tokens)
    else:
        tokens = parse_token_list(args.tokens_file.read_text(), f"--tokens-file {args.tokens_file}")
    needed = args.block_size + args.lookahead
    if len(tokens) < needed:
        raise ValueError(
            f"no block is full: {len(tokens)} token(s) given, the first block needs {needed} "
            f"(--block-size {args.block_size}"
            + (f" + --lookahead {args.lookahead} successor tokens)" if args.lookahead else ")")
        )
    algo = get_hash_algo(args.algo)
    seed = resolve_seed(args.seed)
    lora = LoRARef(args.lora_name, args.lora_path) if args.lora_name is not None else None
    inputs = HashInputs(lora=lora, cache_salt=args.cache_salt)
    for block_hash in hash_prompt(algo, make_none_hash(algo, seed), args.block_size,
                                  format_for(args.lookahead), tokens, inputs):
        print(block_hash.hex())
    return 0
