"""A learner's file's local import closure: the modules and packages of its own folder that it imports,
directly or through one another, found by reading the import statements (ast), never by running them.

`gptlab check` copies exactly these beside the file's private copy (isolate.py), so a submission laid out
as a package (CS336's `cs336_basics/` beside the file, minGPT's `mingpt/`) imports as it does at home,
and a classmate's file in the same folder is not there to be read or imported. Resolved: `import a.b`,
`from a.b import c` (c a submodule or a name), relative imports inside a package (`from . import c`,
`from ..a import b`), wherever the statement stands (inside a function, under `try`), in every module
found; modules are Python source (`a.py`), packages regular (`a/__init__.py`, which wins over `a.py`,
as in Python's own search) or namespace folders. Not resolved: imports built at run time
(`importlib.import_module(name)`, `__import__`), compiled extensions, and data files a module reads.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

Name = tuple[str, ...]  # a dotted module name, split: ("cs336_basics", "model")


def local_imports(path: Path) -> set[Path]:
    """What `path` imports from its folder, directly or through what it imports: each module's file (a
    package's `__init__.py`) or a namespace package's folder, as a path under the folder; `path` not
    among them. The folder is the one `path` resolves into (a symlink's target's)."""
    root = path.resolve().parent
    found: set[Path] = set()
    todo = [path.resolve()]
    while todo:
        source = todo.pop()
        package = source.relative_to(root).parts[:-1]  # where its relative imports start
        for name in _imported(source, package):
            for module in _modules(root, name):
                if module not in found and module.resolve() != path.resolve():
                    found.add(module)
                    if module.is_file():
                        todo.append(module)
    return found


def _imported(source: Path, package: Name) -> Iterator[Name]:
    """Every module name the file `source` (in `package`) may import: for `from a import b`, both `a` and
    `a.b`, since b may be a submodule. Nothing for a file that does not parse (its check says why)."""
    try:
        tree = ast.parse(source.read_bytes(), str(source))
    except (SyntaxError, ValueError, OSError):
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (tuple(alias.name.split(".")) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level > len(package):  # above the top package (or in a script): fails when run
                continue
            base = package[:len(package) - node.level + 1] if node.level else ()
            module = base + tuple(node.module.split(".") if node.module else ())
            if module:
                yield module
                yield from (module + (alias.name,) for alias in node.names if alias.name != "*")


def _modules(root: Path, name: Name) -> list[Path]:
    """The local modules importing `name` loads from `root`, outermost first: a package's `__init__.py`
    (a namespace package's folder), then the next part's; empty where `name` is not local."""
    found: list[Path] = []
    folder = root
    for part in name:
        package = folder / part
        if (package / "__init__.py").is_file():
            found.append(package / "__init__.py")
        elif (folder / f"{part}.py").is_file():
            found.append(folder / f"{part}.py")
            break  # a module holds no submodules
        elif package.is_dir():
            found.append(package)
        else:
            break
        folder = package
    return found
