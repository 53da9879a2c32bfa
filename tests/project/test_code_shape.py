"""Size limits that tell a concept wants its own home: no function over 100 lines in the package
(the four layers, the commands, and the front door's own modules), no module over 500 lines
anywhere outside tools/ (generators of shipped data)."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MAX_FUNCTION_LINES = 100
MAX_MODULE_LINES = 500
#: functions allowed past the limit, each with why (the reason is also a comment at the function)
LONG_FUNCTIONS = {
    # numba compiles one loop over the whole program; split into calls it would pass the
    # executor's state through arguments on every step of the walk
    ("src/epsim/sim/step/executor/walk.py", "walk"),
}


def _python_files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (REPO / folder).rglob("*.py"))


@pytest.mark.parametrize("folder", [f"src/epsim/{layer}" for layer in
                                    ("model", "sim", "runtime", "calibrate", "commands")])
def test_no_function_over_the_limit(folder):
    long = []
    for path in _python_files(folder):
        rel = str(path.relative_to(REPO))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES and (rel, node.name) not in LONG_FUNCTIONS:
                    long.append(f"{rel}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "functions over the limit: " + ", ".join(long)


def test_no_function_over_the_limit_in_the_front_door():
    long = []
    for path in sorted((REPO / "src" / "epsim").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}")
    assert not long, "functions over the limit: " + ", ".join(long)


def test_no_module_over_the_limit():
    folders = ["src", "bench", "tests"]
    long = [f"{p.relative_to(REPO)} ({n} lines)" for p in _python_files(*folders)
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, "modules over the limit: " + ", ".join(long)


def test_the_allowed_long_functions_still_exist_and_say_why():
    for rel, name in LONG_FUNCTIONS:
        source = (REPO / rel).read_text()
        tree = ast.parse(source)
        node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
        above = source.splitlines()[node.lineno - 4:node.lineno - 1]
        assert any(line.strip().startswith("#") for line in above), \
            f"{rel} {name}: say in a comment above it why it is one function"
