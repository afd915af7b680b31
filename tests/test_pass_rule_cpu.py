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


# -- subtle mutants: the bugs a kernel really makes, each as the float64 reference with the
#    bug, rounded to the dtype (what such a kernel would return), through assert_pass_rule.
#    Each must fail on the output alone (lse not given), in fp16 and bf16, causal and not,
#    at 512 and 2048 rows and keys, on three seeds. Held over the whole tensor, the rule
#    passed several of them in bf16 (the last tile's rows 10 % off, one future key) --

BLOCK = 128         # a key block and a query tile, as the kernels' tiles
SOFTCAP = 3.0       # small enough that a masked key capped to -SOFTCAP is not negligible
ALIBI = (2.0 ** -4, 2.0 ** -8)


def _scores(raw, *, scale, causal, softcap=0.0, alibi=False, alibi_sign=1.0, diag=0,
            softcap_after_mask=False, dropped_block=None, doubled_block=None,
            extra_future_key=False):
    """Final scores (h, n, n) from raw dot products, the mods in the kernels' order (scale,
    softcap, ALiBi, mask), or with one bug."""
    h, n, _ = raw.shape
    rows, cols = np.arange(n)[:, None], np.arange(n)[None, :]
    s = raw * scale
    if softcap and not softcap_after_mask:
        s = softcap * np.tanh(s / softcap)
    if alibi:
        slopes = np.asarray(ALIBI[:h])[:, None, None]
        s = s - alibi_sign * slopes * np.abs(rows - cols)
    visible = np.ones((n, n), dtype=bool)
    if causal:
        visible = cols <= rows + diag
        if extra_future_key:  # the last tile's rows see one key past the diagonal
            visible = visible | ((cols == rows + 1) & (rows >= n - BLOCK))
    if dropped_block is not None:
        visible = visible & ~((cols >= dropped_block) & (cols < dropped_block + BLOCK))
    s = np.where(visible, s, -np.inf)
    if doubled_block is not None:  # its keys' exponentials counted twice
        s = s + np.where((cols >= doubled_block) & (cols < doubled_block + BLOCK), math.log(2), 0)
    if softcap and softcap_after_mask:
        s = softcap * np.tanh(s / softcap)
    return s


def _softmax_pv(s, vh, dtype=None):
    """out (h, n, d) and lse (h, n) of scores s; with dtype, P and out rounded to it."""
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(np.isneginf(m), 0.0, m)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        pn = np.where(l == 0, 0.0, p / l)
        lse = np.where(l[..., 0] == 0, -np.inf, m[..., 0] + np.log(l[..., 0]))
    if dtype is None:
        return pn @ vh, lse
    return rounded(rounded(pn, dtype) @ vh, dtype), lse


SUBTLE_MUTANTS = {
    # name: (scores' arguments, or None for the output's mutation; causal only)
    "scale x 1.01": (dict(scale_factor=1.01), False),
    "one key block dropped": (dict(dropped_block=BLOCK), False),
    "one key block counted twice": (dict(doubled_block=BLOCK), False),
    "diagonal + 1": (dict(diag=1), True),
    "diagonal - 1": (dict(diag=-1), True),
    "one future key in the last tile": (dict(extra_future_key=True), True),
    "the last tile's rows x 1.01": (None, False),
    "ALiBi with the wrong sign": (dict(alibi_sign=-1.0), False),
    "softcap after the mask": (dict(softcap_after_mask=True), True),
}


def _mutant_case(n, causal, dtype, seed):
    """(q-side inputs made) -> per mutant: (out, ref, lowp) as (b, s, h, d) arrays."""
    rng = np.random.default_rng(seed)
    heads = 1 if n > 512 else 2
    tdt = DTYPES[dtype]
    q, k, v = (rounded(rng.standard_normal((heads, n, 64)), tdt) for _ in range(3))
    raw = q @ k.transpose(0, 2, 1)
    scale = 1 / math.sqrt(64)
    to_bshd = (lambda o: o.transpose(1, 0, 2)[None])
    cases, references = {}, {}
    for name, (bug, causal_only) in SUBTLE_MUTANTS.items():
        if causal_only and not causal:
            continue
        mods = dict(causal=causal)
        if name.startswith("ALiBi"):
            mods["alibi"] = True
        if name.startswith("softcap"):
            mods["softcap"] = SOFTCAP
        key = tuple(sorted(mods.items()))  # (mutants of the same mods share references)
        if key not in references:
            references[key] = (
                _softmax_pv(_scores(raw, scale=scale, **mods), v),
                _softmax_pv(_scores(rounded(raw, tdt), scale=scale, **mods), v, tdt))
        ref, lowp = references[key]
        if bug is None:
            bad = ref[0].copy()
            bad[:, -BLOCK:] *= 1.01
            out = rounded(bad, tdt)
        else:
            bug = dict(bug)
            factor = bug.pop("scale_factor", 1.0)
            out = _softmax_pv(_scores(raw, scale=scale * factor, **mods, **bug), v, None)[0]
            out = rounded(out, tdt)
        cases[name] = (to_bshd(out), (to_bshd(ref[0]), ref[1][None]),
                       (to_bshd(lowp[0]), lowp[1][None]), ref)
    return cases


@pytest.mark.parametrize("n", [512, 2048])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_pass_rule_rejects_subtle_mutants(n, causal, dtype):
    tdt = DTYPES[dtype]
    passed = []
    for seed in range(3):
        checked = set()  # (mutants of the same mods share their references: one check each)
        for name, (out, ref, lowp, ref_hnd) in _mutant_case(n, causal, dtype, seed).items():
            if id(ref_hnd) not in checked:
                checked.add(id(ref_hnd))
                # the correct output, rounded, passes: the bound is not trivially tight
                good = torch.from_numpy(rounded(ref[0], tdt)).to(tdt)
                assert_pass_rule(good, None, ref, lowp, tdt, f"correct, for {name}")
            try:
                assert_pass_rule(torch.from_numpy(out).to(tdt), None, ref, lowp, tdt, name)
            except AssertionError:
                continue
            passed.append(f"{name} (seed {seed})")
    assert not passed, f"mutants the per-row rule let through: {passed}"
