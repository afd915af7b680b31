"""CPU: bench/flash_attn_tests.py, the harness that runs flash-attn's own test file against
cufa: its removal of the backward statements, its choice of cases, and a whole run on a
small stand-in for flash-attn's file (torch on the CPU, so its attention calls fail with
cufa's error, which the record must show)."""
import ast
import importlib.util
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("flash_attn_tests",
                                               ROOT / "bench" / "flash_attn_tests.py")
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)

SOURCE = textwrap.dedent('''\
    import torch


    def helper(dq_unpad):
        return dq_unpad


    def test_grads(kvpacked):
        q = torch.randn(3, requires_grad=True)
        out = q * 2
        g = torch.randn_like(out)
        if kvpacked:
            (
                dq,
                dkv,
            ) = torch.autograd.grad(out, (q, q), g)
            dk, dv = dkv.unbind(0)
        else:
            dq, dk, dv = torch.autograd.grad(out, (q, q, q), g)
        dq_pad_fn, dk_pad_fn = helper, helper
        print(f"dQ max diff: {dq.abs().max().item()}")
        dq_atol = 2 * dq.abs().max().item()
        test_backward = kvpacked
        if test_backward:
            assert dq.abs().max().item() <= dq_atol
        else:
            x = 1
        for i in range(3):
            assert out.sum() == out.sum()
            dq_equal = torch.allclose(dq, dq)
            if not dq_equal:
                print("differs")
        out.backward(g)
        print(q.grad)
        assert out.shape == (3,)


    def test_no_backward():
        assert 1 + 1 == 2
    ''')


def test_backward_statements_removed_and_every_other_line_kept():
    stripped, removed = harness.strip_backward(SOURCE)
    assert removed == {"test_grads": 11}
    kept = stripped.splitlines()
    assert len(kept) == len(SOURCE.splitlines())  # flash-attn's line numbers hold
    for before, after in zip(SOURCE.splitlines(), kept):
        assert after in (before, "") or after.strip() == "pass"
    body = ast.unparse(ast.parse(stripped))
    for gone in ("autograd", ".backward(", ".grad", "dq ", "dkv", "dq_atol", "dq_equal",
                 "differs", "dk, dv"):
        assert gone not in body, gone
    for stays in ("g = torch.randn_like(out)", "dq_pad_fn, dk_pad_fn = (helper, helper)",
                  "test_backward = kvpacked", "x = 1", "for i in range(3):",
                  "assert out.shape == (3,)", "def helper(dq_unpad):", "assert 1 + 1 == 2"):
        assert stays in body, stays
    # the if whose body held only backward statements keeps its else, with a pass
    assert re.search(r"if test_backward:\s+pass\s+else:\s+x = 1", body)
    compile(stripped, "stripped", "exec")


def test_choose_leaves_out_backward_only_tests_and_dropout_then_samples():
    cases = [dict(dropout_p=p, d=d) for p in (0.0, 0.17) for d in range(10)]
    chosen, counts = harness.choose("test_flash_attn_output", cases, 4, seed=3)
    assert counts == {"cases": 20, "backward only": 0, "dropout": 10, "sampled": 4}
    assert len(chosen) == 4 and chosen == sorted(chosen)
    assert all(cases[i]["dropout_p"] == 0 for i in chosen)
    again, _ = harness.choose("test_flash_attn_output", cases, 4, seed=3)
    other_seed, _ = harness.choose("test_flash_attn_output", cases, 4, seed=4)
    other_function, _ = harness.choose("test_flash_attn_varlen_output", cases, 4, seed=3)
    assert again == chosen and (other_seed != chosen or other_function != chosen)
    few, counts = harness.choose("test_flash_attn_output", cases, 10, seed=3)
    assert few == list(range(10)) and counts["sampled"] == 10  # all, where no more
    none, counts = harness.choose("test_flash_attn_deterministic", cases, 50, seed=3)
    assert none == [] and counts["backward only"] == 20 and counts["sampled"] == 0
    # --with-backward: the backward-only tests run too (dropout still left out)
    some, counts = harness.choose("test_flash_attn_deterministic", cases, 50, seed=3,
                                  with_backward=True)
    assert some == list(range(10)) and counts["backward only"] == 0 and counts["dropout"] == 10


STAND_IN = textwrap.dedent('''\
    import pytest
    import torch

    import flash_attn
    from flash_attn import flash_attn_func
    from flash_attn.bert_padding import unpad_input
    from flash_attn.flash_attn_interface import USE_TRITON_ROCM, _get_block_size_n
    from flash_attn.layers.rotary import apply_rotary_emb


    def test_aliases():
        import cufa.compat.flash_attn as compat
        assert flash_attn is compat and unpad_input is compat.bert_padding.unpad_input
        assert USE_TRITON_ROCM is False


    @pytest.mark.parametrize("dropout_p", [0.0, 0.17])
    @pytest.mark.parametrize("d", [32, 40, 64, 128, 256])
    def test_flash_attn_output(d, dropout_p):
        if d == 40:
            pytest.skip("a skip of flash-attn's own")
        if d == 128:
            pytest.skip()
        q = torch.randn(1, 4, 2, d, dtype=torch.float16, requires_grad=True)
        out = flash_attn_func(q, q, q, dropout_p)
        (dq,) = torch.autograd.grad(out, q, torch.randn_like(out))
        assert dq.shape == q.shape


    @pytest.mark.parametrize("seqlen", [1, 2])
    def test_flash_attn_deterministic(seqlen):
        raise AssertionError("a backward-only test ran")
    ''')


def _run_on_the_stand_in(tmp_path, *options):
    """bench/flash_attn_tests.py over STAND_IN (3 cases a function, no workers) -> (the
    finished process, its --out folder)."""
    test_file = tmp_path / "test_flash_attn.py"
    test_file.write_text(STAND_IN)
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "flash_attn_tests.py"),
                          str(test_file), "--commit", "abc1234", "--sample", "3", "--seed", "0",
                          "--workers", "0", *options, "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    return run, out


def test_a_whole_run_on_a_stand_in(tmp_path):
    pytest.importorskip("torch", reason="the compat module the run imports needs PyTorch")
    run, out = _run_on_the_stand_in(tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr  # the attention calls fail on a CPU
    text = (out / "flash_attn_tests.md").read_text()
    assert "commit `abc1234`" in text
    rows = {cells[0].strip("` "): cells[1:] for cells in
            (line.strip("|").split("|") for line in text.splitlines()
             if line.startswith("| `"))}
    cols = ["cases", "by design", "not sampled", "run", "passed", "failed", "skipped",
            "not reached", "removed"]
    got = {fn: dict(zip(cols, (c.strip().split(" ")[0] for c in cells)))
           for fn, cells in rows.items()}
    assert got["test_aliases"] == dict(cases="1", **{"by design": "0"}, **{"not sampled": "0"},
                                       run="1", passed="1", failed="0", skipped="0",
                                       **{"not reached": "0"}, removed="0")
    output = got["test_flash_attn_output"]
    assert (output["cases"], output["by design"], output["not sampled"], output["run"]) == (
        "10", "5", "2", "3")
    assert int(output["failed"]) + int(output["skipped"]) == 3 and output["removed"] == "2"
    assert got["test_flash_attn_deterministic"]["by design"] == "2"
    assert got["test_flash_attn_deterministic"]["run"] == "0"
    assert "cufa needs CUDA device arrays" in text  # the first line of each failure
    assert re.search(r"- `test_flash_attn\.py::test_flash_attn_output\[\d+-0\.0\]`: \S+", text)
    assert "Skipped: a skip of flash-attn's own" in text
    assert "Skipped (no reason given): line 23: if d == 128: pytest.skip()" in text
    assert "cufa tree: " in text


def test_a_whole_run_with_the_backward(tmp_path):
    """--with-backward: the file as it is, the backward-only tests sampled too."""
    pytest.importorskip("torch", reason="the compat module the run imports needs PyTorch")
    run, out = _run_on_the_stand_in(tmp_path, "--with-backward")
    assert run.returncode == 1, run.stdout + run.stderr
    rows = {cells[0].strip("` "): [c.strip().split(" ")[0] for c in cells[1:]] for cells in
            (line.strip("|").split("|") for line in
             (out / "flash_attn_tests.md").read_text().splitlines() if line.startswith("| `"))}
    assert rows["test_flash_attn_deterministic"][1:4] == ["0", "0", "2"], rows
    assert {r[-1] for r in rows.values()} == {"0"}  # no statement removed
    assert "--with-backward --out" in (out / "flash_attn_tests.md").read_text()
