"""No test may fail because the machine is busy: the test tree holds no fixed wall-clock limit
(a number of seconds given as a timeout, a deadline, or a wait) outside `tests/patience.py`,
whose CPU-time-bounded waits and one generous watchdog replace them.

A number that is the behaviour under test rather than a limit on the test (a product timeout a
test makes fire, a poll interval) carries `# not a wall limit` on its line."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ALLOWED = {TESTS / "patience.py"}
PRAGMA = "# not a wall limit"
# keyword arguments and parameters whose number is a wall-clock limit
LIMIT_NAMES = {"timeout", "timeout_s", "deadline", "start_timeout_s", "wait_timeout_s",
               "join_timeout_s"}
# methods whose first positional argument is a wall-clock limit in seconds
LIMIT_METHODS = {"wait", "join", "result", "communicate", "wait_sent", "wait_for"}
CLOCKS = {"monotonic", "time", "perf_counter"}


def _number(node: ast.AST | None) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, int | float) and not isinstance(node.value, bool)
    if isinstance(node, ast.BinOp | ast.UnaryOp):
        return all(_number(child) for child in ast.iter_child_nodes(node)
                   if not isinstance(child, ast.operator | ast.unaryop))
    return False


def _is_clock(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and not node.args and (
        (isinstance(node.func, ast.Attribute) and node.func.attr in CLOCKS)
        or (isinstance(node.func, ast.Name) and node.func.id in CLOCKS)))


def _limits(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for each fixed wall limit in a module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            found += [(kw.value.lineno, f"{kw.arg}=<number>") for kw in node.keywords
                      if kw.arg in LIMIT_NAMES and _number(kw.value)]
            func = node.func
            if (isinstance(func, ast.Attribute) and func.attr in LIMIT_METHODS and node.args
                    and _number(node.args[0])):
                found.append((node.lineno, f".{func.attr}(<number>)"))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and (
                (_is_clock(node.left) and _number(node.right))
                or (_is_clock(node.right) and _number(node.left))):
            found.append((node.lineno, "clock() + <number>"))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            positional = [*args.posonlyargs, *args.args]
            pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d]
            found += [(default.lineno, f"{arg.arg}=<number> default") for arg, default in pairs
                      if arg.arg in LIMIT_NAMES and _number(default)]
    return found


def test_the_scanner_finds_each_form():
    source = ("import time, subprocess\n"
              "subprocess.run(['x'], timeout=120)\n"
              "deadline = time.monotonic() + 30\n"
              "thread.join(5.0)\n"
              "def wait(timeout_s: float = 10.0): pass\n"
              "httpx.get(url, timeout=2 * 60)\n"
              "ok = settings(deadline=None)\n"
              "fine = thread.join(WATCHDOG_S)\n")
    assert sorted(line for line, _ in _limits(ast.parse(source))) == [2, 3, 4, 5, 6]


def test_no_fixed_wall_limit_in_the_test_tree():
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        if path in ALLOWED:
            continue
        text = path.read_text()
        lines = text.splitlines()
        for line, what in _limits(ast.parse(text, str(path))):
            if PRAGMA not in lines[line - 1]:
                offenders.append(f"{path.relative_to(TESTS.parent)}:{line}: {what}")
    assert not offenders, ("fixed wall-clock limits (use tests/patience.py: wait_until, run, "
                           "WATCHDOG_S):\n" + "\n".join(offenders))
