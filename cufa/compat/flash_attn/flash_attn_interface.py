"""flash-attn 2's ``flash_attn_interface`` on cufa's kernels: its seven public functions
with flash-attn's signatures, defaults and returns, the private helpers its own tests
import (_flash_attn_forward, _flash_attn_varlen_forward, _get_block_size_n,
USE_TRITON_ROCM) and ``flash_attn_gpu``, its raw entry points.

Where it differs from flash-attn, by design:
- dropout_p > 0 raises NotImplementedError: cufa's forward has no dropout;
- gradients flow through cufa's backward (torch autograd), but for flash_attn_with_kvcache
  and paged caches, whose inputs that require grad get the forward and a backward through
  its outputs raises NotImplementedError;
- cufa's ValueErrors and TypeErrors are also RuntimeErrors, as flash-attn's are;
- nothing is copied: odd head dims are read as they are, packed qkv and kv in place.
"""
import torch

import cufa
from cufa._checks import NO_WINDOW

# (by its full name: `from . import _gpu` names this package, whose __init__ imports this
# module, and the import graph would read as a cycle)
import cufa.compat.flash_attn._gpu as flash_attn_gpu
from ._gpu import fa2_options, runtime_errors

USE_TRITON_ROCM = False  # (flash-attn's switch to its ROCm Triton kernels)


class _ForwardOnly(torch.autograd.Function):
    """A cufa forward without a backward, of inputs that require grad: it runs on them
    detached, and a backward through any of its outputs raises, naming the function."""

    @staticmethod
    def forward(ctx, name, run, *tensors):
        ctx.name = name
        return run(*(None if t is None else t.detach() for t in tensors))

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            f"{ctx.name}: cufa has no backward pass for it, so no gradient flows through "
            "attention; run it under torch.no_grad() or on detached inputs where none should")


def _attention(name, run, *tensors, differentiable=True):
    """run(*tensors). cufa's flash_attn_func and flash_attn_varlen_func record their own
    backward where autograd records; the others run through _ForwardOnly then."""
    if not differentiable and torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in tensors):
        return _ForwardOnly.apply(name, run, *tensors)
    return run(*tensors)


@runtime_errors
def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=NO_WINDOW, softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """flash-attn 2's flash_attn_func: q (batch, seqlen_q, nheads, headdim), k and v
    (batch, seqlen_k, nheads_k, headdim) -> out like q, or (out, softmax_lse (batch,
    nheads, seqlen_q), S_dmask (empty)) with return_attn_probs. Masks align bottom-right
    (cufa.flash_attn_func)."""
    window, cap = fa2_options(window_size, softcap, k.shape[1])

    def run(q, k, v, alibi_slopes):
        return cufa.flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window, cap,
                                    alibi_slopes, deterministic, return_attn_probs)
    return _attention("flash_attn_func", run, q, k, v, alibi_slopes)


@runtime_errors
def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=NO_WINDOW, softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """flash_attn_func of qkv (batch, seqlen, 3, nheads, headdim), read in place."""
    window, cap = fa2_options(window_size, softcap, qkv.shape[1])

    def run(qkv, alibi_slopes):
        return cufa.flash_attn_func(*qkv.unbind(2), dropout_p, softmax_scale, causal, window,
                                    cap, alibi_slopes, deterministic, return_attn_probs)
    return _attention("flash_attn_qkvpacked_func", run, qkv, alibi_slopes)


@runtime_errors
def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=NO_WINDOW, softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """flash_attn_func of q and kv (batch, seqlen_k, 2, nheads_k, headdim), read in place."""
    window, cap = fa2_options(window_size, softcap, kv.shape[1])

    def run(q, kv, alibi_slopes):
        return cufa.flash_attn_func(q, *kv.unbind(2), dropout_p, softmax_scale, causal, window,
                                    cap, alibi_slopes, deterministic, return_attn_probs)
    return _attention("flash_attn_kvpacked_func", run, q, kv, alibi_slopes)


@runtime_errors
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=NO_WINDOW,
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    """flash-attn 2's flash_attn_varlen_func: q (total_q, nheads, headdim), k and v
    (total_k, nheads_k, headdim), or with block_table a paged cache (num_pages,
    page_block_size, nheads_k, headdim) -> out like q, or (out, softmax_lse (nheads,
    total_q), S_dmask (empty)) with return_attn_probs."""
    window, cap = fa2_options(window_size, softcap, max_seqlen_k)

    def run(q, k, v, alibi_slopes):
        k, v, table = flash_attn_gpu.cufa_pages(k, v, block_table)
        return cufa.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                           max_seqlen_k, dropout_p, softmax_scale, causal,
                                           window, cap, alibi_slopes, deterministic,
                                           return_attn_probs, block_table=table)
    return _attention("flash_attn_varlen_func", run, q, k, v, alibi_slopes)


@runtime_errors
def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=NO_WINDOW,
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash_attn_varlen_func of qkv (total, 3, nheads, headdim), read in place."""
    window, cap = fa2_options(window_size, softcap, max_seqlen)

    def run(qkv, alibi_slopes):
        return cufa.flash_attn_varlen_func(*qkv.unbind(1), cu_seqlens, cu_seqlens, max_seqlen,
                                           max_seqlen, dropout_p, softmax_scale, causal,
                                           window, cap, alibi_slopes, deterministic,
                                           return_attn_probs)
    return _attention("flash_attn_varlen_qkvpacked_func", run, qkv, alibi_slopes)


@runtime_errors
def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=NO_WINDOW, softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False):
    """flash_attn_varlen_func of q and kv (total_k, 2, nheads_k, headdim), read in place."""
    window, cap = fa2_options(window_size, softcap, max_seqlen_k)

    def run(q, kv, alibi_slopes):
        return cufa.flash_attn_varlen_func(q, *kv.unbind(1), cu_seqlens_q, cu_seqlens_k,
                                           max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                                           causal, window, cap, alibi_slopes,
                                           deterministic, return_attn_probs)
    return _attention("flash_attn_varlen_kvpacked_func", run, q, kv, alibi_slopes)


@runtime_errors
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=NO_WINDOW, softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    """flash-attn 2's flash_attn_with_kvcache (cufa.flash_attn_with_kvcache): k and v, if
    given, are appended to the cache in place. With block_table, the longest sequence is
    checked against the positions the table addresses, as flash-attn does: one read of
    max(cache_seqlens), skipped while a CUDA graph is being captured. (FlashAttention-3's
    k_descale, v_descale, q_descale and qv: cufa.flash_attn_with_kvcache itself.)"""
    def run(q, k, v, alibi_slopes):
        return flash_attn_gpu.kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                                      cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                                      softmax_scale, causal, window_size, softcap,
                                      rotary_interleaved, alibi_slopes, num_splits,
                                      return_softmax_lse)
    return _attention("flash_attn_with_kvcache", run, q, k, v, alibi_slopes,
                      differentiable=False)


# -- what flash-attn's own tests import ------------------------------------------------------

def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left,
                        window_size_right, softcap, alibi_slopes, return_softmax):
    """(out, softmax_lse, S_dmask, rng_state): flash_attn_gpu.fwd of q, k, v."""
    return tuple(flash_attn_gpu.fwd(q, k, v, None, alibi_slopes, dropout_p, softmax_scale,
                                    causal, window_size_left, window_size_right, softcap,
                                    return_softmax, None))


def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p, softmax_scale, causal, window_size_left=-1,
                               window_size_right=-1, softcap=0.0, alibi_slopes=None,
                               return_softmax=False, block_table=None, leftpad_k=None,
                               seqused_k=None, zero_tensors=False, num_splits=0):
    """(out, softmax_lse, S_dmask, rng_state): flash_attn_gpu.varlen_fwd of a packed batch."""
    return tuple(flash_attn_gpu.varlen_fwd(
        q, k, v, None, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k, block_table,
        alibi_slopes, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, zero_tensors,
        causal, window_size_left, window_size_right, softcap, return_softmax, None, num_splits))


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale,
                         causal, window_size_left, window_size_right, softcap, alibi_slopes,
                         deterministic, rng_state=None):
    """flash-attn's backward: dq, dk, dv written in place; returns softmax_d."""
    return flash_attn_gpu.bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, alibi_slopes,
                              dropout_p, softmax_scale, causal, window_size_left,
                              window_size_right, softcap, deterministic, None, rng_state)[3]


def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                                cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                softmax_scale, causal, window_size_left, window_size_right,
                                softcap, alibi_slopes, deterministic, rng_state=None,
                                zero_tensors=False):
    """flash-attn's packed backward: dq, dk, dv written in place; returns softmax_d."""
    return flash_attn_gpu.varlen_bwd(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
        max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, zero_tensors, causal,
        window_size_left, window_size_right, softcap, deterministic, None, rng_state)[3]


def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """The key-block width by which flash-attn's tests read back the attention matrix that
    its kernels return with dropout. cufa returns none (it has no dropout); this keeps
    those helpers importable, with flash-attn's widths at the common head dims: 128 up to
    head dim 64, 64 above."""
    if not 0 < head_dim <= 256:
        raise ValueError(f"head_dim must be from 1 to 256; got {head_dim}")
    return 128 if head_dim <= 64 else 64
