"""The package's layout (ARCHITECTURE.md): its import drawing has no circle and
no import that runs back up, and no module is over 600 lines."""

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kvram")

# From the bottom up: a module may import its own room and the rooms below it.
ROOMS = [
    ("kvram._env", "kvram._state"),
    ("kvram._version", "kvram._quiet", "kvram._checks", "kvram._einsum", "kvram._order", "kvram._xla_flags", "kvram._custom_gradient",
     "kvram.memory", "kvram.precision"),
    ("kvram._plan_process",),
    ("kvram.layers", "kvram.data", "kvram.optimizers"),
    ("kvram.speed",),
    ("kvram.training",),
    ("kvram.callbacks", "kvram.parallel"),
    ("kvram.remat",),
    ("kvram.cli",),
    ("kvram", "kvram.__main__", "kvram.plan"),
]


def _modules() -> dict:
    found = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path[:-3], os.path.dirname(ROOT)).replace(os.sep, ".")
                found[module.removesuffix(".__init__")] = path
    return found


def _imports(modules: dict) -> dict:
    """{module: the kvram modules it imports, anywhere in it}; `from a import b`
    counts as importing a.b where that is a module."""
    edges = {}
    for module, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in modules else node.module)
        edges[module] = {t for t in targets if t in modules and t != module}
    return edges


def _room(module: str) -> tuple:
    """(floor, room) of a module: its subpackage's place in ROOMS."""
    best = None
    for floor, rooms in enumerate(ROOMS):
        for room in rooms:
            if (module == room or module.startswith(room + ".")) and (best is None or len(room) > len(best[1])):
                best = (floor, room)
    assert best is not None, f"{module} is in no room of ROOMS"
    return best


def test_no_import_runs_back_up():
    modules = _modules()
    upward = []
    for module, targets in _imports(modules).items():
        floor, room = _room(module)
        for target in targets:
            other_floor, other_room = _room(target)
            if other_floor > floor or (other_floor == floor and other_room != room):
                upward.append(f"{module} -> {target}")
    assert not upward, upward


def test_no_import_circle():
    edges = _imports(_modules())
    state, circles = {}, []

    def visit(module, path):
        state[module] = "open"
        for target in sorted(edges[module]):
            if state.get(target) == "open":
                circles.append(path[path.index(target):] + [target] if target in path else [module, target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert not circles, circles


def test_no_module_over_600_lines():
    lines = {}
    for module, path in _modules().items():
        with open(path) as handle:
            lines[module] = sum(1 for _ in handle)
    assert not {m: n for m, n in lines.items() if n > 600}, sorted(lines.items(), key=lambda i: -i[1])[:5]


def test_examples_import_kvram_before_tensorflow():
    """An example run as `python examples/x.py` on a CPU without AVX-512 VNNI
    has CPU allocator statistics only where kvram is imported before
    TensorFlow (kvram/__init__.py; the tests set TF_ENABLE_ONEDNN_OPTS
    themselves and would not see it): each example's first import of kvram,
    Keras or TensorFlow is kvram's."""
    folder = os.path.join(os.path.dirname(ROOT), "examples")
    late = {}
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py"):
            continue
        first = None
        for node in ast.walk(ast.parse(open(os.path.join(folder, name)).read())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                top = [m.split(".")[0] for m in modules if m.split(".")[0] in ("kvram", "keras", "tensorflow")]
                if top and (first is None or node.lineno < first[0]):
                    first = (node.lineno, top[0])
        if first is not None and first[1] != "kvram":
            late[name] = first
    assert not late, f"examples importing {{name: (line, module)}} before kvram: {late}"


def test_ci_runs_the_readmes_test_command():
    """.ci/run installs and runs the test suite as README's second set-up command does."""
    import re

    top = os.path.dirname(ROOT)
    readme = open(os.path.join(top, "README.md")).read()
    command = re.search(r"# 2\. .*\n(.+)\n", readme).group(1)
    install, run = command.split(" && ")[-2:]
    ci = open(os.path.join(top, ".ci", "run")).read().splitlines()
    assert run in ci, (run, ci)
    assert any(install in line.replace(" -q", "") for line in ci), (install, ci)  # CI's install is quiet
