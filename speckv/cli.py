"""The `speckv` command: parses arguments, calls the package, prints. Nothing else lives here.

Subcommands are mounted from the modules that own them (each exposes `add_arguments(parser)`
and `run(args) -> int`), imported lazily so `speckv --help` stays fast. `--help` shows every
option's default. User errors (`ValueError`, `FileNotFoundError`) print one line to stderr and
exit 2, without a traceback, naming the command's flags rather than internal fields.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Sequence
from typing import NoReturn

# (command path, module, help)
COMMANDS: list[tuple[tuple[str, ...], str, str]] = [
    (("demo",), "speckv.commands.demo",
     "the main job: hit lengths, hashing cost, the built-in model (speculation where it pays), "
     "a short prefix_repetition run, and the same chat request sent twice to speckv serve"),
    (("generate",), "speckv.commands.generate",
     "stream one completion from the built-in model (or --model DIR)"),
    (("serve",), "speckv.server.cli",
     "OpenAI-compatible HTTP server over the engine (Prometheus metrics, KV events)"),
    (("hash",), "speckv.commands.hash",
     "print the block hashes of a token list (router debugging)"),
    (("bench", "hit-length"), "speckv.bench.hit_length",
     "cached tokens of a repeated prompt, per drafter and hash mode"),
    (("bench", "retention"), "speckv.bench.retention",
     "sliding-window retention under the legacy drop (a Gemma-style window + full attention)"),
    (("bench", "hash"), "speckv.bench.hash_cost", "CPU cost of the block-hash formats"),
    (("bench", "throughput"), "speckv.bench.throughput",
     "engine vs transformers on the built-in model: prefill, decode, cached TTFT"),
    (("bench", "step-overhead"), "speckv.bench.step_overhead",
     "host cost per engine step and per request-step by phase, beside vLLM's scheduler"),
    (("bench", "prefix-repetition"), "speckv.bench.prefix_repetition",
     "end to end on a prefix_repetition workload: no spec / legacy drop / lookahead"),
    (("bench", "hybrid-gdn"), "speckv.bench.hybrid_gdn",
     "GDN hybrid on tensors: unit-544 hit scenario vs cold (logits, state); --perf vs HF"),
    (("bench", "draft-kv"), "speckv.bench.draft_kv",
     "a hit's target and draft KV vs a cold run, with a stale-successor negative control"),
    (("bench", "spec-decode"), "speckv.bench.spec_decode",
     "decode tokens/s with speculation (EAGLE3, n-gram) vs without, batch 1, 8 and 32"),
    (("train-draft",), "speckv.training.train",
     "train the built-in model's EAGLE3 head on its own generations"),
    (("bench", "cache"), "speckv.bench.cache_ops",
     "cost of lookup + allocation + free for long prompts"),
    (("bench", "serve"), "speckv.bench.serve",
     "load-test an OpenAI-compatible server (like vllm bench serve), vs the engine in process"),
    (("bench", "vs-vllm"), "speckv.bench.vs_vllm",
     "speckv serve vs vLLM's CPU engine: same model, client and prompts, turn about"),
    (("bench", "events"), "speckv.bench.events", "KV-event publisher and router throughput"),
    (("bench", "kv-store"), "speckv.bench.kv_store",
     "the store tier's load speed beside raw redis-py GETs of the same bytes"),
    (("bench", "kv-tiers"), "speckv.bench.kv_tiers",
     "load and store speed of the KV connector tiers beside a plain copy_"),
    (("bench", "pd"), "speckv.bench.pd",
     "prefill/decode over NIXL: decode TTFT vs a local hit, transfer GB/s, acceptance"),
    (("bench", "kv-connector"), "speckv.bench.kv_connector",
     "KV tiers on the built-in model: TTFT of a tier hit vs local vs cold, load GB/s, step "
     "time with stores running"),
    (("bench", "soak"), "speckv.bench.soak",
     "a long random run of the real scheduler and cache, integrity and hit KV checked each op"),
    (("bench", "store-soak"), "speckv.bench.store_soak",
     "engine processes sharing one KV store that is killed and restarted mid-run: every "
     "request completes, outputs equal a no-store run, integrity holds"),
    (("events", "tail"), "speckv.commands.events:tail", "print KV events from a publisher, live"),
    (("events", "publish-sample"), "speckv.commands.events:publish_sample",
     "publish a synthetic workload's KV events for consumer authors"),
    (("route",), "speckv.commands.route:route", "KV-aware router as a small HTTP service"),
    (("router",), "speckv.commands.router",
     "KV-aware OpenAI front for several speckv serve engines (routes by predicted cache hits)"),
    (("bench", "route"), "speckv.bench.route",
     "engines behind speckv router: kv vs round-robin vs least-loaded on prefix_repetition"),
]


def _load(target: str):
    module_name, _, prefix = target.partition(":")
    module = importlib.import_module(module_name)
    add = getattr(module, f"add_{prefix}_arguments" if prefix else "add_arguments")
    run = getattr(module, f"run_{prefix}" if prefix else "run")
    return add, run


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("speckv")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


class _Parser(argparse.ArgumentParser):
    """A bad flag value is one line naming the flag (argparse's own message), not the
    command's whole usage; `--help` still shows it all."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="speckv",
        description="Prefix caching and speculative decoding that keep their cache hits "
        "(lookahead block hashes).",
    )
    parser.add_argument("--version", action="version", version=f"speckv {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    wanted = [arg for arg in argv if not arg.startswith("-")][:2]
    for path, target, help_text in COMMANDS:
        parent = subparsers
        if len(path) == 2:
            if path[0] not in groups:
                group_parser = subparsers.add_parser(path[0], help=f"{path[0]} commands")
                groups[path[0]] = group_parser.add_subparsers(dest="subcommand",
                                                              metavar="SUBCOMMAND")
            parent = groups[path[0]]
        sub = parent.add_parser(path[-1], help=help_text, description=help_text)
        # Import only the module of the command being run (keeps --help fast and robust).
        if list(path) == wanted[: len(path)]:
            add, run = _load(target)
            add(sub)
            _show_defaults(sub)
            sub.set_defaults(_run=run, _flags=frozenset(
                option for action in sub._actions for option in action.option_strings))
    return parser


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Append "(default: X)" to every option's help that has a default worth showing."""
    for action in parser._actions:
        default = action.default
        if (not action.option_strings or default is None or default is False
                or default is argparse.SUPPRESS
                or isinstance(action, argparse._HelpAction | argparse._VersionAction)
                or "default" in (action.help or "")  # the help already says it
                or action.help == argparse.SUPPRESS):
            continue
        action.help = f"{action.help} (default: %(default)s)" if action.help \
            else "default: %(default)s"


def _attach_dash_lists(argv: list[str]) -> list[str]:
    """`--tokens -1,2` as `--tokens=-1,2`: argparse reads a value starting with '-' that is not
    a plain number as an unknown option, so the command's own check could never say what is
    wrong with it."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] \
                and _DASH_LIST.match(arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


_DASH_LIST = re.compile(r"^-\d+\s*,")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except ModuleNotFoundError as error:
        if error.name is None or error.name.startswith("speckv"):
            raise
        # `pip install speckv` alone is the core a vLLM environment needs (the plugin)
        print(f"speckv: error: the speckv commands need its serving dependencies (no module "
              f"{error.name!r}): pip install 'speckv[serve]'", file=sys.stderr)
        return 2


def _main(argv: Sequence[str] | None) -> int:
    argv = _attach_dash_lists(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    run = getattr(args, "_run", None)
    if run is None:
        parser.print_help()
        return 2
    try:
        return int(run(args) or 0)
    except (ValueError, FileNotFoundError, OSError) as error:
        from speckv.commands.cli_words import in_cli_words

        print(f"speckv: error: {in_cli_words(str(error), args._flags)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
