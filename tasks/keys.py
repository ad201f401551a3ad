"""What a run's cache keys hash (the README's "cache key"): training is keyed by the code training imports, the
verdict by the claim and the decision rule, so a changed claim re-decides from stored metrics instead of retraining.

- Training key: the paper's module with its claim stripped, and every project file that training, preparation and
  evaluation import from it and from the runtime's entry points (`tasks/worker.py`, `tasks/prepare_stage.py`,
  `tasks/steps.py`), found by reading their import statements (no import runs): what the paper uses of
  `models/common` and `kernels/`, and the training runtime in `tasks/`. The planner, reports, CLI and tracking are
  not in it (`NOT_TRAINING`).
- Verdict key: the claim's source in the module (every `Claim(...)` expression) and `models/verdicts.py`.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
from pathlib import Path

# project code training may import (a file enters the key only when the import closure reaches it)
TRAINING_ROOTS = ("models", "tasks", "kernels")
# reached by those imports but deciding nothing that training computes: the verdict side, planning, tracking
NOT_TRAINING = ("models/verdicts.py", "tasks/planning.py", "tasks/replicates.py", "tasks/tracking.py",
                "tasks/keys.py", "tasks/quiet.py", "tasks/evaluators.py")
RUNTIME_ENTRIES = ("tasks/worker.py", "tasks/prepare_stage.py", "tasks/steps.py")
VERDICT_RULE = "models/verdicts.py"


@functools.lru_cache(maxsize=128)
def _parse(source: str) -> ast.Module:
    """One parse per module text: keying a paper reads its module for imports and for its claim."""
    return ast.parse(source)


def _nodes_mentioning(tree: ast.Module, lines: list[str], word: str):
    """Every node of the top-level statements whose text mentions `word`: walking only those keeps keying a
    suite's papers in milliseconds (a full `ast.walk` of 38 modules takes seconds)."""
    for statement in tree.body:
        if any(word in line for line in lines[statement.lineno - 1 : statement.end_lineno]):
            yield from ast.walk(statement)


def _claim_segments(source: str) -> list[tuple[int, int]]:
    """Byte spans of every `Claim(...)` call in the source (outermost only)."""
    tree = _parse(source)
    lines = source.split("\n")  # ast's lines: "\n" ends one (col offsets count UTF-8 bytes)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line.encode()) + 1)
    spans = []
    for node in _nodes_mentioning(tree, lines, "Claim("):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name | ast.Attribute) and \
                (node.func.id if isinstance(node.func, ast.Name) else node.func.attr) == "Claim":
            spans.append((offsets[node.lineno - 1] + node.col_offset, offsets[node.end_lineno - 1] +
                          node.end_col_offset))
    spans.sort()
    outer: list[tuple[int, int]] = []
    for start, end in spans:
        if not outer or start >= outer[-1][1]:
            outer.append((start, end))
    return outer


@functools.lru_cache(maxsize=128)
def split_claim(source: str) -> tuple[str, str]:
    """(the module without its claim, the claim's source): each `Claim(...)` expression is cut out of the module
    and replaced by a placeholder, so editing it changes the second and not the first."""
    data = source.encode()
    kept, cut, at = [], [], 0
    for start, end in _claim_segments(source):
        kept.append(data[at:start])
        kept.append(b"Claim(...)")
        cut.append(data[start:end])
        at = end
    kept.append(data[at:])
    return b"".join(kept).decode(), b"\n".join(cut).decode()


@functools.cache
def _package_dir(top: str) -> Path | None:
    """Where the top-level package `top` is imported from (found, not imported: a top-level name's spec)."""
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def project_path(path: Path) -> str:
    """`models/common/x.py` for a file of one of the training roots (what the key hashes beside its bytes)."""
    for top in TRAINING_ROOTS:
        folder = _package_dir(top)
        if folder is not None and path.is_relative_to(folder):
            return f"{top}/{path.relative_to(folder).as_posix()}"
    raise ValueError(f"{path} is not in the project's packages {TRAINING_ROOTS}")


def _module_file(name: str) -> Path | None:
    """`models.common.x` -> models/common/x.py (or its package's __init__.py), inside the training roots only."""
    top, *rest = name.split(".")
    folder = _package_dir(top) if top in TRAINING_ROOTS else None
    if folder is None:
        return None
    base = folder.joinpath(*rest)
    for candidate in ((base.with_suffix(".py"),) if rest else ()) + (base / "__init__.py",):
        if candidate.is_file():
            return candidate
    return None


def _imports(path: Path) -> frozenset[Path]:
    stat = path.stat()
    return _imports_of(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=512)
def _imports_of(path: Path, mtime_ns: int, size: int) -> frozenset[Path]:
    """The project files one file imports (anywhere in it: lazy imports inside functions count); cached per
    version of the file (a suite keys 38 papers that share the runtime's files)."""
    source = path.read_text()
    tree = _parse(source)
    package = ".".join(Path(project_path(path)).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    found: set[Path] = set()
    for node in _nodes_mentioning(tree, source.split("\n"), "import"):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(p for p in (*parent, base) if p)
            names = [base] + [f"{base}.{a.name}" for a in node.names]  # `from pkg import submodule`
        for name in names:
            parts = name.split(".")
            for i in range(1, len(parts) + 1):  # a package's __init__ runs before its submodule
                file = _module_file(".".join(parts[:i]))
                if file is not None:
                    found.add(file)
    return frozenset(found)


def _in_training(path: Path) -> bool:
    try:
        rel = project_path(path)
    except ValueError:
        return False
    return not any(rel == x or rel.startswith(x + "/") for x in NOT_TRAINING)


def training_files(paper_file: Path) -> list[Path]:
    """The paper's module and every project file the import closure of it and of the runtime entries reaches,
    less `NOT_TRAINING` (whose own imports are not followed)."""
    todo = [paper_file.resolve(), *(f for f in (_module_file(e.removesuffix(".py").replace("/", "."))
                                                for e in RUNTIME_ENTRIES) if f is not None)]
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen or not _in_training(path):
            continue
        seen.add(path)
        todo += _imports(path)
    return sorted(seen)


def training_hash(paper_file: Path) -> str:
    digest = hashlib.sha256()
    for f in training_files(paper_file):
        digest.update(project_path(f).encode())
        source = f.read_bytes()
        digest.update(split_claim(source.decode())[0].encode() if f == paper_file.resolve() else source)
    return digest.hexdigest()


def verdict_hash(paper_file: Path) -> str:
    digest = hashlib.sha256()
    digest.update(split_claim(paper_file.read_text())[1].encode())
    digest.update(_module_file(VERDICT_RULE.removesuffix(".py").replace("/", ".")).read_bytes())
    return digest.hexdigest()
