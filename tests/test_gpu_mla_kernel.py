"""The MLA decode kernel (decode/decode_mla_sm90.cu) launched on its own, with a
DecodeParams record built here, against the float64 reference under the per-row pass rule:
MLA's scores are those of plain attention with q' = [qv, q] and k' = [c_kv, k_pe], its
values c_kv, so the forward's references check it. Contiguous and paged caches, 1 to 4
query tokens, GQA groups of 16 and 128 heads (one and two CTAs of rows), lengths that are
not multiples of the 32-key block, an empty sequence, causal, splits merged by
decode_combine; outputs poisoned first."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cufa import _compile, _heuristics, _params, _runtime, reference  # noqa: E402
from cufa._checks import UNBOUNDED  # noqa: E402

from _attention_check import check_attention  # noqa: E402

pytestmark = pytest.mark.gpu

LATENT, ROPE = _compile.MLA_LATENT_DIM, _compile.MLA_ROPE_DIM

CASES = {  # batch, query tokens, heads, KV heads, cache lengths, page size, causal, splits
    "one token, 16 heads": dict(sq=1, h=16, hk=1, lens=[77, 1, 300], page=None, causal=False,
                                splits=1),
    "128 heads, two row CTAs": dict(sq=1, h=128, hk=1, lens=[513, 64], page=None,
                                    causal=False, splits=1),
    "speculative, causal, paged 64": dict(sq=4, h=16, hk=1, lens=[130, 5, 1000], page=64,
                                          causal=True, splits=1),
    "split in 5, paged 16, an empty one": dict(sq=2, h=32, hk=1, lens=[1500, 0, 33],
                                               page=16, causal=True, splits=5),
    "two KV heads, split in 3": dict(sq=1, h=16, hk=2, lens=[700, 95], page=None,
                                     causal=False, splits=3),
}


def _random(rng, shape, dtype):
    return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).to("cuda", dtype)


def _launch(q, qv, kc, vc, lens, table, page, causal, splits, dtype_name):
    b, sq, h, _ = q.shape
    hk = kc.shape[2]
    group = h // hk
    num_m_blocks = -(-sq * group // _compile.MLA_ROWS)
    out = torch.full((b, sq, h, LATENT), float("nan"), dtype=q.dtype, device="cuda")
    lse = torch.full((b, h, sq), float("nan"), dtype=torch.float32, device="cuda")
    o_part = torch.full((splits, b, sq, h, LATENT), float("nan"), device="cuda")
    lse_part = torch.full((splits, b, h, sq), float("nan"), device="cuda")
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    scale = 1.0 / math.sqrt(LATENT + ROPE)
    p = dict(q=q.data_ptr(), k=kc.data_ptr(), v=vc.data_ptr(), o=out.data_ptr(),
             lse=lse.data_ptr(), o_partial=o_part.data_ptr() if splits > 1 else 0,
             lse_partial=lse_part.data_ptr() if splits > 1 else 0,
             cache_seqlens=seqlens.data_ptr(), qv=qv.data_ptr(),
             block_table=table.data_ptr() if table is not None else 0,
             batch=b, seqlen_q=sq, nheads=h, nheads_k=hk, group=group, head_dim=LATENT,
             capacity=table.shape[1] * page if table is not None else kc.shape[1],
             cache_rows=kc.shape[0], num_splits=splits, num_m_blocks=num_m_blocks,
             combine_row_threads=_heuristics.combine_row_threads(LATENT, splits),
             window_left=UNBOUNDED, window_right=0 if causal else UNBOUNDED,
             scale=scale, scale_log2=scale * math.log2(math.e),
             lse_batch_stride=h * sq, lse_head_stride=sq)
    if table is not None:
        p.update(page_shift=int(math.log2(page)), max_pages=table.shape[1],
                 block_table_batch_stride=table.stride(0))
    for name, x in (("q", q), ("qv", qv), ("k", kc), ("v", vc), ("o", out)):
        (p[f"{name}_batch_stride"], p[f"{name}_row_stride"],
         p[f"{name}_head_stride"]) = x.stride()[:3]
    record = _params.DECODE.argument(_params.DECODE.pack(p))
    stream = torch.cuda.current_stream().cuda_stream
    device = torch.cuda.current_device()
    kernel = _compile.MlaVariant(dtype_name)
    _runtime.driver_launch(_compile.function_pointer(kernel, device),
                           (num_m_blocks * splits, hk, b), kernel.threads, kernel.smem_bytes,
                           stream, (record,))
    if splits > 1:
        combine = _heuristics.combine_kernel(dtype_name, LATENT, splits)
        _runtime.driver_launch(_compile.function_pointer(combine, device),
                               (-(-b * sq * h // combine.rows), 1, 1), combine.threads, 0,
                               stream, (record,))
    torch.cuda.synchronize()
    return out, lse


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(CASES))
def test_mla_kernel_against_the_reference(name, dtype):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the MLA kernel is Hopper's (wgmma)")
    c = CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    b, sq, h, hk, lens = len(c["lens"]), c["sq"], c["h"], c["hk"], c["lens"]
    capacity = -(-max(lens) // 64) * 64 + 64
    q = _random(rng, (b, sq, h, ROPE), dtype)
    qv = _random(rng, (b, sq, h, LATENT), dtype)
    k_pe = _random(rng, (b, capacity, hk, ROPE), dtype)
    c_kv = _random(rng, (b, capacity, hk, LATENT), dtype)
    table = None
    kc, vc = k_pe, c_kv
    if c["page"]:
        page = c["page"]
        table_np, num_pages = reference.paged_layout(b, capacity, page, rng)
        table = torch.from_numpy(table_np).to("cuda")
        kc = torch.zeros((num_pages, page, hk, ROPE), dtype=dtype, device="cuda")
        vc = torch.zeros((num_pages, page, hk, LATENT), dtype=dtype, device="cuda")
        for s in range(b):
            for j in range(capacity // page):
                kc[int(table_np[s, j])] = k_pe[s, j * page:(j + 1) * page]
                vc[int(table_np[s, j])] = c_kv[s, j * page:(j + 1) * page]
    out, lse = _launch(q, qv, kc, vc, lens, table, c["page"], c["causal"], c["splits"],
                       "bf16" if dtype == torch.bfloat16 else "fp16")
    scale = 1.0 / math.sqrt(LATENT + ROPE)
    for s, n in enumerate(lens):
        q_cat = torch.cat([qv[s:s + 1], q[s:s + 1]], dim=-1)
        k_cat = torch.cat([c_kv[s:s + 1, :n], k_pe[s:s + 1, :n]], dim=-1)
        check_attention(out[s:s + 1], lse[s:s + 1], q_cat, k_cat, c_kv[s:s + 1, :n],
                        label=f"{name} seq {s}", softmax_scale=scale, causal=c["causal"])
