"""The README and docs/ as a newcomer reads them: every ```python block compiles and
imports every name it uses (CPU), runs alone in a fresh process (GPU), and the README's
performance table holds the numbers of the results file it names."""
import ast
import builtins
import importlib.util
import os
import re
import subprocess
import sys
import symtable
import textwrap
from pathlib import Path

import pytest


def _root():
    """The project folder: the first parent holding README.md and docs/."""
    for parent in Path(__file__).resolve().parents:
        if (parent / "README.md").is_file() and (parent / "docs").is_dir():
            return parent
    raise RuntimeError(f"no README.md and docs/ above {__file__}")


ROOT = _root()
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^( *)```(\w*)[^\n]*\n(.*?)^\1```", re.M | re.S)  # indented in lists too


def _blocks(language):
    """(path relative to ROOT, first line, source) of every fenced block in that language."""
    found = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            if m.group(2) == language:
                line = text.count("\n", 0, m.start(3)) + 1
                found.append((str(path.relative_to(ROOT)), line, textwrap.dedent(m.group(3))))
    return found


PYTHON = _blocks("python")
IDS = [f"{path}:{line}" for path, line, _ in PYTHON]


def undefined_names(source, filename="<block>"):
    """Names a block reads that it neither imports nor assigns (builtins aside): what a
    reader pasting the block alone would meet as a NameError."""
    top = symtable.symtable(source, filename, "exec")
    defined = {s.get_name() for s in top.get_symbols()
               if s.is_assigned() or s.is_imported() or s.is_namespace()}
    known = defined | set(dir(builtins))
    missing = set()

    def visit(table):
        for s in table.get_symbols():
            if not s.is_referenced():
                continue
            at_top = table is top and not (s.is_assigned() or s.is_imported())
            if (at_top or (table is not top and s.is_global())) and s.get_name() not in known:
                missing.add(s.get_name())
        for child in table.get_children():
            visit(child)

    visit(top)
    return missing


def imported_modules(source):
    """The top-level modules a block imports."""
    mods = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            mods.add(node.module.split(".")[0])
    return mods


def test_docs_have_python_examples():
    assert any(path == "README.md" for path, _, _ in PYTHON)
    assert any(path.startswith("docs") for path, _, _ in PYTHON)


def test_the_name_check_catches_what_it_should():
    assert undefined_names("out = cufa.flash_attn_func(q, q, q)") == {"cufa", "q"}
    assert undefined_names("import cufa\nq = 1\nout = cufa.f(q, len([q]))") == set()
    assert undefined_names("def f(x):\n    return torch.relu(x) + y\ny = 2") == {"torch"}
    assert undefined_names("import jax\n@jax.jit\ndef g(a):\n    return [b * a for b in c]") \
        == {"c"}


@pytest.mark.parametrize("path,line,source", PYTHON, ids=IDS)
def test_block_compiles_and_imports_what_it_uses(path, line, source):
    compile(source, f"{path}:{line}", "exec")
    missing = undefined_names(source, f"{path}:{line}")
    assert not missing, f"{path}:{line} uses {sorted(missing)} without importing or assigning them"


@pytest.mark.parametrize("path,line,source", PYTHON, ids=IDS)
def test_block_calls_cufa_with_its_real_arguments(path, line, source):
    """Every cufa.f(...) in a block names a public function and passes arguments its
    signature binds: a renamed or misspelled argument fails here, without a GPU."""
    import inspect

    import cufa
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "cufa"):
            continue
        name = node.func.attr
        assert name in cufa.__all__, f"{path}:{line}: cufa.{name} is not a public function"
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            continue
        try:
            inspect.signature(getattr(cufa, name)).bind(*node.args, **{k.arg: k for k in node.keywords})
        except TypeError as e:
            pytest.fail(f"{path}:{line + node.lineno - 1}: cufa.{name}(...): {e}")


@pytest.mark.gpu
@pytest.mark.parametrize("path,line,source", PYTHON, ids=IDS)
def test_block_runs_alone(path, line, source):
    absent = sorted(m for m in imported_modules(source) if importlib.util.find_spec(m) is None)
    if absent:
        pytest.skip(f"{path}:{line} needs {', '.join(absent)}, not installed")
    import cufa
    from cufa import _compile, _runtime
    if "qv=" in source and _compile.family_for(_runtime.compute_capability(0)) != "sm90":
        pytest.skip(f"{path}:{line}: MLA decode (qv) runs on Hopper's kernel family alone")
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    # the cufa under test, whether the checkout's or an installed one
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(cufa.__file__))] + env.get("PYTHONPATH", "").split(os.pathsep))
    run = subprocess.run([sys.executable, "-c", source], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"{path}:{line} exited {run.returncode}:\n{run.stderr[-3000:]}"


# -- the README's performance table against its results file -------------------------------

def _tables(text):
    """Every markdown table in text: (line index of its header, header cells, rows of cells)."""
    lines, found, i = text.splitlines(), [], 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and set(lines[i + 1]) <= set("|- :"):
            head = [c.strip() for c in lines[i].strip("|").split("|")]
            j, rows = i + 2, []
            while j < len(lines) and lines[j].startswith("|"):
                rows.append([c.strip() for c in lines[j].strip("|").split("|")])
                j += 1
            found.append((i, head, rows))
            i = j
        else:
            i += 1
    return found


def _readme_performance():
    """(the caption above the README's performance table, its header, its rows)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Performance", 1)[1].split("\n## ", 1)[0]
    tables = _tables(section)
    assert len(tables) == 1, "the README's Performance section has one table"
    at, head, rows = tables[0]
    caption = " ".join(section.splitlines()[:at])
    return caption, head, rows


# README column -> the results table's column (bench_fwd.py writes that table)
_COLUMNS = {"head dim": "d", "causal": "causal", "N": "N", "cufa": "cufa",
            "SDPA cuDNN": "SDPA cuDNN", "SDPA flash (FlashAttention-2)": "SDPA flash"}
_KEYS = ("d", "causal", "N")


def test_readme_performance_table_matches_its_results_file():
    caption, head, rows = _readme_performance()
    named = re.findall(r"bench/results/[\w.]+\.md", caption)
    assert len(named) == 1, f"the caption names one results file: {caption!r}"
    results = (ROOT / named[0]).read_text(encoding="utf-8")
    device = re.search(r"NVIDIA [\w ]+?(?=,)", results.splitlines()[0]).group(0)
    assert device in caption, f"the caption names the device {device!r}"
    dtype = re.search(r"\b(fp16|bf16)\b", caption).group(1)
    assert set(head) <= set(_COLUMNS), f"unknown README columns {set(head) - set(_COLUMNS)}"
    cols = [_COLUMNS[h] for h in head]
    assert {"cufa", "SDPA cuDNN", "SDPA flash"} <= set(cols), "peers measured in the same run"

    (_, rhead, rrows), = [t for t in _tables(results) if "cufa" in t[1]]
    by_key = {}
    for r in rrows:
        cell = dict(zip(rhead, r))
        heads = cell["B x H/Hkv"].split(" x ")[1].split("/")
        if cell["dtype"] == dtype and heads[0] == heads[1]:
            by_key[tuple(cell[k] for k in _KEYS)] = cell
    assert rows
    for row in rows:
        cell = dict(zip(cols, row))
        key = tuple(cell[k] for k in _KEYS)
        assert key in by_key, f"README row {row} is not in {named[0]}"
        for col in set(cols) - set(_KEYS):
            assert cell[col] == by_key[key][col], \
                f"README row {row}: {col} {cell[col]} but {named[0]} says {by_key[key][col]}"


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text(encoding="utf-8")) <= 8000


@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
def test_docs_describe_the_product_not_its_history(path):
    text = path.read_text(encoding="utf-8")
    for pattern, what in ((r"\b20\d\d-\d\d-\d\d\b", "a date"), (r"\bsession\b", "'session'"),
                          (r"\blease\b", "'lease'"), (r"\bissue \d+", "an issue number"),
                          (r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b",
                           "a commit hash")):
        m = re.search(pattern, text)
        assert not m, f"{path.name} has {what}: {m.group(0)!r}"
