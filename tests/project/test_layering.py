"""The architecture's import rules (docs/architecture.md, docs/design.md): arrows only point down.

The layers are the folders src/epsim/model/, sim/, runtime/, calibrate/ and src/epsim/ itself,
imported as ``epsim.model``, ``epsim.sim``, ``epsim.runtime``, ``epsim.calibrate`` and the front
door ``epsim`` (``epsim.cli``, ``epsim.commands``, ``epsim.common``): the import path is the
file path under src/.

epsim.model imports neither sim, runtime, calibrate nor the front door; epsim.sim and
epsim.runtime import epsim.model only (never each other); epsim.calibrate may import all three;
nothing imports the front door but the front door itself. The old top-level names (``model``,
``sim``, ...) are not importable once installed, so no module may use them.
Also: epsim.model and epsim.sim must work without torch, so they never import it at module level.

Inside sim/, five parts and the root, each allowed the parts in ``SIM_PARTS`` (the sim/ map of
docs/architecture.md). No circle anywhere in epsim: every import counts, at module level or
inside a function or under ``TYPE_CHECKING`` alike, so a lazy import cannot hide one.
"""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "epsim"
LAYERS = ("model", "sim", "runtime", "calibrate")
ALLOWED = {
    "model": {"model"},
    "sim": {"model", "sim"},
    "runtime": {"model", "runtime"},
    "calibrate": {"model", "sim", "runtime", "calibrate"},
    "epsim": {"model", "sim", "runtime", "calibrate", "epsim"},
}
#: sim/'s parts and what each may import besides itself and epsim.model: ``"root"`` is the
#: files directly in sim/ (spec.py, deployment.py, scenario.py, replay.py: the composition); a
#: ``part.module`` entry allows that module alone
SIM_PARTS = {
    "hardware": set(),
    "workload": set(),
    "step": {"hardware"},
    "serving": {"workload", "hardware", "step"},
    "root": {"hardware", "serving", "workload"},
    "search": {"root", "serving.metrics"},
}
#: the one serving/ file that imports step/
SERVING_STEP_DOOR = "epsim.sim.serving.step_time"


def _layer_of(module: str) -> str | None:
    """The layer an absolute module name belongs to (``epsim.sim.step.roofline`` -> ``sim``, ``epsim.cli``
    -> ``epsim``), or None for a module outside epsim."""
    parts = module.split(".")
    if parts[0] != "epsim":
        return None
    if len(parts) > 1 and parts[1] in LAYERS:
        return parts[1]
    return "epsim"


def _module_of(path: Path) -> str:
    """The installed name of a source file (``sim/step/compile.py`` -> ``epsim.sim.step.compile``,
    ``sim/step/__init__.py`` -> ``epsim.sim.step``)."""
    names = ["epsim", *path.relative_to(SRC).with_suffix("").parts]
    if names[-1] == "__init__":
        names.pop()
    return ".".join(names)


def _resolve_relative(package: str, path: Path, level: int, module: str | None) -> str:
    """The absolute name of ``from <level dots><module> import ...`` inside ``path``."""
    installed = ["epsim"] if package == "epsim" else ["epsim", package]
    inside = path.relative_to(_folder(package)).parent.parts
    base = installed + list(inside)
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _folder(package: str) -> Path:
    """A layer's folder (``sim`` -> src/epsim/sim; the front door ``epsim`` -> src/epsim)."""
    return SRC if package == "epsim" else SRC / package


def _layer_files(package: str) -> list[Path]:
    """The layer's own source files (the front door's exclude the four layers' folders)."""
    files = sorted(_folder(package).rglob("*.py"))
    if package == "epsim":
        files = [f for f in files if f.relative_to(SRC).parts[0] not in LAYERS]
    return files


def _source_files() -> dict[str, Path]:
    """Every module of the five layers by installed name."""
    return {_module_of(path): path for package in ALLOWED for path in _layer_files(package)}


SOURCES = _source_files()


def _imports(path: Path, package: str) -> list[tuple[str, int, bool, bool]]:
    """(absolute module, line, at module level, relative) for every import in ``path``; ``from
    pkg import name`` names the submodule ``pkg.name`` where one exists."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (_resolve_relative(package, path, node.level, node.module) if node.level
                    else node.module or "")
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in SOURCES]
            names = subs if len(subs) == len(node.names) else [base, *subs]
        else:
            continue
        found.extend((name, node.lineno, id(node) in top_level,
                      isinstance(node, ast.ImportFrom) and node.level > 0) for name in names)
    return found


def _packages_run(module: str, target: str) -> list[str]:
    """The packages Python initialises to import ``target`` from ``module``: ``target``'s
    ancestors that ``module`` is not inside (its own are initialised already)."""
    parts = target.split(".")
    ancestors = [".".join(parts[:i]) for i in range(1, len(parts))]
    return [a for a in ancestors if not (module == a or module.startswith(a + "."))]


def import_graph(faces: bool = True) -> dict[str, set[str]]:
    """``{module: modules of epsim it imports}`` over the five layers (every import counts; with
    ``faces``, also the packages an import initialises on the way: what a circle runs through,
    not what a file names)."""
    graph = {}
    for module, path in SOURCES.items():
        targets = set()
        for name, *_ in _imports(path, _layer_of(module)):
            if name in SOURCES:
                targets.add(name)
                if faces:
                    targets.update(p for p in _packages_run(module, name) if p in SOURCES)
        graph[module] = targets - {module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: its strongly connected components of more than one
    module, or of one that imports itself (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    out.append(sorted(component))
    return out


def sim_part(module: str) -> str | None:
    """The sim/ part of a module (``epsim.sim.step.compile`` -> ``step``; ``epsim.sim.scenario``
    -> ``root``; ``epsim.sim`` itself -> ``root``), None outside sim/."""
    parts = module.split(".")
    if parts[:2] != ["epsim", "sim"]:
        return None
    if len(parts) > 2 and parts[2] in SIM_PARTS:
        return parts[2]
    return "root"


def sim_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import inside sim/ that runs against ``SIM_PARTS`` (up the chain, or step/ from a
    serving/ file other than its door)."""
    out = []
    for module, targets in sorted(graph.items()):
        part = sim_part(module)
        if part is None:
            continue
        for target in sorted(targets):
            other = sim_part(target)
            if other is None or other == part:
                continue
            allowed = SIM_PARTS[part]
            inner = ".".join(target.split(".")[2:4])
            if other not in allowed and inner not in allowed:
                out.append(f"{module} imports {target}: sim/{part} may use "
                           f"{', '.join(sorted(allowed)) or 'epsim.model only'}")
            elif other == "step" and part == "serving" and module != SERVING_STEP_DOOR:
                out.append(f"{module} imports {target}: serving/ reaches step/ only through "
                           f"{SERVING_STEP_DOOR}")
    return out


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_down(package):
    for path in _layer_files(package):
        for module, line, _, _ in _imports(path, package):
            where = f"{path.relative_to(REPO)}:{line}"
            if module.split(".")[0] in LAYERS:
                pytest.fail(f"{where} imports {module}: use epsim.{module} (or a relative import)")
            layer = _layer_of(module)
            if layer is not None and layer not in ALLOWED[package]:
                pytest.fail(f"{where} imports {module}, which {package}/ must not")


def test_relative_imports_resolve_as_installed():
    assert _resolve_relative("sim", SRC / "sim" / "step" / "compile.py", 1,
                             "roofline") == "epsim.sim.step.roofline"
    assert _resolve_relative("epsim", SRC / "commands" / "step.py", 2,
                             "common") == "epsim.common"
    assert _module_of(SRC / "sim" / "step" / "__init__.py") == "epsim.sim.step"
    assert _layer_of("epsim.common") == "epsim" and _layer_of("epsim.runtime.kv") == "runtime"
    assert _layer_of("numpy") is None


def test_no_import_circles_anywhere():
    found = circles(import_graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_sim_imports_point_down_its_chain():
    found = sim_violations(import_graph(faces=False))
    assert not found, "\n".join(found)


def test_the_checks_fail_on_a_planted_import():
    graph = import_graph(faces=False)
    # hardware/ reaching up into serving/: a violation, and serving's metrics import nothing
    # of hardware/ that closes a loop, so no circle
    planted = {**graph, "epsim.sim.hardware.profile":
               graph["epsim.sim.hardware.profile"] | {"epsim.sim.serving.metrics"}}
    assert any("epsim.sim.hardware.profile imports epsim.sim.serving.metrics" in v
               for v in sim_violations(planted))
    # a serving/ file other than step_time reaching step/
    planted = {**graph, "epsim.sim.serving.loop":
               graph["epsim.sim.serving.loop"] | {"epsim.sim.step.simulate"}}
    assert any("only through" in v for v in sim_violations(planted))
    # the config importing the simulation that imports it: a circle, as a lazy import would be
    planted = {**graph, "epsim.sim.serving.config":
               graph["epsim.sim.serving.config"] | {"epsim.sim.serving.simulate"}}
    assert any({"epsim.sim.serving.config", "epsim.sim.serving.simulate"} <= set(c)
               for c in circles(planted))
    # and the search part may read serving's metrics but not its loop
    planted = {**graph, "epsim.sim.search.slo":
               graph["epsim.sim.search.slo"] | {"epsim.sim.serving.loop"}}
    assert any("epsim.sim.search.slo imports epsim.sim.serving.loop" in v
               for v in sim_violations(planted))


def test_sim_parts_import_their_own_files_relatively_and_other_parts_absolutely():
    for path in sorted((SRC / "sim").rglob("*.py")):
        module = _module_of(path)
        part = sim_part(module)
        for target, line, _, relative in _imports(path, "sim"):
            if sim_part(target) is None:
                continue
            same = sim_part(target) == part and part != "root"
            where = f"{path.relative_to(REPO)}:{line}"
            if same and not relative:
                pytest.fail(f"{where}: {target} is in the same part: import it relatively")
            if not same and relative and part != "root":
                pytest.fail(f"{where}: {target} is in another part: import it as epsim.sim...")


@pytest.mark.parametrize("part", sorted(set(SIM_PARTS) - {"root"}))
def test_each_sim_part_has_a_face(part):
    folder = SRC / "sim" / part
    face = folder / "__init__.py"
    tree = ast.parse(face.read_text())
    doc = ast.get_docstring(tree) or ""
    exported = next((node.value for node in tree.body if isinstance(node, ast.Assign)
                     and any(getattr(t, "id", "") == "__all__" for t in node.targets)), None)
    assert exported is not None, f"sim/{part}/__init__.py has no __all__"
    names = ast.literal_eval(exported)
    assert 3 <= len(names) <= 8, f"sim/{part}'s face has {len(names)} names"
    for path in sorted(folder.glob("*.py")):
        if path.name != "__init__.py":
            assert path.name in doc, f"sim/{part}/__init__.py's docstring omits {path.name}"
            # the folder carries the concept: a file name does not repeat it
            assert not path.stem.startswith(part.rstrip("s")), f"sim/{part}/{path.name}"


@pytest.mark.parametrize("package", ["model", "sim"])
def test_no_module_level_torch(package):
    for path in _layer_files(package):
        for module, line, module_level, _ in _imports(path, package):
            if module.split(".")[0] == "torch" and module_level:
                pytest.fail(f"{path.relative_to(REPO)}:{line} imports torch at module level")


def test_commands_import_no_other_command():
    """What commands share lives in epsim.common, so a command never imports another one."""
    commands = SRC / "commands"
    for path in sorted(commands.glob("*.py")):
        for module, line, _, _ in _imports(path, "epsim"):
            other = module.removeprefix("epsim.commands.")
            if other != module and other != path.stem:
                pytest.fail(f"{path.relative_to(REPO)}:{line} imports {module}: "
                            "move what they share to epsim/common.py")
