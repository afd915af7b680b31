"""CPU: page ids are read where the caller asks for device values to be checked
(flash_attn_varlen_func's check_cu_seqlens=True, flash_attn_with_kvcache's
check_inputs=True), and an id outside the cache raises an error naming block_table
before anything is launched; without the check the call goes ahead (the kernels clamp
ids). The device is stubbed out: arrays are cufa's view type over host arrays."""
import numpy as np
import pytest

import cufa
from cufa import _compile, _decode_plan, _fwd_plan, _heuristics, _interop, _runtime, api
from cufa._interop import DeviceArray

PAGES, PAGE, HK, D = 6, 16, 2, 64
_addresses = iter(range(1 << 32, 1 << 40, 1 << 24))


def view(values=None, shape=None, dtype="float16"):
    """A view of a device array: of `values` (its host copy) or, for arrays whose values no
    check reads, of `shape` alone."""
    if values is not None:
        values = np.asarray(values, dtype=np.int32)
        shape, dtype = values.shape, "int32"
    itemsize = 4 if dtype == "int32" else 2
    return DeviceArray(values, "cupy", next(_addresses), tuple(shape),
                       _interop.contiguous_strides(shape), dtype, 0, itemsize)


@pytest.fixture
def launched(monkeypatch):
    """Plans without a GPU (an sm_80 device, kernels as fake handles); device values read
    from the views' host arrays; launches recorded, not made."""
    monkeypatch.setattr(_compile, "function_pointer", lambda kernel, device: 0xF00)
    monkeypatch.setattr(_runtime, "compute_capability", lambda device: "80")
    monkeypatch.setattr(_runtime, "sm_count", lambda device: 108)
    monkeypatch.setattr(_runtime, "smem_per_sm", lambda device: 164 * 1024)
    monkeypatch.setattr(_runtime, "peak_bytes_per_s", lambda device: None)
    monkeypatch.setattr(_heuristics, "_keeps_up", {})
    monkeypatch.setattr(_interop, "to_numpy", lambda x: x.obj)
    calls = []
    monkeypatch.setattr(_fwd_plan, "_execute", lambda *a, **kw: calls.append("varlen"))
    monkeypatch.setattr(_decode_plan, "_run", lambda *a: calls.append("kvcache"))
    api.clear_plans()
    yield calls
    api.clear_plans()


def varlen(table, **kw):
    q, pages = view(shape=(10, 4, D)), view(shape=(PAGES, PAGE, HK, D))
    return cufa.flash_attn_varlen_func(q, pages, pages, view([0, 4, 10]), view([0, 20, 50]),
                                       6, 30, block_table=view(table), **kw)


def kvcache_call(table, **kw):
    q, pages = view(shape=(2, 1, 8, D)), view(shape=(PAGES, PAGE, HK, D))
    return cufa.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=view([10, 20]),
                                        block_table=view(table), **kw)


GOOD = [[3, 0, 5], [1, 2, 4]]
BAD = [  # (table, the entry the error names)
    ([[3, 0, 5], [1, 2, PAGES]], r"block_table\[1, 2\] = 6\b"),    # one past the last page
    ([[3, -1, 5], [1, 2, 4]], r"block_table\[0, 1\] = -1\b"),
    ([[3, 0, 5], [2**30, 2, 4]], r"block_table\[1, 0\] = 1073741824\b"),
]


@pytest.mark.parametrize("call, check", [(varlen, "check_cu_seqlens"),
                                         (kvcache_call, "check_inputs")],
                         ids=["flash_attn_varlen_func", "flash_attn_with_kvcache"])
def test_page_ids_outside_the_cache_are_refused_when_checked(launched, call, check):
    for table, entry in BAD:
        with pytest.raises(ValueError, match=entry):
            call(table, **{check: True})
    assert launched == []
    call(GOOD, **{check: True})
    for table, _ in BAD:  # unchecked: launched, the ids clamped on the device
        call(table)
    assert len(launched) == 1 + len(BAD)


def test_paged_sequences_longer_than_their_table_rows_are_refused_when_checked(launched):
    """A sequence's keys (cu_seqlens_k's length, or seqused_k) must fit its row of
    block_table: 3 pages of 16 hold 48 keys. The kernels would clamp the page index and
    read another page's keys."""
    q, pages = view(shape=(10, 4, D)), view(shape=(PAGES, PAGE, HK, D))

    def call(cu_k, **kw):
        return cufa.flash_attn_varlen_func(q, pages, pages, view([0, 4, 10]), view(cu_k), 6, 60,
                                           block_table=view(GOOD), check_cu_seqlens=True, **kw)
    with pytest.raises(ValueError, match=r"key sequence 1 has 49 keys \(cu_seqlens_k\), more "
                                         r"than the 48"):
        call([0, 20, 69])
    with pytest.raises(ValueError, match=r"key sequence 0 has 49 keys \(seqused_k\)"):
        call([0, 60, 69], seqused_k=view([49, 5]))
    assert launched == []
    call([0, 48, 96])
    call([0, 60, 69], seqused_k=view([48, 5]))
    assert launched == ["varlen", "varlen"]


def test_cache_batch_idx_outside_the_cache_or_twice_with_an_append_is_refused_when_checked(
        launched):
    """cache_batch_idx's entries must name rows of the cache (3 here), and where the call
    appends, each row once: two sequences would write one row."""
    q, cache = view(shape=(2, 1, 8, D)), view(shape=(3, 64, HK, D))
    v_cache, new = view(shape=(3, 64, HK, D)), view(shape=(2, 1, HK, D))

    def call(rows, append=False):
        extra = dict(k=new, v=new) if append else {}
        return cufa.flash_attn_with_kvcache(q, cache, v_cache, cache_seqlens=view([10, 20]),
                                            cache_batch_idx=view(rows), check_inputs=True,
                                            **extra)
    for rows, entry in (([0, 3], r"cache_batch_idx\[1\] = 3 is not a row of the cache "
                                 r"\(0 to 2\)"), ([-1, 0], r"cache_batch_idx\[0\] = -1")):
        with pytest.raises(ValueError, match=entry):
            call(rows)
    with pytest.raises(ValueError, match="names cache row 2 more than once"):
        call([2, 2], append=True)
    assert launched == []
    call([2, 2])  # (reading one row for two sequences is fine)
    call([2, 0], append=True)
    assert launched == ["kvcache", "kvcache"]
