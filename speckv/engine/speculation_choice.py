"""Which drafter runs for a command's speculation flags: the one rule `speckv generate` and
`speckv serve` (and through them the demo) share.

Owns the defaults (the built-in model's shipped head only where its recorded held-out figure
passes `speculation_default`; a random-init MTP head on the random `hybrid-gdn`, a random-init
Gemma 4 MTP assistant on `hybrid-swa`), the method a drafter directory implies, and the errors,
in flag words, for combinations that cannot run. Nothing is loaded.

The CLI word `none` (speculation off, said explicitly) becomes `method=None` here and only
here; a flag left out (`None` in) means "the default for this model".
"""

from __future__ import annotations

from dataclasses import dataclass

from speckv.engine.config import DRAFTER_METHODS, MAX_NUM_SPEC_TOKENS

NO_SPECULATION = "none"  # the --speculative-method word for "off"


@dataclass(frozen=True)
class SpeculationChoice:
    method: str | None  # "ngram" or one of DRAFTER_METHODS; None: no speculation
    speculative_model: str | None  # a drafter dir, "builtin", "random-mtp"; None: no drafter
    summary: str  # one line saying what runs and why


def choose_speculation(model: str, method: str | None, speculative_model: str | None,
                       num_spec_tokens: int) -> SpeculationChoice:
    """The choice for `--model`, `--speculative-method`, `--speculative-model` and
    `--num-spec-tokens`; ValueError in flag words before anything is loaded."""
    from speckv.drafters.builtin import (
        BUILTIN_DRAFTER_METHOD,
        measured_speedup,
        speculation_default,
    )

    if not 1 <= num_spec_tokens <= MAX_NUM_SPEC_TOKENS:
        raise ValueError(f"--num-spec-tokens must be between 1 and {MAX_NUM_SPEC_TOKENS}, got "
                         f"{num_spec_tokens}")
    builtin = model == "builtin"
    measured = measured_speedup() if builtin else None
    default = speculation_default(measured) if builtin else None
    if model == "hybrid-gdn" and speculative_model is None and method == "mtp":
        speculative_model = "random-mtp"  # a random-init MTP drafter on the random hybrid
    if model == "hybrid-swa" and speculative_model is None and method == "mtp":
        speculative_model = "random-assistant"  # a random-init Gemma 4 MTP assistant
    if speculative_model not in (None, "builtin", "random-mtp", "random-assistant"):
        from pathlib import Path

        if not Path(speculative_model).exists():
            raise ValueError(f"--speculative-model {speculative_model}: no such file or "
                             "directory (a drafter's directory or file, or builtin)")
    if method is None:
        if speculative_model in ("random-mtp", "random-assistant"):
            method = "mtp"
        elif speculative_model is not None and speculative_model != "builtin":
            from speckv.drafters.loaders import detect_format

            method = detect_format(speculative_model)[0]
        elif builtin and (speculative_model == "builtin" or (default is not None and default.on)):
            method = BUILTIN_DRAFTER_METHOD
        else:
            method = NO_SPECULATION
    if method in (NO_SPECULATION, "ngram"):
        if speculative_model is not None:
            raise ValueError(f"--speculative-model needs --speculative-method "
                             f"{'/'.join(DRAFTER_METHODS)}, got {method}")
        if method == "ngram":
            return SpeculationChoice("ngram", None, "speculation: n-gram prompt lookup, "
                                     f"{num_spec_tokens} drafts")
        summary = "speculation off"
        if default is not None:
            summary += f": {default.reason}; --speculative-method eagle3 turns it on"
        return SpeculationChoice(None, None, summary)
    if speculative_model is None or speculative_model == "builtin":
        if not builtin:
            raise ValueError(f"--speculative-method {method} needs --speculative-model DIR (a "
                             f"{method} drafter for {model})")
        if method != BUILTIN_DRAFTER_METHOD:
            raise ValueError(
                f"the built-in model has no built-in {method.upper()} drafter (it ships an "
                f"{BUILTIN_DRAFTER_METHOD.upper()} head): use --speculative-method "
                f"{BUILTIN_DRAFTER_METHOD}, or --speculative-model DIR with a {method} drafter")
        summary = (f"speculation: the built-in EAGLE3 head, up to {num_spec_tokens} drafts "
                   "(adaptive)")
        if measured is not None:
            summary += f"; {measured.describe(1)}"
        return SpeculationChoice(method, "builtin", summary)
    return SpeculationChoice(method, speculative_model, f"speculation: {method} drafter "
                             f"{speculative_model}, up to {num_spec_tokens} drafts")
