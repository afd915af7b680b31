"""The backward's check: gradients against reference.attention_backward in float64, held
to the pass rule per row (_attention_check.py) with a low-precision backward of its own as
the row's yardstick: P and dS rounded to the inputs' dtype before their products, as the
kernels round them. Rows are (batch, row, head) of dq and (batch, key, KV head) of dk, dv."""
import numpy as np
import torch

from cufa import reference
from _attention_check import f64, row_bound, _row_max, _worst_row

F32_ROUNDINGS = 32  # of a gradient's sum of |terms|, beside the pass rule's bound


def _round(x, dtype):
    return torch.from_numpy(np.ascontiguousarray(x)).to(dtype).double().numpy()


def lowp_backward(q, k, v, dout, dtype, out=None, softmax_scale=None, causal=False,
                  window_size=(-1, -1), softcap=0.0, alibi_slopes=None, learnable_sink=None,
                  attn_mask=None, diag_offset=None):
    """The float64 backward with P and dS rounded to `dtype` before their products and the
    gradients rounded at the end: what the kernels' own roundings cost on this input."""
    qh, kh, vh, scale, visible, mask, diag = reference._prepare(
        q, k, v, softmax_scale, causal, window_size, attn_mask, diag_offset)
    b, h, sq, _ = qh.shape
    hk, sk = k.shape[2], kh.shape[2]
    dots = qh @ kh.transpose(0, 1, 3, 2)
    s = reference.with_sink_column(reference._score_mods(
        dots, np.arange(sq), np.arange(sk), scale=scale, softcap=softcap,
        alibi_slopes=alibi_slopes, attn_mask=mask, visible=visible, diag_offset=diag),
        learnable_sink)
    _, e, l = reference._exp_rows(s)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(l == 0, 0.0, e / l)[..., :sk]
    do = dout.transpose(0, 2, 1, 3)
    p_r = _round(p, dtype)
    # D reads the out the backward is given (an input, rounded as the forward left it)
    o = _round(p_r @ vh, dtype) if out is None else out.transpose(0, 2, 1, 3)
    dvh = p_r.transpose(0, 1, 3, 2) @ do
    ds = p * (do @ vh.transpose(0, 1, 3, 2) - (do * o).sum(-1, keepdims=True))
    if softcap:
        ds = ds * (1.0 - np.tanh(dots * scale / softcap) ** 2)
    ds_r = _round(ds, dtype)
    dqh, dkh = scale * ds_r @ kh, scale * ds_r.transpose(0, 1, 3, 2) @ qh

    def per_kv(x):
        return x.reshape(b, hk, h // hk, sk, x.shape[-1]).sum(2).transpose(0, 2, 1, 3)
    # each gradient's sum of |terms|: float32 sums of such terms (dP - D above all, which
    # cancel to 0 where a row takes all from one key) err by a few float32 roundings of it
    ds_mag = p * (np.abs(do @ vh.transpose(0, 1, 3, 2)) + np.abs((do * o).sum(-1, keepdims=True)))
    mags = (scale * ds_mag @ np.abs(kh), scale * ds_mag.transpose(0, 1, 3, 2) @ np.abs(qh),
            p.transpose(0, 1, 3, 2) @ np.abs(do))
    mags = [_row_max(x) for x in (mags[0].transpose(0, 2, 1, 3), per_kv(mags[1]), per_kv(mags[2]))]
    return ([_round(x, dtype) for x in (dqh.transpose(0, 2, 1, 3), per_kv(dkh), per_kv(dvh))],
            mags)


def check_grads(got, q, k, v, dout, label, out=None, **kw):
    """got: (dq, dk, dv[, dsink]) torch tensors; q, k, v, dout torch (and the out the
    backward read); kw as the call's. Returns the reference (its dsink, for a caller that
    sums one over sequences)."""
    np_kw = {n: (f64(x) if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    args = [f64(x) for x in (q, k, v, dout)]
    ref = reference.attention_backward(*args, **np_kw)
    lowp, mags = lowp_backward(*args, q.dtype, None if out is None else f64(out), **np_kw)
    for name, g, r, lp, mag in zip(("dq", "dk", "dv"), got[:3], (ref.dq, ref.dk, ref.dv), lowp,
                                   mags):
        g = f64(g)
        assert g.shape == r.shape, (label, name, g.shape, r.shape)
        assert np.isfinite(g).all(), f"{label}: {name} not finite"
        err = _row_max(g - r)
        bound, err_lp = row_bound(r, [lp], q.dtype)
        bound = bound + F32_ROUNDINGS * np.finfo(np.float32).eps * mag
        ratio = err / bound
        assert (ratio <= 1).all(), _worst_row(ratio, label, name, err, bound, err_lp)
    if "learnable_sink" in kw and len(got) > 3:
        dsink = f64(got[3])
        np.testing.assert_allclose(dsink, ref.dsink, rtol=2e-2, atol=1e-3 * np.abs(ref.dsink).max())
    return ref


def poisoned_like(x):
    return torch.full_like(x, float("nan"))
