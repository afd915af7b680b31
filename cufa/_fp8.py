"""The fp8 forward's layouts, as the kernels hold them (kernels_cu/fwd/transpose_v_e4m3.cu),
and its pre-passes' launches."""
import numpy as np

from . import _compile, _params, _runtime

VT_STEP = 32  # keys a k-step of the e4m3 P V product (wgmma k32)
VT_BLOCK = 128  # the fp8 forward's key block (kVtBlockKeys, _compile.FP8_TILES)


def vt_key_of(k):
    """The key (0..31) of a k-step that vt's column k (0..31) holds: P's A fragment has
    k-index 4t + i where the score accumulator has key 8 (i // 2) + 2t + i % 2 (t: the
    lane's column pair), and the same 16 on."""
    half, t, i = k // 16, (k % 16) // 4, k % 4
    return 16 * half + 8 * (i // 2) + 2 * t + i % 2


def transposed_v(v, padded_seqlen):
    """vt of a (batch, seqlen, nheads_k, d) array of e4m3 bytes (uint8): (batch, nheads_k,
    d, padded_seqlen), each 32-key step in vt_key_of's order, zeros past seqlen."""
    batch, seqlen, heads, d = v.shape
    padded = np.zeros((batch, padded_seqlen, heads, d), dtype=np.uint8)
    padded[:, :seqlen] = v
    order = np.array([(k // VT_STEP) * VT_STEP + vt_key_of(k % VT_STEP)
                      for k in range(padded_seqlen)])
    return np.ascontiguousarray(padded[:, order].transpose(0, 2, 3, 1))


def vt_sequence_start(k_start, b):
    """Where sequence b's keys start in a packed batch's vt (its first key k_start in k):
    128-aligned, each past the last one's keys rounded up to 128 (kernels_cu/fwd/
    vt_layout.cuh)."""
    return VT_BLOCK * (k_start // VT_BLOCK + b)


def vt_packed_keys(total_k, batch):
    """A packed batch's vt keys a row: room for every sequence's region."""
    return VT_BLOCK * (total_k // VT_BLOCK + batch + 1)


def transposed_v_packed(v, cu_seqlens, seqused=None):
    """vt of a packed (total_k, nheads_k, d) array of e4m3 bytes with int cu_seqlens (and
    seqused, keys used of each, or None): (nheads_k, d, vt_packed_keys), sequence b at
    vt_sequence_start, each 32-key step in vt_key_of's order, zeros past each sequence's
    used keys up to its last block's end (and in the gaps, which the kernel leaves as
    they were)."""
    total, heads, d = v.shape
    batch = len(cu_seqlens) - 1
    vt = np.zeros((heads, d, vt_packed_keys(total, batch)), dtype=np.uint8)
    for b in range(batch):
        start, end = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
        padded = padded_keys(max(end - start, 0)) if end > start else 0
        used = end - start if seqused is None else min(max(int(seqused[b]), 0), end - start)
        if padded:
            one = transposed_v(v[None, start:start + used], padded)[0]  # (heads, d, padded)
            s = vt_sequence_start(start, b)
            vt[:, :, s:s + padded] = one
    return vt


def padded_keys(seqlen, block_n=128):
    """vt's keys a row: seqlen rounded up to whole key blocks of the fp8 forward, at least
    one (the V map needs a row even where no key is read)."""
    return max(-(-seqlen // block_n), 1) * block_n


def launch_transpose_v(v_ptr, v_shape, v_strides, vt_ptr, padded_seqlen, device, stream,
                       cu_seqlens_k=0, seqused_k=0):
    """transpose_v_e4m3 on `stream`: v (batch, seqlen, nheads_k, d) e4m3 at v_ptr, element
    strides (batch, row, head; unit columns, d a multiple of 16) -> vt, contiguous
    (batch, nheads_k, d, padded_seqlen) at vt_ptr (the caller's workspace). A packed v:
    cu_seqlens_k's address (and seqused_k's or 0: zeros past each sequence's used keys),
    v_shape (batch, total_k, nheads_k, d), vt (nheads_k, d, padded_seqlen =
    vt_packed_keys)."""
    batch, seqlen, heads, d = v_shape
    if d % 16 or padded_seqlen % 64 or padded_seqlen < seqlen:
        raise ValueError(f"transpose_v: head dim {d} (16s) and padded keys {padded_seqlen} "
                         f"(64s, >= {seqlen})")
    kernel = _compile.TransposeVVariant()
    record = _params.TRANSPOSE_V.pack(dict(
        batch=batch, seqlen=seqlen, nheads_k=heads, head_dim=d, padded_seqlen=padded_seqlen,
        v_batch_stride=v_strides[0], v_row_stride=v_strides[1], v_head_stride=v_strides[2],
        cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k))
    args = _params.TRANSPOSE_V.with_pointer_values(record, (v_ptr, vt_ptr))
    pairs = heads if cu_seqlens_k else batch * heads
    grid = (padded_seqlen // 64 * pairs, -(-d // 64), 1)
    _runtime.driver_launch(_compile.function_pointer(kernel, device), grid, kernel.threads, 0,
                           stream, (args,))


GATHER_CTAS = 1024  # gather_pages_e4m3's grid: ~8 CTAs an SM, looping over the keys


def launch_gather_pages(k_cache, v_cache, paged, batch, k_rows_ptr, v_rows_ptr, cu_ptr, used_ptr,
                        cu_seqlens_k, seqused_k, device, stream):
    """gather_pages_e4m3 on `stream`: the pages of k_cache, v_cache (views, (num_pages,
    page_size, nheads_k, d) e4m3) that a packed batch's block_table names -> rows
    (batch * capacity, nheads_k, d), contiguous, at k_rows_ptr and v_rows_ptr, sequence b
    from row b * capacity on; at cu_ptr, int32 (batch + 1,), those starts, and at used_ptr,
    int32 (batch,), the keys the forward takes of each (what the packed route then reads
    as cu_seqlens_k and seqused_k). paged: _checks.check_block_table's dict plus the
    table's address."""
    _, _, heads, d = k_cache.shape
    kernel = _compile.GatherPagesVariant()
    strides = {f"{x}_{dim}_stride": s for x, c in (("k", k_cache), ("v", v_cache))
               for dim, s in zip(("page", "row", "head"), c.strides)}
    record = _params.GATHER_PAGES.pack(dict(
        k_cache=k_cache.ptr, v_cache=v_cache.ptr, k_out=k_rows_ptr, v_out=v_rows_ptr,
        block_table=paged["table"], cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k,
        cu_seqlens_out=cu_ptr, seqused_out=used_ptr, batch=batch, nheads_k=heads, head_dim=d,
        page_shift=paged["page_shift"], num_pages=paged["num_pages"],
        max_pages=paged["max_pages"], table_stride=paged["table_stride"], **strides))
    sequences = min(batch, 65535)
    tiles = -(-paged["capacity"] // 64)  # (kGatherRows)
    grid = (max(1, min(tiles, GATHER_CTAS // sequences)), sequences, 1)
    _runtime.driver_launch(_compile.function_pointer(kernel, device), grid, kernel.threads, 0,
                           stream, (_params.GATHER_PAGES.argument(record),))


def vt_map_view(batch, nheads_k, d, padded_seqlen, box_rows):
    """vt (batch, nheads_k, d, padded_seqlen) as the fp8 forward's V map sees it: _tma's
    (shape (batch, rows, heads, columns), strides (batch, rows, heads), box rows) with rows
    the head dim and columns pairs of keys (a box: 128 keys of box_rows dims)."""
    row = padded_seqlen // 2
    return (batch, d, nheads_k, row), (nheads_k * d * row, row, d * row), box_rows
