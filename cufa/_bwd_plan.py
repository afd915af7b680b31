"""Backward launches: the gradients dq, dk, dv (and the learnable sink's, an additive
mask's) of a flash_attn_func, flash_attn_varlen_func or scaled_dot_product_attention call,
from its inputs, its output, its lse and the output's gradient. The kernels (bwd/bwd_sm80.cu
on any GPU from sm_80 on, bwd/bwd_sm90.cu on Hopper) read the forward's FwdParams record
beside a BwdParams one; a call validates and plans (a _Plan: variants, both records' fields
but the addresses, the launches; kept per signature where the call passes no gradient
arrays of its own), then allocates the gradients in the caller's framework and launches
preprocess, dq, then dk/dv (or dk/dv with dq fused, then dq's sums to rows)."""
import dataclasses
import math

from . import _arrays, _compile, _heuristics, _interop, _params, _runtime, _tma
from ._checks import (ATTN_MASK_TYPES, KERNEL_DTYPES, UNBOUNDED, check_dense, check_options,
                      check_packed, window_mask_kind)
from ._fwd_plan import _broadcast_strides, _work_list_ints, tma_views
from ._runtime import (caller_stream, check_scratch, driver_launch, plans, remember, stream_call,
                       stream_workspace)

# the preprocess's rows of one head a CTA (bwd_sm80.cu: 8 warps of kPreprocessRowsPerWarp)
PREPROCESS_ROWS_PER_CTA = 128

# the arrays of each entry point's signature (_kept), by their argument names (which
# _launch reads as _ADDRESSES renames them)
_DENSE_NAMES = ("q", "k", "v", "dout", "out", "lse", "alibi_slopes", "learnable_sink", "dlse")
_PACKED_NAMES = ("q", "k", "v", "dout", "out", "lse", "cu_seqlens_q", "cu_seqlens_k",
                 "seqused_k", "alibi_slopes", "learnable_sink", "dlse")
_SDPA_NAMES = ("query", "key", "value", "dout", "out", "lse", "attn_mask", "learnable_sink",
               "dlse")
_ADDRESSES = dict(query="q", key="k", value="v")


def _kept(head, arrays, names, given, stream, scratch):
    """(key, gradients): a call that passes no output arrays of its own (given: dq, dk, dv,
    dsink, dmask) launches the plan kept for its signature (arrays: q, k, v first), which
    skips validation as the forward's plans do (a kept plan's arrays passed it); else (the
    key to keep its plan under, or None where outputs were given, and None)."""
    if any(x is not None for x in given):
        return None, None
    entries, addresses = _interop.signature(arrays, names)
    key = head + entries
    plan = plans.get(key)
    if plan is None:
        return key, None
    found = {_ADDRESSES.get(n, n): at for n, at in zip(names, addresses)}
    found.setdefault("attn_mask", 0)
    found["dmask"] = 0
    return key, _execute(plan, found, arrays[:3], (None,) * 4, stream, scratch)


def dense(dout, q, k, v, out, lse, *, alibi_slopes=None, learnable_sink=None, dq=None, dk=None,
          dv=None, dsink=None, dlse=None, softmax_scale=None, causal=False,
          window_size=(-1, -1), softcap=0.0, deterministic=False, stream=None, scratch=None):
    """flash_attn_func's gradients -> (dq, dk, dv, dsink or None). Under jax.jit: dq, dk,
    dv, dsink are XLA's output buffers, stream XLA's and scratch (address, bytes) an XLA
    buffer of scratch_bytes() (memory that stays valid where XLA replays the launches).
    dlse: the gradient of lse too (lse's shape, float32, contiguous), or None: lse's own
    derivative by a score is P, so it enters as D - dlse. deterministic: the same bits
    every run (variants_of)."""
    window, scale, softcap = check_options(softmax_scale, causal, window_size, softcap)
    key, done = _kept(("bwd_dense", window, scale, softcap, bool(deterministic)),
                      (q, k, v, dout, out, lse, alibi_slopes, learnable_sink, dlse),
                      _DENSE_NAMES, (dq, dk, dv, dsink), stream, scratch)
    if done is not None:
        return done
    a = _arrays.Dense(*(_view(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"),
                                                 (alibi_slopes, "alibi_slopes"),
                                                 (learnable_sink, "learnable_sink"),
                                                 (out, "out"))))
    aligned = check_dense(a._replace(out=None), None)
    batch, seqlen_q, nheads, d = a.q.shape
    return _run(dout, a, lse, dq, dk, dv, dsink, dlse, aligned, seq_dim=1, head_dim=2, batch=batch,
                nheads=nheads, seqlen_q=seqlen_q, seqlen_k=a.k.shape[1], d=d, window=window,
                scale=scale, softcap=softcap, stream=stream, scratch=scratch,
                lse_shape=(batch, nheads, seqlen_q), deterministic=deterministic, key=key)


def packed(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, seqused_k=None,
           alibi_slopes=None, learnable_sink=None, dq=None, dk=None, dv=None, dsink=None,
           dlse=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
           deterministic=False, stream=None, scratch=None):
    """flash_attn_varlen_func's gradients -> (dq, dk, dv, dsink or None); the rest as
    dense's."""
    window, scale, softcap = check_options(softmax_scale, causal, window_size, softcap)
    key, done = _kept(("bwd_packed", window, scale, softcap, bool(deterministic)),
                      (q, k, v, dout, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                       alibi_slopes, learnable_sink, dlse), _PACKED_NAMES, (dq, dk, dv, dsink),
                      stream, scratch)
    if done is not None:
        return done
    names = _arrays.Packed._fields
    given = dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                 seqused_k=seqused_k, alibi_slopes=alibi_slopes,
                 learnable_sink=learnable_sink, out=out)
    a = _arrays.Packed(**{n: _view(given.get(n), n) for n in names})
    batch, _, aligned = check_packed(a._replace(out=None), None)
    total_q, nheads, d = a.q.shape
    return _run(dout, a, lse, dq, dk, dv, dsink, dlse, aligned, seq_dim=0, head_dim=1, batch=batch,
                nheads=nheads, seqlen_q=total_q, seqlen_k=a.k.shape[0], d=d, window=window,
                scale=scale, softcap=softcap, stream=stream, scratch=scratch,
                lse_shape=(nheads, total_q), packed=True, deterministic=deterministic,
                key=key)


def sdpa(dout, query, key, value, out, lse, attn_mask=None, *, is_causal=False, scale=None,
         enable_gqa=False, learnable_sink=None, dq=None, dk=None, dv=None, dsink=None,
         dlse=None, dmask=None, deterministic=False, stream=None, scratch=None):
    """scaled_dot_product_attention's gradients -> (dq, dk, dv, dsink or None): query, key,
    value (batch, heads, L / S, E), lse (batch, heads, L) from the forward (return_lse);
    attn_mask (boolean or additive, broadcast) is read as the forward reads it. dmask: a
    float32 array of an additive attn_mask's shape (contiguous), overwritten with its
    gradient (dS summed over the dimensions the mask broadcasts along). The rest as
    dense's."""
    from ._checks import check_scale, check_sdpa
    scale = check_scale(scale, "scale")
    plan_key, done = _kept(("bwd_sdpa", bool(is_causal), scale, bool(enable_gqa),
                            bool(deterministic)),
                           (query, key, value, dout, out, lse, attn_mask, learnable_sink,
                            dlse), _SDPA_NAMES, (dq, dk, dv, dsink, dmask), stream, scratch)
    if done is not None:
        return done
    views = _arrays.Sdpa(*(_view(x, n) for x, n in (
        (query, "query"), (key, "key"), (value, "value"), (attn_mask, "attn_mask"),
        (learnable_sink, "learnable_sink"))))
    aligned = check_sdpa(views, bool(enable_gqa))
    a = _arrays.Dense(views.query, views.key, views.value, None, views.learnable_sink,
                      _view(out, "out"))
    batch, nheads, seqlen_q, d = a.q.shape
    window = (UNBOUNDED, 0 if is_causal else UNBOUNDED)
    return _run(dout, a, lse, dq, dk, dv, dsink, dlse, aligned, seq_dim=2, head_dim=1, batch=batch,
                nheads=nheads, seqlen_q=seqlen_q, seqlen_k=a.k.shape[2], d=d, window=window,
                scale=scale, softcap=0.0, stream=stream, scratch=scratch,
                lse_shape=(batch, nheads, seqlen_q), bottom_right=False,
                attn_mask=views.attn_mask, dmask=_mask_grad(dmask, views.attn_mask),
                deterministic=deterministic, key=plan_key)


def _mask_grad(dmask, mask):
    """dmask's view, checked against the mask it is the gradient of."""
    if dmask is None:
        return None
    dmask = _interop.as_device_array(dmask, "dmask")
    if mask is None or mask.dtype == "bool":
        raise ValueError("dmask is the gradient of an additive (float) attn_mask; there is none")
    if (dmask.dtype != "float32" or dmask.shape != mask.shape or dmask.device != mask.device
            or dmask.strides != _interop.contiguous_strides(mask.shape)):
        raise ValueError(f"dmask must be a contiguous float32 {mask.shape} on cuda:{mask.device}, "
                         f"attn_mask's shape; got {dmask.dtype} {dmask.shape} strides "
                         f"{dmask.strides} on cuda:{dmask.device}")
    return dmask


def _view(x, name):
    return None if x is None else _interop.as_device_array(x, name)


def _check_like(x, name, like, like_name):
    """dout (like out) or a caller's dq, dk, dv (like q, k, v): same shape, dtype, device and
    framework, rows readable -> whether chunk_aligned."""
    from ._checks import check_loadable
    if x.framework != like.framework and "dlpack" not in (x.framework, like.framework):
        raise TypeError(f"{name} is a {x.framework} array but {like_name} is a "
                        f"{like.framework} array")
    if x.shape != like.shape or x.dtype != like.dtype:
        raise ValueError(f"{name} must have {like_name}'s shape {like.shape} and dtype "
                         f"{like.dtype}; got {x.shape} {x.dtype}")
    if x.device != like.device:
        raise ValueError(f"{name} is on cuda:{x.device} but {like_name} is on "
                         f"cuda:{like.device}")
    return check_loadable(x, name)


def _check_grads_apart(grads, inputs):
    """The caller's dq, dk, dv: none may name one element twice (check_rows_apart), nor be
    an input or another gradient (one start address): the kernels read q, k, v, dout after
    other launches have written gradients. (Arrays that interleave in one buffer, as a
    packed dqkv's three parts do, start apart and pass.)"""
    from ._checks import check_rows_apart
    seen = {n: x for n, x in inputs.items() if x is not None and 0 not in x.shape}
    for name, g in grads.items():
        check_rows_apart(g, name)
        if 0 in g.shape:
            continue
        for other, x in seen.items():
            if x.ptr == g.ptr:
                raise ValueError(f"{name} and {other} are one array (one address), and "
                                 f"{name} is written: pass {name} an array of its own")
        seen[name] = g


def _check_lse(lse, shape, q, name="lse"):
    """lse (or its gradient, dlse): float32 in the forward's lse layout, contiguous."""
    if lse.dtype != "float32":
        raise TypeError(f"{name} must be float32 (the forward's lse, return_lse=True); got "
                        f"{lse.dtype}")
    if lse.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, the forward's lse's; got {lse.shape}")
    if lse.device != q.device:
        raise ValueError(f"{name} is on cuda:{lse.device} but q is on cuda:{q.device}")
    if 0 not in shape and lse.strides != _interop.contiguous_strides(shape):
        raise ValueError(f"{name} must be contiguous, as the forward returns lse; got strides "
                         f"{lse.strides}")


def dq_sums_layout(variants, lse_shape, batch, seqlen_q, packed, d):
    """With dq fused, its float32 sums: (floats, dq_accum's batch, row and head strides).
    The mma.sync kernel's are rows as dq's ((rows, heads, d)); the wgmma kernel's, blocks
    of 64 rows x the padded head dim (bwd_dq_blocks_kernel) a head after another, each
    sequence's from a multiple of 64 rows (a packed batch's at (q_start + 64 b) rounded
    down: at most its rows + 64 a sequence). None without dq fused."""
    if variants[1].kind != "dkdv":
        return None
    if variants[-1].kind == "dq_blocks":
        width, padded = variants[1].head_dim, -(-seqlen_q // 64) * 64
        rows = seqlen_q + 64 * batch if packed else batch * padded
        return (rows * lse_shape[-2] * width, 0 if packed else padded * width, width,
                rows * width)
    nheads = lse_shape[-2]
    return (math.prod(lse_shape) * d, 0 if packed else seqlen_q * nheads * d, nheads * d, d)


def scratch_bytes(variants, lse_shape, batch, seqlen_q, seqlen_k, packed, d):
    """Device scratch a backward needs: D (lse's shape, float32), then a packed batch's two
    work lists, then with dq fused its float32 sums (dq_sums_layout), then the persistent
    kernel's counter, each 256-byte aligned: (bytes, [offsets of D, the query list, the key
    list, the sums, the counter]; None for what the call has not)."""
    sums = dq_sums_layout(variants, lse_shape, batch, seqlen_q, packed, d)
    block_m = _dq_variant(variants).block_m
    sizes = [4 * math.prod(lse_shape)]
    sizes += [4 * _work_list_ints(total // block + batch, total // block + 2) if packed else None
              for total, block in ((seqlen_q, block_m), (seqlen_k, _keys_per_cta(variants)))]
    sizes.append(4 * sums[0] if sums else None)
    sizes.append(4 if any(v.persistent for v in variants) else None)  # (its key-block counter)
    offsets, at = [], 0
    for size in sizes:
        offsets.append(None if size is None else at)
        at += -(-(size or 0) // 256) * 256
    return at, offsets


def _dq_variant(variants):
    """The dq kernel's variant of a call (the launches' second, or with dq fused the one it
    stands for): its query tiles size num_m_blocks and the packed query list either way."""
    v = variants[1]
    return v if v.kind == "dq" else _compile.bwd_variants(v.dtype, v.head_dim, v.mask,
                                                          v.score_mods)[1]


def _keys_per_cta(variants):
    """The dk/dv kernels' key block (every dk/dv launch of a call takes the same): it sizes
    num_n_blocks and the packed key list."""
    keys = {v.block_n for v in variants if v.kind == "dkdv"}
    assert len(keys) == 1, keys
    return keys.pop()


def variants_of(q, d, window, softcap, alibi, attn_mask=None, *, seqlen_q, deterministic=False):
    """The backward's launches for a call: _compile.bwd_variants' (preprocess, dq, dk/dv...),
    or on Hopper at bwd_sm90_head_dims() _compile.bwd_sm90_variants' (dq and dk/dv on
    wgmma), or with dq fused (preprocess, dk/dv with dq fused, dq's sums to rows; never
    with attn_mask, whose gradient the dq kernel sums, nor with deterministic: the sums'
    order varies from run to run): on Hopper where _compile.bwd_sm90_fused_by_default
    says it is faster, or wherever it applies with CUFA_BWD_FUSED_DQ=1
    (bwd_sm90_fused_variants', else bwd_fused_variants'); CUFA_BWD_FUSED_DQ=0 never.
    seqlen_q: a sequence's query rows (a packed batch's total: its longest may be as
    long)."""
    if d > _compile.MAX_HEAD_DIM:
        raise NotImplementedError(f"the backward takes head dims up to {_compile.MAX_HEAD_DIM};"
                                  f" got {d} (the forward takes up to {_compile.WIDE_HEAD_DIM})")
    mask = window_mask_kind(window)
    key = (KERNEL_DTYPES[q.dtype], d, mask, softcap > 0 or alibi is not None
           or attn_mask is not None)
    wgmma = None
    if _compile.bwd_variants(*key)[1].head_dim in _compile.bwd_sm90_head_dims():
        wgmma = _compile.bwd_sm90_variants(
            *key, _compile.bwd_sm90_tiles(),
            short_window=seqlen_q <= _compile.BWD_SM90_SHORT_WINDOW_ROWS,
            producer=_compile.bwd_producer_wanted(), tma=_compile.bwd_tma_wanted(),
            split_cols=_compile.bwd_split_cols_wanted())
    if wgmma and _compile.family_for(_runtime.compute_capability(q.device)) != "sm90":
        wgmma = None
    fused, wanted = None, _compile.bwd_fused_wanted()
    persistent = _compile.bwd_persistent_wanted(seqlen_q, mask)  # (its variable checked always)
    if not deterministic and attn_mask is None and wanted is not False:
        if wanted:
            fused = ((_compile.bwd_sm90_fused_variants(*key, _compile.bwd_tma_wanted(),
                                                        persistent)
                      if wgmma else None)
                     or _compile.bwd_fused_variants(*key))
        elif wgmma and _compile.bwd_sm90_fused_by_default(wgmma[1].head_dim):
            fused = _compile.bwd_sm90_fused_variants(*key, persistent=persistent)
    return fused or wgmma or _compile.bwd_variants(*key)


def _run(dout, a, lse, dq, dk, dv, dsink, dlse, aligned, *, seq_dim, head_dim, batch, nheads,
         seqlen_q, seqlen_k, d, window, scale, softcap, stream, scratch, lse_shape,
         packed=False, bottom_right=True, attn_mask=None, dmask=None, deterministic=False,
         key=None):
    """Validate the views, plan and launch; key: the call's _runtime.plans key where its
    plan may be kept (no gradient arrays of the caller's), else None."""
    q, k, v, o = a.q, a.k, a.v, a.out
    if o is None:
        raise ValueError("out, the forward's output, is needed for the backward")
    if v.shape[-1] != d:
        raise NotImplementedError("the backward takes v with q's head dim")
    if k.dtype != q.dtype:
        raise NotImplementedError(f"the backward takes k, v in q's dtype; got {k.dtype}")
    aligned = _check_like(o, "out", q, "q") and aligned
    do = _interop.as_device_array(dout, "dout")
    aligned = _check_like(do, "dout", o, "out") and aligned
    lse_view = _interop.as_device_array(lse, "lse")
    _check_lse(lse_view, lse_shape, q)
    if dlse is not None:
        dlse = _interop.as_device_array(dlse, "dlse")
        _check_lse(dlse, lse_shape, q, "dlse")
    grads = {}
    if dsink is not None:
        dsink = _interop.as_device_array(dsink, "dsink")
        if dsink.shape != (nheads,) or dsink.dtype != "float32" or a.learnable_sink is None:
            raise ValueError(f"dsink must be float32 ({nheads},), with a learnable_sink; got "
                             f"{dsink.shape} {dsink.dtype}")
    for name, x, like, like_name in (("dq", dq, q, "q"), ("dk", dk, k, "k"), ("dv", dv, v, "v")):
        if x is not None:
            if _interop.is_jax(x):
                raise TypeError(f"{name} is a JAX array, and JAX arrays are immutable; call "
                                f"without {name}= to get a new one")
            grads[name] = _interop.as_device_array(x, name)
            aligned = _check_like(grads[name], name, like, like_name) and aligned
    _check_grads_apart(grads, dict(q=q, k=k, v=v, out=o, dout=do, lse=lse_view, dlse=dlse))
    if not aligned:
        raise NotImplementedError(
            "the backward moves rows in 16-byte chunks: q, k, v, out, dout (and dq, dk, dv "
            "if given) need a head dim that is a multiple of 8, strides that are multiples "
            "of 8 elements and 16-byte aligned starts")
    plan = _plan(a, do, grads, seq_dim=seq_dim, head_dim=head_dim, batch=batch,
                 nheads=nheads, seqlen_q=seqlen_q, seqlen_k=seqlen_k, d=d, window=window,
                 scale=scale, softcap=softcap, lse_shape=lse_shape, packed=packed,
                 bottom_right=bottom_right, attn_mask=attn_mask, dmask=dmask,
                 deterministic=deterministic)
    if key is not None:
        remember(key, plan)
    addresses = {name: x.ptr for name, x in a._asdict().items() if x is not None}
    addresses.update(out=o.ptr, dout=do.ptr, lse=lse_view.ptr,
                     dlse=dlse.ptr if dlse is not None else 0,
                     attn_mask=attn_mask.ptr if attn_mask is not None else 0,
                     dmask=dmask.ptr if dmask is not None else 0)
    return _execute(plan, addresses, (q.obj, k.obj, v.obj),
                    tuple(grads.get(n) for n in ("dq", "dk", "dv")) + (dsink,), stream, scratch)


@dataclasses.dataclass  # (not frozen: see _fwd_plan._Plan)
class _Plan:
    """What a backward's launches need besides the arrays' addresses: it follows from the
    call's signature, so where the caller passes no gradient arrays of its own (autograd's
    calls) it is made once per signature and kept in _runtime.plans beside the forward's;
    a repeated call then allocates its gradients, fills in the addresses and launches."""
    framework: str        # of the gradients
    device: int
    dtype: str
    grad_shapes: tuple    # dq's, dk's and dv's: q's, k's and v's
    like_inputs: bool     # q, k, v are of `framework`: new gradients are allocated like them
    nheads: int
    sink: bool            # a learnable sink: dsink, float32 (nheads,), zeroed, summed into
    dmask_bytes: int      # an additive mask's gradient: zeroed in the stream, summed into
    scratch_bytes: int
    offsets: list         # scratch_bytes' offsets: D, the work lists, dq's sums, the counter
    fwd: dict             # the FwdParams fields but the addresses
    bwd: dict             # the BwdParams fields but the addresses
    to_jax: bool
    schedules: tuple = ()  # a packed batch's work lists: (the schedule kernel's CUfunction,
                           # its ScheduleParams record, the cu_seqlens' name, its offset's
                           # index, its tiles)
    launches: tuple = ()   # (variant, CUfunction, blocks, maps): maps None where the kernel
                           # takes none, else (TMA template or None, the arrays it streams)
    persistent: bool = False  # a launch takes the key-block counter


def _plan(a, do, grads, *, seq_dim, head_dim, batch, nheads, seqlen_q, seqlen_k, d,
          window, scale, softcap, lse_shape, packed, bottom_right, attn_mask, dmask,
          deterministic):
    """The _Plan of validated views (grads: the caller's dq, dk, dv, where given)."""
    q, k, v, o = a.q, a.k, a.v, a.out
    nheads_k = k.shape[head_dim]
    framework = "cupy" if q.framework == "dlpack" else q.framework
    variants = variants_of(q, d, window, softcap, a.alibi_slopes, attn_mask, seqlen_q=seqlen_q,
                           deterministic=deterministic)
    block_m, block_n = _dq_variant(variants).block_m, _keys_per_cta(variants)
    sink = a.learnable_sink

    fwd = dict(nheads=nheads, nheads_k=nheads_k, head_dim=d, head_dim_v=d,
               bottom_right=int(bottom_right),
               batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
               num_m_blocks=-(-seqlen_q // block_m), heads_per_group=1,
               tail_group_head=batch * nheads,
               lse_batch_stride=0 if packed else nheads * seqlen_q, lse_head_stride=seqlen_q,
               sink_dtype=_params.SINK_DTYPES[sink.dtype] if sink is not None else 0,
               **_params.score_fields(window, scale, softcap, d, a.alibi_slopes))
    if attn_mask is not None:
        fwd["attn_mask_type"] = ATTN_MASK_TYPES[attn_mask.dtype]
        (fwd["mask_batch_stride"], fwd["mask_head_stride"], fwd["mask_row_stride"],
         fwd["mask_col_stride"]) = _broadcast_strides(attn_mask, (batch, nheads, seqlen_q,
                                                                  seqlen_k))
    bwd = dict(num_n_blocks=-(-seqlen_k // block_n), rows=(1 if packed else batch) * seqlen_q)
    if dmask is not None:
        (bwd["dmask_batch_stride"], bwd["dmask_head_stride"], bwd["dmask_row_stride"],
         bwd["dmask_col_stride"]) = _broadcast_strides(dmask, (batch, nheads, seqlen_q, seqlen_k))
    strided = [(q, "q", fwd), (k, "k", fwd), (v, "v", fwd), (o, "o", fwd), (do, "dout", bwd)]
    for name, like in (("dq", q), ("dk", k), ("dv", v)):  # (new ones are contiguous)
        strided.append((grads.get(name) or _interop.DeviceArray(
            None, framework, 0, like.shape, _interop.contiguous_strides(like.shape), q.dtype,
            q.device, like.itemsize), name, bwd))
    for x, prefix, record in strided:
        record[f"{prefix}_batch_stride"] = 0 if packed else x.strides[0]
        record[f"{prefix}_row_stride"] = x.strides[seq_dim]
        record[f"{prefix}_head_stride"] = x.strides[head_dim]
    needed, offsets = scratch_bytes(variants, lse_shape, batch, seqlen_q, seqlen_k, packed, d)
    if offsets[3] is not None:  # (dq's sums: zeroed by the preprocess)
        floats, *strides = dq_sums_layout(variants, lse_shape, batch, seqlen_q, packed, d)
        bwd.update(dq_accum_floats=floats, **dict(zip(
            ("dq_accum_batch_stride", "dq_accum_row_stride", "dq_accum_head_stride"), strides)))
    plan = _Plan(framework, q.device, q.dtype, (q.shape, k.shape, v.shape),
                 q.framework == framework, nheads, sink is not None,
                 4 * math.prod(dmask.shape) if dmask is not None else 0, needed, offsets, fwd,
                 bwd, _interop.returns_jax(q))
    if batch and nheads and (seqlen_q or seqlen_k):
        _plan_launches(plan, variants, a, do, packed, batch, seqlen_q, seqlen_k, nheads,
                       nheads_k, seq_dim, head_dim, d)
    return plan


def _execute(plan, addresses, inputs, given, stream, scratch):
    """Allocate the gradients (but the caller's `given` (dq, dk, dv, dsink) views) and
    queue the plan's launches on the caller's stream. addresses: {name: device address} of
    the arrays (_arrays' names, and out, dout, lse, dlse, attn_mask, dmask); inputs: the
    caller's q, k, v (new gradients are allocated like them)."""
    with caller_stream(plan.framework, plan.device, stream) as stream:
        outs = []
        for x, shape, like in zip(given, plan.grad_shapes, inputs):
            outs.append((x.obj, x.ptr) if x is not None else _interop.allocate(
                plan.framework, shape, plan.dtype, plan.device, stream,
                like if plan.like_inputs else None))
        # D and a packed batch's work lists: XLA's scratch under jax.jit, else the stream's
        # workspace (held until the launches are queued)
        held = None
        if scratch is not None:
            base = check_scratch(scratch, plan.scratch_bytes)
        else:
            held, base = stream_workspace(plan.framework, plan.device, stream,
                                          plan.scratch_bytes)
        places = [None if at is None else base + at for at in plan.offsets]
        dsink, dsink_ptr = (given[3].obj, given[3].ptr) if given[3] is not None else (None, 0)
        if plan.sink:
            import cupy
            if given[3] is None:  # (XLA's buffer's view has no obj)
                dsink, dsink_ptr = _interop.allocate(plan.framework, (plan.nheads,), "float32",
                                                     plan.device, stream)
            stream_call(cupy.cuda.runtime.memsetAsync, dsink_ptr, 0, 4 * plan.nheads, stream)
        if plan.dmask_bytes:  # (summed into: zeroed in the stream, as dsink)
            import cupy
            stream_call(cupy.cuda.runtime.memsetAsync, addresses["dmask"], 0, plan.dmask_bytes,
                        stream)
        if plan.launches:
            _launch(plan, stream, addresses, [ptr for _, ptr in outs], places, dsink_ptr)
        del held
    result = [x for x, _ in outs] + [dsink]
    if plan.to_jax:
        result = _interop.to_jax(*result)
    return tuple(result)


def _resident_per_sm(variant):
    """About how many CTAs of a dq or dk/dv launch an SM runs at once (for the tail rule of
    _heuristics.bwd_groups): one where a CTA has two or more warpgroups (their registers
    fill the SM); else as many as the shared memory holds, at most two (128 threads of up
    to 255 registers)."""
    if variant.threads > 128:
        return 1
    return max(1, min(2, _compile.SM90_SMEM_PER_SM // (variant.smem_bytes + 1024)))


def _streamed_template(variant, x, y, seq_dim, head_dim, d, packed):
    """The TMA maps' template (_tma.template) of a kernel whose producer streams x and y
    (kTma, bwd/bwd_sm90.cu: dq streams k and v, dk/dv q and dout) in the maps' k and v
    places (q's holds x again) and, for a packed batch, their tails; None if the copy
    engine cannot describe them or a packed batch's tails (the kernels count on those where
    the tails are on)."""
    box_rows = variant.block_n if variant.kind == "dq" else variant.block_m
    views, tails = tma_views(((x, box_rows), (x, box_rows), (y, box_rows)), seq_dim, head_dim,
                             d, packed)
    template = _tma.template(x.dtype, views, tails)
    return None if template is None or (packed and not template.has_tails) else template


def _plan_launches(plan, variants, a, do, packed, batch, seqlen_q, seqlen_k, nheads,
                   nheads_k, seq_dim, head_dim, d):
    """plan's launches, work lists and the launch-shaped fields of its records: preprocess,
    dq, dk/dv (or dk/dv with dq fused, then dq's sums to rows)."""
    q, fwd, bwd = a.q, plan.fwd, plan.bwd
    # the TMA kernels' maps; a kernel whose arrays the copy engine cannot describe (None)
    # runs its cp.async twin instead
    streamed = {v: ("k", "v") if v.kind == "dq" else ("q", "dout") for v in variants if v.tma}
    views = dict(q=q, k=a.k, v=a.v, dout=do)
    templates = {v: _streamed_template(v, views[x], views[y], seq_dim, head_dim, d, packed)
                 for v, (x, y) in streamed.items()}
    variants = tuple(dataclasses.replace(v, tma=False, persistent=False)
                     if v in templates and templates[v] is None else v for v in variants)
    fwd["kv_tail_maps"] = int(packed and any(v.tma for v in variants))  # (maps with tails)
    fused = variants[1].kind == "dkdv"
    pre, kv_variants = variants[0], variants[1:2] if fused else variants[2:]
    dq_variant = _dq_variant(variants)
    block_m, block_n = dq_variant.block_m, _keys_per_cta(variants)
    device = q.device
    q_blocks = fwd["num_m_blocks"] * batch
    kv_blocks = bwd["num_n_blocks"] * batch
    # the order of a padded batch's blocks on Hopper's kernels (a packed batch's comes from
    # its work list; the mma.sync kernels keep one head at a time, as timed)
    bwd["kv_heads_per_group"], bwd["kv_tail_group_head"] = 1, batch * nheads_k
    kv, sms = kv_variants[0], _runtime.sm_count(device)
    if not packed and kv.family == "sm90":
        bwd["kv_heads_per_group"], bwd["kv_tail_group_head"] = _heuristics.bwd_groups(
            batch * nheads_k, bwd["num_n_blocks"], seqlen_q * d * 8 * (nheads // nheads_k),
            sms * _resident_per_sm(kv), kv.mask == "window")
    if not packed and not fused and dq_variant.family == "sm90":
        fwd["heads_per_group"], fwd["tail_group_head"] = _heuristics.bwd_groups(
            batch * nheads, fwd["num_m_blocks"], seqlen_k * d * 4,
            sms * _resident_per_sm(dq_variant), dq_variant.mask == "window")
    if packed:
        q_blocks = seqlen_q // block_m + batch
        kv_blocks = seqlen_k // block_n + batch
        schedule = _compile.function_pointer(_compile.VARLEN_SCHEDULE, device)
        plan.schedules = tuple(
            (schedule, _params.SCHEDULE.pack(dict(batch=batch, total_q=total, block_m=block,
                                                  num_buckets=total // block + 2)),
             cu, at, tiles)
            for cu, total, block, tiles, at in (("cu_seqlens_q", seqlen_q, block_m, q_blocks, 1),
                                                ("cu_seqlens_k", seqlen_k, block_n, kv_blocks, 2)))
    # (a packed batch's preprocess also zeroes the gradients' rows past its last sequence:
    # at least one CTA)
    launches = [(pre, max(-(-bwd["rows"] // PREPROCESS_ROWS_PER_CTA) * nheads,
                          1 if packed else 0))]
    if not fused:
        launches.append((dq_variant, q_blocks * nheads if seqlen_q else 0))
    for v in kv_variants:  # (the persistent kernel: a CTA an SM at most, the key blocks
        # past them from a counter the preprocess zeroes)
        blocks = kv_blocks * nheads_k if seqlen_k else 0
        launches.append((v, min(blocks, sms) if v.persistent else blocks))
    if fused:  # (dq's sums, converted; the rows of sequences without keys are zeros)
        if variants[2].kind == "dq_blocks":  # (a CTA a 64-row block of a head's sums)
            sum_rows = bwd["dq_accum_head_stride"] // bwd["dq_accum_row_stride"]
            launches.append((variants[2], -(-sum_rows // 64) * nheads))
        else:  # (a thread a column)
            launches.append((variants[2], -(-bwd["rows"] * nheads * fwd["head_dim"] // 256)))
    # (bwd_sm90.cu's dq and dk/dv kernels take the maps: a TMA producer's, else none)
    plan.launches = tuple(
        (v, _compile.function_pointer(v, device), blocks,
         (templates.get(v), *streamed.get(v, ("q", "q")))
         if v.family == "sm90" and v.kind in ("dq", "dkdv") else None)
        for v, blocks in launches if blocks)
    plan.persistent = any(v.persistent for v in variants)


def _launch(plan, stream, addresses, grads, places, dsink_ptr):
    """The plan's launches on `stream` (the device current), a packed batch's work lists
    first; grads: dq's, dk's and dv's addresses; places: the scratch addresses of
    scratch_bytes' offsets."""
    lists = {}
    for function, record, cu, at, tiles in plan.schedules:
        start = places[at]
        count = start + 8 * tiles
        lists[cu] = (start, count)
        driver_launch(function, 1, _compile.VARLEN_SCHEDULE.threads, 0, stream,
                      (_params.SCHEDULE.with_pointer_values(record, (
                          addresses[cu], count + 4, start, count, 0, 0, 0, 0)),))
    tile_list, tile_count = lists.get("cu_seqlens_q", (0, 0))
    kv_tile_list, kv_tile_count = lists.get("cu_seqlens_k", (0, 0))
    get = addresses.get
    fwd_record = _params.FWD.pack(dict(
        plan.fwd, q=addresses["q"], k=addresses["k"], v=addresses["v"], o=addresses["out"],
        lse=addresses["lse"], attn_mask=addresses["attn_mask"],
        alibi_slopes=get("alibi_slopes", 0), learnable_sink=get("learnable_sink", 0),
        cu_seqlens_q=get("cu_seqlens_q", 0), cu_seqlens_k=get("cu_seqlens_k", 0),
        seqused_k=get("seqused_k", 0), tile_list=tile_list, tile_count=tile_count))
    bwd_record = _params.BWD.pack(dict(
        plan.bwd, dout=addresses["dout"], dq=grads[0], dk=grads[1], dv=grads[2],
        softmax_d=places[0], dsink=dsink_ptr, dlse=addresses["dlse"],
        dmask=addresses["dmask"], kv_tile_list=kv_tile_list, kv_tile_count=kv_tile_count,
        dq_accum=places[3] or 0, tile_counter=places[4] if plan.persistent else 0))
    args = (_params.FWD.argument(fwd_record), _params.BWD.argument(bwd_record))
    for variant, function, blocks, maps in plan.launches:
        extra = ()
        if maps is not None:
            template, x, y = maps
            extra = (_tma.with_addresses(template, addresses[x], addresses[x], addresses[y])
                     if template is not None else _tma.NO_MAPS,)
        driver_launch(function, blocks, variant.threads, variant.smem_bytes, stream,
                      args + extra)
