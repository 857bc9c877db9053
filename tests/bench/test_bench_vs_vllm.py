"""`speckv bench vs-vllm`: its numbers without vLLM, and one tiny real run where vLLM is installed.

The aggregation, table, JSON and PNG are checked on hand-made points; the command's flag
checks, skip message and both servers' command lines without starting anything. The `vllm`
test starts vLLM's CPU engine from $SPECKV_VLLM_VENV and `speckv serve` on the built-in model
and drives both with one tiny workload.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from speckv.bench import vs_vllm
from speckv.bench.vs_vllm_report import (
    TABLE_COLUMNS,
    RunPoint,
    aggregate,
    payload,
    speculation_speedups,
    table_rows,
    write_png,
)


def _point(method: str, workload: str, server: str, round_index: int, tok_s: float,
           ttft: float = 100.0, failed: int = 0) -> RunPoint:
    return RunPoint(method, workload, server, round_index, tok_s, ttft, 2 * ttft, 50.0, 60.0,
                    0.5 if server == "speckv" else 0.25, None, failed)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    vs_vllm.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_ratios_pair_rounds_and_report_median_and_range() -> None:
    points = [_point("none", "batch1", server, round_index, tok_s)
              for round_index, pair in enumerate([(10.0, 20.0), (30.0, 20.0), (20.0, 20.0)])
              for server, tok_s in zip(("speckv", "vllm"), pair)]
    (row,) = aggregate(points)
    ratio = row.throughput_ratio
    assert ratio is not None
    # per-round ratios 0.5, 1.5, 1.0 (not the ratio of medians 20 / 20)
    assert (ratio.median, ratio.low, ratio.high, ratio.count) == (1.0, 0.5, 1.5, 3)
    assert ratio.text() == "1.00x (0.50-1.50)"
    assert row.median["speckv"]["output_tok_s"] == 20.0
    assert row.median["vllm"]["hit_rate"] == 0.25


def test_a_round_with_failures_or_one_server_is_not_paired() -> None:
    points = [_point("none", "random", "speckv", 0, 10.0, failed=1),
              _point("none", "random", "vllm", 0, 20.0),
              _point("none", "random", "speckv", 1, 40.0),
              _point("none", "random", "vllm", 1, 20.0),
              _point("none", "random", "speckv", 2, 40.0)]
    (row,) = aggregate(points)
    assert row.throughput_ratio is not None and row.throughput_ratio.count == 1
    assert row.throughput_ratio.text() == "2.00x"
    assert row.median["speckv"]["output_tok_s"] == 40.0  # the failed run's 10 is left out


def test_an_unreachable_server_gives_a_failed_point() -> None:
    from speckv.events.endpoints import free_port

    server = vs_vllm.Server("vllm", f"http://127.0.0.1:{free_port()}")  # nothing listens
    workload = vs_vllm.build_workload("batch1", _Tokens(), quick=True, scale=1.0)
    point = vs_vllm.measure_or_fail(server, workload, "none", 0)
    assert point.num_failed == len(workload.requests) and point.output_tok_s == 0.0


def test_speculation_speedup_is_each_servers_own_ratio() -> None:
    points = []
    for round_index in range(2):
        points += [_point("none", "chat", "speckv", round_index, 10.0),
                   _point("eagle3", "chat", "speckv", round_index, 15.0),
                   _point("none", "chat", "vllm", round_index, 20.0),
                   _point("eagle3", "chat", "vllm", round_index, 20.0 + 10 * round_index)]
    speedups = speculation_speedups(points)
    assert speedups["chat"]["speckv"].median == pytest.approx(1.5)
    assert (speedups["chat"]["vllm"].low, speedups["chat"]["vllm"].high) == (1.0, 1.5)


def test_table_json_and_png(tmp_path: Path) -> None:
    points = [_point(m, "prefix", s, 0, t) for m, s, t in
              [("none", "speckv", 12.0), ("none", "vllm", 10.0),
               ("eagle3", "speckv", 18.0), ("eagle3", "vllm", 12.0)]]
    rows = aggregate(points)
    cells = table_rows(rows)
    assert [len(c) for c in cells] == [len(TABLE_COLUMNS)] * 2
    assert cells[0][:4] == ["none", "prefix", "12.0 / 10.0", "1.20x"]
    assert cells[1][3] == "1.50x"
    assert cells[0][10] == "50% / 25%"
    document = json.loads(json.dumps(payload(points, {"machine": "x"})))
    assert document["machine"] == "x" and len(document["runs"]) == 4
    assert document["rows"][1]["throughput_ratio"]["median"] == 1.5
    assert document["speculation_speedup"]["prefix"]["vllm"]["median"] == pytest.approx(1.2)
    write_png(rows, tmp_path / "ratio.png")
    assert (tmp_path / "ratio.png").read_bytes()[:4] == b"\x89PNG"


def test_skips_with_a_message_without_vllm(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("SPECKV_VLLM_VENV", raising=False)
    assert vs_vllm.run(_args()) == 0
    err = capsys.readouterr().err
    assert "bench vs-vllm skipped: no vLLM: pass --vllm-venv DIR" in err
    assert vs_vllm.run(_args("--vllm-venv", "/nonexistent")) == 0
    assert "no bin/vllm there" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--workloads", "batch1,nope"], "--workloads: unknown ['nope']"),
    (["--speculative-method", "ngram"], "--speculative-method: choose from"),
    (["--speculative-method", "none,eagle3"], "--vllm-url is one"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--threads", "0"], "--threads must be >= 1"),
])
def test_flag_errors_name_the_flag(argv: list[str], words: str) -> None:
    source = ["--vllm-url", "http://x"] if "--vllm-url" in words else ["--vllm-venv", "/x"]
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        vs_vllm.run(_args(*source, *argv))


def test_both_servers_get_the_same_threads_kv_memory_and_head(tmp_path: Path) -> None:
    args = _args("--vllm-venv", "/venv", "--threads", "2", "--kv-gib", "3")
    speckv = vs_vllm.speckv_command(args, "eagle3", 1234)
    command, env = vs_vllm.vllm_command(args, "eagle3", 5678, tmp_path)
    assert speckv[speckv.index("--threads") + 1] == "2"
    assert speckv[speckv.index("--prefill-threads") + 1] == "2"  # every step on 2, as vLLM's
    assert speckv[speckv.index("--kv-cache-memory-bytes") + 1] == "3G"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["SPECKV_VLLM_PLUGIN"] == "0"  # stock vLLM even with the plugin installed
    spec = json.loads(command[command.index("--speculative-config") + 1])
    head = speckv[speckv.index("--speculative-model") + 1]
    from speckv.drafters.builtin import BUILTIN_DRAFTER_DIR

    assert head == "builtin" and spec["model"] == str(BUILTIN_DRAFTER_DIR)
    assert spec["num_speculative_tokens"] == int(speckv[speckv.index("--num-spec-tokens") + 1])
    assert command[:3] == ["/venv/bin/vllm", "serve", str(tmp_path)]
    none_command, _ = vs_vllm.vllm_command(args, "none", 5678, tmp_path)
    assert "--speculative-config" not in none_command


class _Tokens:
    vocab_size = 1000

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 1000 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(32 + i % 90) for i in ids)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages)


def test_workloads_have_their_shapes() -> None:
    batch1 = vs_vllm.build_workload("batch1", _Tokens(), quick=False, scale=1.0)
    assert batch1.concurrency == 1 and {len(r.prompt_token_ids) for r in batch1.requests} == {64}
    prefix = vs_vllm.build_workload("prefix", _Tokens(), quick=False, scale=0.5)
    assert prefix.concurrency == 4 and len(prefix.requests) == 16
    assert {r.prompt_token_ids[:256] == prefix.requests[0].prompt_token_ids[:256]
            for r in prefix.requests} == {True, False}
    chat = vs_vllm.build_workload("chat", _Tokens(), quick=True, scale=1.0)
    assert not chat.ignore_eos and chat.requests[0].output_len == 8


@pytest.mark.vllm
@pytest.mark.slow
def test_a_tiny_run_against_a_real_vllm(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    venv = os.environ.get("SPECKV_VLLM_VENV")
    if not venv:
        pytest.skip("set SPECKV_VLLM_VENV to a virtual environment with vLLM's CPU engine")
    args = _args("--vllm-venv", venv, "--quick", "--vllm-enforce-eager", "--workloads",
                 "batch1", "--speculative-method", "none", "--rounds", "1", "--output-dir",
                 str(tmp_path), "--json")
    assert vs_vllm.run(args) == 0
    document = json.loads(capsys.readouterr().out)
    (row,) = document["rows"]
    assert row["throughput_ratio"]["count"] == 1
    assert {r["server"] for r in document["runs"]} == {"speckv", "vllm"}
    assert all(r["num_failed"] == 0 and r["output_tok_s"] > 0 for r in document["runs"])
    assert document["versions"]["vllm"].startswith("0.")
    assert (tmp_path / "ratio.png").is_file()


def test_a_method_whose_server_does_not_start_leaves_the_others_figures(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(vs_vllm, "vllm_source", lambda args: None)

    def run_method(args, method, workloads, model_dir, versions):  # type: ignore[no-untyped-def]
        if method == "eagle3":
            raise RuntimeError("vllm exited with 1; its log ends:\nTraceback ...")
        return [_point(method, w.name, server, 0, tok_s) for w in workloads
                for server, tok_s in (("speckv", 12.0), ("vllm", 10.0))]

    monkeypatch.setattr(vs_vllm, "run_method", run_method)
    assert vs_vllm.run(_args("--vllm-venv", "/x", "--workloads", "batch1", "--quick",
                             "--output-dir", str(tmp_path))) == 0
    document = json.loads((tmp_path / "results.json").read_text())
    assert document["failed_methods"] == {"eagle3": "vllm exited with 1; its log ends:"}
    assert [run["method"] for run in document["runs"]] == ["none", "none"]
    assert "eagle3: vllm exited with 1" in capsys.readouterr().err
