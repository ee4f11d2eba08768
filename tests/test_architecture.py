"""The import structure the folders promise: each package imports only packages of lower layers (so there is no
upward import and no cycle between packages), and the router runs without torch."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Lower layers never import higher ones; packages of one layer do not import each other.
LAYERS = [
    {"wire", "text", "http", "discovery", "settings"},  # what crosses process boundaries, where peers are, flags; no torch
    {"cache"},  # pages and the prefix tree (pure Python)
    {"ops", "transfer"},
    {"model"},
    {"engine"},
    {"disagg"},  # the prefill -> decode hand-off: its states per request and role, over an engine and a transport
    {"worker", "router"},  # the two server processes
    {"cluster", "bench"},
    {"planner"},  # sizes the pools from the routers' metrics; scales StatefulSets or a local cluster
    {"cli"},
]
LAYER_OF = {package: level for level, packages in enumerate(LAYERS) for package in packages}
SOURCES = {"pdserve": ROOT / "pdserve", "pdserve_router": ROOT / "router"}


def package_of(module: str) -> str | None:
    """The layer package a dotted module name belongs to (None: not ours, or the top-level pdserve facade)."""
    parts = module.split(".")
    if parts[0] == "pdserve_router":
        return "router"
    if parts[0] == "pdserve" and len(parts) > 1 and parts[1] in LAYER_OF:
        return parts[1]
    return None


def imports_between_packages() -> list[tuple[str, str, str]]:
    """(importing file, its package, imported package) for every import that crosses packages."""
    found = []
    for top, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            source = package_of(".".join([top, *[p for p in parts if p != "__init__"]]))
            if source is None:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                for name in names:
                    target = package_of(name)
                    if target is not None and target != source:
                        found.append((str(path.relative_to(ROOT)), source, target))
    return found


def test_every_package_is_in_a_layer():
    packages = {p.name for p in (ROOT / "pdserve").iterdir() if (p / "__init__.py").exists()}
    assert packages <= set(LAYER_OF), f"packages with no layer: {sorted(packages - set(LAYER_OF))}"


def test_no_package_imports_its_own_layer_or_a_higher_one():
    crossings = imports_between_packages()
    assert crossings, "the scan found no imports at all"
    upward = [c for c in crossings if LAYER_OF[c[2]] >= LAYER_OF[c[1]]]
    assert not upward, "imports against the layering:\n" + "\n".join(f"{f}: {s} -> {t}" for f, s, t in upward)


def test_importing_the_router_and_the_command_line_does_not_import_torch():
    """The router image has no torch: it runs the router and `pdserve planner` (the modules main_planner imports)."""
    modules = ["pdserve_router.app", "pdserve_router.serving", "pdserve_router.dispatch", "pdserve.cli.main",
               "pdserve.cli.planner", "pdserve.planner.config", "pdserve.planner.policy", "pdserve.planner.pools",
               "pdserve.planner.loop", "pdserve.planner.traffic", "pdserve.engine.step_profile",
               "pdserve.discovery.endpoints"]
    code = (f"import sys; import {', '.join(modules)}; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"the router or the planner imported torch modules: {result.stdout[:300]}"
