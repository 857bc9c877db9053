"""The router's copy of an engine's tokenizer, loaded without the weights.

Owns finding the tokenizer of a `speckv serve` MODEL argument (the built-in model and the
random-init demo models: the built-in tokenizer; an HF directory: its tokenizer.json; a .gguf
file: its embedded vocabulary) and checking it against the engine's contract digest, so the
router's token ids are the engine's (prompts then go through the server's own parsing,
`speckv.api.protocol`, chat template included).
"""

from __future__ import annotations

import json
from pathlib import Path

from speckv.api.contract import tokenizer_digest
from speckv.models.common.tokenizer import Tokenizer

BUILTIN_TOKENIZER_MODELS = ("builtin", "hybrid-swa", "hybrid-gdn")
# the contract `tokenizer` of an engine that publishes no digest (a vLLM engine), + its model
UNPUBLISHED = "unpublished:"


def _config_eos_ids(directory: Path) -> tuple[int, ...]:
    config = directory / "config.json"
    if not config.is_file():
        return ()
    eos = json.loads(config.read_text()).get("eos_token_id")
    if isinstance(eos, int):
        return (eos,)
    return tuple(e for e in eos or () if isinstance(e, int))


def load_tokenizer(model: str) -> Tokenizer | None:
    """The tokenizer `speckv serve MODEL` uses; FileNotFoundError when MODEL is not here."""
    if model in BUILTIN_TOKENIZER_MODELS:
        from speckv.models.llama.builtin import builtin_tokenizer

        return builtin_tokenizer(progress=False)
    path = Path(model)
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            return None
        return Tokenizer.from_dir(path, _config_eos_ids(path))
    if path.is_file() and path.suffix == ".gguf":
        from speckv.models.llama.gguf_file import GGUFFile

        gguf = GGUFFile(path)
        if "tokenizer.ggml.tokens" not in gguf.fields:
            return None
        return Tokenizer.from_gguf_data(gguf.tokenizer_data())
    raise FileNotFoundError(f"no model {model!r} on this machine to read its tokenizer from")


class TokenizerCache:
    """One tokenizer per contract digest, loaded once (`--tokenizer` overrides the source)."""

    def __init__(self, override: str | None = None) -> None:
        self.override = override
        self._by_digest: dict[str | None, Tokenizer | None] = {None: None}

    def get(self, engine: str, model: str, digest: str | None) -> Tokenizer | None:
        """The tokenizer whose digest is `digest`; ValueError naming the contract's
        `tokenizer` field when the one found here differs."""
        if digest in self._by_digest:
            return self._by_digest[digest]
        source = self.override or model
        try:
            tokenizer = load_tokenizer(source)
        except FileNotFoundError as error:
            raise ValueError(f"engine {engine!r}: cache contract field 'tokenizer': {error}; "
                             "pass --tokenizer MODEL (the engine's model dir or file)") from None
        found = tokenizer_digest(tokenizer)
        if digest is not None and digest.startswith(UNPUBLISHED):
            pass  # the engine publishes no digest (vLLM): its model's tokenizer is trusted
        elif found != digest:
            raise ValueError(f"engine {engine!r}: cache contract field 'tokenizer': the "
                             f"tokenizer of {source!r} here (digest {str(found)[:12]}) is not "
                             f"the engine's ({digest[:12]}); pass --tokenizer MODEL with the "
                             "engine's own model")
        self._by_digest[digest] = tokenizer
        return tokenizer
