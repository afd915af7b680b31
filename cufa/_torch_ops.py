"""PyTorch custom ops, so that torch.compile can trace calls to cufa.

torch.compile cannot look inside cufa (CuPy, raw pointers), so while it traces, the
public functions hand torch tensors to ``torch.ops.cufa.*`` (flash_attn, flash_attn_varlen,
flash_attn_fp8, flash_attn_varlen_fp8, sdpa, kvcache, kvcache_append, merge): opaque ops
with fake implementations that only compute output shapes, symbolically under dynamic
shapes. When the compiled code runs, each op takes its tensors to the planners, as an
eager call does (the public function has checked its other arguments while tracing).
Eager calls that autograd records take the differentiable ops' own formulas as a plain
autograd.Function (recorded); other eager calls do not come through here.

Importing cufa never imports torch, and torch.compile cannot trace the registration
itself, so the ops are registered when cufa is imported after torch, or else at the
first eager call with torch tensors.
"""
import sys

from . import _bwd_plan, _decode_plan, _fwd_plan, _interop

_ops = _recorded = None


def compiling(x):
    """True while torch.compile traces a call whose input `x` is a torch tensor."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor) and torch.compiler.is_compiling()


def register_if_torch_loaded():
    global _ops, _recorded
    if _ops is None and "torch" in sys.modules:
        _interop.know_torch(sys.modules["torch"])
        _ops, _recorded = _register()


def op(name):
    """The registered op `name` (torch.ops.cufa.<name>)."""
    if _ops is None:
        raise RuntimeError("cufa's torch.compile ops are not registered yet: import torch "
                           "before cufa, or call cufa once outside torch.compile first")
    return _ops[name]


def recorded(name, x):
    """The call of differentiable op `name` where autograd records it (x: its q): the op
    itself while torch.compile traces, under a dispatch mode (FakeTensorMode, selective
    activation checkpointing's policies: both see ops), under torch.func's transforms, or
    for a tensor that is not a plain one (meta, a subclass); else the same forward and
    formulas as an autograd.Function (_eager_autograd)."""
    torch = sys.modules["torch"]
    if (compiling(x) or (type(x) is not torch.Tensor and type(x) is not torch.nn.Parameter)
            or x.is_meta or torch._C._len_torch_dispatch_stack()
            or torch._C._are_functorch_transforms_active()):
        return op(name)
    return _recorded[name]


def _eager_autograd(torch, forward, setup, backward):
    """forward as an autograd.Function with an op's own setup_context and backward formulas,
    the formulas calling the backward's function rather than its op (ctx.eager).
    torch.library's dispatch of the forward op under autograd and of the backward op cost
    an eager call about 0.4 ms of host time on the H200 machine's host (the forward op 319
    us against its planner's 21.5: bench/results/bwd_host_h200.md), enough to leave a GPT's
    training step host-bound."""
    def forward_and_setup(ctx, *inputs):  # (not a setup_context of its own: apply then
        output = forward(*inputs)           # binds the arguments by inspect.signature, 50 us)
        setup(ctx, inputs, output)
        ctx.eager = True
        ctx.set_materialize_grads(False)  # (an unused lse's gradient stays None)
        return output

    def first_order(ctx, *grads):
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not torch.is_grad_enabled():
            return outputs
        # create_graph: the gradients were made without autograd, so a derivative through
        # them raises, as the op's backward op (which has no formula) does. (Not
        # once_differentiable, which marks them only where dout requires grad: a gradient
        # penalty's second derivative would silently leave attention's share out.)
        error = torch._C._functions.DelayedError(
            b"cufa's attention gradients are first-order: differentiating them again "
            b"(create_graph=True) is not supported", len(outputs))
        return error(*[None if x is None else x.detach().requires_grad_() for x in outputs])

    # (named so that grad_fn reads cufa_flash_attnBackward)
    return type(f"cufa_{forward.__name__[:-len('_impl')]}", (torch.autograd.Function,), dict(
        forward=staticmethod(forward_and_setup), backward=staticmethod(first_order))).apply


def _backward_of(ctx, function, registered):
    """The backward a formula calls: its function where the eager route recorded the call
    (ctx.eager, _eager_autograd), else its op (torch.compile traces the op)."""
    return function if getattr(ctx, "eager", False) else registered


def grad_mode():
    """Whether autograd records (torch's grad mode), where a tensor requires grad."""
    return sys.modules["torch"].is_grad_enabled()


def _sink_grad(dsink, q):
    """The op's dsink output: float32 (nheads,), or empty (0,) without a sink."""
    return dsink if dsink is not None else q.new_empty((0,), dtype=sys.modules["torch"].float32)


def _as_sink_grad(dsink, sink, needed):
    """The sink's gradient in its dtype, where autograd wants one."""
    return dsink.to(sink.dtype) if sink is not None and needed else None


def _on_chunks(dout, q, k, v, out):
    """The backward kernels move 16-byte chunks: where a head dim or stride is not a
    multiple of 8 elements (or a start not 16-byte aligned), copies with the head dim padded
    with zeros to a multiple of 8 (zeros change no score, output or D), and the head dim to
    cut the gradients back to; else the tensors themselves and None."""
    from ._checks import chunk_aligned
    xs = (dout, q, k, v, out)
    if all(chunk_aligned(tuple(x.shape), x.stride(), x.data_ptr()) for x in xs):
        return xs, None
    d = q.shape[-1]
    padded = -(-d // 8) * 8
    copies = []
    for x in xs:
        y = x.new_zeros(tuple(x.shape[:-1]) + (padded,))
        y[..., :d] = x
        copies.append(y)
    return tuple(copies), d


def _deterministic(asked):
    """A backward's deterministic: asked for by the call, or by
    torch.use_deterministic_algorithms(True)."""
    import torch
    return bool(asked) or torch.are_deterministic_algorithms_enabled()


def _no_alibi_grad(needed):
    """A gradient of the ALiBi slopes is asked for (they require grad): cufa computes none,
    and a None would leave them silently untrained."""
    if needed:
        raise NotImplementedError("alibi_slopes requires grad, and cufa computes no gradient "
                                  "for the ALiBi slopes: pass alibi_slopes.detach() (slopes "
                                  "are fixed in ALiBi)")


def _backward(run, dout, q, k, v, out, lse, scale, dlse):
    """run((dout, q, k, v, out, lse), scale, dlse) (a _bwd_plan entry with the call's other
    arguments bound) on tensors the kernels take, and the op's outputs: (dq, dk, dv (cut
    back to the head dim where _on_chunks padded it), dsink). dlse: lse's gradient or
    None."""
    # (dout.contiguous(): autograd's dout of a sum is an expanded one, strides 0; None where
    # only lse was used)
    if dout is None:
        dout = sys.modules["torch"].zeros_like(out)
    (dout, q, k, v, out), cut = _on_chunks(dout.contiguous(), q.detach(), k.detach(),
                                           v.detach(), out.detach())
    if cut and scale is None:  # (the default scale is the head dim's, not the padded one's)
        scale = cut ** -0.5
    if dlse is not None:
        dlse = dlse.detach().float().contiguous()
    dq, dk, dv, dsink = run((dout, q, k, v, out, lse.detach()), scale, dlse)
    if cut:
        dq, dk, dv = (x[..., :cut].contiguous() for x in (dq, dk, dv))
    return dq, dk, dv, _sink_grad(dsink, q)


def _register():
    from typing import Optional, Tuple

    import torch
    from torch import Tensor

    def flash_attn_impl(q: Tensor, k: Tensor, v: Tensor, softmax_scale: Optional[float],
                        causal: bool, window_left: int, window_right: int, softcap: float,
                        alibi_slopes: Optional[Tensor],
                        learnable_sink: Optional[Tensor], deterministic: bool = False
                        ) -> Tuple[Tensor, Tensor]:
        # (deterministic: for the backward, which setup_context keeps)
        return _fwd_plan.dense(q.detach(), k.detach(), v.detach(), alibi_slopes, None,
                               softmax_scale=softmax_scale,
                               causal=causal, window_size=(window_left, window_right),
                               softcap=softcap, return_lse=True,
                               learnable_sink=_interop.detached(learnable_sink))

    flash_attn = torch.library.custom_op("cufa::flash_attn", mutates_args=())(flash_attn_impl)

    @flash_attn.register_fake
    def _(q, k, v, *rest):  # (out's head dim: v's)
        batch, seqlen_q, nheads, _ = q.shape
        return (q.new_empty(q.shape[:-1] + v.shape[-1:]),
                q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32))

    # -- the backward: one op per forward, registered as its autograd formula, so
    #    torch.compile and activation checkpointing take it (eager calls the same formula
    #    through _eager_autograd, with the op's function). dsink is empty (0,) without a
    #    sink (an op returns tensors) --
    def flash_attn_bwd_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                            lse: Tensor, softmax_scale: Optional[float], causal: bool,
                            window_left: int, window_right: int, softcap: float,
                            alibi_slopes: Optional[Tensor], learnable_sink: Optional[Tensor],
                            dlse: Optional[Tensor], deterministic: bool = False
                            ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        return _backward(lambda arrays, scale, dlse: _bwd_plan.dense(
            *arrays, alibi_slopes=alibi_slopes, learnable_sink=_interop.detached(learnable_sink),
            dlse=dlse, softmax_scale=scale, causal=causal,
            window_size=(window_left, window_right), softcap=softcap,
            deterministic=_deterministic(deterministic)),
            dout, q, k, v, out, lse, softmax_scale, dlse)

    flash_attn_bwd = torch.library.custom_op("cufa::flash_attn_bwd",
                                             mutates_args=())(flash_attn_bwd_impl)

    def bwd_fake(dout, q, k, v, out, lse, *rest):  # (both ops end in learnable_sink, dlse,
        sink = rest[-3]                             # deterministic)
        return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
                q.new_empty((0,) if sink is None else sink.shape, dtype=torch.float32))

    flash_attn_bwd.register_fake(bwd_fake)

    def flash_attn_varlen_bwd_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                                   lse: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                   softmax_scale: Optional[float], causal: bool,
                                   window_left: int, window_right: int, softcap: float,
                                   alibi_slopes: Optional[Tensor], seqused_k: Optional[Tensor],
                                   learnable_sink: Optional[Tensor],
                                   dlse: Optional[Tensor], deterministic: bool = False
                                   ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        return _backward(lambda arrays, scale, dlse: _bwd_plan.packed(
            *arrays, cu_seqlens_q, cu_seqlens_k, seqused_k=seqused_k, alibi_slopes=alibi_slopes,
            learnable_sink=_interop.detached(learnable_sink), dlse=dlse, softmax_scale=scale,
            causal=causal, window_size=(window_left, window_right), softcap=softcap,
            deterministic=_deterministic(deterministic)),
            dout, q, k, v, out, lse, softmax_scale, dlse)

    flash_attn_varlen_bwd = torch.library.custom_op("cufa::flash_attn_varlen_bwd",
                                                    mutates_args=())(flash_attn_varlen_bwd_impl)
    flash_attn_varlen_bwd.register_fake(bwd_fake)

    def dense_setup(ctx, inputs, output):
        q, k, v, scale, causal, left, right, softcap, alibi, sink, *deterministic = inputs
        ctx.save_for_backward(q, k, v, output[0], output[1], alibi, sink)
        ctx.options = (scale, causal, left, right, softcap)
        ctx.deterministic = bool(deterministic and deterministic[0])

    def dense_backward(ctx, dout, dlse):
        _no_alibi_grad(ctx.needs_input_grad[8])
        q, k, v, out, lse, alibi, sink = ctx.saved_tensors
        bwd = _backward_of(ctx, flash_attn_bwd_impl, flash_attn_bwd)
        dq, dk, dv, dsink = bwd(dout, q, k, v, out, lse, *ctx.options, alibi, sink, dlse,
                                ctx.deterministic)
        return (dq, dk, dv, None, None, None, None, None, None,
                _as_sink_grad(dsink, sink, ctx.needs_input_grad[9]), None)

    flash_attn.register_autograd(dense_backward, setup_context=dense_setup)

    def packed_setup(ctx, inputs, output):
        (q, k, v, cu_q, cu_k, _, _, scale, causal, left, right, softcap, alibi, used, table,
         sink, k_descale, v_descale, *deterministic) = inputs
        ctx.save_for_backward(q, k, v, output[0], output[1], cu_q, cu_k, alibi, used, sink)
        ctx.options = (scale, causal, left, right, softcap)
        ctx.deterministic = bool(deterministic and deterministic[0])
        ctx.paged = table is not None or k_descale is not None or v_descale is not None

    def packed_backward(ctx, dout, dlse):
        if ctx.paged:
            raise NotImplementedError("flash_attn_varlen_func over a paged or fp8 cache has no "
                                      "backward pass")
        _no_alibi_grad(ctx.needs_input_grad[12])
        q, k, v, out, lse, cu_q, cu_k, alibi, used, sink = ctx.saved_tensors
        bwd = _backward_of(ctx, flash_attn_varlen_bwd_impl, flash_attn_varlen_bwd)
        dq, dk, dv, dsink = bwd(dout, q, k, v, out, lse, cu_q, cu_k, *ctx.options, alibi, used,
                                sink, dlse, ctx.deterministic)
        return (dq, dk, dv) + (None,) * 12 + (
            _as_sink_grad(dsink, sink, ctx.needs_input_grad[15]), None, None, None)

    @torch.library.custom_op("cufa::sdpa", mutates_args=())
    def sdpa(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor],
             is_causal: bool, scale: Optional[float], enable_gqa: bool,
             learnable_sink: Optional[Tensor]) -> Tensor:
        return _fwd_plan.sdpa(query, key, value, attn_mask, None, is_causal=is_causal,
                              scale=scale, enable_gqa=enable_gqa,
                              learnable_sink=_interop.detached(learnable_sink))

    @sdpa.register_fake
    def _(query, *rest):
        return query.new_empty(query.shape)

    # SDPA where autograd records: out and the lse its backward reads (the op above, out
    # alone, stays the inference one)
    def sdpa_lse_impl(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor],
                      is_causal: bool, scale: Optional[float], enable_gqa: bool,
                      learnable_sink: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        return _fwd_plan.sdpa(query.detach(), key.detach(), value.detach(),
                              _interop.detached(attn_mask), None, is_causal=is_causal,
                              scale=scale, enable_gqa=enable_gqa,
                              learnable_sink=_interop.detached(learnable_sink), return_lse=True)

    sdpa_lse = torch.library.custom_op("cufa::sdpa_lse", mutates_args=())(sdpa_lse_impl)

    @sdpa_lse.register_fake
    def _(query, *rest):
        batch, nheads, seqlen_q, _ = query.shape
        return (query.new_empty(query.shape),
                query.new_empty((batch, nheads, seqlen_q), dtype=torch.float32))

    # (dmask: the additive mask's gradient, float32 in its shape, where mask_grad; else (0,))
    def sdpa_bwd_impl(dout: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor,
                      lse: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
                      scale: Optional[float], enable_gqa: bool, learnable_sink: Optional[Tensor],
                      mask_grad: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        dmask = (torch.empty(attn_mask.shape, dtype=torch.float32, device=attn_mask.device)
                 if mask_grad else query.new_empty((0,), dtype=torch.float32))
        return _backward(lambda arrays, s, dlse: _bwd_plan.sdpa(
            *arrays, _interop.detached(attn_mask), is_causal=is_causal,
            scale=s, enable_gqa=enable_gqa, learnable_sink=_interop.detached(learnable_sink),
            dmask=dmask if mask_grad else None, deterministic=_deterministic(False)),
            dout, query, key, value, out, lse, scale,
            None) + (dmask,)

    sdpa_bwd = torch.library.custom_op("cufa::sdpa_bwd", mutates_args=())(sdpa_bwd_impl)

    @sdpa_bwd.register_fake
    def _(dout, q, k, v, out, lse, mask, *rest):
        sink, mask_grad = rest[-2], rest[-1]
        return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
                q.new_empty((0,) if sink is None else sink.shape, dtype=torch.float32),
                q.new_empty(mask.shape if mask_grad else (0,), dtype=torch.float32))

    def sdpa_setup(ctx, inputs, output):
        query, key, value, mask, is_causal, scale, enable_gqa, sink = inputs
        ctx.save_for_backward(query, key, value, output[0], output[1], mask, sink)
        ctx.options = (is_causal, scale, enable_gqa)

    def sdpa_backward(ctx, dout, dlse):
        query, key, value, out, lse, mask, sink = ctx.saved_tensors
        mask_grad = bool(ctx.needs_input_grad[3])
        bwd = _backward_of(ctx, sdpa_bwd_impl, sdpa_bwd)
        dq, dk, dv, dsink, dmask = bwd(dout, query, key, value, out, lse, mask, *ctx.options,
                                       sink, mask_grad)
        return (dq, dk, dv, dmask.to(mask.dtype) if mask_grad else None, None, None, None,
                _as_sink_grad(dsink, sink, ctx.needs_input_grad[7]))

    sdpa_lse.register_autograd(sdpa_backward, setup_context=sdpa_setup)

    def flash_attn_varlen_impl(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                               cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                               softmax_scale: Optional[float], causal: bool, window_left: int,
                               window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
                               seqused_k: Optional[Tensor], block_table: Optional[Tensor],
                               learnable_sink: Optional[Tensor], k_descale: Optional[Tensor],
                               v_descale: Optional[Tensor], deterministic: bool = False
                               ) -> Tuple[Tensor, Tensor]:
        return _fwd_plan.packed(
            q.detach(), k.detach(), v.detach(), cu_seqlens_q, cu_seqlens_k, seqused_k,
            alibi_slopes, block_table, None,
            softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right),
            softcap=softcap, return_lse=True, learnable_sink=_interop.detached(learnable_sink),
            k_descale=k_descale, v_descale=v_descale)

    flash_attn_varlen = torch.library.custom_op("cufa::flash_attn_varlen",
                                                mutates_args=())(flash_attn_varlen_impl)

    @flash_attn_varlen.register_fake
    def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *rest):
        total_q, nheads, _ = q.shape
        return (q.new_empty(q.shape[:-1] + v.shape[-1:]),
                q.new_empty((nheads, total_q), dtype=torch.float32))

    flash_attn_varlen.register_autograd(packed_backward, setup_context=packed_setup)

    def kvcache_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                     cache_seqlen, cache_batch_idx, cache_leftpad, block_table, softmax_scale,
                     causal, window_left, window_right, softcap, rotary_interleaved,
                     alibi_slopes, num_splits, learnable_sink, k_descale, v_descale, qv):
        return _decode_plan.with_kvcache(
            (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
             cache_leftpad, block_table, alibi_slopes, _interop.detached(learnable_sink), k_descale,
             v_descale, qv, None),
            cache_seqlen=cache_seqlen,
            softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right),
            softcap=softcap, rotary_interleaved=rotary_interleaved, num_splits=num_splits,
            return_lse=True)

    def kvcache_fake(q, k_cache, v_cache, *rest):
        batch, seqlen_q, nheads, _ = q.shape
        qv = rest[-1]  # (MLA: out takes v's head dim)
        return (q.new_empty(q.shape if qv is None else q.shape[:-1] + v_cache.shape[-1:]),
                q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32))

    # Two ops: with k and v the cache is written in place, and an op that mutates its
    # inputs costs torch.compile more (functionalization) than a decode that only reads.
    ops = {}
    for name, mutates in (("kvcache", ()), ("kvcache_append", ("k_cache", "v_cache"))):
        @torch.library.custom_op(f"cufa::{name}", mutates_args=mutates)
        def kvcache_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor],
                       v: Optional[Tensor], rotary_cos: Optional[Tensor],
                       rotary_sin: Optional[Tensor], cache_seqlens: Optional[Tensor],
                       cache_seqlen: Optional[int], cache_batch_idx: Optional[Tensor],
                       cache_leftpad: Optional[Tensor], block_table: Optional[Tensor],
                       softmax_scale: Optional[float], causal: bool, window_left: int,
                       window_right: int, softcap: float, rotary_interleaved: bool,
                       alibi_slopes: Optional[Tensor], num_splits: int,
                       learnable_sink: Optional[Tensor], k_descale: Optional[Tensor],
                       v_descale: Optional[Tensor],
                       qv: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
            return kvcache_call(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                                cache_seqlens, cache_seqlen, cache_batch_idx, cache_leftpad,
                                block_table, softmax_scale, causal, window_left, window_right,
                                softcap, rotary_interleaved, alibi_slopes, num_splits,
                                learnable_sink, k_descale, v_descale, qv)
        kvcache_op.register_fake(kvcache_fake)
        ops[name] = kvcache_op

    # -- the fp8 forward (q, k, v in float8_e4m3fn; out bfloat16): no backward --
    @torch.library.custom_op("cufa::flash_attn_fp8", mutates_args=())
    def flash_attn_fp8(q: Tensor, k: Tensor, v: Tensor, q_descale: Optional[Tensor],
                       k_descale: Optional[Tensor], v_descale: Optional[Tensor],
                       softmax_scale: Optional[float], causal: bool, window_left: int,
                       window_right: int) -> Tuple[Tensor, Tensor]:
        return _fwd_plan.fp8_dense(q, k, v, None, q_descale, k_descale, v_descale,
                                   softmax_scale=softmax_scale, causal=causal,
                                   window_size=(window_left, window_right), return_lse=True)

    @flash_attn_fp8.register_fake
    def _(q, k, v, *rest):
        batch, seqlen_q, nheads, _ = q.shape
        return (q.new_empty(q.shape, dtype=torch.bfloat16),
                q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32))

    @torch.library.custom_op("cufa::flash_attn_varlen_fp8", mutates_args=())
    def flash_attn_varlen_fp8(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                              cu_seqlens_k: Tensor, seqused_k: Optional[Tensor],
                              block_table: Optional[Tensor], q_descale: Optional[Tensor],
                              k_descale: Optional[Tensor], v_descale: Optional[Tensor],
                              softmax_scale: Optional[float], causal: bool, window_left: int,
                              window_right: int) -> Tuple[Tensor, Tensor]:
        return _fwd_plan.fp8_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table,
                                    None,
                                    q_descale, k_descale, v_descale,
                                    softmax_scale=softmax_scale, causal=causal,
                                    window_size=(window_left, window_right), return_lse=True)

    @flash_attn_varlen_fp8.register_fake
    def _(q, *rest):
        total_q, nheads, _ = q.shape
        return (q.new_empty(q.shape, dtype=torch.bfloat16),
                q.new_empty((nheads, total_q), dtype=torch.float32))

    @torch.library.custom_op("cufa::merge", mutates_args=())
    def merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor,
              lse_b: Tensor) -> Tuple[Tensor, Tensor]:
        return _decode_plan.merge((out_a, lse_a, out_b, lse_b, None))

    @merge.register_fake
    def _(out_a, lse_a, out_b, lse_b):
        return out_a.new_empty(out_a.shape), lse_a.new_empty(lse_a.shape)

    recorded = dict(
        flash_attn=_eager_autograd(torch, flash_attn_impl, dense_setup, dense_backward),
        flash_attn_varlen=_eager_autograd(torch, flash_attn_varlen_impl, packed_setup,
                                          packed_backward),
        sdpa_lse=_eager_autograd(torch, sdpa_lse_impl, sdpa_setup, sdpa_backward))
    return dict(flash_attn=flash_attn, sdpa=sdpa, sdpa_lse=sdpa_lse,
                flash_attn_varlen=flash_attn_varlen, flash_attn_fp8=flash_attn_fp8,
                flash_attn_varlen_fp8=flash_attn_varlen_fp8, merge=merge, **ops), recorded
