"""Tokenizer: a small wrapper over a `tokenizers.Tokenizer` plus chat-template rendering.

Owns text <-> token ids for the engine: built offline from GGUF metadata (byte-level BPE, the
"gpt2" tokenizer model) or loaded from an HF directory's tokenizer.json; chat templates are
rendered with a sandboxed jinja2 environment as transformers does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from speckv.models.common.model_files import read_json_file, reading
from speckv.models.llama.gguf_file import GGUFTokenizerData

# llama.cpp pre-tokenizer names -> split regex (GPT-2's own regex is ByteLevel's default).
_LLAMA3_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
_CONFIG_FILE = "speckv_tokenizer.json"


_SPLIT_RE: dict[str, str] = {
    "llama-bpe": _LLAMA3_RE,
    "llama3": _LLAMA3_RE,
    "smaug-bpe": _LLAMA3_RE,
    "qwen2": _QWEN2_RE,
}


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    split_re = _SPLIT_RE.get(pre) if pre is not None else None
    if split_re is not None:
        split = pre_tokenizers.Split(Regex(split_re), behavior="isolated", invert=False)
        return pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    if pre == "smollm":  # digits split one by one, then GPT-2's regex
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


class Tokenizer:
    """encode / decode / apply_chat_template over a `tokenizers.Tokenizer`."""

    def __init__(
        self,
        backend: HFTokenizer,
        eos_token_ids: Sequence[int],
        bos_token_id: int | None = None,
        add_bos_token: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template

    # ---- construction -----------------------------------------------------------------------

    @classmethod
    def from_gguf_data(cls, data: GGUFTokenizerData) -> Tokenizer:
        if data.model != "gpt2":
            raise ValueError(
                f"tokenizer.ggml.model {data.model!r} is not supported (only 'gpt2' byte-level BPE)"
            )
        vocab = {tok: i for i, tok in enumerate(data.tokens)}
        merges = [tuple(m.split(" ", 1)) for m in data.merges]
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        backend.pre_tokenizer = _byte_level_pre_tokenizer(data.pre)
        backend.decoder = decoders.ByteLevel()
        types = data.token_types or [1] * len(data.tokens)
        special = [
            AddedToken(tok, special=True, normalized=False)
            for tok, t in zip(data.tokens, types)
            if t == _TOKEN_TYPE_CONTROL
        ]
        user = [
            AddedToken(tok, special=False, normalized=False)
            for tok, t in zip(data.tokens, types)
            if t == _TOKEN_TYPE_USER_DEFINED
        ]
        backend.add_special_tokens(special)
        if user:
            backend.add_tokens(user)
        eos = () if data.eos_token_id is None else (int(data.eos_token_id),)
        return cls(backend, eos, data.bos_token_id, data.add_bos_token, data.chat_template)

    @classmethod
    def from_dir(cls, path: str | Path, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """Load tokenizer.json + our sidecar (or HF tokenizer_config.json, chat_template.jinja)."""
        d = Path(path)
        tj = d / "tokenizer.json"
        if not tj.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {d}")
        with reading(tj, "tokenizer.json"):
            backend = HFTokenizer.from_file(str(tj))
        ours = d / _CONFIG_FILE
        if ours.is_file():
            meta = read_json_file(ours)
            return cls(
                backend,
                meta["eos_token_ids"],
                meta.get("bos_token_id"),
                bool(meta.get("add_bos_token", False)),
                meta.get("chat_template"),
            )
        cfg: dict[str, Any] = {}
        if (d / "tokenizer_config.json").is_file():
            cfg = read_json_file(d / "tokenizer_config.json")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()

        def token_id(entry: Any) -> int | None:
            text = entry.get("content") if isinstance(entry, Mapping) else entry
            return backend.token_to_id(text) if isinstance(text, str) else None

        eos = list(eos_token_ids)
        eos_from_cfg = token_id(cfg.get("eos_token"))
        if eos_from_cfg is not None and eos_from_cfg not in eos:
            eos.append(eos_from_cfg)
        return cls(
            backend,
            eos,
            token_id(cfg.get("bos_token")),
            bool(cfg.get("add_bos_token", False)),
            template,
        )

    def save(self, path: str | Path) -> None:
        """Write tokenizer.json and our sidecar (eos/bos ids, chat template) into `path`."""
        d = Path(path)
        d.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(d / "tokenizer.json"))
        meta = {
            "eos_token_ids": list(self.eos_token_ids),
            "bos_token_id": self.bos_token_id,
            "add_bos_token": self.add_bos_token,
            "chat_template": self.chat_template,
        }
        (d / _CONFIG_FILE).write_text(json.dumps(meta, indent=1))

    # ---- use ----------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """Render the model's jinja chat template (as transformers does) to a prompt string."""
        if not self.chat_template:
            raise ValueError("chat_template: this tokenizer has no chat template")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, indent=None: json.dumps(
            x, ensure_ascii=False, indent=indent
        )
        bos = self.token_text(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.token_text(self.eos_token_ids[0]) if self.eos_token_ids else ""
        return env.from_string(self.chat_template).render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=bos or "",
            eos_token=eos or "",
            **extra,
        )
