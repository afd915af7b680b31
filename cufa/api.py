"""The public functions: validate -> plan -> launch. Each takes the caller's arrays to the
planner of its family (_fwd_plan, _decode_plan), or, while torch.compile or jax.jit
traces the call, to that framework's front-end (_torch_ops, _jax)."""
import numbers
import sys

from . import (_arrays, _bwd_plan, _compile, _decode_plan, _fwd_plan, _interop, _jax,
               _runtime, _torch_ops)
from ._checks import (FP8_CACHE, NO_WINDOW, as_index, check_descale_dtype_and_shape, check_flag,
                      check_num_splits, reject_unsupported, sink_without_grad, window_ints)
from ._decode_plan import merge, with_kvcache
from ._fwd_plan import dense, packed, sdpa


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=NO_WINDOW, softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, return_lse=False, out=None,
                    learnable_sink=None, q_descale=None, k_descale=None, v_descale=None):
    """Exact attention ``softmax(q k^T * scale + mask) v``, flash-attn 2 conventions.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim),
    fp16 or bf16 CUDA arrays (PyTorch, CuPy, JAX or any ``__dlpack__`` object), headdim
    from 1 to 256 (up to 512 on the fast path below: docs/api.md), nheads divisible by
    nheads_k (MQA/GQA). Any strides with a contiguous
    last dimension. The fast path is a headdim that is a multiple of 8 with every array
    (out= included) on strides that are multiples of 8 elements from a 16-byte aligned
    start: rows move in 16-byte copies. Any other call runs kernels that move the rows
    an element at a time, in place (no padded copies), on every GPU (on Hopper the
    portable mma.sync ones), at a cost bench/bench_fwd.py measures (docs/benchmarks.md).

    Masks are aligned to the bottom-right corner when seqlen_q != seqlen_k: query i sees
    key j iff ``j <= i + seqlen_k - seqlen_q`` (causal). For seqlen_q=2, seqlen_k=5::

        causal:  1 1 1 1 0        window_size=(1, 0):  0 0 1 1 0
                 1 1 1 1 1                             0 0 0 1 1

    window_size=(left, right) keeps keys ``i + seqlen_k - seqlen_q - left <= j <=
    i + seqlen_k - seqlen_q + right``; -1 leaves a side unbounded. softcap > 0 replaces a
    scaled score s by ``softcap * tanh(s / softcap)``. alibi_slopes, float32 (nheads,) or
    (batch, nheads), adds ``-slope * |i + seqlen_k - seqlen_q - j|``.

    learnable_sink, float32, float16 or bfloat16 (nheads,): query head h's sink logit
    (gpt-oss), one more term exp(sink_h) in every row's softmax denominator that adds no
    value; taken as it is, never scaled, capped or masked.

    Returns out shaped like q (in `out` if given), and with return_lse=True also
    lse (batch, nheads, seqlen_q) float32 = log(sum_j exp(score_ij) [+ exp(sink_h)]). Rows
    that see no key give 0 and lse -inf (lse = sink_h with a sink). return_attn_probs=True
    returns (out, lse, S_dmask) as flash-attn does without dropout, S_dmask an empty (0,)
    array of q's framework and dtype (the probabilities are never materialized). The
    forward is deterministic; `deterministic` is the backward's (flash_attn_backward). Window
    entries may be any integer held on the host (NumPy integers, 0-d CPU tensors).

    fp8 (Hopper): q, k, v all in float8_e4m3fn (PyTorch's, or CuPy arrays of ml_dtypes'),
    head dims in 16s up to 256, with q_descale, k_descale, v_descale (float32 (batch,
    nheads_k), or one scale: (1,) or 0-d; None: 1) as FlashAttention-3 takes them: the
    scores are q_descale * k_descale times the e4m3 product, out v_descale times P V. P
    is rounded to e4m3 for P V (times 2^8, so small probabilities keep their exponents);
    accumulation is float32. out is bfloat16 (or out='s float16 / bfloat16). V is first
    transposed into a new array of V's size (fp8 wgmma reads both operands K-major). No
    softcap, ALiBi or sink here yet, and no backward. torch.compile traces it as one op;
    JAX arrays (jnp.float8_e4m3fn, eager or under jax.jit) run it as one buffer callback.
    """
    reject_unsupported(dropout_p)
    return_lse = return_lse or return_attn_probs
    if q_descale is not None or k_descale is not None or v_descale is not None:
        return _fp8_forward(q, k, v, softcap, alibi_slopes, learnable_sink, return_attn_probs,
                            return_lse, out, q_descale, k_descale, v_descale,
                            softmax_scale=softmax_scale, causal=causal, window_size=window_size)
    if learnable_sink is not None:
        learnable_sink = sink_without_grad(learnable_sink, differentiable=True)
    grad = _records_grad(q, k, v, learnable_sink)
    if grad or _other_route(q):
        if _is_fp8(q):
            return _fp8_forward(q, k, v, softcap, alibi_slopes, learnable_sink,
                                return_attn_probs, return_lse, out, q_descale, k_descale,
                                v_descale, softmax_scale=softmax_scale, causal=causal,
                                window_size=window_size)
        if grad or _torch_ops.compiling(q):
            if out is not None:
                raise NotImplementedError("out= is not supported inside torch.compile or where "
                                          "autograd records the call")
            o, lse = _torch_ops.recorded("flash_attn", q)(
                q, k, v, softmax_scale, causal, *window_ints(window_size), softcap, alibi_slopes,
                learnable_sink, check_flag(deterministic, "deterministic"))
            return _returned(o, lse, return_lse, return_attn_probs)
        if _jax.tracing(q, k, v, alibi_slopes, learnable_sink):
            o, *lse = _jax.call("flash_attn_func", dict(q=q, k=k, v=v,
                                                        alibi_slopes=alibi_slopes,
                                                        learnable_sink=learnable_sink),
                                dict(softmax_scale=softmax_scale, causal=causal,
                                     window_size=window_ints(window_size), softcap=softcap,
                                     deterministic=check_flag(deterministic, "deterministic")),
                                out=out, lse=return_lse)
            return _returned(o, lse[0] if lse else None, return_lse, return_attn_probs)
    # (eager calls only, so torch.compile traces none of it; a 1-byte q's alone reads its
    # dtype's name: str() of a NumPy dtype costs microseconds a call)
    if getattr(q, "itemsize", 0) == 1 and "float8" in str(q.dtype):
        return _fp8_forward(q, k, v, softcap, alibi_slopes, learnable_sink, return_attn_probs,
                            return_lse, out, q_descale, k_descale, v_descale,
                            softmax_scale=softmax_scale, causal=causal, window_size=window_size)
    result = dense(q, k, v, alibi_slopes, out, softmax_scale=softmax_scale, causal=causal,
                   window_size=window_size, softcap=softcap, return_lse=return_lse,
                   learnable_sink=learnable_sink)
    return _returned(*result, True, True) if return_attn_probs else result


def _fp8_only_plain(q, k, v, softcap, alibi_slopes, learnable_sink):
    """What the fp8 forward does not take yet, refused before anything is read."""
    if softcap or alibi_slopes is not None or learnable_sink is not None:
        raise NotImplementedError("the fp8 forward takes no softcap, alibi_slopes or "
                                  "learnable_sink yet")
    if _records_grad(q, k, v, None):
        raise NotImplementedError("the fp8 forward has no backward pass: call it without "
                                  "autograd recording (torch.no_grad(), or inputs that do not "
                                  "require grad)")


def _is_fp8(x):
    """Whether x's dtype is a float8 (on the torch.compile and JAX routes only: str() of a
    NumPy dtype costs microseconds, which eager calls do not pay)."""
    return "float8" in str(getattr(x, "dtype", ""))


def _fp8_traced_checks(arrays, descales, out):
    """What the fp8 forward checks while torch.compile traces: no out=, and the dtypes (its
    op's fake only makes shapes; the shapes and strides are checked when the compiled code
    runs)."""
    if out is not None:
        raise NotImplementedError("out= is not supported inside torch.compile")
    for name, x in arrays.items():
        if str(x.dtype) != "torch.float8_e4m3fn":
            raise TypeError(f"{name} has dtype {x.dtype}: the fp8 forward takes q, k and v all "
                            "in float8_e4m3fn (e4m3)")
    for name, x in descales.items():
        if x is not None and str(x.dtype) != "torch.float32":
            raise TypeError(f"{name} must be float32; got {x.dtype}")


def _fp8_forward(q, k, v, softcap, alibi_slopes, learnable_sink, return_attn_probs, return_lse,
                 out, q_descale, k_descale, v_descale, *, softmax_scale, causal, window_size):
    """flash_attn_func's fp8 route (q in float8_e4m3fn, or descales given): eager, through
    torch.ops.cufa.flash_attn_fp8 under torch.compile, or one buffer callback for JAX."""
    _fp8_only_plain(q, k, v, softcap, alibi_slopes, learnable_sink)
    descales = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    if _torch_ops.compiling(q):
        _fp8_traced_checks(dict(q=q, k=k, v=v), descales, out)
        o, lse = _torch_ops.op("flash_attn_fp8")(q, k, v, q_descale, k_descale, v_descale,
                                                 softmax_scale, causal,
                                                 *window_ints(window_size))
        return _returned(o, lse, return_lse, return_attn_probs)
    if _interop.is_jax(q) or _jax.tracing(q, k, v, *descales.values()):
        o, lse = _jax.call("flash_attn_fp8", dict(q=q, k=k, v=v, **descales), dict(
            softmax_scale=softmax_scale, causal=causal, window_size=window_ints(window_size)),
            out=out)
        return _returned(o, lse, return_lse, return_attn_probs)
    result = _fwd_plan.fp8_dense(q, k, v, out, q_descale, k_descale, v_descale,
                                 return_lse=return_lse, softmax_scale=softmax_scale,
                                 causal=causal, window_size=window_size)
    return _returned(*result, True, True) if return_attn_probs else result


def _fp8_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, softcap,
                alibi_slopes, learnable_sink, return_attn_probs, return_lse, out, q_descale,
                k_descale, v_descale, check_cu_seqlens, *, softmax_scale, causal, window_size):
    """flash_attn_varlen_func's fp8 route (q in float8_e4m3fn, or q_descale given), as
    _fp8_forward's."""
    _fp8_only_plain(q, k, v, softcap, alibi_slopes, learnable_sink)
    arrays = dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                  seqused_k=seqused_k, block_table=block_table, q_descale=q_descale,
                  k_descale=k_descale, v_descale=v_descale)
    compiling, on_jax = _torch_ops.compiling(q), False
    if not compiling:
        on_jax = _interop.is_jax(q) or _jax.tracing(*arrays.values())
    if check_cu_seqlens:
        if compiling or on_jax:
            raise ValueError("check_cu_seqlens=True reads device values (a sync), which "
                             "torch.compile cannot trace and a call through XLA's buffers "
                             "(jax.jit, or JAX arrays) does not have; check them outside it")
        _fwd_plan.check_packed_values(_arrays.Packed(*(
            None if x is None else _interop.as_device_array(x, name)
            for x, name in ((q, "q"), (k, "k"), (v, "v"), (cu_seqlens_q, "cu_seqlens_q"),
                            (cu_seqlens_k, "cu_seqlens_k"), (seqused_k, "seqused_k"),
                            (None, ""), (block_table, "block_table")))))
    if compiling:
        _fp8_traced_checks(dict(q=q, k=k, v=v), {n: arrays[n] for n in (
            "q_descale", "k_descale", "v_descale")}, out)
        o, lse = _torch_ops.op("flash_attn_varlen_fp8")(
            q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, q_descale, k_descale,
            v_descale, softmax_scale, causal, *window_ints(window_size))
        return _returned(o, lse, return_lse, return_attn_probs)
    if on_jax:
        o, lse = _jax.call("flash_attn_varlen_fp8", arrays, dict(
            softmax_scale=softmax_scale, causal=causal, window_size=window_ints(window_size)),
            out=out)
        return _returned(o, lse, return_lse, return_attn_probs)
    result = _fwd_plan.fp8_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table,
                                  out, q_descale, k_descale, v_descale, return_lse=return_lse,
                                  softmax_scale=softmax_scale, causal=causal,
                                  window_size=window_size)
    return _returned(*result, True, True) if return_attn_probs else result


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=NO_WINDOW,
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, *, return_lse=False, out=None,
                           seqused_k=None, check_cu_seqlens=False, block_table=None,
                           learnable_sink=None, k_descale=None, v_descale=None,
                           q_descale=None):
    """Attention over a packed batch of variable-length sequences (flash-attn 2 conventions).

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim): the rows of all
    sequences stacked; head dims and strides as in flash_attn_func. cu_seqlens_q/k: int32 (batch + 1,), starting at 0, non-decreasing,
    ending at total_q/total_k; sequence b is rows cu_seqlens[b]:cu_seqlens[b + 1]. Masks
    apply per sequence exactly as in flash_attn_func (causal aligned bottom-right per
    sequence). seqused_k, int32 (batch,), uses only the first seqused_k[b] keys of
    sequence b. Zero-length sequences and sequences without keys are legal (their rows
    give 0 and lse -inf, or lse = sink_h with learnable_sink, as in flash_attn_func). lse
    is float32 (nheads, total_q).

    max_seqlen_q / max_seqlen_k are accepted for compatibility and may exceed the true
    maxima; the work list is built on the GPU from cu_seqlens, so they are not needed.

    block_table, int32 (batch, max_pages): k and v are a paged KV cache
    (num_pages, page_size, nheads_k, headdim), page_size a power of two up to 256, the
    one flash_attn_with_kvcache reads (chunked prefill against a serving cache). Key j of
    sequence b is row j % page_size of page block_table[b, j // page_size]; the sequence
    has seqused_k[b] keys if given, else cu_seqlens_k[b + 1] - cu_seqlens_k[b], at most
    max_pages * page_size. Paged batches run on the mma.sync kernels (sm80 family);
    their sequences of 1 to 16 // (nheads // nheads_k) query rows on the decode kernel.
    A paged cache in float8_e4m3fn (PyTorch's, or CuPy arrays of ml_dtypes'), with
    k_descale, v_descale as in flash_attn_with_kvcache, is read the same way (q and out stay
    16-bit; the e4m3 bytes turn into q's dtype as they enter the matrix units).

    Free checks (no device sync): dtype, shape and device of cu_seqlens and seqused_k.
    check_cu_seqlens=True also reads the values (one device-to-host copy, a sync): first
    0, non-decreasing, last equal to the rows, seqused_k within the key lengths, and with
    block_table each sequence's keys within its row of pages. Without
    it, malformed values cannot make the kernel read or write outside the tensors, but
    the result is undefined.

    return_attn_probs=True returns (out, lse, S_dmask) as in flash_attn_func.

    q, k, v all in float8_e4m3fn (with q_descale, k_descale, v_descale) run the fp8 forward
    as flash_attn_func's does (Hopper); with block_table, k and v a paged e4m3 cache, whose
    named pages are first gathered into contiguous rows (a copy: docs/api.md).
    """
    reject_unsupported(dropout_p)
    return_lse = return_lse or return_attn_probs
    max_seqlen_q, max_seqlen_k = _max_seqlens(max_seqlen_q, max_seqlen_k)
    if q_descale is not None:
        return _fp8_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, softcap,
                           alibi_slopes, learnable_sink, return_attn_probs, return_lse, out,
                           q_descale, k_descale, v_descale, check_cu_seqlens,
                           softmax_scale=softmax_scale, causal=causal, window_size=window_size)
    if learnable_sink is not None:
        learnable_sink = sink_without_grad(learnable_sink, differentiable=True)
    grad = _records_grad(q, k, v, learnable_sink)
    if grad or _other_route(q):
        if _is_fp8(q):
            return _fp8_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table,
                               softcap, alibi_slopes, learnable_sink, return_attn_probs,
                               return_lse, out, q_descale, k_descale, v_descale,
                               check_cu_seqlens, softmax_scale=softmax_scale, causal=causal,
                               window_size=window_size)
        if grad or _torch_ops.compiling(q):
            if out is not None:
                raise NotImplementedError("out= is not supported inside torch.compile or where "
                                          "autograd records the call")
            if check_cu_seqlens:
                if _torch_ops.compiling(q):
                    raise ValueError("check_cu_seqlens=True reads device values (a sync), "
                                     "which torch.compile cannot trace; check them outside "
                                     "the compiled code")
                _fwd_plan.check_packed_values(_arrays.Packed(*(
                    None if x is None else _interop.as_device_array(
                        _interop.detached(x), name)
                    for x, name in ((q, "q"), (k, "k"), (v, "v"), (cu_seqlens_q, "cu_seqlens_q"),
                                    (cu_seqlens_k, "cu_seqlens_k"), (seqused_k, "seqused_k"),
                                    (None, ""), (block_table, "block_table")))))
            o, lse = _torch_ops.recorded("flash_attn_varlen", q)(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                causal, *window_ints(window_size), softcap, alibi_slopes, seqused_k, block_table,
                learnable_sink, k_descale, v_descale, check_flag(deterministic, "deterministic"))
            return _returned(o, lse, return_lse, return_attn_probs)
        arrays = dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      seqused_k=seqused_k, alibi_slopes=alibi_slopes, block_table=block_table,
                      learnable_sink=learnable_sink, k_descale=k_descale, v_descale=v_descale)
        # (JAX arrays of an fp8 cache go through XLA's buffers eagerly too, as under jax.jit:
        # DLPack importers do not all take float8)
        if _jax.tracing(*arrays.values()) or (_interop.is_jax(q) and any(
                _interop.is_jax(x) and "float8" in str(x.dtype) for x in (k, v))):
            if check_cu_seqlens:
                raise ValueError("check_cu_seqlens=True reads device values, which a call "
                                 "through XLA's buffers (jax.jit, or JAX arrays of an fp8 "
                                 "cache) does not have; check them outside it")
            o, *lse = _jax.call("flash_attn_varlen_func", arrays, dict(
                softmax_scale=softmax_scale, causal=causal, window_size=window_ints(window_size),
                softcap=softcap, deterministic=check_flag(deterministic, "deterministic")),
                out=out, lse=return_lse)
            return _returned(o, lse[0] if lse else None, return_lse, return_attn_probs)
    if getattr(q, "itemsize", 0) == 1 and "float8" in str(q.dtype):  # (as flash_attn_func's)
        return _fp8_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, softcap,
                           alibi_slopes, learnable_sink, return_attn_probs, return_lse, out,
                           q_descale, k_descale, v_descale, check_cu_seqlens,
                           softmax_scale=softmax_scale, causal=causal, window_size=window_size)
    result = packed(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, block_table,
                    out, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                    softcap=softcap, return_lse=return_lse, learnable_sink=learnable_sink,
                    k_descale=k_descale, v_descale=v_descale, check_cu_seqlens=check_cu_seqlens)
    return _returned(*result, True, True) if return_attn_probs else result


def flash_attn_backward(dout, q, k, v, out, lse, softmax_scale=None, causal=False,
                        window_size=NO_WINDOW, softcap=0.0, alibi_slopes=None,
                        deterministic=False, *, learnable_sink=None, dq=None, dk=None, dv=None,
                        dlse=None):
    """The gradients of a flash_attn_func call: (dq, dk, dv), and with learnable_sink a
    fourth, dsink (float32 (nheads,)). For custom training code in any framework; PyTorch
    autograd and jax.grad call it themselves.

    dout: the gradient of out, out's shape and dtype; out and lse: what the forward
    returned (return_lse=True), lse contiguous; q, k, v and every option as the forward
    was called. dk and dv are summed over the query heads that share a KV head (GQA);
    rows that see no key give zero gradients, and so do keys that no query sees. dq, dk,
    dv: arrays to write the gradients into (q's, k's and v's shapes and dtype), else new
    contiguous ones of q's framework. On Hopper at head dims 33-64 and 97-128, without
    softcap or ALiBi, dq is summed in float32 by the dk/dv kernel, so its last bits vary
    from run to run; deterministic=True (or torch.use_deterministic_algorithms(True))
    keeps a dq kernel of its own: the same bits every run, at 1.0-1.2x the time
    (docs/api.md). dsink sums with atomics.
    Needs 16-byte rows: head dims and strides that are multiples of 8. dlse: the gradient
    of lse as well, where a loss reads lse (its shape, float32, contiguous). Torch tensors
    are read detached (this is what a backward runs on)."""
    dout, q, k, v, out, lse, alibi_slopes, learnable_sink, dlse = map(
        _interop.detached, (dout, q, k, v, out, lse, alibi_slopes, learnable_sink, dlse))
    dq, dk, dv, dsink = _bwd_plan.dense(
        dout, q, k, v, out, lse, alibi_slopes=alibi_slopes, learnable_sink=learnable_sink,
        dq=dq, dk=dk, dv=dv, dlse=dlse, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, softcap=softcap,
        deterministic=check_flag(deterministic, "deterministic"))
    return (dq, dk, dv) if learnable_sink is None else (dq, dk, dv, dsink)


def flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                               max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False,
                               window_size=NO_WINDOW, softcap=0.0, alibi_slopes=None,
                               deterministic=False, *, seqused_k=None, learnable_sink=None,
                               dq=None, dk=None, dv=None, dlse=None):
    """flash_attn_backward for a flash_attn_varlen_func call (packed rows, lse (nheads,
    total_q)). Keys past seqused_k[b] get zero gradients. max_seqlen_q / max_seqlen_k are
    accepted for compatibility (the work lists are built on the GPU from cu_seqlens). A
    paged cache (block_table) has no backward."""
    max_seqlen_q, max_seqlen_k = _max_seqlens(max_seqlen_q, max_seqlen_k)
    dout, q, k, v, out, lse, alibi_slopes, learnable_sink, dlse = map(
        _interop.detached, (dout, q, k, v, out, lse, alibi_slopes, learnable_sink, dlse))
    dq, dk, dv, dsink = _bwd_plan.packed(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k=seqused_k,
        alibi_slopes=alibi_slopes, learnable_sink=learnable_sink, dq=dq, dk=dk, dv=dv,
        dlse=dlse, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, deterministic=check_flag(deterministic, "deterministic"))
    return (dq, dk, dv) if learnable_sink is None else (dq, dk, dv, dsink)


def _max_seqlens(max_seqlen_q, max_seqlen_k):
    """flash-attn's max_seqlen_q / max_seqlen_k (unused: the work lists come from
    cu_seqlens on the GPU), checked as ints >= 0 (any integer as_index takes)."""
    if not (type(max_seqlen_q) is int and type(max_seqlen_k) is int
            and max_seqlen_q >= 0 <= max_seqlen_k):  # (as_index: other integers, or the error)
        max_seqlen_q, max_seqlen_k = (as_index(m, n, 0, "an int >= 0") for m, n in (
            (max_seqlen_q, "max_seqlen_q"), (max_seqlen_k, "max_seqlen_k")))
    return max_seqlen_q, max_seqlen_k


def _returned(o, lse, return_lse, return_attn_probs):
    """What flash_attn_func and flash_attn_varlen_func return: flash-attn's (out, lse,
    S_dmask) with return_attn_probs, S_dmask empty as flash-attn's is without dropout."""
    if return_attn_probs:
        return o, lse, _interop.empty_of(o)
    return (o, lse) if return_lse else o


def _records_grad(q, k, v, sink):
    """Whether q is an eager or traced torch tensor and autograd records this call: it then
    goes through the torch ops, whose autograd formula is the backward. (Read in the order
    that costs an inference call least: requires_grad first, then grad mode.)"""
    kind = type(q)
    if kind is not _interop._torch_tensor:
        if kind is _interop._cupy_array or kind.__module__.split(".")[0] != "torch":
            return False
        _torch_ops.register_if_torch_loaded()  # (torch imported after cufa, a first call)
    if not (q.requires_grad or getattr(k, "requires_grad", False)
            or getattr(v, "requires_grad", False) or getattr(sink, "requires_grad", False)):
        return False
    return _torch_ops.grad_mode()


def _other_route(q):
    """Whether a call may take the torch.compile or the JAX route: not for a CuPy array or
    an eager torch tensor q, the usual call, which then skips those routes' checks."""
    kind = type(q)
    return kind is not _interop._cupy_array and (kind is not _interop._torch_tensor
                                                 or _torch_ops.compiling(q))


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False, *,
                                 learnable_sink=None):
    """PyTorch's ``scaled_dot_product_attention`` on the cufa kernels.

    query: (batch, heads, L, E); key, value: (batch, heads_k, S, E); fp16 or bf16.
    heads_k must equal heads unless enable_gqa=True (then heads % heads_k == 0).
    is_causal aligns the mask to the top-left corner: query i sees keys j <= i.
    attn_mask is boolean (True = take part) or additive float (float16, bfloat16,
    float32), broadcastable to (batch, heads, L, S); it is read tile by tile inside the
    kernel, never expanded. is_causal and attn_mask may be combined.

    learnable_sink: as in flash_attn_func, one logit a query head (heads,).

    Rows that see no key give 0 (PyTorch's math backend gives NaN there). Torch tensors
    that require grad get the backward (autograd), an additive attn_mask too (its gradient
    summed over the dimensions it broadcasts along).
    """
    reject_unsupported(dropout_p)
    if learnable_sink is not None:
        learnable_sink = sink_without_grad(learnable_sink, differentiable=True)
    if _records_grad(query, key, value, learnable_sink) or (
            getattr(attn_mask, "requires_grad", False) and _torch_ops.grad_mode()):
        return _torch_ops.recorded("sdpa_lse", query)(query, key, value, attn_mask, is_causal,
                                                       scale, enable_gqa, learnable_sink)[0]
    if _torch_ops.compiling(query):
        return _torch_ops.op("sdpa")(query, key, value, attn_mask, is_causal, scale, enable_gqa,
                                     learnable_sink)
    options = dict(is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    if _jax.tracing(query, key, value, attn_mask, learnable_sink):
        return _jax.call("scaled_dot_product_attention", dict(
            query=query, key=key, value=value, attn_mask=attn_mask,
            learnable_sink=learnable_sink), options)[0]
    return sdpa(query, key, value, attn_mask, None, **options, learnable_sink=learnable_sink)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=NO_WINDOW, softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, out=None, check_inputs=False,
                            learnable_sink=None, k_descale=None, v_descale=None, qv=None,
                            q_descale=None):
    """Attention of new query tokens against a KV cache (flash-attn 2 conventions).

    q: (batch, seqlen_q, nheads, headdim). The cache is contiguous,
    (batch_cache, seqlen_cache, nheads_k, headdim), or paged, (num_pages, page_size,
    nheads_k, headdim) with block_table int32 (batch, max_pages): key position j of
    sequence b is row j % page_size of page block_table[b, j // page_size]; page_size a
    power of two from 1 to 256. Head dims and strides as in flash_attn_func: q, the cache
    and out= on the 16-byte path, else the element-wise kernels (bench/bench_decode.py
    measures them); the new k and v are copied in an element at a time either way.

    cache_seqlens: int32 (batch,) or an int (any integer held on the host: a NumPy integer,
    a 0-d CPU tensor), the keys in the cache before this call (default: all of it). k, v
    (batch, seqlen_new, nheads_k, headdim), if given, are written into the cache in place
    at positions cache_seqlens .. cache_seqlens + seqlen_new - 1, and the queries attend
    to the old keys and the new ones. cache_batch_idx int32 (batch,) picks the cache row
    of each sequence (contiguous cache); cache_leftpad int32 (batch,) makes a sequence's
    keys start at that position.

    Masks align bottom-right against seqlen_k = cache_seqlens + seqlen_new - leftpad, as
    in flash_attn_func: query t sees key j iff j <= t + seqlen_k - seqlen_q (causal).
    rotary_cos / rotary_sin (seqlen_ro, rotary_dim / 2), seqlen_ro >= the cache's
    capacity, rotate q and the new k: new key i at position cache_seqlens + i; query t at
    cache_seqlens + t when causal or windowed, else at cache_seqlens; rotary_interleaved
    pairs features (2i, 2i+1), else (i, i + rotary_dim / 2).

    num_splits: 0 picks a split of the keys from the shapes alone (never from device
    values, so a CUDA graph can replay the call with new lengths); 1 does not split; n > 1
    splits into n (at most 128: more raises); learnable_sink (nheads,), as in
    flash_attn_func, enters each row once, in the merge of the splits. Returns out (batch,
    seqlen_q, nheads, headdim), and with return_softmax_lse=True also lse float32 (batch,
    nheads, seqlen_q).
    check_inputs=True reads the device values first (one sync) and raises for page ids
    outside the cache, lengths past its capacity, leftpads past the lengths and
    cache_batch_idx rows outside the cache (or, with an append, named twice); without it
    such values are clamped in the kernels, so they never read or write outside the arrays.

    An fp8 cache: k_cache and v_cache in float8_e4m3fn (PyTorch's, JAX's, or CuPy arrays
    of ml_dtypes' float8_e4m3fn), contiguous or paged,
    with a head dim and strides that are multiples of 16; q (and the new k, v) stay
    float16 or bfloat16, and out is q's dtype. k_descale, v_descale: float32 (batch,
    nheads_k), or (1,) / 0-d for one scale a tensor (default 1): the cache's key is its
    e4m3 value times k_descale[b, h] (FlashAttention-3's names). The decode kernel turns
    the e4m3 bytes into q's dtype as it reads them into the matrix units. New k, v are
    quantized as they are appended: round_to_e4m3(clamp(k / k_descale, -448, 448))
    (rotated first, and rounded to q's dtype, where rotary is on). JAX arrays take it
    eager and under jax.jit (through XLA's buffers, not DLPack).

    q in float8_e4m3fn too (FlashAttention-3's fp8 decode), from PyTorch or JAX, with an
    fp8 cache only: q_descale, float32 (batch, nheads_k) or one scale ((1,) or 0-d;
    default 1), as k_descale. An fp8 q is dequantized to bf16 by a framework op first,
    q_fp8 * q_descale[b, h // (nheads / nheads_k)] in float32 rounded to bfloat16 (to
    out='s float16 or bfloat16 where out= is given), and the call runs with that q: the
    new k, v come in that dtype (rotary tables in it or float32), out is in it. q is a
    decode step's few rows, so the copy costs little; torch.compile and jax.jit trace it
    with the call. Not with qv, nor for CuPy arrays (pass q times q_descale in 16 bits).

    MLA decode (DeepSeek's latent attention, FlashAttention-3's form), on Hopper: qv
    (batch, seqlen_q, nheads, 512) the absorbed queries, q (..., 64) the rotary ones,
    k_cache the keys' rotary rows k_pe (64) and v_cache their latent rows c_kv (512), which
    are also the values; the new k and v likewise. Scores are qv . c_kv + q . k_pe (default
    scale 1 / sqrt(576)); out is (batch, seqlen_q, nheads, 512). Not with softcap, ALiBi or
    a learnable sink; an fp8 cache takes k_descale and v_descale as above (docs/api.md).

    JAX arrays (eager or under jax.jit): with k and v, the call also returns the caches
    after the append, (out, [lse,] k_cache, v_cache), since JAX arrays are immutable.
    Under jax.jit with the caches donated (donate_argnums), they are the same memory and
    no copy is made; without donation, or eagerly, XLA copies each cache once per call.
    """
    fixed = None
    if learnable_sink is not None:
        learnable_sink = sink_without_grad(learnable_sink)
    if cache_seqlens is None or _is_integral(cache_seqlens) or getattr(
            cache_seqlens, "ndim", None) == 0:  # (an int, or a 0-d array: one length for all)
        fixed, cache_seqlens = (None if cache_seqlens is None else as_index(
            cache_seqlens, "cache_seqlens", 0, "an int >= 0 or an int32 (batch,) array")), None
    if type(num_splits) is not int:
        num_splits = check_num_splits(num_splits)
    interleaved = (rotary_interleaved if type(rotary_interleaved) is bool
                   else check_flag(rotary_interleaved, "rotary_interleaved"))
    if q_descale is not None or getattr(q, "itemsize", 0) == 1:  # (an fp8 q: as 16-bit)
        q = _fp8_query(q, q_descale, k_cache, v_cache, k, v, qv, out)
    arrays = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
              cache_leftpad, block_table, alibi_slopes, learnable_sink, k_descale,
              v_descale, qv)  # in ARRAYS' order
    if _other_route(q):  # (the usual decode step's host time is what a small batch waits on)
        if _torch_ops.compiling(q):
            if out is not None or check_inputs:
                raise NotImplementedError("out= and check_inputs=True are not supported "
                                          "inside torch.compile")
            for x, name in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache"), (k, "k"),
                            (v, "v"), (qv, "qv")):
                if getattr(x, "requires_grad", False) and _torch_ops.grad_mode():
                    raise NotImplementedError(
                        f"{name} requires grad, but flash_attn_with_kvcache is inference "
                        f"only (no backward pass): pass {name}.detach() or call under "
                        "torch.no_grad()")
            o, lse = _torch_ops.op("kvcache_append" if k is not None else "kvcache")(
                q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, fixed,
                cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal,
                *window_ints(window_size), softcap, interleaved, alibi_slopes,
                num_splits, learnable_sink, k_descale, v_descale, qv)
            return (o, lse) if return_softmax_lse else o
        # (JAX arrays go through XLA's buffers when they are traced, when the call writes
        # new keys into a cache (the updated cache is an output), and for an fp8 cache,
        # which DLPack importers do not all take)
        if _jax.tracing(*arrays) or (_interop.is_jax(q) and (k is not None or any(
                _interop.is_jax(c) and "float8" in str(c.dtype) for c in (k_cache, v_cache)))):
            if check_inputs:
                raise ValueError("check_inputs=True is not supported for JAX arrays: under "
                                 "jax.jit there are no device values to read")
            options = dict(cache_seqlen=fixed, softmax_scale=softmax_scale, causal=causal,
                           window_size=window_ints(window_size), softcap=softcap,
                           rotary_interleaved=interleaved, num_splits=num_splits)
            o, lse, *caches = _jax.call("flash_attn_with_kvcache",
                                        dict(zip(_decode_plan.ARRAYS, arrays)), options,
                                        out=out)
            return tuple([o] + ([lse] if return_softmax_lse else []) + caches) if caches else (
                (o, lse) if return_softmax_lse else o)
    return with_kvcache(arrays + (out,), cache_seqlen=fixed, softmax_scale=softmax_scale,
                        causal=causal, window_size=window_size, softcap=softcap,
                        rotary_interleaved=interleaved, num_splits=num_splits,
                        return_lse=bool(return_softmax_lse), check_inputs=check_inputs)


def _fp8_query(q, q_descale, k_cache, v_cache, k, v, qv, out):
    """flash_attn_with_kvcache's q where it is 1 byte or q_descale is given: an e4m3 q,
    checked against the rest of the call, as the 16-bit q the decode kernels take
    (_fp8_query_as_16_bit); any other q as it is, for the planner's dtype checks."""
    name = _dtype_name(q)
    if not name.startswith("float8"):
        if q_descale is not None:
            raise TypeError(f"q_descale applies to a q in {FP8_CACHE}; q has dtype {name}")
        return q
    if name != FP8_CACHE:  # (as an fp8 cache of another float8 is refused)
        raise TypeError(f"q has dtype {name}, which cufa does not support: an fp8 q is "
                        f"{FP8_CACHE} (e4m3)")
    framework = _framework(q)
    if framework is None:
        raise NotImplementedError(
            f"q in {FP8_CACHE} is dequantized by PyTorch or JAX ops, and this q is a "
            f"{_interop._framework_name(q)} array; pass q in float16 or bfloat16 (q times "
            "q_descale)")
    if qv is not None:
        raise NotImplementedError(f"q in {FP8_CACHE} is not supported with qv (MLA decode); "
                                  "pass q and qv in float16 or bfloat16")
    for x, n in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        if _dtype_name(x) != FP8_CACHE:
            raise TypeError(f"{n} has dtype {_dtype_name(x)}: a q in {FP8_CACHE} reads an fp8 "
                            f"cache (k_cache and v_cache in {FP8_CACHE}), as FlashAttention-3's "
                            "does; pass q in float16 or bfloat16 for a 16-bit cache")
    if (q.ndim != 4 or k_cache.ndim != 4 or k_cache.shape[2] == 0
            or q.shape[2] % k_cache.shape[2]):
        raise ValueError(f"q must be (batch, seqlen_q, nheads, headdim) and k_cache 4-D with "
                         f"nheads_k heads, nheads a multiple of nheads_k; got q {tuple(q.shape)}, "
                         f"k_cache {tuple(k_cache.shape)}")
    dtype = "bfloat16" if out is None else _dtype_name(out)
    if dtype not in ("float16", "bfloat16"):
        raise ValueError(f"out must be float16 or bfloat16 (the output of a q in {FP8_CACHE}); "
                         f"got {dtype}")
    for x, n in ((k, "k"), (v, "v")):
        if x is not None and _dtype_name(x) != dtype:
            raise TypeError(f"{n} has dtype {_dtype_name(x)}: with q in {FP8_CACHE}, the new "
                            f"k and v come in {dtype}, the dtype q is dequantized to "
                            "(bfloat16, or out='s)")
    if q_descale is not None:
        if _framework(q_descale) != framework:
            raise TypeError(f"q_descale must be a float32 array of q's framework "
                            f"({_interop._FRAMEWORKS[framework]}); got "
                            f"{type(q_descale).__module__}.{type(q_descale).__name__}")
        check_descale_dtype_and_shape(_dtype_name(q_descale), tuple(q_descale.shape),
                                      "q_descale", q.shape[0], k_cache.shape[2])
        if framework == "torch" and q_descale.device != q.device:
            raise ValueError(f"q_descale is on {q_descale.device} but q is on {q.device}")
    return _fp8_query_as_16_bit(q, q_descale, q.shape[2] // k_cache.shape[2], dtype)


def _fp8_query_as_16_bit(q, q_descale, group, dtype="bfloat16"):
    """An e4m3 q (batch, seqlen_q, nheads, headdim) of PyTorch or JAX, dequantized by that
    framework's ops (traced by torch.compile and jax.jit as any other): q * q_descale in
    float32, rounded to dtype ("bfloat16" or "float16"). q_descale (float32): (batch,
    nheads_k), query head h taking its KV head's q_descale[b, h // group] as
    FlashAttention-3 does; (1,) or 0-d, one scale; None, 1."""
    if _interop.is_jax(q):
        jnp = sys.modules["jax"].numpy
        cast = (lambda x, to: x.astype(getattr(jnp, to)))
    else:
        torch = sys.modules["torch"]
        cast = (lambda x, to: x.to(getattr(torch, to)))
    x = cast(q, "float32")
    if q_descale is not None and q_descale.ndim == 2:
        batch, seqlen, nheads, d = q.shape
        grouped = x.reshape(batch, seqlen, nheads // group, group, d)
        x = (grouped * _interop.detached(q_descale)[:, None, :, None, None]).reshape(q.shape)
    elif q_descale is not None:
        x = x * _interop.detached(q_descale)
    return cast(x, dtype)


def _dtype_name(x):
    """x's dtype as cufa names it ("float8_e4m3fn"), of any framework's array, traced
    too; a value that is no array gives its type's name."""
    dtype = getattr(x, "dtype", None)
    return type(x).__name__ if dtype is None else str(dtype).replace("torch.", "")


def _framework(x):
    """"torch" or "jax" for their arrays (traced too), else None."""
    if type(x).__module__.split(".")[0] == "torch":
        return "torch"
    return "jax" if _interop.is_jax(x) else None


_integral_types = {}  # type -> whether numbers.Integral (an ABC check each call costs more)


def _is_integral(x):
    kind = type(x)
    known = _integral_types.get(kind)
    if known is None:
        known = isinstance(x, numbers.Integral)
        if not _torch_ops.compiling(x):  # traced, the insert would become a guard: a recompile
            _integral_types[kind] = known
    return known


def merge_attention_states(out_a, lse_a, out_b, lse_b, *, out=None):
    """The attention over the union of two disjoint key sets, from each part's output and
    lse: lse = log(exp(lse_a) + exp(lse_b)), out = exp(lse_a - lse) out_a + exp(lse_b -
    lse) out_b. This is how split-KV, prefix caching and attention spread over GPUs
    combine their parts.

    out_a, out_b: (batch, seqlen, nheads, headdim) with lse float32 (batch, nheads,
    seqlen), as flash_attn_func returns them, or packed (total, nheads, headdim) with lse
    (nheads, total), as flash_attn_varlen_func does; float16, bfloat16 or float32 (the
    same for both), any strides. A part with lse -inf (no keys) weighs 0 and its output
    is not read; two such parts give 0 and -inf. Returns (out, lse): out in the inputs'
    dtype (written into `out` if given: same shape and dtype, any strides; it may be
    out_a or out_b), lse float32.
    """
    arrays = dict(out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b)
    if _torch_ops.compiling(out_a):
        if out is not None:
            raise NotImplementedError("out= is not supported inside torch.compile")
        return _torch_ops.op("merge")(out_a, lse_a, out_b, lse_b)
    if _jax.tracing(*arrays.values()):
        return _jax.call("merge_attention_states", arrays, {}, out=out)
    return merge((out_a, lse_a, out_b, lse_b, out))


def clear_plans():
    """Forget every launch plan (the next call of each signature plans again) and read
    the environment's overrides (CUFA_KERNEL_FAMILY, CUFA_SM90_BLOCK_M, CUFA_DECODE_TMA,
    CUFA_BWD_FUSED_DQ, CUFA_BWD_SM90, CUFA_BWD_SM90_TILES, CUFA_BWD_SM90_PRODUCER,
    CUFA_BWD_SPLIT_COLS, CUFA_WIDE_TILES) afresh."""
    _runtime.plans.clear()
    _fwd_plan.layouts.clear()
    _jax.replays.clear()
    _compile.read_overrides()
