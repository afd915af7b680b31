"""bench/bench_bwd.py's tables from measured rows (no GPU): each cell, and cufa's time
against the best peer's, in each table."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import bench_bwd  # noqa: E402


def _row(causal, **ms):
    return dict(dtype="bfloat16", head_dim=128, seqlen=4096, batch=4, nheads=16, causal=causal,
                impls={name.replace("_", " "): dict(ms=t, tflops=100.0 / t)
                       for name, t in ms.items()})


def test_the_backward_table_and_the_training_step_one():
    step = bench_bwd.STEP.replace(" ", "_")
    rows = [_row(False, cufa=2.0, SDPA_flash=3.0, SDPA_cuDNN=1.0,
                 **{f"cufa_{step}": 3.0, f"SDPA_cuDNN_{step}": 2.4}),
            _row(True, cufa=1.0, SDPA_cuDNN=1.5)]
    text = bench_bwd.render(rows, ["cufa", "SDPA flash", "SDPA cuDNN"], "H", with_forward=True)
    backward, training = text.split("\n\nForward + backward")
    lines = [line for line in backward.splitlines() if line.startswith("| bfloat16")]
    assert lines[0] == "| bfloat16 | 128 | 4096 | False | 2.000 (50) | 3.000 (33) | 1.000 (100) | 0.50 |"
    assert lines[1].endswith("| 1.000 (100) | n/a | 1.500 (67) | 1.50 |")
    lines = [line for line in training.splitlines() if line.startswith("| bfloat16")]
    assert lines[0].endswith("| 3.000 (33) | n/a | 2.400 (42) | 0.80 |")
    assert lines[1].endswith("| n/a | n/a | n/a | - |")
    assert "Forward + backward" not in bench_bwd.render(rows, ["cufa"], "H")


def test_a_column_without_numbers_says_why():
    rows = [_row(False, cufa=2.0)]
    rows[0]["impls"]["FA4"] = {"na": "flash_attn.cute does not import"}
    text = bench_bwd.render(rows, ["cufa", "FA4"], "H")
    assert "| 2.000 (50) | n/a | - |" in text
    assert "- FA4: flash_attn.cute does not import" in text


def test_the_kernels_table_and_cufa_s_kernel_names():
    assert bench_bwd.kernel_label("void cufa::bwd_dq_sm90_kernel<1, 128, 0, false, 64, 64, 2>"
                                  "(cufa::FwdParams, cufa::BwdParams)") == "bwd_dq_sm90_kernel"
    assert bench_bwd.kernel_label("x" * 80) == "x" * 60
    rows = [_row(True, cufa=1.0)]
    rows[0]["kernels"] = {"cufa": {"bwd_dq_sm90_kernel": 300.0, "bwd_dkdv_sm90_kernel": 600.0,
                                   "bwd_preprocess_kernel": 20.0}}
    text = bench_bwd.render(rows, ["cufa"], "H")
    line = text.splitlines()[-1]
    assert line == ("| bfloat16 | 128 | 4096 | True | cufa | bwd_dkdv_sm90_kernel 600, "
                    "bwd_dq_sm90_kernel 300, bwd_preprocess_kernel 20 (sum 920) |")
    assert "Kernels of one backward" not in bench_bwd.render([_row(True, cufa=1.0)], ["cufa"], "H")
