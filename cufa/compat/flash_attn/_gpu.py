"""flash-attn's raw entry points on cufa -- ``flash_attn_gpu``, its CUDA extension: fwd,
varlen_fwd, fwd_kvcache, bwd and varlen_bwd, with their positional signatures -- and the
translations of flash-attn's conventions that every compat function shares. The backward
entry points check their `generator` slot as flash-attn does, then run cufa's backward."""
import functools
import numbers
import operator

import torch

import cufa
from cufa._checks import MAX_PAGE_SIZE, as_index, reject_unsupported


class FlashAttnValueError(ValueError, RuntimeError):
    """A cufa ValueError that is also the RuntimeError flash-attn raises for such input
    (its checks are TORCH_CHECKs), so that code catching either catches it."""


class FlashAttnTypeError(TypeError, RuntimeError):
    """A cufa TypeError that is also flash-attn's RuntimeError (see FlashAttnValueError)."""


def runtime_errors(fn):
    """fn, raising its ValueErrors and TypeErrors as FlashAttnValueError and
    FlashAttnTypeError (same message and traceback)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ValueError, TypeError) as e:
            if isinstance(e, RuntimeError):
                raise
            kind = FlashAttnValueError if isinstance(e, ValueError) else FlashAttnTypeError
            raise kind(*e.args).with_traceback(e.__traceback__) from None
    return call


def detached(x):
    """x without its autograd history (cufa refuses inputs that require grad)."""
    return x.detach() if x is not None and x.requires_grad else x


def cufa_pages(k_cache, v_cache, block_table):
    """A paged cache as cufa takes it. flash-attn's pages hold a multiple of 256 rows and
    cufa's a power of two up to 256, so a page of 256 x m rows is seen as m pages of 256
    (views of the same memory) and each page id p of block_table as p m .. p m + m - 1 (a
    small op on the device: no sync, and a CUDA graph captures it). Other caches are
    passed on as they are, for cufa to take or to say what it takes."""
    rows = k_cache.shape[1]
    if block_table is None or rows <= MAX_PAGE_SIZE or rows % MAX_PAGE_SIZE:
        return k_cache, v_cache, block_table
    m = rows // MAX_PAGE_SIZE
    caches = []
    for cache in (k_cache, v_cache):
        pages, _, heads, d = cache.shape
        page_stride, row_stride, head_stride, col_stride = cache.stride()
        if page_stride != rows * row_stride:  # (sub-pages a single stride cannot reach)
            return k_cache, v_cache, block_table
        caches.append(cache.as_strided((pages * m, MAX_PAGE_SIZE, heads, d), (
            MAX_PAGE_SIZE * row_stride, row_stride, head_stride, col_stride)))
    parts = torch.arange(m, dtype=block_table.dtype, device=block_table.device)
    return caches[0], caches[1], (block_table.unsqueeze(-1) * m + parts).flatten(1)


def check_block_table_capacity(cache_seqlens, k, block_table, page_rows):
    """Raise, as flash-attn does, where a paged cache's longest sequence with its new keys
    passes the positions block_table addresses. flash-attn reads max(cache_seqlens) for
    it, a device sync, and so does this, except while a CUDA graph is being captured:
    there reading would break the capture, and cufa clamps the lengths instead (no access
    outside the cache; cufa.flash_attn_with_kvcache never reads them unless asked by
    check_inputs=True)."""
    if isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.ndim == 1:
        if capturing(cache_seqlens):
            return
        longest = int(cache_seqlens.max()) if cache_seqlens.numel() else 0
    elif isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        longest = int(cache_seqlens)
    else:  # None (the whole cache), or a form cufa checks itself
        return
    new = 0 if k is None else k.shape[1]
    capacity = block_table.shape[1] * page_rows
    if longest + new > capacity:
        raise RuntimeError(
            f"paged KV cache: max(cache_seqlens){' + seqlen_new' if new else ''} = "
            f"{longest + new} exceeds the {capacity} positions block_table addresses "
            f"({block_table.shape[1]} pages of {page_rows}); give block_table more columns")


def fa2_options(window_size, softcap, seqlen_k):
    """(window_size, softcap) as flash-attn 2 reads them (flash_api.cpp): a window side that
    is negative, or reaches seqlen_k or further, is unbounded (-1); where the other side is
    bounded, a right side so made unbounded is seqlen_k (a left one would be too, which
    bottom-right alignment makes the same as unbounded); and a negative softcap is off.
    cufa itself takes the sides at their word and refuses sides under -1 and a negative
    softcap. The window comes back as given where nothing changes (the default's fast
    path), and is only compared with seqlen_k, never read as an int, so that a symbolic
    length under torch.compile does not make one graph a length. Anything else is passed
    on as it is, for cufa's checks to name."""
    if isinstance(softcap, (int, float)) and not isinstance(softcap, bool) and softcap < 0:
        softcap = 0.0
    try:
        given = tuple(window_size)
        sides = [operator.index(side) for side in given]
    except TypeError:
        return window_size, softcap
    if len(sides) != 2 or any(isinstance(side, bool) for side in given):
        return window_size, softcap
    left, right = (-1 if side < 0 or side >= seqlen_k else side for side in sides)
    if left < 0 and right < 0:
        return (window_size if sides == [-1, -1] else (-1, -1)), softcap
    if right < 0:
        right = int(seqlen_k)
    return (window_size if [left, right] == sides else (left, right)), softcap


def capturing(x):
    """Whether x is a CUDA tensor and a CUDA graph is being captured on the current stream."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
            cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
            rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, out=None):
    """flash_attn_with_kvcache with flash-attn's paged caches and its block_table check."""
    window_size, softcap = fa2_options(window_size, softcap, k_cache.shape[1] * (
        1 if block_table is None else block_table.shape[1]))
    if block_table is not None:
        check_block_table_capacity(cache_seqlens, k, block_table, k_cache.shape[1])
        k_cache, v_cache, block_table = cufa_pages(k_cache, v_cache, block_table)
    return cufa.flash_attn_with_kvcache(
        detached(q), k_cache, v_cache, detached(k), detached(v), rotary_cos, rotary_sin,
        cache_seqlens, cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
        window_size, softcap, rotary_interleaved, detached(alibi_slopes), num_splits,
        return_softmax_lse, out=out)


def _no_generator(gen):
    if gen is not None:
        raise RuntimeError("generator: the `generator` argument is no longer supported and "
                           "must be None (the slot keeps the arguments' positions)")


def _softmax_needs_dropout(return_softmax, p_dropout):
    if return_softmax and not p_dropout > 0:
        raise RuntimeError("return_softmax=True needs p_dropout > 0: without dropout the "
                           "attention matrix is not returned")


def _no_softmax_no_rng(q):
    """fwd's S_dmask and rng_state without dropout: empty, and two unused int64s."""
    return [q.new_empty((0,)), torch.empty(2, dtype=torch.int64, device=q.device)]


@runtime_errors
def fwd(q, k, v, out_, alibi_slopes_, p_dropout, softmax_scale, is_causal, window_size_left,
        window_size_right, softcap, return_softmax, gen_):
    """[out, softmax_lse, S_dmask, rng_state] of (batch, seqlen, nheads, headdim) q, k, v."""
    _no_generator(gen_)
    _softmax_needs_dropout(return_softmax, p_dropout)
    window, softcap = fa2_options((window_size_left, window_size_right), softcap, k.shape[1])
    out, lse = cufa.flash_attn_func(
        detached(q), detached(k), detached(v), p_dropout, softmax_scale, is_causal, window,
        softcap, detached(alibi_slopes_), return_lse=True, out=out_)
    return [out, lse] + _no_softmax_no_rng(q)


@runtime_errors
def varlen_fwd(q, k, v, out_, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k_, block_table_,
               alibi_slopes_, max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors,
               is_causal, window_size_left, window_size_right, softcap, return_softmax, gen_,
               num_splits=0):
    """[out, softmax_lse, S_dmask, rng_state] of a packed batch (total, nheads, headdim), k
    and v a paged cache with block_table_."""
    _no_generator(gen_)
    _softmax_needs_dropout(return_softmax, p_dropout)
    if leftpad_k_ is not None:
        raise NotImplementedError("leftpad_k is not supported: cufa's packed forward has no "
                                  "left padding of the keys (flash_attn_with_kvcache has "
                                  "cache_leftpad)")
    if block_table_ is not None and as_index(num_splits, "num_splits", 0, "an int >= 0") > 1:
        raise RuntimeError("num_splits > 1 is not supported for varlen paged KV: pass 0 or 1")
    k, v, block_table = cufa_pages(k, v, block_table_)
    if zero_tensors:  # (flash-attn zeroes out, then writes the sequences' rows)
        out_ = torch.zeros_like(q) if out_ is None else out_.zero_()
    window, softcap = fa2_options((window_size_left, window_size_right), softcap, max_seqlen_k)
    out, lse = cufa.flash_attn_varlen_func(
        detached(q), detached(k), detached(v), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, p_dropout, softmax_scale, is_causal, window, softcap,
        detached(alibi_slopes_), return_lse=True, out=out_, seqused_k=seqused_k,
        block_table=block_table)
    return [out, lse] + _no_softmax_no_rng(q)


@runtime_errors
def fwd_kvcache(q, kcache, vcache, k_, v_, seqlens_k_, rotary_cos_, rotary_sin_,
                cache_batch_idx_, leftpad_k_, block_table_, alibi_slopes_, out_, softmax_scale,
                is_causal, window_size_left, window_size_right, softcap, is_rotary_interleaved,
                num_splits):
    """[out, softmax_lse] of new queries against a KV cache, appending k_ and v_."""
    return list(kvcache(q, kcache, vcache, k_, v_, rotary_cos_, rotary_sin_, seqlens_k_,
                        cache_batch_idx_, leftpad_k_, block_table_, softmax_scale, is_causal,
                        (window_size_left, window_size_right), softcap, is_rotary_interleaved,
                        alibi_slopes_, num_splits, True, out=out_))


def _softmax_d(dout, out, lse_shape, packed):
    """flash-attn's softmax_d output, rowsum(dout * out) in lse's layout (float32), by torch:
    cufa's kernels keep theirs in scratch."""
    d = (dout.detach().float() * out.detach().float()).sum(-1)  # (b, s, h) or (total, h)
    return (d.t() if packed else d.transpose(1, 2)).contiguous().view(lse_shape)


@runtime_errors
def bwd(dout, q, k, v, out, softmax_lse, dq_, dk_, dv_, alibi_slopes_, p_dropout, softmax_scale,
        is_causal, window_size_left, window_size_right, softcap, deterministic, gen_, rng_state):
    """[dq, dk, dv, softmax_d] of a flash_attn_func call, written into dq_, dk_, dv_ where
    given (cufa.flash_attn_backward)."""
    _no_generator(gen_)
    reject_unsupported(p_dropout)
    window, softcap = fa2_options((window_size_left, window_size_right), softcap, k.shape[1])
    dq, dk, dv = cufa.flash_attn_backward(
        detached(dout), detached(q), detached(k), detached(v), detached(out),
        detached(softmax_lse), softmax_scale, is_causal, window, softcap,
        detached(alibi_slopes_), deterministic, dq=dq_, dk=dk_, dv=dv_)
    return [dq, dk, dv, _softmax_d(dout, out, softmax_lse.shape, False)]


@runtime_errors
def varlen_bwd(dout, q, k, v, out, softmax_lse, dq_, dk_, dv_, cu_seqlens_q, cu_seqlens_k,
               alibi_slopes_, max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors,
               is_causal, window_size_left, window_size_right, softcap, deterministic, gen_,
               rng_state):
    """[dq, dk, dv, softmax_d] of a flash_attn_varlen_func call (cufa.flash_attn_varlen_
    backward), into dq_, dk_, dv_ where given."""
    _no_generator(gen_)
    reject_unsupported(p_dropout)
    if zero_tensors:  # (flash-attn zeroes the gradients, then writes the sequences' rows)
        for x in (dq_, dk_, dv_):
            if x is not None:
                x.zero_()
    window, softcap = fa2_options((window_size_left, window_size_right), softcap, max_seqlen_k)
    dq, dk, dv = cufa.flash_attn_varlen_backward(
        detached(dout), detached(q), detached(k), detached(v), detached(out),
        detached(softmax_lse), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        softmax_scale, is_causal, window, softcap, detached(alibi_slopes_), deterministic,
        dq=dq_, dk=dk_, dv=dv_)
    return [dq, dk, dv, _softmax_d(dout, out, softmax_lse.shape, True)]
