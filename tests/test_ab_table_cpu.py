"""CPU: bench/ab.sh's table applies the A/B rule (a row over the baseline by more than 3 %
and its spread is SLOWER) and names a tree that timed fewer rows, rather than dropping it."""
import json
import shutil
import subprocess
from pathlib import Path

import pytest

AB = Path(__file__).resolve().parent.parent / "bench" / "ab.sh"


def _fwd_file(folder, ms_by_row, failure=None):
    rows = []
    for (d, causal), ms in ms_by_row.items():
        cufa = {"na": failure} if failure else {"ms": ms}
        rows.append(dict(dtype="fp16", head_dim=d, seqlen=512, causal=causal, nheads=16,
                         nheads_k=16, impls={"cufa": cufa}))
    folder.mkdir(parents=True)
    (folder / "bench_fwd.json").write_text(json.dumps(dict(meta=dict(device="Test GPU"),
                                                           rows=rows)))


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_table_marks_slower_rows_and_names_missing_trees(tmp_path):
    (tmp_path / "_ab").mkdir()
    (tmp_path / "_ab" / "ORDER").write_text("old abc old subject\nnew def new subject\n"
                                            "gone 123 before an argument existed\n")
    out = tmp_path / "out"
    # old: 100 us a row; new: a row 5 % slower with 1 % spread (SLOWER), a row 2 % slower
    # (under 3 %), a row 10 % slower but inside a 12 % spread (not SLOWER), a row faster
    old = {(64, False): 0.100, (64, True): 0.100, (128, False): 0.100, (128, True): 0.100}
    new_rounds = [
        {(64, False): 0.105, (64, True): 0.102, (128, False): 0.110, (128, True): 0.090},
        {(64, False): 0.1055, (64, True): 0.102, (128, False): 0.100, (128, True): 0.090},
        {(64, False): 0.1045, (64, True): 0.102, (128, False): 0.112, (128, True): 0.090},
    ]
    for rnd in range(3):
        _fwd_file(out / "fwd" / f"old.{rnd + 1}", old)
        _fwd_file(out / "fwd" / f"new.{rnd + 1}", new_rounds[rnd])
        _fwd_file(out / "fwd" / f"gone.{rnd + 1}", old, failure="TypeError: no such argument")
    run = subprocess.run(["bash", str(AB), "table", str(out)], cwd=tmp_path,
                         capture_output=True, text=True)
    text = run.stdout
    assert run.returncode == 1, text + run.stderr  # a tree timed nothing
    assert "tree gone has 0 of 4 rows; first reason: TypeError: no such argument" in text
    assert "bench_fwd on Test GPU" in text and "old abc old subject" in text
    lines = {line.split(" full")[0].split(" causal")[0] + (" causal" if " causal" in line
                                                            else " full"): line
             for line in text.splitlines() if line.startswith("fp16 d=")}
    assert "SLOWER" in lines["fp16 d=64 N=512 full"]
    assert "SLOWER" not in lines["fp16 d=64 N=512 causal"]   # 2 %: under 3 %
    assert "SLOWER" not in lines["fp16 d=128 N=512 full"]    # inside its 12 % spread
    assert "faster" in lines["fp16 d=128 N=512 causal"]
    assert "new / old: 4 rows" in text and "1 rows SLOWER" in text
    assert "SLOWER fp16 d=64 N=512 full 1.050" in text


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_table_of_the_backward(tmp_path):
    """bench_bwd.json: a row per (shape, cufa column), its ms in us."""
    (tmp_path / "_ab").mkdir()
    (tmp_path / "_ab" / "ORDER").write_text("old abc old subject\nnew def new subject\n")
    out = tmp_path / "out"
    for tree, ms in (("old", 2.0), ("new", 2.2)):
        for rnd in range(3):
            folder = out / "bwd" / f"{tree}.{rnd + 1}"
            folder.mkdir(parents=True)
            impls = {"cufa": {"ms": ms}, "cufa mma.sync": {"ms": 1.0},
                     "SDPA cuDNN": {"ms": 0.5}}
            rows = [dict(dtype="bfloat16", head_dim=128, seqlen=4096, causal=True, impls=impls)]
            (folder / "bench_bwd.json").write_text(json.dumps(dict(
                meta=dict(device="Test GPU"), rows=rows)))
    run = subprocess.run(["bash", str(AB), "table", str(out)], cwd=tmp_path,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [line for line in run.stdout.splitlines() if line.startswith("bfloat16 d=128")]
    assert len(lines) == 2  # cufa's two columns, not the peer's
    assert lines[0].startswith("bfloat16 d=128 N=4096 causal backward") and "SLOWER" in lines[0]
    assert lines[1].startswith("bfloat16 d=128 N=4096 causal mma.sync")
    assert "2000.0" in lines[0] and "1.100" in lines[0]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_table_of_mla_decode(tmp_path):
    """bench_mla.json: a row per (heads, batch, keys, tokens, page), its ms in us; a row
    without a time (na) leaves the tree short of rows, said in the table."""
    (tmp_path / "_ab").mkdir()
    (tmp_path / "_ab" / "ORDER").write_text("old abc old subject\nnew def new subject\n")
    out = tmp_path / "out"
    for tree, ms in (("old", 1.0), ("new", 0.8)):
        for rnd in range(3):
            folder = out / "mla" / f"{tree}.{rnd + 1}"
            folder.mkdir(parents=True)
            rows = [dict(batch=64, seqlen=8192, seqlen_q=1, heads=128, page=64, ms=ms),
                    dict(batch=1, seqlen=1024, seqlen_q=2, heads=128, page=64,
                         **({"na": "RuntimeError: x"} if tree == "new" else {"ms": 0.1}))]
            (folder / "bench_mla.json").write_text(json.dumps(dict(
                meta=dict(device="Test GPU"), rows=rows)))
    run = subprocess.run(["bash", str(AB), "table", str(out)], cwd=tmp_path,
                         capture_output=True, text=True)
    assert run.returncode == 1, run.stdout + run.stderr  # (new timed 1 of 2 rows)
    assert "tree new has 1 of 2 rows" in run.stdout
    (line,) = [x for x in run.stdout.splitlines() if x.startswith("128 heads B=64 N=8192 sq=1")]
    assert "faster" in line and "0.800" in line
