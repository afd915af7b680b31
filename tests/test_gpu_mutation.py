"""GPU: the checks the GPU tests rely on reject wrong results (mutation checks). cufa's
own out and lse pass; the same out zeroed, with its rows shifted, with one element off
by 5 % of its scale or one NaN, and a wrong lse (test_pass_rule_cpu.MUTATIONS) fail the
pass rule, through check_attention and check_kvcache alike; a KV cache with a stray
write, a missed append, a new key left unrotated or 4 ulps off fails the cache check."""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import cufa  # noqa: E402
from _attention_check import (  # noqa: E402
    check_appended_cache, check_attention, check_kvcache, kvcache_references, randn)
from test_gpu_kvcache import build, snapshot  # noqa: E402
from test_pass_rule_cpu import MUTATIONS  # noqa: E402


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.__name__ for m in MUTATIONS])
def test_check_attention_rejects_a_corrupted_output(rng, dtype, mutation):
    q = randn(rng, (2, 97, 4, 64), dtype)
    k, v = (randn(rng, (2, 130, 2, 64), dtype) for _ in range(2))
    out, lse = cufa.flash_attn_func(q, k, v, causal=True, return_lse=True)
    check_attention(out, lse, q, k, v, causal=True)
    with pytest.raises(AssertionError):
        check_attention(*mutation(out, lse), q, k, v, label=mutation.__name__, causal=True)


@pytest.mark.parametrize("seqlen_q", [1, 3])
@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.__name__ for m in MUTATIONS])
def test_check_kvcache_rejects_a_corrupted_output(rng, seqlen_q, mutation):
    kw, _ = build(rng, page_size=16, new=2, seqlen_q=seqlen_q, causal=True,
                  rotary="interleaved", lens=[7, 60, 33])
    before = snapshot(kw)
    out, lse = cufa.flash_attn_with_kvcache(**kw, return_softmax_lse=True)
    check_kvcache(out, lse, **{**kw, **before})
    with pytest.raises(AssertionError):
        check_kvcache(*mutation(out, lse), label=mutation.__name__, **{**kw, **before})


def test_check_cache_rejects_a_wrong_cache(rng):
    """An append of 2 rotated keys a sequence into pages of 16: the cache as cufa leaves it
    passes; one value changed outside the new slots, one new slot holding its old value,
    one holding its key unrotated, and one 4 ulps off each fail."""
    kw, slots = build(rng, page_size=16, new=2, seqlen_q=1, rotary="half", lens=[7, 60, 33])
    before = snapshot(kw)
    cufa.flash_attn_with_kvcache(**kw)
    _, _, k_after, _ = kvcache_references(**{**kw, **before})
    cache = kw["k_cache"]
    check_appended_cache(cache, before["k_cache"], k_after, slots, "as written", rotated=True)
    page, row = (int(s[-1]) for s in slots)   # the last new key of the last sequence
    unused = int(np.setdiff1d(np.arange(cache.shape[0]), kw["block_table"].cpu().numpy())[0])
    corruptions = {
        "a stray write": lambda c: c[unused, 0, 0, 0].fill_(1.0),
        "a missed append": lambda c: c[page, row].copy_(before["k_cache"][page, row]),
        "a key left unrotated": lambda c: c[page, row].copy_(kw["k"][-1, -1]),
        "a key 4 ulps off": lambda c: c[page, row].view(torch.int16).add_(4),
    }
    for name, corrupt in corruptions.items():
        bad = cache.clone()
        corrupt(bad)
        with pytest.raises(AssertionError):
            check_appended_cache(bad, before["k_cache"], k_after, slots, name, rotated=True)
