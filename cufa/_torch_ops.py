"""PyTorch custom ops, so that torch.compile can trace calls to cufa.

torch.compile cannot look inside cufa (CuPy, raw pointers), so while it traces, the
public functions hand torch tensors to ``torch.ops.cufa.flash_attn`` /
``torch.ops.cufa.sdpa``: opaque ops with fake implementations that only compute output
shapes. In eager mode nothing goes through here.

Importing cufa never imports torch, and torch.compile cannot trace the registration
itself, so the ops are registered when cufa is imported after torch, or else at the
first eager call with torch tensors.
"""
import sys

_ops = None


def compiling(x):
    """True while torch.compile traces a call whose input `x` is a torch tensor."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor) and torch.compiler.is_compiling()


def register_if_torch_loaded():
    global _ops
    if _ops is None and "torch" in sys.modules:
        _ops = _register()


def ops():
    if _ops is None:
        raise RuntimeError("cufa's torch.compile ops are not registered yet: import torch "
                           "before cufa, or call cufa once outside torch.compile first")
    return _ops


def _register():
    from typing import Optional, Tuple

    import torch
    from torch import Tensor

    from . import api

    @torch.library.custom_op("cufa::flash_attn", mutates_args=())
    def flash_attn(q: Tensor, k: Tensor, v: Tensor, softmax_scale: Optional[float],
                   causal: bool, window_left: int, window_right: int, softcap: float,
                   alibi_slopes: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        return api.flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                   window_size=(window_left, window_right), softcap=softcap,
                                   alibi_slopes=alibi_slopes, return_lse=True)

    @flash_attn.register_fake
    def _(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes):
        batch, seqlen_q, nheads, _ = q.shape
        return (q.new_empty(q.shape),
                q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32))

    @torch.library.custom_op("cufa::sdpa", mutates_args=())
    def sdpa(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor],
             is_causal: bool, scale: Optional[float], enable_gqa: bool) -> Tensor:
        return api.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                                is_causal=is_causal, scale=scale,
                                                enable_gqa=enable_gqa)

    @sdpa.register_fake
    def _(query, key, value, attn_mask, is_causal, scale, enable_gqa):
        return query.new_empty(query.shape)

    return flash_attn, sdpa
