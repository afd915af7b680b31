"""CPU: the pass rule of _attention_check.py rejects wrong outputs (mutation checks).

A stand-in for a correct kernel (the float64 reference rounded to the dtype) passes
against a low-precision reference computed here as lowp_attention computes it on the
GPU (both products rounded to the dtype); the same output zeroed, with its rows
shifted, with one element off by 5 % of the output's scale or one NaN, and with a wrong
lse, each fail. test_gpu_mutation.py applies the same MUTATIONS to cufa's outputs."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cufa import reference  # noqa: E402
from _attention_check import DTYPES, assert_pass_rule  # noqa: E402


def zeroed(out, lse):
    return torch.zeros_like(out), lse


def rows_shifted(out, lse):
    """Each query row given its neighbour's output (batch rows, where one query row)."""
    return out.roll(1, dims=1 if out.shape[1] > 1 else 0), lse


def one_element_off(out, lse):
    bad = out.clone()
    bad[0, -1, 0, 1] += 0.05 * out.double().abs().max().item()
    return bad, lse


def one_nan(out, lse):
    bad = out.clone()
    bad[-1, 0, -1, 0] = math.nan
    return bad, lse


def lse_in_log2_units(out, lse):
    return out, lse / math.log(2)


def lse_one_row_off(out, lse):
    bad = lse.clone()
    bad[0, 0, -1] += 0.01
    return out, bad


def lse_row_without_keys(out, lse):
    bad = lse.clone()
    bad[-1, -1, -1] = -math.inf
    return out, bad


MUTATIONS = [zeroed, rows_shifted, one_element_off, one_nan, lse_in_log2_units, lse_one_row_off,
             lse_row_without_keys]


def rounded(x, dtype):
    """float64 NumPy x rounded to a torch dtype, back in float64."""
    return torch.from_numpy(np.ascontiguousarray(x)).to(dtype).double().numpy()


def lowp_attention_cpu(q, k, v, dtype, causal):
    """Naive attention with Q K^T and P V rounded to dtype (float64 products of rounded
    values, then rounded: the GPU's float32-accumulated products, to their rounding)."""
    qh, kh, vh = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    s = rounded(qh @ kh.transpose(0, 1, 3, 2), dtype) / math.sqrt(q.shape[-1])
    if causal:  # bottom-right aligned
        sq, sk = s.shape[-2:]
        s = np.where(np.arange(sk)[None] <= np.arange(sq)[:, None] + sk - sq, s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    out = rounded(rounded(p / l, dtype) @ vh, dtype)
    return out.transpose(0, 2, 1, 3), (m + np.log(l))[..., 0]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.__name__ for m in MUTATIONS])
def test_pass_rule_rejects_a_corrupted_output(dtype, mutation):
    rng = np.random.default_rng(7)
    tdt = DTYPES[dtype]
    q, k, v = (rounded(rng.standard_normal(shape), tdt)
               for shape in ((2, 37, 4, 64), (2, 50, 4, 64), (2, 50, 4, 64)))
    ref = reference.attention(q, k, v, causal=True)
    lowp = lowp_attention_cpu(q, k, v, tdt, causal=True)
    out = torch.from_numpy(ref[0]).to(tdt)
    lse = torch.from_numpy(ref[1]).float()
    assert_pass_rule(out, lse, ref, lowp, tdt, "the reference, rounded")
    with pytest.raises(AssertionError):
        assert_pass_rule(*mutation(out, lse), ref, lowp, tdt, mutation.__name__)
