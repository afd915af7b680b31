"""flash-attn 2's ``layers.rotary.apply_rotary_emb`` in plain PyTorch: rotary position
embedding of (batch, seqlen, nheads, headdim) or packed (total, nheads, headdim) arrays,
computed in float32 and rounded once to x's dtype. Gradients flow through it."""
import torch


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0,
                     cu_seqlens=None, max_seqlen=None):
    """Rotate the first rotary_dim = 2 * cos.shape[1] features of x; the rest are unchanged.

    x: (batch, seqlen, nheads, headdim), or (total, nheads, headdim) with cu_seqlens int32
    (batch + 1,) marking its sequences (max_seqlen, their longest, as flash-attn asks).
    cos, sin: (seqlen_ro, rotary_dim / 2). Token t of sequence b is at position
    t + seqlen_offsets (an int, or a (batch,) integer tensor: its entry b) and rotated by
    the angle of that row of cos and sin; positions past seqlen_ro are left unrotated.
    interleaved=True pairs features (2i, 2i + 1) (GPT-J), else (i, i + rotary_dim / 2)
    (GPT-NeoX). inplace=True writes into x and returns it.
    """
    half = cos.shape[-1]
    rotary_dim = 2 * half
    if cos.ndim != 2 or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must both be (seqlen_ro, rotary_dim / 2); got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"cos gives rotary_dim {rotary_dim}, more than x's head dim "
                         f"{x.shape[-1]}")
    device = x.device
    if cu_seqlens is None:
        if x.ndim != 4:
            raise ValueError(f"x must be (batch, seqlen, nheads, headdim); got {tuple(x.shape)}")
        positions = torch.arange(x.shape[1], device=device)[None, :]   # (1, seqlen)
        offsets = seqlen_offsets
        if isinstance(offsets, torch.Tensor):
            offsets = offsets.to(device=device, dtype=torch.long)[:, None]
    else:
        if x.ndim != 3 or max_seqlen is None:
            raise ValueError("with cu_seqlens, x must be (total, nheads, headdim) and "
                             "max_seqlen given")
        rows = torch.arange(x.shape[0], device=device)
        starts = cu_seqlens.to(device=device, dtype=torch.long)
        # the sequence of each row (rows past the last sequence: positions past seqlen_ro)
        seq = torch.searchsorted(starts[1:], rows, right=True)
        inside = seq < len(starts) - 1
        seq = seq.clamp(max=max(len(starts) - 2, 0))
        positions = torch.where(inside, rows - starts[seq], cos.shape[0])
        offsets = seqlen_offsets
        if isinstance(offsets, torch.Tensor):
            offsets = offsets.to(device=device, dtype=torch.long)[seq]
    positions = positions + offsets
    seen = (positions >= 0) & (positions < cos.shape[0])
    at = positions.clamp(0, max(cos.shape[0] - 1, 0))
    c = torch.where(seen[..., None], cos[at].float(), 1.0)[..., None, :]  # (..., 1, half)
    s = torch.where(seen[..., None], sin[at].float(), 0.0)[..., None, :]
    part = x[..., :rotary_dim].float()
    if interleaved:
        x0, x1 = part[..., 0::2], part[..., 1::2]
        rotated = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    else:
        x0, x1 = part[..., :half], part[..., half:]
        rotated = torch.cat((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    rotated = rotated.to(x.dtype)
    if inplace:
        x[..., :rotary_dim] = rotated
        return x
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


apply_rotary_emb_func = apply_rotary_emb  # (flash-attn's older name)
