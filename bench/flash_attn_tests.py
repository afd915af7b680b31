#!/usr/bin/env python3
"""FlashAttention-2's own test file against cufa, through cufa.compat.flash_attn.

    python bench/flash_attn_tests.py PATH/test_flash_attn.py --commit SHA \\
        [--sample N] [--seed S] [--workers K] --out DIR [-- PYTEST_ARGS...]

PATH/test_flash_attn.py is tests/test_flash_attn.py of the flash-attn repository at
commit SHA (kept out of the tree: _ext/ is ignored). A temporary folder gets a copy of it
with the backward statements removed and a conftest.py that makes `import flash_attn`
(and flash_attn.bert_padding, .flash_attn_interface, .layers, .layers.rotary) resolve to
cufa.compat.flash_attn through sys.modules; nothing is written into the tree.

What runs is the forward half of every test (--with-backward: the whole file, the
backward-only tests included). The transform removes the statements that
call torch.autograd.grad or .backward(), or read .grad, then, transitively, every
statement that reads a name one of them assigned (dq, dk, dv, dqkv, dkv, dq_unpad, ...,
and what is computed from those), and the blocks left empty. Deselected, each counted with
its reason: the tests of the backward pass alone (BACKWARD_ONLY) and the cases with
dropout_p > 0 (cufa has no dropout, by design). Of the rest, each test function runs at
most --sample cases, drawn uniformly by a generator seeded with --seed and the function's
name (one function's draw does not depend on another's); a function of at most --sample
cases runs them all.

DIR/flash_attn_tests.md gets the flash-attn commit, the rule, per test function the counts
(cases, left out by design, not sampled, run, passed, failed, skipped: flash-attn's own
pytest.skip calls count as skips) and every failure's node id with the first line of its
error. --workers K runs K pytest-xdist workers on the one GPU (kernel compiles then
overlap); 0, one pytest process. --time-limit stops pytest (default 540 s, under a lent
machine's 10 minutes a command); the record keeps every result that came before, and
counts the rest as not reached. The exit status is pytest's (124 when stopped).
"""
import argparse
import ast
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ALIASES = {"flash_attn": "cufa.compat.flash_attn",
           "flash_attn.flash_attn_interface": "cufa.compat.flash_attn.flash_attn_interface",
           "flash_attn.bert_padding": "cufa.compat.flash_attn.bert_padding",
           "flash_attn.layers": "cufa.compat.flash_attn.layers",
           "flash_attn.layers.rotary": "cufa.compat.flash_attn.layers.rotary"}
BACKWARD_ONLY = ("test_flash_attn_bwd_overflow", "test_flash_attn_bwd_transpose",
                 "test_flash_attn_bwd_varlen_overflow", "test_flash_attn_deterministic",
                 "test_flash_attn_varlen_deterministic")
REASONS = {"backward only": "checks the backward pass alone (--with-backward runs it)",
           "dropout": "dropout_p > 0: cufa's forward has no dropout (by design)"}


# -- removing the backward statements ---------------------------------------------------------

def _is_backward(node):
    """node calls torch.autograd.grad or .backward(), or reads .grad."""
    for n in ast.walk(node):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            f = n.func
            if f.attr == "backward" or (f.attr == "grad" and isinstance(f.value, ast.Attribute)
                                        and f.value.attr == "autograd"):
                return True
        if isinstance(n, ast.Attribute) and n.attr == "grad" and isinstance(n.ctx, ast.Load):
            return True
    return False


def _names(node, ctx):
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ctx)}


_BLOCKS = ("body", "orelse", "finalbody", "handlers")


def _headers(stmt):
    """The parts of a compound statement outside its blocks (an if's test, a for's target
    and iterable, a with's items)."""
    parts = []
    for field in ("test", "iter", "target", "items"):
        part = getattr(stmt, field, None)
        parts += part if isinstance(part, list) else [part] if part is not None else []
    return parts


def _strip(stmts, tainted, edits):
    """stmts without the backward statements; tainted (the names they assign) grows, and
    edits gets the source edits that do the same, in order: ("blank", statement) or
    ("pass", first statement of a block left empty). -> (kept statements, how many were
    removed)."""
    kept, removed = [], 0
    for stmt in stmts:
        compound = any(isinstance(getattr(stmt, b, None), list) for b in _BLOCKS) and not \
            isinstance(stmt, (ast.FunctionDef, ast.ClassDef))
        header = _headers(stmt) if compound else [stmt]
        if any(_is_backward(h) or _names(h, ast.Load) & tainted for h in header):
            tainted |= _names(stmt, ast.Store)
            edits.append(("blank", stmt))
            removed += 1
            continue
        if compound:
            emptied = set()
            for block in _BLOCKS:
                inner = getattr(stmt, block, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                    first = inner[0]
                    inner, n = _strip(inner, tainted, edits)
                    removed += n
                    if not inner:
                        emptied.add(block)
                        inner = [ast.Pass(lineno=first.lineno, col_offset=first.col_offset)]
                        edits.append(("pass", first))
                    setattr(stmt, block, inner)
            if "body" in emptied and (not getattr(stmt, "orelse", None) or "orelse" in emptied):
                edits.append(("blank", stmt))  # nothing left to run: the whole statement
                removed += 1
                continue
        kept.append(stmt)
    return kept, removed


def strip_backward(source):
    """The test file's source without its backward statements, every other line where it
    was (tracebacks keep flash-attn's line numbers) -> (source, {test function: statements
    removed})."""
    tree = ast.parse(source)
    removed, edits = {}, []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            tainted = set()
            while True:  # (until no statement reads a name removed further down, as loops do)
                node.body, n = _strip(node.body, tainted, edits)
                if not n:
                    break
                removed[node.name] = removed.get(node.name, 0) + n
    lines = source.splitlines(keepends=True)
    for kind, stmt in edits:
        if kind == "blank":
            lines[stmt.lineno - 1:stmt.end_lineno] = ["\n"] * (stmt.end_lineno - stmt.lineno + 1)
        else:
            lines[stmt.lineno - 1] = " " * stmt.col_offset + "pass\n"
    stripped = "".join(lines)
    if ast.dump(ast.parse(stripped)) != ast.dump(tree):  # (the edits do what the tree says)
        raise RuntimeError("removing the backward statements from the source went wrong")
    return stripped, removed


# -- choosing the cases (run inside pytest, from the conftest) --------------------------------

def choose(function, cases, sample, seed, with_backward=False):
    """The cases of one test function to run: cases is its parameter dicts, in pytest's
    order -> (indexes of those chosen, counts {"cases", "backward only", "dropout",
    "sampled"}). with_backward: the backward-only tests run too."""
    import random
    counts = {"cases": len(cases), "backward only": 0, "dropout": 0, "sampled": 0}
    if function in BACKWARD_ONLY and not with_backward:
        counts["backward only"] = len(cases)
        return [], counts
    runnable = [i for i, params in enumerate(cases) if not params.get("dropout_p", 0) > 0]
    counts["dropout"] = len(cases) - len(runnable)
    if len(runnable) > sample:
        runnable = sorted(random.Random(f"{seed}:{function}").sample(runnable, sample))
    counts["sampled"] = len(runnable)
    return runnable, counts


CONFTEST = '''"""Written by bench/flash_attn_tests.py: flash_attn is cufa.compat.flash_attn; the
cases run are the harness's choose(), picked from each function's parameter sets before
pytest makes test items of them (half a million items would take minutes to collect);
each result is appended to a file as it comes (a run stopped at its time limit keeps what
it did)."""
import importlib
import json
import os
import sys

import pytest

SETTINGS = json.loads({settings!r})
sys.path.insert(0, SETTINGS["bench"])
for name, target in SETTINGS["aliases"].items():
    sys.modules[name] = importlib.import_module(target)

import flash_attn_tests  # noqa: E402  (the harness: choose(), outcome())

WORKER = os.environ.get("PYTEST_XDIST_WORKER")
COUNTS = {{}}
LEFT_OUT = set()  # functions none of whose cases run (one item kept, then deselected)


@pytest.hookimpl(hookwrapper=True)
def pytest_generate_tests(metafunc):
    yield  # (after the parametrize marks made their parameter sets)
    calls, name = metafunc._calls, metafunc.function.__name__
    if not calls:
        return
    chosen, COUNTS[name] = flash_attn_tests.choose(
        name, [c.params for c in calls], SETTINGS["sample"], SETTINGS["seed"],
        SETTINGS["with_backward"])
    if not chosen:
        LEFT_OUT.add(name)
        chosen = [0]
    calls[:] = [calls[i] for i in chosen]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.originalname not in COUNTS:  # not parametrized: one case
            _, COUNTS[item.originalname] = flash_attn_tests.choose(
                item.originalname, [{{}}], SETTINGS["sample"], SETTINGS["seed"],
                SETTINGS["with_backward"])
            if not COUNTS[item.originalname]["sampled"]:
                LEFT_OUT.add(item.originalname)
    deselected = [i for i in items if i.originalname in LEFT_OUT]
    items[:] = [i for i in items if i.originalname not in LEFT_OUT]
    config.hook.pytest_deselected(items=deselected)
    if WORKER in (None, "gw0"):  # (every worker collects alike)
        with open(SETTINGS["counts"], "w") as f:
            json.dump(COUNTS, f)


def pytest_runtest_logreport(report):
    if WORKER is None:  # the process that runs the session (xdist's controller, or the only one)
        record = flash_attn_tests.outcome(report)
        if record:
            with open(SETTINGS["results"], "a") as f:
                f.write(json.dumps(record) + "\\n")
'''


# -- the run and its record --------------------------------------------------------------------

def outcome(report):
    """A pytest report -> {node id, outcome, message} where it decides the case's outcome
    (the call; a setup that did not pass; a teardown that failed), else None."""
    if not (report.when == "call" or (report.when == "setup" and not report.passed)
            or (report.when == "teardown" and report.failed)):
        return None
    longrepr = report.longrepr
    if report.skipped and isinstance(longrepr, tuple):  # (path, line, "Skipped: reason")
        message = longrepr[2]
        if message.strip().rstrip(":") == "Skipped":  # pytest.skip() without a reason
            message = f"Skipped (no reason given): {skip_site(*longrepr[:2])}"
    else:
        crash = getattr(longrepr, "reprcrash", None)
        message = getattr(crash, "message", None) or str(longrepr or "")
    lines = message.strip().splitlines()
    return dict(nodeid=report.nodeid, outcome=report.outcome,
                message=lines[0][:300] if lines else "")


def skip_site(path, lineno):
    """Where a reasonless pytest.skip() was called: the condition above it and the call, as
    `line N: if ...: pytest.skip()` (flash-attn's file skips so where a reference would
    run out of memory, or a combination it does not test)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError:
        return f"{Path(path).name}:{lineno}"
    near = [i for i in (lineno - 1, lineno, lineno - 2) if 0 <= i < len(lines)
            and "skip" in lines[i]]
    if not near:
        return f"{Path(path).name}:{lineno}"
    at = near[0]
    cond = next((lines[i].strip() for i in range(at - 1, max(at - 4, -1), -1)
                 if lines[i].strip().startswith(("if ", "elif "))), "")
    return f"line {at + 1}: {cond + ' ' if cond else ''}{lines[at].strip()}"


def outcomes(records):
    """{function: {"passed", "failed", "skipped": counts, "failures": [(node id, first
    error line)], "skips": {reason: count}}}: a case failed where any phase failed."""
    worst = {}
    for r in records:
        rank = {"passed": 0, "skipped": 1, "failed": 2}[r["outcome"]]
        if r["nodeid"] not in worst or rank > worst[r["nodeid"]][0]:
            worst[r["nodeid"]] = (rank, r)
    results = {}
    for nodeid, (_, r) in worst.items():
        fn = nodeid.split("::")[-1].split("[")[0]
        out = results.setdefault(fn, {"passed": 0, "failed": 0, "skipped": 0, "failures": [],
                                      "skips": {}})
        out[r["outcome"]] += 1
        if r["outcome"] == "failed":
            out["failures"].append((nodeid, r["message"]))
        elif r["outcome"] == "skipped":
            reason = r["message"] or "(no reason given)"
            out["skips"][reason] = out["skips"].get(reason, 0) + 1
    return results


def tree_name():
    """The cufa tree under test: CUFA_TREE (give it on a GPU machine whose copy of the
    checkout may carry an older .git), else `git describe`."""
    if os.environ.get("CUFA_TREE"):
        return os.environ["CUFA_TREE"]
    try:
        return subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git here; pass CUFA_TREE)"


def report(args, counts, results, removed, summary, device, tree=None):
    """The results file's markdown."""
    lines = [f"# flash-attn's tests against cufa ({device})", "",
             f"cufa tree: {tree or tree_name()}; device: {device}.", "",
             f"flash-attn `tests/test_flash_attn.py` at commit `{args.commit}`, run through "
             "`cufa.compat.flash_attn` by `bench/flash_attn_tests.py` (its docstring has the "
             "rules):", "",
             f"    python bench/flash_attn_tests.py {args.test_file} --commit {args.commit} "
             f"--sample {args.sample} --seed {args.seed} --workers {args.workers} "
             + ("--with-backward " if args.with_backward else "") + f"--out {args.out}", "",
             f"Sample: at most {args.sample} cases of each test function, drawn uniformly "
             f"(seed {args.seed} and the function's name); all of a function's cases where "
             "it has no more. Left out by design: "
             + "; ".join(f"{k}, {v}" for k, v in REASONS.items()) + ".", "",
             f"pytest: {summary}", "",
             "| test function | cases | left out by design | not sampled | run | passed | "
             "failed | skipped | not reached | backward statements removed |",
             "| --- |" + " ---: |" * 9]
    keys = ("cases", "by design", "not sampled", "run", "passed", "failed", "skipped",
            "not reached")
    total = dict.fromkeys(keys, 0)
    for fn in sorted(set(counts) | set(results)):
        c = counts.get(fn, {})
        r = results.get(fn, {"passed": 0, "failed": 0, "skipped": 0})
        by_design = sum(c.get(k, 0) for k in REASONS)
        run = r["passed"] + r["failed"] + r["skipped"]
        row = {"cases": c.get("cases", 0), "by design": by_design,
               "not sampled": c.get("cases", 0) - by_design - c.get("sampled", 0), "run": run,
               "passed": r["passed"], "failed": r["failed"], "skipped": r["skipped"],
               "not reached": max(c.get("sampled", 0) - run, 0)}
        for k in keys:
            total[k] += row[k]
        why = ", ".join(f"{c[k]} {k}" for k in REASONS if c.get(k))
        cells = [str(row[k]) + (f" ({why})" if k == "by design" and why else "") for k in keys]
        lines.append(f"| `{fn}` | " + " | ".join(cells) + f" | {removed.get(fn, 0)} |")
    lines.append("| **all** | " + " | ".join(str(total[k]) for k in keys) + " | |")
    skips = {}
    for r in results.values():
        for reason, n in r["skips"].items():
            skips[reason] = skips.get(reason, 0) + n
    if skips:
        lines += ["", "## Skips (flash-attn's own)", ""]
        lines += [f"- {n} x {reason}" for reason, n in sorted(skips.items())]
    failures = sorted(f for r in results.values() for f in r["failures"])
    lines += ["", f"## Failures ({len(failures)})", ""]
    lines += [f"- `{node}`: {first}" for node, first in failures] or ["None."]
    return "\n".join(lines) + "\n"


def device_name():
    try:
        import torch
        return torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    except Exception as e:  # torch missing or broken: the run itself will say more
        return f"no device ({type(e).__name__})"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                epilog="Arguments after -- go to pytest.")
    p.add_argument("test_file", help="flash-attn's tests/test_flash_attn.py")
    p.add_argument("--commit", required=True, help="the flash-attn commit it comes from")
    p.add_argument("--sample", type=int, default=20, help="cases per test function at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=4, help="pytest-xdist workers (0: none)")
    p.add_argument("--time-limit", type=float, default=540,
                   help="seconds before pytest is stopped (the record keeps what ran)")
    p.add_argument("--out", required=True, help="folder for flash_attn_tests.md")
    p.add_argument("--with-backward", action="store_true",
                   help="the whole file: no statement removed, the backward-only tests run")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)  # (what follows -- is pytest's)
    args = p.parse_args(argv[:split])
    args.pytest_args = argv[split + 1:]

    source = Path(args.test_file).read_text(encoding="utf-8")
    stripped, removed = (source, {}) if args.with_backward else strip_backward(source)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="flash_attn_tests_") as work:
        work = Path(work)
        test = work / Path(args.test_file).name
        test.write_text(stripped, encoding="utf-8")
        counts_file, results_file = work / "counts.json", work / "results.jsonl"
        settings = dict(aliases=ALIASES, sample=args.sample, seed=args.seed,
                        counts=str(counts_file), results=str(results_file),
                        bench=str(ROOT / "bench"), with_backward=args.with_backward)
        (work / "conftest.py").write_text(CONFTEST.format(settings=json.dumps(settings)),
                                          encoding="utf-8")
        (work / "pytest.ini").write_text("[pytest]\n", encoding="utf-8")
        cmd = [sys.executable, "-m", "pytest", test.name, "-q", "-p", "no:cacheprovider",
               "--rootdir", str(work), "-c", str(work / "pytest.ini")]
        if args.workers:
            cmd += ["-n", str(args.workers)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(ROOT)] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x]))
        status, summary = run_pytest(cmd + args.pytest_args, work, env, args.time_limit)
        counts = json.loads(counts_file.read_text()) if counts_file.exists() else {}
        records = ([json.loads(line) for line in results_file.read_text().splitlines()]
                   if results_file.exists() else [])
    text = report(args, counts, outcomes(records), removed, summary, device_name(), tree_name())
    (out / "flash_attn_tests.md").write_text(text, encoding="utf-8")
    print(f"wrote {out / 'flash_attn_tests.md'}")
    return status


def run_pytest(cmd, cwd, env, time_limit):
    """pytest in its own process group (xdist's workers too), stopped at time_limit:
    (exit status, its summary line)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=time_limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        sys.stdout.write(output[-5000:])
        return 124, f"stopped after {time_limit:.0f} s (--time-limit): cases not reached " \
            "are counted as such"
    sys.stdout.write(output[-5000:])
    tail = [line for line in output.splitlines() if line.strip()]
    return proc.returncode, (tail[-1].strip("= ") if tail else f"exit status {proc.returncode}")


if __name__ == "__main__":
    sys.exit(main())
