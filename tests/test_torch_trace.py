"""CPU: torch.compile traces a cufa call into one opaque op (meta tensors, no GPU).
Skipped where PyTorch is not installed."""
import pytest

torch = pytest.importorskip("torch")
import torch._dynamo  # noqa: E402

import cufa  # noqa: E402
from cufa import _torch_ops  # noqa: E402


def _traced_graph(fn, *args):
    _torch_ops.register_if_torch_loaded()
    torch._dynamo.reset()
    explain = torch._dynamo.explain(fn)(*args)
    assert explain.graph_break_count == 0, explain.break_reasons
    assert explain.graph_count == 1
    return explain.graphs[0].code


def test_flash_attn_traces_as_one_op():
    q = torch.empty(2, 64, 4, 32, dtype=torch.float16, device="meta")
    k = torch.empty(2, 80, 2, 32, dtype=torch.float16, device="meta")

    def f(q, k, v):
        out, lse = cufa.flash_attn_func(q, k, v, causal=True, window_size=(8, -1),
                                        return_lse=True)
        assert out.shape == q.shape and lse.shape == (2, 4, 64)
        return out * 2, lse
    code = _traced_graph(f, q, k, k)
    assert "torch.ops.cufa.flash_attn" in code


def test_sdpa_traces_as_one_op():
    q = torch.empty(2, 4, 64, 32, dtype=torch.bfloat16, device="meta")
    mask = torch.empty(64, 64, dtype=torch.bool, device="meta")
    code = _traced_graph(lambda q, m: cufa.scaled_dot_product_attention(q, q, q, attn_mask=m),
                         q, mask)
    assert "torch.ops.cufa.sdpa" in code


def test_out_is_refused_under_compile():
    q = torch.empty(1, 8, 1, 32, dtype=torch.float16, device="meta")
    _torch_ops.register_if_torch_loaded()
    torch._dynamo.reset()
    f = torch.compile(lambda q: cufa.flash_attn_func(q, q, q, out=q), fullgraph=True,
                      backend="eager")
    with pytest.raises(Exception, match="out= is not supported inside torch.compile"):
        f(q)
