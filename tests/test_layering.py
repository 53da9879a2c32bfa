"""The architecture's import rules (DESIGN.md section 2): arrows only point down.

model/ imports neither sim/, runtime/, calibrate/ nor epsim/; sim/ and runtime/ import model/ only
(never each other); calibrate/ may import all three; nothing imports epsim/ but epsim/ itself.
Also: model/ and sim/ must work without torch, so they never import it at module level.
"""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ALLOWED = {
    "model": {"model"},
    "sim": {"model", "sim"},
    "runtime": {"model", "runtime"},
    "calibrate": {"model", "sim", "runtime", "calibrate"},
    "epsim": {"model", "sim", "runtime", "calibrate", "epsim"},
}


def _imports(path: Path, package: str) -> list[tuple[str, int, bool]]:
    """(top-level module, line, at module level) for every import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: stays inside the package
                names = [package]
            else:
                names = [node.module or ""]
        else:
            continue
        for name in names:
            found.append((name.split(".")[0], node.lineno, id(node) in top_level))
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_down(package):
    for path in sorted((REPO / package).rglob("*.py")):
        for module, line, _ in _imports(path, package):
            if module in ALLOWED and module not in ALLOWED[package]:
                pytest.fail(f"{path.relative_to(REPO)}:{line} imports {module}, "
                            f"which {package}/ must not")


@pytest.mark.parametrize("package", ["model", "sim"])
def test_no_module_level_torch(package):
    for path in sorted((REPO / package).rglob("*.py")):
        for module, line, module_level in _imports(path, package):
            if module == "torch" and module_level:
                pytest.fail(f"{path.relative_to(REPO)}:{line} imports torch at module level")
