"""The package layout's rules, checked on the source tree (see README, "Layout"):

- :mod:`determ_backend` (runs inside the user's process) never imports :mod:`repro_tools`, not even lazily;
- the import graph between the project's modules has no cycle;
- no module imports another module's ``_private`` names (private modules of one's own package are fine; the two
  files of the repro-script runtime are exempt: they are pasted into one script);
- private torch APIs are reached only in ``determ_backend/_torch_compat.py`` (and in the standalone runtime of
  generated repro scripts, which imports torch alone).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple

from paths import ROOT

PACKAGES = ("determ_backend", "repro_tools")
STANDALONE = {"repro_tools.repro._harness", "repro_tools.repro._inputs"}
COMPAT = "determ_backend._torch_compat"


def _modules() -> Dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = p
    return mods


MODULES = _modules()


def _package_of(name: str) -> str:
    return name if MODULES[name].name == "__init__.py" else name.rsplit(".", 1)[0]


def _imports(name: str) -> List[Tuple[str, str, int]]:
    """(imported module, imported name or '', line) for every import in module ``name``, function-local ones too."""
    out = []
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, "", node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                base = _package_of(name).split(".")
                mod = ".".join(base[:len(base) - node.level + 1] + ([mod] if mod else []))
            out += [(mod, a.name, node.lineno) for a in node.names]
    return out


def _edges() -> Dict[str, Set[str]]:
    edges = {}
    for name in MODULES:
        targets = set()
        for mod, what, _ in _imports(name):
            full = f"{mod}.{what}" if what else mod
            target = full if full in MODULES else mod
            if target in MODULES and target != name:
                targets.add(target)
        edges[name] = targets
    return edges


def test_the_runtime_package_never_imports_the_offline_one():
    upward = [f"{name}:{line} imports {mod}" for name in MODULES if name.startswith("determ_backend")
              for mod, _, line in _imports(name) if mod.split(".")[0] == "repro_tools"]
    assert upward == []


def test_the_import_graph_has_no_cycle():
    edges, state, cycles = _edges(), {}, []

    def visit(v: str, stack: List[str]) -> None:
        state[v] = "open"
        for w in sorted(edges[v]):
            if state.get(w) == "open":
                cycles.append(" -> ".join(stack[stack.index(w):] + [v, w]) if w in stack else f"{v} -> {w}")
            elif w not in state:
                visit(w, stack + [v])
        state[v] = "done"

    for v in sorted(edges):
        if v not in state:
            visit(v, [])
    assert cycles == []


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_imports_another_modules_private_names():
    bad = []
    for name in sorted(set(MODULES) - STANDALONE):  # the runtime's two files become one script
        tree = ast.parse(MODULES[name].read_text())
        for mod, what, line in _imports(name):
            if what and f"{mod}.{what}" not in MODULES and _private(what) and mod in MODULES and mod != name:
                bad.append(f"{name}:{line} imports {mod}.{what}")
        aliases = {}  # local name -> project module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level:
                for a in node.names:
                    if f"{node.module}.{a.name}" in MODULES:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in MODULES})
        aliases = {k: v for k, v in aliases.items() if v != COMPAT}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and _private(node.attr) and aliases[node.value.id] != name):
                bad.append(f"{name}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert sorted(set(bad)) == []


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def test_private_torch_is_reached_only_through_torch_compat():
    bad = []
    for name in MODULES:
        if name == COMPAT or name in STANDALONE:
            continue
        for node in ast.walk(ast.parse(MODULES[name].read_text())):
            names = []
            if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "ctx", None), ast.Store):
                names = [_dotted(node)]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for dotted in names:
                parts = dotted.split(".")
                if parts[0] == "torch" and parts[1:2] != ["ops"] and any(_private(p) for p in parts[1:]):
                    bad.append(f"{name}:{node.lineno} {dotted}")
    assert sorted(set(bad)) == []
