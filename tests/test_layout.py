"""The house rules of src/gptlab, held by the code: imports point down the layers written in
docs/layout.md and never round in a cycle, files and functions stay small, and `import gptlab` and
every `--help` answer without torch.

The import graph is read from the source (ast), every file a node, a package's `__init__.py` included,
and every import statement counted: at the top, inside a function or under `if TYPE_CHECKING:`.
"""

from __future__ import annotations

import ast
import fnmatch
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "gptlab"
LAYOUT = ROOT / "docs" / "layout.md"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60
MAX_TOP_LEVEL_MODULES = 15


def module_names(src: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the package folder `src`."""
    names = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imported_modules(node: ast.AST, name: str, is_package: bool) -> Iterator[str]:
    """The dotted names an import statement asks for: `from a import b` asks for `a.b` (a submodule
    or a name in `a`), relative imports resolved against module `name`."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            package = name.split(".") if is_package else name.split(".")[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join(package + ([node.module] if node.module else []))
        yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph(src: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports: `a.b.c` when that is a module, else the
    nearest enclosing module (the one that defines the name, or a package's `__init__`)."""
    modules = module_names(src)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            for target in imported_modules(node, name, path.name == "__init__.py"):
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def unit(module: str) -> str:
    """The room a module belongs to: its top-level module or package (`gptlab.training.loop` -> `training`);
    the package's own `__init__` is `gptlab`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def read_layers(text: str) -> dict[str, int]:
    """Unit -> layer number, from the numbered list under the "## Layers" heading of docs/layout.md."""
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    layers = {}
    for line in section.splitlines():
        match = re.match(r"(\d+)\. (.*)", line.strip())
        if match:
            for name in re.findall(r"`([\w./]+)`", match[2].split(":")[0]):
                layers[name.removeprefix("gptlab.").removesuffix("/")] = int(match[1])
    return layers


def layer_violations(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    """Each import of a module in a higher layer, and each room the layers do not place."""
    problems = sorted({f"{unit(m)} is in no layer of docs/layout.md" for m in graph if unit(m) not in layers})
    for source, targets in sorted(graph.items()):
        for target in sorted(targets):
            low, high = unit(source), unit(target)
            if low in layers and high in layers and layers[high] > layers[low]:
                problems.append(f"{source} (layer {layers[low]}) imports {target} (layer {layers[high]})")
    return problems


def function_lengths(path: Path) -> Iterator[tuple[str, int]]:
    """(name, lines) of every function and method in a file, decorators and nested functions included."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            yield f"{path.relative_to(SRC.parent)}:{node.lineno} {node.name}", node.end_lineno - start + 1


def test_the_package_has_no_import_cycle() -> None:
    assert cycles(import_graph(SRC)) == []


def test_the_rooms_import_each_other_in_no_cycle_either() -> None:
    graph = import_graph(SRC)
    rooms: dict[str, set[str]] = {}
    for source, targets in graph.items():
        rooms.setdefault(unit(source), set()).update(unit(t) for t in targets if unit(t) != unit(source))
    assert cycles(rooms) == []


def test_imports_point_down_the_layers_of_docs_layout() -> None:
    assert layer_violations(import_graph(SRC), read_layers(LAYOUT.read_text(encoding="utf-8"))) == []


def fake_package(root: Path, files: dict[str, str]) -> Path:
    """A package `fake` under `root` with the given files (relative path -> source)."""
    for name, source in files.items():
        path = root / "fake" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source), encoding="utf-8")
    return root / "fake"


def test_the_checks_catch_a_cycle_through_a_package_init(tmp_path: Path) -> None:
    # training/__init__ re-exports the loop, and the loop imports a name back from the package.
    src = fake_package(tmp_path, {
        "__init__.py": "",
        "training/__init__.py": "from fake.training.loop import Trainer\n",
        "training/loop.py": "from fake.training import runs\n\nclass Trainer: ...\n",
        "training/runs.py": "from fake.training import Trainer\n",
    })
    assert cycles(import_graph(src)) == [["fake.training", "fake.training.loop", "fake.training.runs"]]


def test_the_checks_catch_an_upward_import_hidden_in_a_function(tmp_path: Path) -> None:
    src = fake_package(tmp_path, {
        "__init__.py": "",
        "model.py": "def build():\n    from fake.cli import main\n    return main\n",
        "cli.py": "from fake.model import build\n\ndef main(): ...\n",
        "new.py": "",
    })
    layers = read_layers("## Layers\n\n1. `model`\n2. `cli`: the command\n")
    assert cycles(import_graph(src)) == [["fake.cli", "fake.model"]]
    assert layer_violations(import_graph(src), layers) == [
        "fake is in no layer of docs/layout.md",
        "new is in no layer of docs/layout.md",
        "fake.model (layer 1) imports fake.cli (layer 2)",
    ]


def test_files_and_functions_stay_small() -> None:
    files = {str(p.relative_to(SRC.parent)): len(p.read_text(encoding="utf-8").splitlines())
             for p in SRC.rglob("*.py")}
    assert {name: n for name, n in files.items() if n > MAX_FILE_LINES} == {}
    long = {name: n for path in SRC.rglob("*.py") for name, n in function_lengths(path)
            if n > MAX_FUNCTION_LINES}
    assert long == {}
    top_level = sorted(p.name for p in SRC.glob("*.py") if p.name != "__init__.py")
    assert len(top_level) <= MAX_TOP_LEVEL_MODULES, top_level


def test_package_inits_only_document_their_package() -> None:
    """A package's __init__ holds its docstring and nothing else, so importing one module of a package
    never imports the rest."""
    busy = []
    for init in SRC.rglob("__init__.py"):
        if init.parent in (SRC, SRC / "cli"):  # gptlab's lazy names; cli's is the command (gptlab.cli:main)
            continue
        body = ast.parse(init.read_text(encoding="utf-8")).body
        if any(not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)) for n in body):
            busy.append(str(init.relative_to(SRC.parent)))
    assert busy == []


TORCH_FREE = """
import sys
import gptlab
assert "torch" not in sys.modules, "import gptlab imported torch"
from gptlab.cli import build_parser
parser = build_parser()
commands = parser._subparsers._group_actions[0].choices
for name, command in commands.items():
    command.format_help()
    for action in command._actions:
        if getattr(action, "choices", None) and isinstance(action.choices, dict):
            for sub in action.choices.values():
                sub.format_help()
heavy = sorted(m for m in ("torch", "numpy", "matplotlib", "tokenizers", "safetensors") if m in sys.modules)
print(len(commands), heavy)
"""


def test_import_gptlab_and_every_help_need_no_torch() -> None:
    out = subprocess.run([sys.executable, "-c", TORCH_FREE], capture_output=True, text=True, check=True)
    count, heavy = out.stdout.split(" ", 1)
    assert int(count) > 20 and heavy.strip() == "[]"


@pytest.mark.parametrize("name", ["GPT", "EncoderDecoder", "ModelConfig", "Seq2SeqConfig", "parameter_count"])
def test_public_names_are_imported_when_first_used(name: str) -> None:
    import gptlab

    assert getattr(gptlab, name).__name__ == name


def test_every_data_file_is_package_data() -> None:
    """Each non-Python file under src/gptlab matches a pattern of its package in pyproject.toml's
    package-data, so a wheel ships it (an editable install would hide a missing key)."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    unshipped = []
    for path in sorted(SRC.rglob("*")):
        if not path.is_file() or path.suffix in (".py", ".pyc") or "__pycache__" in path.parts:
            continue
        folder = path.parent
        while not (folder / "__init__.py").exists():
            folder = folder.parent
        package = ".".join(folder.relative_to(SRC.parent).parts)
        inside = str(path.relative_to(folder))
        if not any(fnmatch.fnmatch(inside, pattern) for pattern in declared.get(package, [])):
            unshipped.append(f"{package}: {inside}")
    assert unshipped == []
