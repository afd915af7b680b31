"""CPU: bench_fwd.py's FA4 column and its lead summary (cufa over the better of SDPA cuDNN
and FlashAttention-4 on each row), on made-up rows."""
import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _bench_fwd():
    sys.path.insert(0, str(BENCH))  # (its own imports: _timing)
    try:
        spec = importlib.util.spec_from_file_location("bench_fwd_under_test",
                                                      BENCH / "bench_fwd.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def _row(n, causal, **tflops):
    row = dict(dtype="fp16", head_dim=128, seqlen=n, causal=causal, nheads=16, nheads_k=16,
               batch=16384 // n, impls={k: {"tflops": v} for k, v in tflops.items()})
    return row


def test_ratios_and_the_lead_summary():
    b = _bench_fwd()
    rows = [_row(512, False, cufa=400, sdpa_cudnn=380, fa4=360, sdpa_flash=270),
            _row(1024, True, cufa=330, sdpa_cudnn=350, fa4=320, sdpa_flash=230),
            _row(4096, False, cufa=600, sdpa_cudnn=560, sdpa_flash=330)]  # FA4 n/a here
    for r in rows:
        b.add_ratios(r)
    assert abs(rows[0]["ratio_vs_best_peer"] - 400 / 380) < 1e-12
    assert abs(rows[1]["ratio_vs_best_peer"] - 330 / 350) < 1e-12
    assert abs(rows[2]["ratio_vs_best_peer"] - 600 / 560) < 1e-12  # the peer that ran
    assert rows[2]["ratio_vs_fa4"] is None
    text = b.lead_summary(rows)
    assert "cufa/FA4 over 2 rows" in text and "cufa/SDPA cuDNN over 3 rows" in text
    assert "below 1.0 on 1" in text and "fp16 d=128 N=1024 causal" in text
    table = b.markdown(rows, ["cufa", "fa4", "sdpa_flash", "sdpa_cudnn"])
    assert "| FA4 |" in table and "cufa/FA4" in table


def test_fa4_missing_is_a_reason_not_an_error():
    b = _bench_fwd()
    got = b.load_fa4()
    assert callable(got) or "bench/fa4.sh" in got


def test_fp8_column():
    """--fp8 adds "cufa fp8" (cufa's flash_attn_func on e4m3 copies); a PyTorch without
    float8 gives a reason, not an error."""
    b = _bench_fwd()
    assert b.parse_args(["--fp8", "--list"]).fp8

    class NoFloat8:
        pass
    impls = b.load_impls(NoFloat8(), no_peers=True, fp8=True)
    assert set(impls) == {"cufa", "cufa_fp8"} and "float8_e4m3fn" in impls["cufa_fp8"]
    rows = [_row(4096, False, cufa=600, cufa_fp8=900)]
    assert "| cufa fp8 |" in b.markdown(rows, ["cufa", "cufa_fp8"])
