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


def _counting_compile(fn):
    """torch.compile(fullgraph, dynamic) with a backend that records each graph it gets."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    _torch_ops.register_if_torch_loaded()
    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=True), graphs


def test_dynamic_lengths_trace_once():
    def block(q, k, v):
        return cufa.flash_attn_func(q, k, v, causal=True) * 2
    f, graphs = _counting_compile(block)
    for n in (64, 100, 333):
        q = torch.empty(2, n, 4, 32, dtype=torch.float16, device="meta")
        k = torch.empty(2, n + 7, 2, 32, dtype=torch.float16, device="meta")
        assert f(q, k, k).shape == (2, n, 4, 32)
    assert len(graphs) == 1
    assert "torch.ops.cufa.flash_attn" in graphs[0].code


def test_varlen_kvcache_and_merge_trace_as_one_op_each_with_dynamic_shapes():
    def step(q, k, v, cu, q1, k_cache, v_cache, k_new, lens, table):
        o, lse = cufa.flash_attn_varlen_func(q, k, v, cu, cu, 128, 128, causal=True,
                                             return_lse=True)
        o1 = cufa.flash_attn_with_kvcache(q1, k_cache, v_cache, k_new, k_new,
                                          cache_seqlens=lens, block_table=table, causal=True)
        merged, _ = cufa.merge_attention_states(o, lse, o, lse)
        return merged, o1
    f, graphs = _counting_compile(step)
    for total, batch in ((300, 5), (517, 9)):  # (no size equal to another: duck sizing)
        meta = dict(dtype=torch.float16, device="meta")
        q = torch.empty(total, 4, 64, **meta)
        k = torch.empty(total, 2, 64, **meta)
        cu = torch.empty(batch + 1, dtype=torch.int32, device="meta")
        q1 = torch.empty(batch, 1, 4, 64, **meta)
        pages = torch.empty(40, 16, 2, 64, **meta)
        k_new = torch.empty(batch, 1, 2, 64, **meta)
        lens = torch.empty(batch, dtype=torch.int32, device="meta")
        table = torch.empty(batch, 8, dtype=torch.int32, device="meta")
        merged, o1 = f(q, k, k, cu, q1, pages, pages, k_new, lens, table)
        assert merged.shape == q.shape and o1.shape == q1.shape
    assert len(graphs) == 1
    code = graphs[0].code
    for op in ("flash_attn_varlen", "kvcache_append", "merge"):
        assert f"torch.ops.cufa.{op}" in code, op


def test_decode_without_append_is_the_op_that_mutates_nothing():
    q = torch.empty(4, 1, 8, 64, dtype=torch.float16, device="meta")
    cache = torch.empty(4, 256, 2, 64, dtype=torch.float16, device="meta")
    lens = torch.empty(4, dtype=torch.int32, device="meta")
    code = _traced_graph(lambda q, c, n: cufa.flash_attn_with_kvcache(q, c, c, cache_seqlens=n),
                         q, cache, lens)
    assert "torch.ops.cufa.kvcache.default" in code and "kvcache_append" not in code


def test_learnable_sink_is_an_optional_tensor_of_every_op():
    """A sink goes into each op as one more tensor argument (a parameter of the model, its
    values not specialized on); a parameter that requires grad is refused by a function
    without a backward while tracing with autograd on, as eagerly, and detached under
    no_grad."""
    meta = dict(dtype=torch.float16, device="meta")
    sink = torch.empty(4, dtype=torch.float32, device="meta")

    def f(q, k, cu, q1, cache, lens, sink):
        o, lse = cufa.flash_attn_func(q, k, k, causal=True, learnable_sink=sink,
                                      return_lse=True)
        ov = cufa.flash_attn_varlen_func(q[0], k[0], k[0], cu, cu, 64, 80, learnable_sink=sink)
        od = cufa.flash_attn_with_kvcache(q1, cache, cache, cache_seqlens=lens,
                                          learnable_sink=sink)
        os_ = cufa.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                k.transpose(1, 2), enable_gqa=True,
                                                learnable_sink=sink)
        return o, lse, ov, od, os_
    args = (torch.empty(2, 64, 4, 32, **meta), torch.empty(2, 80, 2, 32, **meta),
            torch.empty(3, dtype=torch.int32, device="meta"), torch.empty(2, 1, 4, 32, **meta),
            torch.empty(2, 128, 2, 32, **meta), torch.empty(2, dtype=torch.int32, device="meta"),
            sink)
    code = _traced_graph(f, *args)
    calls = [line for line in code.splitlines() if "torch.ops.cufa." in line]
    assert len(calls) == 4
    for op in ("flash_attn", "flash_attn_varlen", "kvcache", "sdpa"):
        (call,) = [c for c in calls if f"torch.ops.cufa.{op}.default(" in c]
        assert "l_sink_" in call.split("=", 1)[1], call  # the sink passed to the op
    param = torch.nn.Parameter(torch.empty(4, device="meta"))
    _torch_ops.register_if_torch_loaded()
    torch._dynamo.reset()
    # (the KV-cache call has no backward: its sink parameter is refused where autograd
    # records)
    g = torch.compile(lambda q, c, s: cufa.flash_attn_with_kvcache(q, c, c, learnable_sink=s),
                      fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="learnable_sink requires grad"):
        g(args[3], args[4], param)
    with torch.no_grad():  # (inference: the parameter detached, in the graph)
        code = _traced_graph(lambda q, s: cufa.flash_attn_func(q, q, q, learnable_sink=s),
                             args[0], param)
    assert "torch.ops.cufa.flash_attn" in code


def test_torch_is_known_before_the_first_trace():
    """A trace reads _interop's torch tensor type (api._other_route); were it still unset
    there, the graph would be guarded on None and recompiled once the first real call had
    set it. Importing cufa after torch sets it, in a fresh process."""
    import subprocess
    import sys
    code = ("import torch, cufa; from cufa import _interop; "
            "assert _interop._torch_tensor is torch.Tensor")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fp8_cache_and_descales_trace_into_the_kvcache_op():
    """An fp8 cache traces as a 16-bit one does, its descales one more pair of tensor
    arguments of the op (with the append: the op that mutates the caches; qv, None, after
    them)."""
    q = torch.empty(2, 1, 8, 64, dtype=torch.bfloat16, device="meta")
    cache = torch.empty(2, 256, 2, 64, dtype=torch.float8_e4m3fn, device="meta")
    new = torch.empty(2, 1, 2, 64, dtype=torch.bfloat16, device="meta")
    lens = torch.empty(2, dtype=torch.int32, device="meta")
    k_scale, v_scale = (torch.empty(2, 2, dtype=torch.float32, device="meta") for _ in range(2))

    def f(q, c, k, n, ks, vs):
        return cufa.flash_attn_with_kvcache(q, c, c, k, k, cache_seqlens=n, k_descale=ks,
                                           v_descale=vs)
    code = _traced_graph(f, q, cache, new, lens, k_scale, v_scale)
    (call,) = [line for line in code.splitlines() if "torch.ops.cufa.kvcache_append" in line]
    assert call.split("(", 1)[1].rstrip(");").split(";")[0].endswith("l_ks_, l_vs_, None)"), call


def test_mla_traces_into_the_kvcache_op_with_qv():
    """MLA decode (qv, FlashAttention-3's form): the kvcache op with qv its last argument,
    and an output of v_cache's head dim (512) from the op's fake."""
    q = torch.empty(2, 1, 16, 64, dtype=torch.bfloat16, device="meta")
    qv = torch.empty(2, 1, 16, 512, dtype=torch.bfloat16, device="meta")
    k_pe = torch.empty(2, 256, 1, 64, dtype=torch.bfloat16, device="meta")
    c_kv = torch.empty(2, 256, 1, 512, dtype=torch.bfloat16, device="meta")
    lens = torch.empty(2, dtype=torch.int32, device="meta")

    def f(q, k, v, n, qv):
        out = cufa.flash_attn_with_kvcache(q, k, v, cache_seqlens=n, qv=qv)
        assert out.shape == (2, 1, 16, 512)
        return out * 2
    code = _traced_graph(f, q, k_pe, c_kv, lens, qv)
    (call,) = [line for line in code.splitlines() if "torch.ops.cufa.kvcache" in line]
    assert call.split("(", 1)[1].rstrip(");").split(";")[0].endswith("None, l_qv_)"), call


def test_fp8_paged_varlen_traces_with_its_descales():
    """flash_attn_varlen_func over an fp8 paged cache: one op, the descales its last two
    tensor arguments."""
    q = torch.empty(40, 8, 64, dtype=torch.float16, device="meta")
    pages = torch.empty(16, 16, 2, 64, dtype=torch.float8_e4m3fn, device="meta")
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    table = torch.empty(2, 8, dtype=torch.int32, device="meta")
    k_scale, v_scale = (torch.empty(2, 2, dtype=torch.float32, device="meta") for _ in range(2))

    def f(q, p, cu, t, ks, vs):
        out = cufa.flash_attn_varlen_func(q, p, p, cu, cu, 32, 128, causal=True, block_table=t,
                                          k_descale=ks, v_descale=vs)
        assert out.shape == q.shape
        return out
    code = _traced_graph(f, q, pages, cu, table, k_scale, v_scale)
    (call,) = [line for line in code.splitlines() if "torch.ops.cufa.flash_attn_varlen" in line]
    assert "l_ks_, l_vs_, False)" in call, call  # (then deterministic: the backward's)


def test_out_takes_v_s_head_dim_in_the_trace():
    """A head dim of v's own: the ops' fake outputs have it (dense and packed)."""
    q = torch.empty(2, 64, 4, 192, dtype=torch.float16, device="meta")
    k = torch.empty(2, 80, 2, 192, dtype=torch.float16, device="meta")
    v = torch.empty(2, 80, 2, 128, dtype=torch.float16, device="meta")
    cu = torch.empty(3, dtype=torch.int32, device="meta")

    def f(q, k, v, cu):
        out = cufa.flash_attn_func(q, k, v, causal=True)
        packed = cufa.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 64, 80)
        assert out.shape == (2, 64, 4, 128) and packed.shape == (64, 4, 128)
        return out, packed
    code = _traced_graph(f, q, k, v, cu)
    assert "torch.ops.cufa.flash_attn" in code and "torch.ops.cufa.flash_attn_varlen" in code


def test_fp8_forward_traces_into_its_ops_with_dynamic_shapes():
    """q, k, v in float8_e4m3fn under torch.compile: flash_attn_fp8 and
    flash_attn_varlen_fp8, the descales as tensor arguments (None where absent), out
    bfloat16 and lse of the 16-bit forward's shapes; one graph for new lengths."""
    fp8 = dict(dtype=torch.float8_e4m3fn, device="meta")

    def f(q, k, qp, kp, cu, descale):
        out, lse = cufa.flash_attn_func(q, k, k, causal=True, q_descale=descale,
                                        k_descale=descale, return_lse=True)
        op, lsep = cufa.flash_attn_varlen_func(qp, kp, kp, cu, cu, 64, 64, return_lse=True,
                                               q_descale=descale, v_descale=descale)
        assert out.dtype == op.dtype == torch.bfloat16 and out.shape == q.shape
        assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
        assert lsep.shape == (qp.shape[1], qp.shape[0])
        return out, lse, op, lsep
    compiled, graphs = _counting_compile(f)
    for n, batch in ((64, 5), (100, 8)):  # (no size equal to another: duck sizing)
        compiled(torch.empty(2, n, 4, 32, **fp8), torch.empty(2, n + 3, 2, 32, **fp8),
                 torch.empty(n, 4, 32, **fp8), torch.empty(n + 3, 2, 32, **fp8),
                 torch.empty(batch + 1, dtype=torch.int32, device="meta"),
                 torch.empty(2, 2, dtype=torch.float32, device="meta"))
    assert len(graphs) == 1
    code = graphs[0].code
    for op in ("flash_attn_fp8", "flash_attn_varlen_fp8"):
        assert f"torch.ops.cufa.{op}.default(" in code, op
    assert "torch.ops.cufa.flash_attn.default(" not in code


def test_fp8_forward_without_descales_and_out_under_compile():
    """fp8 q without any descale still takes the fp8 op (not the 16-bit one, which would
    refuse its dtype only when the compiled code runs); out= is refused while tracing."""
    q = torch.empty(1, 16, 2, 32, dtype=torch.float8_e4m3fn, device="meta")
    code = _traced_graph(lambda q: cufa.flash_attn_func(q, q, q), q)
    assert "torch.ops.cufa.flash_attn_fp8.default(" in code
    torch._dynamo.reset()
    out = torch.empty(1, 16, 2, 32, dtype=torch.bfloat16, device="meta")
    f = torch.compile(lambda q, o: cufa.flash_attn_func(q, q, q, out=o), fullgraph=True,
                      backend="eager")
    with pytest.raises(Exception, match="out= is not supported inside torch.compile"):
        f(q, out)


def test_fp8_dtypes_are_checked_while_tracing():
    """A 16-bit q with descales, or a float16 descale, is refused while torch.compile
    traces, naming the argument (the op's fake would otherwise say bfloat16 out)."""
    _torch_ops.register_if_torch_loaded()
    meta = lambda dtype, *shape: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    q8, q16 = meta(torch.float8_e4m3fn, 1, 16, 2, 32), meta(torch.float16, 1, 16, 2, 32)
    for args, match in (((q16, q8, meta(torch.float32, 1)), "q has dtype torch.float16"),
                        ((q8, q8, meta(torch.float16, 1)), "q_descale must be float32")):
        torch._dynamo.reset()
        f = torch.compile(lambda q, k, s: cufa.flash_attn_func(q, k, k, q_descale=s),
                          fullgraph=True, backend="eager")
        with pytest.raises(Exception, match=match):
            f(*args)


def test_fp8_q_is_dequantized_by_traced_ops_before_the_kvcache_op():
    """An e4m3 q with q_descale: torch ops (to float32, times the per-KV-head descale, to
    bfloat16) in the graph, outside cufa's op, which then takes the bfloat16 q; no break."""
    q = torch.empty(2, 1, 8, 64, dtype=torch.float8_e4m3fn, device="meta")
    cache = torch.empty(2, 256, 2, 64, dtype=torch.float8_e4m3fn, device="meta")
    new = torch.empty(2, 1, 2, 64, dtype=torch.bfloat16, device="meta")
    lens = torch.empty(2, dtype=torch.int32, device="meta")
    q_scale = torch.empty(2, 2, dtype=torch.float32, device="meta")

    def f(q, c, k, n, qs):
        out = cufa.flash_attn_with_kvcache(q, c, c, k, k, cache_seqlens=n, q_descale=qs)
        assert out.dtype == torch.bfloat16 and out.shape == q.shape
        return out
    code = _traced_graph(f, q, cache, new, lens, q_scale)
    lines = code.splitlines()
    (at,) = [i for i, line in enumerate(lines) if "torch.ops.cufa.kvcache_append" in line]
    before = "\n".join(lines[:at])
    assert "l_qs_" in before and "torch.bfloat16" in before, code
    assert not lines[at].split("(", 1)[1].startswith("l_q_,"), lines[at]  # (not the e4m3 q)
