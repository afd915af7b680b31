"""flash-attn 2's ``layers.rotary`` in plain PyTorch: apply_rotary_emb (rotary position
embedding of (batch, seqlen, nheads, headdim) or packed (total, nheads, headdim) arrays,
computed in float32 and rounded once to x's dtype), its in-place forms for packed qkv and
kv, the unfused reference apply_rotary_emb_torch, and the RotaryEmbedding module (with
xPos). Gradients flow through all of them; the in-place forms, as flash-attn's, also take
a leaf that requires grad (_in_place)."""
import torch


class _RotateInPlace(torch.autograd.Function):
    """x rotated in place where autograd does not see the write (flash-attn's in-place
    functions take a leaf that requires grad, which a plain in-place write would refuse),
    returned as an alias of x whose gradient is rotated back: rotate(t, conjugate) rotates
    t's parts in place, by -sin where conjugate (a rotation's transpose, xPos's too)."""

    @staticmethod
    def forward(ctx, x, rotate):
        with torch.no_grad():
            rotate(x, False)
        ctx.rotate = rotate
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        with torch.no_grad():
            ctx.rotate(grad, True)
        return grad, None


def _in_place(x, rotate):
    """x after rotate(x, False) in place: through _RotateInPlace where x takes part in
    autograd (an alias of x comes back, as from flash-attn), else x itself."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _RotateInPlace.apply(x, rotate)
    rotate(x, False)
    return x


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0,
                     cu_seqlens=None, max_seqlen=None):
    """Rotate the first rotary_dim = 2 * cos.shape[1] features of x; the rest are unchanged.

    x: (batch, seqlen, nheads, headdim), or (total, nheads, headdim) with cu_seqlens int32
    (batch + 1,) marking its sequences (max_seqlen, their longest, as flash-attn asks).
    cos, sin: (seqlen_ro, rotary_dim / 2). Token t of sequence b is at position
    t + seqlen_offsets (an int, or a (batch,) integer tensor: its entry b) and rotated by
    the angle of that row of cos and sin; positions past seqlen_ro are left unrotated.
    interleaved=True pairs features (2i, 2i + 1) (GPT-J), else (i, i + rotary_dim / 2)
    (GPT-NeoX). inplace=True writes into x and returns it (an alias of it where x requires
    grad, as flash-attn returns).
    """
    if not inplace:
        return _rotated_copy(x, cos, sin, interleaved, seqlen_offsets, cu_seqlens, max_seqlen)

    def rotate(t, conjugate):
        t.copy_(_rotated_copy(t, cos, -sin if conjugate else sin, interleaved, seqlen_offsets,
                              cu_seqlens, max_seqlen))
    return _in_place(x, rotate)


def _rotated_copy(x, cos, sin, interleaved, seqlen_offsets, cu_seqlens, max_seqlen):
    """apply_rotary_emb's rotation, out of place."""
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
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


apply_rotary_emb_func = apply_rotary_emb  # (flash-attn's older name)


def apply_rotary_emb_torch(x, cos, sin, interleaved=False):
    """flash-attn's unfused reference: x (batch, seqlen, nheads, headdim) rotated by cos,
    sin of (seqlen, rotary_dim / 2) or (batch, seqlen, rotary_dim / 2), position t by row t,
    in x's dtype (no offsets; cos has a row for every position)."""
    half = cos.shape[-1]
    if 2 * half > x.shape[-1]:
        raise ValueError(f"cos gives rotary_dim {2 * half}, more than x's head dim {x.shape[-1]}")
    c, s = cos[..., None, :], sin[..., None, :]  # (.., seqlen, 1, half)
    part = x[..., :2 * half]
    if interleaved:
        x0, x1 = part[..., 0::2], part[..., 1::2]
    else:
        x0, x1 = part[..., :half], part[..., half:]
    r0, r1 = x0 * c - x1 * s, x0 * s + x1 * c
    rotated = torch.stack((r0, r1), dim=-1).flatten(-2) if interleaved else torch.cat((r0, r1), -1)
    return torch.cat((rotated, x[..., 2 * half:]), dim=-1)


def _q_and_k(qkv, num_heads_q):
    """Views of q and k in a packed qkv: (b, s, 3, h, d), or (b, s, hq + 2 hk, d) with hq."""
    if qkv.ndim == 5:
        if qkv.shape[2] != 3:
            raise ValueError(f"qkv must be (batch, seqlen, 3, nheads, headdim); got "
                             f"{tuple(qkv.shape)}")
        return qkv[:, :, 0], qkv[:, :, 1]
    if qkv.ndim != 4 or num_heads_q is None:
        raise ValueError(f"qkv must be (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, "
                         f"num_heads_q + 2 * num_heads_k, headdim) with num_heads_q given; got "
                         f"{tuple(qkv.shape)} and num_heads_q={num_heads_q}")
    heads_k, odd = divmod(qkv.shape[2] - num_heads_q, 2)
    if heads_k < 1 or odd:
        raise ValueError(f"qkv's {qkv.shape[2]} heads are not num_heads_q={num_heads_q} plus "
                         f"twice a KV head count")
    return qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q:num_heads_q + heads_k]


def apply_rotary_emb_qkv_(qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False,
                          seqlen_offsets=0, num_heads_q=None):
    """Rotate q and k of a packed qkv in place and return it (an alias where it requires
    grad, as apply_rotary_emb's inplace): (batch, seqlen, 3, nheads,
    headdim), or (batch, seqlen, num_heads_q + 2 * num_heads_k, headdim) with num_heads_q
    given (GQA / MQA). k takes cos_k, sin_k where given (xPos), else cos, sin; v is left as
    it is. Offsets as apply_rotary_emb's."""
    _q_and_k(qkv, num_heads_q)  # (the shape's checks, before any write)
    cos_k, sin_k = cos if cos_k is None else cos_k, sin if sin_k is None else sin_k

    def rotate(t, conjugate):
        q, k = _q_and_k(t, num_heads_q)
        for part, c, s in ((q, cos, sin), (k, cos_k, sin_k)):
            part.copy_(_rotated_copy(part, c, -s if conjugate else s, interleaved, seqlen_offsets,
                                     None, None))
    return _in_place(qkv, rotate)


def apply_rotary_emb_kv_(kv, cos, sin, interleaved=False, seqlen_offsets=0):
    """Rotate k of a packed kv (batch, seqlen, 2, nheads, headdim) in place and return kv."""
    if kv.ndim != 5 or kv.shape[2] != 2:
        raise ValueError(f"kv must be (batch, seqlen, 2, nheads, headdim); got {tuple(kv.shape)}")

    def rotate(t, conjugate):
        t[:, :, 0].copy_(_rotated_copy(t[:, :, 0], cos, -sin if conjugate else sin, interleaved,
                                       seqlen_offsets, None, None))
    return _in_place(kv, rotate)


class RotaryEmbedding(torch.nn.Module):
    """flash-attn's rotary embedding module (RoFormer's rotation; with scale_base, xPos's
    decay, q times scale^p and k divided by it, p = (position - seqlen // 2) / scale_base).

    dim: the rotary dim (features 0..dim-1 of each head rotate); inv_freq =
    base^(-2i / dim). forward rotates qkv (and kv) in place: qkv (batch, seqlen, 3, nheads,
    headdim), or (batch, seqlen, num_heads_q + 2 * num_heads_k, headdim) with num_heads_q;
    or, with kv (batch, seqlen, 2, nheads_k, headdim) given, qkv is q alone and (q, kv)
    comes back. seqlen_offset: an int, or a (batch,) tensor with max_seqlen given (the
    tables are then built up to max_seqlen). The cos / sin tables are kept in qkv's dtype and
    device and rebuilt when a longer sequence, another dtype or device, or training after
    inference mode asks for them (the attribute names are flash-attn's, which subclasses
    override)."""

    def __init__(self, dim, base=10000.0, interleaved=False, scale_base=None,
                 pos_idx_in_fp32=True, device=None):
        super().__init__()
        self.dim = dim
        self.base = float(base)
        self.pos_idx_in_fp32 = pos_idx_in_fp32
        self.register_buffer("inv_freq", self._compute_inv_freq(device), persistent=False)
        self.interleaved = interleaved
        self.scale_base = scale_base
        self.register_buffer("scale", None if scale_base is None else self._compute_scale(device),
                             persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = self._sin_cached = None
        self._cos_k_cached = self._sin_k_cached = None

    def _compute_inv_freq(self, device=None):
        exponents = torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim
        return 1.0 / self.base ** exponents

    def _compute_scale(self, device=None):
        return ((torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) + 0.4 * self.dim)
                / (1.4 * self.dim))

    def _update_cos_sin_cache(self, seqlen, device=None, dtype=None):
        cached = self._cos_cached
        if (cached is not None and seqlen <= self._seq_len_cached and cached.device == device
                and cached.dtype == dtype and not (self.training and cached.is_inference())):
            return
        self._seq_len_cached = seqlen
        # Angles in float32 whatever the module's dtype: positions reach the thousands, and
        # a bf16 angle there is off by whole turns' worth of its last bit
        if self.pos_idx_in_fp32:
            positions = torch.arange(seqlen, device=device, dtype=torch.float32)
            inv_freq = (self.inv_freq if self.inv_freq.dtype == torch.float32
                        else self._compute_inv_freq(device))
        else:
            positions = torch.arange(seqlen, device=device, dtype=self.inv_freq.dtype)
            inv_freq = self.inv_freq
        angles = torch.outer(positions, inv_freq.to(positions.device))
        cos, sin = torch.cos(angles), torch.sin(angles)
        if self.scale is None:
            self._cos_cached, self._sin_cached = cos.to(dtype), sin.to(dtype)
            return
        scale = self.scale if self.scale.dtype == torch.float32 else self._compute_scale(device)
        power = (torch.arange(seqlen, device=device, dtype=torch.float32) - seqlen // 2) / \
            self.scale_base
        decay = scale.to(power.device)[None, :] ** power[:, None]  # (seqlen, dim / 2)
        self._cos_cached, self._sin_cached = (cos * decay).to(dtype), (sin * decay).to(dtype)
        self._cos_k_cached, self._sin_k_cached = (cos / decay).to(dtype), (sin / decay).to(dtype)

    def forward(self, qkv, kv=None, seqlen_offset=0, max_seqlen=None, num_heads_q=None):
        if max_seqlen is not None:
            self._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
        elif isinstance(seqlen_offset, int):
            self._update_cos_sin_cache(qkv.shape[1] + seqlen_offset, device=qkv.device,
                                       dtype=qkv.dtype)
        elif self._cos_cached is None:
            raise ValueError("a tensor seqlen_offset needs max_seqlen (the tables' length)")
        xpos = self.scale is not None
        cos_k = self._cos_k_cached if xpos else self._cos_cached
        sin_k = self._sin_k_cached if xpos else self._sin_cached
        if kv is None:
            return apply_rotary_emb_qkv_(qkv, self._cos_cached, self._sin_cached, cos_k, sin_k,
                                         self.interleaved, seqlen_offset, num_heads_q)
        q = apply_rotary_emb(qkv, self._cos_cached, self._sin_cached, self.interleaved, True,
                             seqlen_offset)
        return q, apply_rotary_emb_kv_(kv, cos_k, sin_k, self.interleaved, seqlen_offset)
