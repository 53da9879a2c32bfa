"""The architecture's import rules (docs/design.md, "Architecture"): arrows only point down.

The layers are the folders model/, sim/, runtime/, calibrate/ and epsim/, installed as
``epsim.model``, ``epsim.sim``, ``epsim.runtime``, ``epsim.calibrate`` and the front door
``epsim`` (``epsim.cli``, ``epsim.commands``, ``epsim.common``).

epsim.model imports neither sim, runtime, calibrate nor the front door; epsim.sim and
epsim.runtime import epsim.model only (never each other); epsim.calibrate may import all three;
nothing imports the front door but the front door itself. The old top-level names (``model``,
``sim``, ...) are not importable once installed, so no module may use them.
Also: epsim.model and epsim.sim must work without torch, so they never import it at module level.
"""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("model", "sim", "runtime", "calibrate")
ALLOWED = {
    "model": {"model"},
    "sim": {"model", "sim"},
    "runtime": {"model", "runtime"},
    "calibrate": {"model", "sim", "runtime", "calibrate"},
    "epsim": {"model", "sim", "runtime", "calibrate", "epsim"},
}


def _layer_of(module: str) -> str | None:
    """The layer an absolute module name belongs to (``epsim.sim.cost`` -> ``sim``, ``epsim.cli``
    -> ``epsim``), or None for a module outside epsim."""
    parts = module.split(".")
    if parts[0] != "epsim":
        return None
    if len(parts) > 1 and parts[1] in LAYERS:
        return parts[1]
    return "epsim"


def _resolve_relative(package: str, path: Path, level: int, module: str | None) -> str:
    """The absolute name of ``from <level dots><module> import ...`` inside ``path``."""
    installed = ["epsim"] if package == "epsim" else ["epsim", package]
    inside = path.relative_to(REPO / package).parent.parts
    base = installed + list(inside)
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _imports(path: Path, package: str) -> list[tuple[str, int, bool]]:
    """(absolute module, line, at module level) for every import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                names = [_resolve_relative(package, path, node.level, node.module)]
            else:
                names = [node.module or ""]
        else:
            continue
        found.extend((name, node.lineno, id(node) in top_level) for name in names)
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_down(package):
    for path in sorted((REPO / package).rglob("*.py")):
        for module, line, _ in _imports(path, package):
            where = f"{path.relative_to(REPO)}:{line}"
            if module.split(".")[0] in LAYERS:
                pytest.fail(f"{where} imports {module}: use epsim.{module} (or a relative import)")
            layer = _layer_of(module)
            if layer is not None and layer not in ALLOWED[package]:
                pytest.fail(f"{where} imports {module}, which {package}/ must not")


def test_relative_imports_resolve_as_installed():
    assert _resolve_relative("sim", REPO / "sim" / "step.py", 1, "cost") == "epsim.sim.cost"
    assert _resolve_relative("epsim", REPO / "epsim" / "commands" / "step.py", 2,
                             "common") == "epsim.common"
    assert _layer_of("epsim.common") == "epsim" and _layer_of("epsim.runtime.kv") == "runtime"
    assert _layer_of("numpy") is None


@pytest.mark.parametrize("package", ["model", "sim"])
def test_no_module_level_torch(package):
    for path in sorted((REPO / package).rglob("*.py")):
        for module, line, module_level in _imports(path, package):
            if module.split(".")[0] == "torch" and module_level:
                pytest.fail(f"{path.relative_to(REPO)}:{line} imports torch at module level")


def test_commands_import_no_other_command():
    """What commands share lives in epsim.common, so a command never imports another one."""
    commands = REPO / "epsim" / "commands"
    for path in sorted(commands.glob("*.py")):
        for module, line, _ in _imports(path, "epsim"):
            other = module.removeprefix("epsim.commands.")
            if other != module and other != path.stem:
                pytest.fail(f"{path.relative_to(REPO)}:{line} imports {module}: "
                            "move what they share to epsim/common.py")
