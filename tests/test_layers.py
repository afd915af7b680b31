"""CPU: the host package imports one way. Every cufa module sits in a layer, and imports only
modules of the layers below its own (docs/design.md); no import anywhere in a module,
function bodies included, makes a cycle. Read from the source with ast, so an import
inside a function counts as much as one at the top."""
import ast
from pathlib import Path

import cufa

PACKAGE = Path(cufa.__file__).parent

# Top to bottom: a module imports only modules in the layers after its own.
LAYERS = (
    ("__main__",),                       # the CLI
    ("__init__",),                       # the public names; registers the torch ops hook
    ("api",),                            # the public functions: validate -> plan -> launch
    ("_torch_ops", "_jax"),              # framework front-ends: they call the planners
    ("_bwd_plan",),                      # the backward's launches (on the forward's records)
    ("_fwd_plan",),                      # dense, packed and SDPA plans, movers, launches
    ("_decode_plan", "_fp8"),            # KV-cache, append, split-KV and merge plans; the
                                         # fp8 forward's layouts and pre-pass
    ("_heuristics",),                    # every tuning rule
    ("_checks",),                        # argument validation
    ("_compile",),                       # variant catalog, sources, NVRTC, caches
    ("_runtime",),                       # device facts, plans, stream buffers, the launch
    ("padding", "reference"),            # public leaves
    ("_params", "_tma", "_interop", "_arrays"),  # leaves (_arrays: the entry points' records)
    ("_dtypes",),                        # the element types' one table
)
_LAYER = {module: i for i, layer in enumerate(LAYERS) for module in layer}


def imports_of(path):
    """The cufa modules `path` imports, each with the line of its first import."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = node.module or ""
            elif node.level == 1:
                base = "cufa" + ("." + node.module if node.module else "")
            else:
                raise AssertionError(f"{path.name}:{node.lineno}: an import from above cufa")
            if base == "cufa":  # from cufa import x: a module, or a name of __init__
                names = [f"cufa.{alias.name}" if (PACKAGE / f"{alias.name}.py").exists()
                         else "cufa" for alias in node.names]
            else:
                names = [base]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] != "cufa":
                continue  # the standard library or a third-party package
            module = parts[1] if len(parts) > 1 else "__init__"
            found.setdefault(module, node.lineno)
    return found


def graph():
    return {path.stem: imports_of(path) for path in sorted(PACKAGE.glob("*.py"))}


def test_every_module_has_a_layer():
    assert sorted(graph()) == sorted(_LAYER), "place a new module in LAYERS"


def test_modules_import_only_lower_layers():
    wrong = [f"{module}.py:{line} imports {target} (layer {_LAYER[target]}, its own "
             f"{_LAYER[module]})"
             for module, targets in graph().items()
             for target, line in targets.items()
             if target != module and _LAYER[target] <= _LAYER[module]]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle():
    edges = {module: set(targets) - {module} for module, targets in graph().items()}
    state = {}  # module -> "open" (on the current path) or "done"

    def visit(module, path):
        state[module] = "open"
        for target in sorted(edges[module]):
            if state.get(target) == "open":
                cycle = path[path.index(target):] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])


def test_the_check_sees_imports_inside_functions(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text("import os\nfrom . import _compile\n\ndef f():\n    from . import api\n"
                      "    import cupy\n    from cufa._runtime import plans\n")
    assert imports_of(source) == {"_compile": 2, "api": 5, "_runtime": 7}


def test_compat_modules_import_no_package_above_them():
    """cufa.compat's modules import cufa's public layers and their own siblings by name; a
    `from . import x` in a module other than its package's __init__ names that package, whose
    __init__ imports the module: a cycle."""
    wrong = []
    for path in sorted((PACKAGE / "compat").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if (isinstance(node, ast.ImportFrom) and node.level and not node.module
                    and path.name != "__init__.py"):
                wrong.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
            if isinstance(node, ast.ImportFrom) and node.level > 1:
                wrong.append(f"{path.relative_to(PACKAGE)}:{node.lineno} (from above)")
    assert not wrong, "imports of a package from below it: " + ", ".join(wrong)


def test_integrations_call_only_the_public_names():
    """cufa.integrations sits on top, like compat: its modules import `cufa` (the public
    names) and nothing private, so an integration never depends on a planner's shape."""
    wrong = []
    for path in sorted((PACKAGE / "integrations").rglob("*.py")):
        for module, line in imports_of(path).items():
            if module != "__init__":
                wrong.append(f"{path.relative_to(PACKAGE)}:{line} imports cufa.{module}")
    assert not wrong, ", ".join(wrong)


def test_every_subpackage_ships():
    """A folder of cufa with an __init__.py is listed in setup.cfg's packages, or the wheel
    leaves it out without a word."""
    listed = set()
    lines = (PACKAGE.parent / "setup.cfg").read_text().splitlines() if (
        PACKAGE.parent / "setup.cfg").exists() else []
    if not lines:
        import pytest
        pytest.skip("no setup.cfg beside the package (an installed cufa)")
    start = lines.index("packages =") + 1
    for line in lines[start:]:
        if not line.startswith("    "):
            break
        listed.add(line.strip())
    found = {"cufa." + ".".join(p.parent.relative_to(PACKAGE).parts) if p.parent != PACKAGE
             else "cufa" for p in PACKAGE.rglob("__init__.py")}
    assert found <= listed, f"not in setup.cfg's packages: {sorted(found - listed)}"
