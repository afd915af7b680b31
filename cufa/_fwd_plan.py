"""Forward plans: flash_attn_func's (padded batches), flash_attn_varlen_func's (packed,
and paged) and scaled_dot_product_attention's. A plan (variant, params record, grid, TMA
maps) is made once per call signature and kept in _runtime.plans; a known layout's plan is
moved to new sizes (_Mover); a call then fills in its addresses and launches."""
import collections
import dataclasses
import math
from dataclasses import dataclass

from . import (_arrays, _compile, _decode_plan, _fp8, _heuristics, _interop, _params, _runtime,
               _tma)
from ._checks import (ATTN_MASK_TYPES, FP8_CACHE, INT32_MAX, KERNEL_DTYPES, UNBOUNDED,
                      check_cu_values, check_dense, check_fp8_dense, check_fp8_packed,
                      check_options, check_packed, check_page_ids, check_scale, check_sdpa,
                      window_mask_kind)
from ._runtime import (MAX_PLANS, caller_stream, check_scratch, driver_launch, outputs, plans,
                       remember, returned, stream_call, stream_tile_counter, stream_workspace)


_DENSE_ARRAYS = _arrays.Dense._fields


def dense(q, k, v, alibi_slopes, out, *, softmax_scale, causal, window_size, softcap,
          return_lse, learnable_sink=None, lse_out=None, stream=None, scratch=None):
    """flash_attn_func on arrays or views. Under jax.jit: out is the output buffer's
    view, lse_out a view to write lse into, stream XLA's (a CUstream handle), and scratch
    (address, bytes) an XLA buffer of the plan's scratch_bytes: memory that stays valid
    when XLA replays the launches from a CUDA graph, as memory cufa allocated would not."""
    options = check_options(softmax_scale, causal, window_size, softcap)
    arrays = (q, k, v, alibi_slopes, learnable_sink, out)
    entries, addresses = _interop.signature(arrays, _DENSE_ARRAYS)
    key = ("dense", options) + entries
    plan = plans.get(key)
    if plan is None:
        plan = remember(key, _dense_plan(arrays, entries, addresses, out, options))
    q_ptr, k_ptr, v_ptr, alibi_ptr, sink_ptr, o_ptr = addresses
    return _execute(plan, q_ptr, k_ptr, v_ptr, out, o_ptr, return_lse, alibi=alibi_ptr,
                    sink=sink_ptr, lse_out=lse_out, stream=stream, scratch=scratch, like=q)


def _dense_plan(arrays, entries, addresses, out, options):
    """A padded batch's plan: its layout's plan moved to the call's sizes (_Mover) where
    there is one, else made."""
    layout = None
    if entries[3] is None and _v_head_dim_is_q(entries):
        # (ALiBi's plans are made, and those of a head dim of v's own)
        layout = _layout_key(("dense", options, entries[4]), entries, 2, 1)
        mover = layouts.get(layout)
        if mover is not None:
            plan = mover.dense(*entries)
            if plan is not None:
                return plan
    views = _arrays.Dense._make(_interop.views(arrays, _DENSE_ARRAYS, entries, addresses, 3))
    return _remember_layout(layout, plan_dense(views, out, *options), views, entries, False)


def plan_dense(a, out, window, scale, softcap):
    """The plan of a padded batch's views (a: an _arrays.Dense) and the caller's out=."""
    aligned = check_dense(a, out)
    q, k = a.q, a.k
    batch, seqlen_q, nheads, d = q.shape
    return _plan(q, k, a.v, a.out, seq_dim=1, head_dim=2, batch=batch, nheads=nheads,
                 nheads_k=k.shape[2], seqlen_q=seqlen_q, seqlen_k=k.shape[1], d=d, scale=scale,
                 bottom_right=True, window=window, softcap=softcap, alibi=a.alibi_slopes,
                 attn_mask=None, sink=a.learnable_sink, aligned=aligned)


PACKED_ARRAYS = _arrays.Packed._fields


def packed(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, block_table, out, *,
           softmax_scale, causal, window_size, softcap, return_lse, learnable_sink=None,
           k_descale=None, v_descale=None, check_cu_seqlens=False, lse_out=None, stream=None,
           scratch=None):
    """flash_attn_varlen_func on arrays or views (as dense)."""
    options = check_options(softmax_scale, causal, window_size, softcap)
    arrays = (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, block_table,
              learnable_sink, k_descale, v_descale, out)
    entries, ptrs = _interop.signature(arrays, PACKED_ARRAYS)
    key = ("packed", options) + entries
    plan = plans.get(key)
    if plan is None:
        plan = remember(key, _packed_plan(arrays, entries, ptrs, out, options))
    if check_cu_seqlens:
        check_packed_values(_arrays.Packed._make(_interop.views(arrays, PACKED_ARRAYS, entries,
                                                                ptrs, 5)))
    (q_ptr, k_ptr, v_ptr, cu_q_ptr, cu_k_ptr, used_ptr, alibi_ptr, table_ptr, sink_ptr,
     k_descale_ptr, v_descale_ptr, o_ptr) = ptrs
    return _execute(plan, q_ptr, k_ptr, v_ptr, out, o_ptr, return_lse, alibi=alibi_ptr,
                    sink=sink_ptr, packed=(cu_q_ptr, cu_k_ptr, used_ptr, table_ptr, k_descale_ptr,
                                           v_descale_ptr), lse_out=lse_out,
                    stream=stream, scratch=scratch, like=q)


def check_packed_values(a):
    """check_cu_seqlens=True's reads of a packed batch's views (a: an _arrays.Packed):
    cu_seqlens, seqused_k and page ids against the rows and pages (one device sync)."""
    paged = a.block_table is not None
    check_cu_values(a.cu_seqlens_q, "cu_seqlens_q", a.q.shape[0], a.cu_seqlens_k,
                    "cu_seqlens_k", None if paged else a.k.shape[0], a.seqused_k,
                    a.block_table.shape[1] * a.k.shape[1] if paged else None)
    if a.block_table is not None:
        check_page_ids(a.block_table, a.k.shape[0])


def _packed_plan(arrays, entries, ptrs, out, options):
    """A packed batch's plan: its layout's plan moved to the call's sizes (_Mover) where
    there is one (paged batches and ALiBi aside), else made."""
    layout = None
    if entries[6] is None and entries[7] is None and _v_head_dim_is_q(entries):
        layout = _layout_key(("packed", options, entries[8]), entries, 1, 0)
        mover = layouts.get(layout)
        if mover is not None:
            plan = mover.packed_batch(*entries)
            if plan is not None:
                return plan
    views = _arrays.Packed._make(_interop.views(arrays, PACKED_ARRAYS, entries, ptrs, 5))
    return _remember_layout(layout, plan_packed(views, out, *options), views, entries, True)


def plan_packed(a, out, window, scale, softcap):
    """The plan of a packed batch's views (a: an _arrays.Packed) and the caller's out=."""
    batch, paged, aligned = check_packed(a, out)
    q, k, v, o, alibi, sink = a.q, a.k, a.v, a.out, a.alibi_slopes, a.learnable_sink
    total_q, nheads, d = q.shape
    descales = (a.k_descale, a.v_descale) if k.dtype == FP8_CACHE else None
    plan = _plan(q, k, v, o, seq_dim=0, head_dim=1, batch=batch, nheads=nheads,
                 nheads_k=k.shape[-2], seqlen_q=total_q,
                 seqlen_k=k.shape[0] if paged is None else paged["capacity"], d=d, scale=scale,
                 bottom_right=True, window=window, softcap=softcap, alibi=alibi,
                 attn_mask=None, packed=True, paged=paged, sink=sink, aligned=aligned,
                 descales=descales)
    if paged is not None and plan.variant is not None:
        # Decode-sized sequences of a serving batch go to the decode kernel (one tile a
        # GQA group, each KV byte read once; above head dim 256 two CTAs, a half of V's
        # columns each); the forward's work list leaves them out.
        plan.decode = _decode_plan.plan_packed_decode(
            q, k, v, o, alibi, sink, paged, batch=batch, nheads=nheads, nheads_k=k.shape[-2],
            d=d, total_q=total_q, window=window, scale=scale, softcap=softcap, aligned=aligned,
            descales=descales)
        capacity = paged["capacity"]
        plan.work_list = plan.work_list[:3] + (_params.SCHEDULE.with_fields(
            plan.work_list[3], {"decode_rows": plan.decode.rows, "capacity": capacity,
                                "key_shift": max(0, capacity.bit_length() - 7)}),)
        plan.scratch_bytes += 4 * batch  # the decode order, after the work list
        plan.decode.scratch_offset = -(-plan.scratch_bytes // 256) * 256
        plan.scratch_bytes = plan.decode.scratch_offset + plan.decode.scratch_bytes
    return plan


_SDPA_ARRAYS = _arrays.Sdpa._fields


def sdpa(query, key, value, attn_mask, out, *, is_causal, scale, enable_gqa,
         learnable_sink=None, stream=None, scratch=None, return_lse=False, lse_out=None):
    """scaled_dot_product_attention on arrays or views; out, lse_out and stream as in
    dense; return_lse: (out, lse), lse (batch, heads, L) float32 (what its backward
    reads)."""
    options = (bool(is_causal), check_scale(scale, "scale"), bool(enable_gqa))
    arrays = (query, key, value, attn_mask, learnable_sink)
    entries, addresses = _interop.signature(arrays, _SDPA_ARRAYS)
    plan_key = ("sdpa", options) + entries
    plan = plans.get(plan_key)
    if plan is None:
        plan = remember(plan_key, plan_sdpa(
            _arrays.Sdpa._make(_interop.views(arrays, _SDPA_ARRAYS, entries, addresses, 3)),
            *options))
    q_ptr, k_ptr, v_ptr, mask_ptr, sink_ptr = addresses
    o_ptr = 0 if out is None else out.ptr
    return _execute(plan, q_ptr, k_ptr, v_ptr, out, o_ptr, return_lse, attn_mask=mask_ptr,
                    sink=sink_ptr, lse_out=lse_out, stream=stream, scratch=scratch, like=query)


def plan_sdpa(a, is_causal, scale, enable_gqa):
    """The plan of a call's views (a: an _arrays.Sdpa)."""
    aligned = check_sdpa(a, enable_gqa)
    q, k, v, mask, sink = a.query, a.key, a.value, a.attn_mask, a.learnable_sink
    batch, nheads, seqlen_q, d = q.shape
    nheads_k, seqlen_k = k.shape[1], k.shape[2]
    return _plan(q, k, v, None, seq_dim=2, head_dim=1, batch=batch, nheads=nheads,
                 nheads_k=nheads_k, seqlen_q=seqlen_q, seqlen_k=seqlen_k, d=d, scale=scale,
                 bottom_right=False, window=(UNBOUNDED, 0 if is_causal else UNBOUNDED),
                 softcap=0.0, alibi=None, attn_mask=mask, sink=sink, aligned=aligned)


# -- launch --------------------------------------------------------------------------------

def _broadcast_strides(m, full_shape):
    """attn_mask strides over (batch, heads, L, S), 0 where the mask broadcasts."""
    shape = (1,) * (4 - m.ndim) + m.shape
    strides = (0,) * (4 - m.ndim) + m.strides
    return tuple(0 if n == 1 and f != 1 else s for n, f, s in zip(shape, full_shape, strides))


@dataclass  # not frozen, which costs every field an object.__setattr__; never changed once made
class _Plan:
    """What a launch needs besides the arrays' addresses. It follows from the call's
    signature alone (shapes, strides, dtypes, devices and alignment of the arrays, and the
    options), so it is made once per signature; a repeated call then only allocates its
    outputs, fills in the addresses and launches (bench/host_overhead.py)."""
    framework: str          # of the outputs: "torch" or "cupy"
    device: int
    out_shape: tuple
    dtype: str
    lse_shape: tuple
    variant: object = None  # None: an empty dimension, nothing to launch
    function: int = 0       # the compiled kernel's CUfunction
    params: bytes = b""     # the FwdParams record with every pointer 0
    num_blocks: int = 0
    tma_template: object = None  # _tma.Template: the TensorMaps record less its addresses
    work_list: tuple = None  # packed batches: (the schedule kernel's CUfunction, max_tiles,
                             # num_buckets, its ScheduleParams record with every pointer 0)
    to_jax: bool = False    # the caller passed JAX arrays: outputs go back as JAX arrays
    scratch_bytes: int = 0  # device scratch a launch needs (packed work list, tile counter)
    decode: object = None   # paged packed batches: _decode_plan.PackedDecode, the short sequences
    out_like_q: bool = True  # out has q's shape (not with a head dim of v's own): a new
                             # one is allocated like q


_STRIDE_FIELDS = tuple((f"{x}_batch_stride", f"{x}_row_stride", f"{x}_head_stride")
                       for x in "qkvo")


# -- plans moved to new sizes -------------------------------------------------------------
# A server calls with new sizes nearly every step (a packed batch's token count, a padded
# batch's length). A call whose arrays differ from a planned call's only in their sizes
# (batch, sequence lengths and the batch strides that follow from them) gets that plan
# moved to its sizes: the size checks and the size-dependent values (_sizes, the TMA maps),
# not validation and planning from scratch.
layouts = collections.OrderedDict()  # _layout_key -> the _Mover of a plan of that layout


def _v_head_dim_is_q(entries):
    """Whether v's head dim is q's (entries 0 and 2 of a signature; True where either is
    missing: the checks then say what is wrong)."""
    q, v = entries[0], entries[2]
    return q is None or v is None or not q[1] or not v[1] or q[1][-1] == v[1][-1]


def _layout_key(head, entries, free_dims, free_strides):
    """A call's signature (entries of _interop.signature) less its sizes: of each array
    its kind, shape past the first free_dims, strides past the first free_strides, dtype,
    device and alignment."""
    return head + tuple([None if e is None else (e[0], e[1][free_dims:], e[2][free_strides:])
                         + e[3:] for e in entries])


def _remember_layout(layout, plan, views, entries, packed):
    """plan as its layout's, when it has one and can move (paged batches do not)."""
    if layout is not None and plan.variant is not None and plan.decode is None:
        mover = _Mover.of(plan, views, entries, packed)
        if mover is not None:
            if len(layouts) >= MAX_PLANS:
                layouts.popitem(last=False)
            layouts[layout] = mover
    return plan


def _movable(seqlen_q, seqlen_k, batch):
    """Sizes a moved plan takes; others (empty, too long) are planned, which says why."""
    return 0 < min(seqlen_q, seqlen_k, batch) and max(seqlen_q, seqlen_k) <= INT32_MAX // 2


class _Shaped:
    """Shape, strides (in elements) and dtype where _tma_template wants an array."""
    __slots__ = ("shape", "strides", "dtype")

    def __init__(self, shape, strides, dtype):
        self.shape, self.strides, self.dtype = shape, strides, dtype


class _Mover:
    """A plan of one layout, and what moving it to other sizes needs that the layout
    fixes, so that a move reads, checks and writes only the sizes: the batch, the
    sequence lengths and the batch strides, taken from the call's signature entries (no
    views), and the TMA maps written from per-layout pieces (_tma.moved_map). A move
    makes what _plan would make (a CPU test compares them); None where the sizes change
    the kernel variant (a tile class, or whether the arrays are chunk-aligned) or whether
    TMA describes the arrays, or a size check fails (the call is then planned, which says
    what is wrong)."""
    __slots__ = ("plan", "packed", "entries", "d", "units", "layout_aligned", "rows_aligned",
                 "same_tiles", "tma", "writers", "words", "box_n")

    @classmethod
    def of(cls, plan, views, entries, packed):
        """plan's mover, or None where the layout does not move (its cu_seqlens strided,
        or planned on the portable kernels where Hopper's could not describe it). The
        rest is read off the entries at the first move (a new layout pays no more)."""
        if plan.variant.family != _compile.family_for(_runtime.compute_capability(plan.device)):
            return None
        if packed and any(x is not None and x.strides != (1,)
                          for x in (views.cu_seqlens_q, views.cu_seqlens_k, views.seqused_k)):
            return None
        self = cls.__new__(cls)
        self.plan, self.packed, self.units = plan, packed, None
        self.entries = entries[:3] + entries[-1:]  # q, k, v, out (no references to arrays)
        return self

    def _prepare(self):
        """What the layout fixes, from the base plan's entries (its first move)."""
        plan, variant = self.plan, self.plan.variant
        # (fp16 and bf16 only: every array of a plan has 2-byte elements)
        self.units = tuple(1 if e is None else _interop.stride_unit(e, 2) for e in self.entries)
        strides = [None if e is None else [s // u for s in e[2]]
                   for e, u in zip(self.entries, self.units)]
        self.d, self.box_n, self.same_tiles = self.entries[0][1][-1], variant.block_n, {}
        # _checks.chunk_aligned of the arrays but for the sizes: the layout's part (head dim,
        # start, head stride), and each array's row stride, which counts above one row
        seq_dim = 0 if self.packed else 1
        self.layout_aligned = self.d % 8 == 0 and all(
            e is None or e[-1] == 0 and (e[1][-2] <= 1 or x[-2] % 8 == 0)
            for e, x in zip(self.entries, strides))
        self.rows_aligned = tuple(x is None or x[seq_dim] % 8 == 0 for x in strides)
        template = plan.tma_template
        self.tma, self.writers, self.words = template is not None, None, None
        # (a row stride 0, which a map takes under one row, is left to the general path)
        if template is not None and template.address_words and (
                not self.packed or template.has_tails) and all(
                    x[seq_dim] for x in strides[:3]):
            boxes = (variant.block_m,) + (variant.block_n,) * (4 if self.packed else 2)
            self.writers = _tma.map_writers(template, plan.dtype, boxes)
            self.words = template.address_words

    def dense(self, q, k, v, alibi, sink, o):
        """The plan at the sizes of a padded batch's signature entries (o: out's or None)."""
        if self.units is None:
            self._prepare()
        batch, seqlen_q = q[1][0], q[1][1]
        seqlen_k = k[1][1]
        if (k[1][0] != batch or v[1][0] != batch or v[1][1] != seqlen_k
                or o is not None and (o[1][0] != batch or o[1][1] != seqlen_q)
                or not _movable(seqlen_q, seqlen_k, batch)
                or not self._same_tiles(seqlen_q, batch)):
            return None
        q_unit, k_unit, v_unit, o_unit = self.units
        batch_strides = (q[2][0] // q_unit, k[2][0] // k_unit, v[2][0] // v_unit,
                         o[2][0] // o_unit if o is not None else seqlen_q * q[1][2] * self.d)
        aligned = self._aligned(seqlen_q, seqlen_k) and (
            batch <= 1 or not any(s % 8 for s in batch_strides))
        if aligned == self.plan.variant.element_io:
            return None
        template = None
        if self.tma:
            if self.writers is None:
                template = self._general_template((q, k, v), 1, 2)
            else:
                (q_map, k_map, v_map), (q_stride, k_stride, v_stride) = (self.writers,
                                                                         batch_strides[:3])
                k_moved = _tma.moved_map(k_map, batch, seqlen_k, k_stride)
                template = self._written((
                    _tma.moved_map(q_map, batch, seqlen_q, q_stride), k_moved,
                    k_moved if (v_map, v_stride) == (k_map, k_stride)
                    else _tma.moved_map(v_map, batch, seqlen_k, v_stride)), False)
            if template is None:
                return None
        return self._moved(batch, q[1][2], seqlen_q, seqlen_k, tuple(q[1]), template,
                           batch_strides)

    def packed_batch(self, q, k, v, cu_q, cu_k, used, alibi, table, sink, k_descale, v_descale,
                     o):
        """The plan at the sizes of a packed batch's signature entries."""
        if self.units is None:
            self._prepare()
        total_q, total_k, batch = q[1][0], k[1][0], cu_q[1][0] - 1
        if (v[1][0] != total_k or cu_k[1][0] != batch + 1
                or used is not None and used[1][0] != batch
                or o is not None and o[1][0] != total_q
                or not _movable(total_q, total_k, batch)
                or self._aligned(total_q, total_k) == self.plan.variant.element_io
                or not self._same_tiles(total_q, batch, total_k / max(batch, 1))):
            return None
        template = None
        if self.tma:
            if self.writers is None:
                template = self._general_template((q, k, v), 0, 1)
            else:
                q_map, k_map, v_map, k_tail, v_tail = self.writers
                k_moved = _tma.moved_map(k_map, 1, total_k, 0)
                k_tail_moved = _tma.moved_map(k_tail, total_k, self.box_n,
                                              k[2][0] // self.units[1])
                template = self._written((
                    _tma.moved_map(q_map, 1, total_q, 0), k_moved,
                    k_moved if v_map == k_map else _tma.moved_map(v_map, 1, total_k, 0),
                    k_tail_moved, k_tail_moved if v_tail == k_tail else _tma.moved_map(
                        v_tail, total_k, self.box_n, v[2][0] // self.units[2])), True)
            if template is None:
                return None
        return self._moved(batch, q[1][1], total_q, total_k, tuple(q[1]), template, None)

    def _aligned(self, rows_q, rows_k):
        """Whether the arrays are chunk-aligned at these row counts, batch strides aside."""
        return self.layout_aligned and all(aligned or rows <= 1 for aligned, rows in zip(
            self.rows_aligned, (rows_q, rows_k, rows_k, rows_q)))

    def _same_tiles(self, total_q, batch, keys_per_sequence=0):
        """Whether these sizes keep the base plan's tiles (sm90: the tile class of
        sm90_rows; the tile classes of a head dim may share tiles)."""
        variant = self.plan.variant
        if variant.family != "sm90":
            return True
        rows = _heuristics.sm90_rows(self.packed, total_q, batch, self.d, variant.mask,
                                     keys_per_sequence)
        same = self.same_tiles.get(rows)
        if same is None:
            same = self.same_tiles[rows] = variant == _compile.fwd_variant(
                variant.dtype, self.d, variant.mask, variant.score_mods, "sm90", rows)
        return same

    def _written(self, maps, has_tails):
        """The Template of maps written by _tma.moved_map; None if it refused one."""
        if None in maps:
            return None
        return _tma.Template(b"".join(maps) + _tma.PADS[len(maps)], has_tails, self.words)

    def _general_template(self, entries, seq_dim, head_dim):
        """The TMA maps through _tma's general path (its kind maps not written in Python
        on this driver); None where it refuses them, or the tails, which base has."""
        dtype = self.plan.dtype
        q, k, v = (_Shaped(tuple(e[1]), tuple(s // unit for s in e[2]), dtype)
                   for e, unit in zip(entries, self.units))
        template = _tma_template(self.plan.variant, q, k, v, seq_dim, head_dim, self.d,
                                 self.packed, _tma.new_shape_template)
        if template is None or template.has_tails != self.plan.tma_template.has_tails:
            return None
        return template

    def _moved(self, batch, nheads, seqlen_q, seqlen_k, out_shape, tma_template,
               batch_strides):
        """The plan at these sizes, its maps made: _sizes and the records' size fields."""
        base, packed = self.plan, self.packed
        values, num_blocks, max_tiles, num_buckets, scratch_bytes = _sizes(
            base.variant, batch, nheads, seqlen_q, seqlen_k, packed, base.device)
        plan = _Plan.__new__(_Plan)  # a copy of base (cheaper than copy.copy)
        plan.__dict__.update(base.__dict__)
        plan.out_shape = out_shape
        plan.num_blocks, plan.scratch_bytes, plan.tma_template = (num_blocks, scratch_bytes,
                                                                  tma_template)
        if packed:
            plan.lse_shape = (nheads, seqlen_q)
            plan.params = _set_sizes(base.params, values)
            plan.work_list = (base.work_list[0], max_tiles, num_buckets, _set_schedule_sizes(
                base.work_list[3], (batch, seqlen_q, num_buckets)))
        else:  # the batch strides follow the sizes; the row and head strides are the layout's
            plan.lse_shape = (batch, nheads, seqlen_q)
            plan.params = _set_batch_strides_and_sizes(base.params, batch_strides + values)
        return plan


def _plan(q, k, v, out, *, seq_dim, head_dim, batch, nheads, nheads_k, seqlen_q, seqlen_k, d, scale,
          bottom_right, window, softcap, alibi, attn_mask, packed=False, paged=None,
          sink=None, aligned=True, descales=None):
    """The variant, launch shape and params of validated arrays. Padded batches: q/k/v/o
    carry a batch dimension (0). Packed batches: rows of all sequences are stacked,
    seqlen_q/k are the total rows, and lse is (nheads, total_q). out: the caller's out=
    view, or None for a new contiguous output. paged: check_block_table's dict when k/v are
    a paged cache (seqlen_k is then its capacity a sequence). sink: the learnable sink's
    view or None (its address comes with each call). aligned: whether every array is
    _checks.chunk_aligned (else the element-wise I/O variant runs, on any GPU). descales:
    (k_descale, v_descale) views (either may be None) where k and v are an e4m3 cache."""
    framework = "cupy" if q.framework == "dlpack" else q.framework
    lse_shape = (nheads, seqlen_q) if packed else (batch, nheads, seqlen_q)
    d_v = v.shape[-1]  # (out's: v's head dim, where it has one of its own)
    out_shape = q.shape[:-1] + (d_v,)
    outputs = dict(framework=framework, device=q.device, out_shape=out_shape, dtype=q.dtype,
                   lse_shape=lse_shape, to_jax=_interop.returns_jax(q),
                   out_like_q=out_shape == q.shape)
    if not (batch and nheads and seqlen_q):
        return _Plan(**outputs)
    mask_kind = window_mask_kind(window)
    score_mods = softcap > 0 or alibi is not None or attn_mask is not None
    family = _compile.family_for(_runtime.compute_capability(q.device))
    if paged is not None and 1 << paged["page_shift"] < _PAGED_TMA_MIN_ROWS:
        family = "sm80"
    # (packed: the mean keys a sequence, or a paged cache's capacity a sequence)
    keys = (seqlen_k if paged is not None else seqlen_k / batch) if packed else 0
    if descales is not None:  # the e4m3 K/V variant (the sm80 family's, on any GPU)
        variant, tma_template = _compile.fwd_variant(
            KERNEL_DTYPES[q.dtype], d, mask_kind, score_mods, e4m3_kv=True), None
    elif d > _compile.MAX_HEAD_DIM and not aligned:
        raise NotImplementedError(
            f"head dim {d} (over {_compile.MAX_HEAD_DIM}) needs a head dim that is a multiple "
            "of 8 and q, k, v (and out) on strides that are multiples of 8 elements from "
            "16-byte aligned starts")
    elif (d_v != d or d > _compile.MAX_HEAD_DIM) and not _hopper_takes(family, d, d_v, paged,
                                                                      aligned):
        variant, tma_template = _wide_variant(KERNEL_DTYPES[q.dtype], d, d_v, mask_kind,
                                              score_mods, q.device), None
    elif aligned:
        variant, tma_template = _variant(q, k, v, seq_dim, head_dim, d, batch, seqlen_q, packed,
                                         mask_kind, score_mods, family, paged, keys,
                                         d_v if d_v != d else 0)
    else:
        variant, tma_template = _compile.fwd_element_io_variant(KERNEL_DTYPES[q.dtype], d), None
    values, num_blocks, max_tiles, num_buckets, scratch_bytes = _sizes(
        variant, batch, nheads, seqlen_q, seqlen_k, packed, q.device)
    o_strides = out.strides if out is not None else _interop.contiguous_strides(out_shape)
    p = dict(
        nheads=nheads, nheads_k=nheads_k, head_dim=d, head_dim_v=d_v,
        kv_tail_maps=int(tma_template is not None and tma_template.has_tails),
        bottom_right=int(bottom_right), **dict(zip(_SIZE_FIELDS, values)),
        sink_dtype=_params.SINK_DTYPES[sink.dtype] if sink is not None else 0,
        **_params.score_fields(window, scale, softcap, d, alibi))
    for (batch_field, row_field, head_field), strides in zip(
            _STRIDE_FIELDS, (q.strides, k.strides, v.strides, o_strides)):
        p[batch_field] = 0 if packed else strides[0]
        p[row_field] = strides[seq_dim]
        p[head_field] = strides[head_dim]
    if paged is not None:  # k, v: (pages, page_size, nheads_k, d); batch stride = page stride
        for fields, x in zip(_STRIDE_FIELDS[1:3], (k, v)):
            p.update(zip(fields, x.strides[:3]))
        p["block_table_batch_stride"] = paged["table_stride"]
        p["page_shift"], p["num_pages"] = paged["page_shift"], paged["num_pages"]
    if descales is not None:  # (e4m3 rows move as 16-bit units: strides in those, halved)
        for fields in _STRIDE_FIELDS[1:3]:
            for field in fields:
                p[field] //= 2
        p.update(_decode_plan.descale_strides(*descales))
    if attn_mask is not None:
        full = (batch, nheads, seqlen_q, seqlen_k)
        p["attn_mask_type"] = ATTN_MASK_TYPES[attn_mask.dtype]
        (p["mask_batch_stride"], p["mask_head_stride"], p["mask_row_stride"],
         p["mask_col_stride"]) = _broadcast_strides(attn_mask, full)
    return _Plan(**outputs, variant=variant, scratch_bytes=scratch_bytes,
                 function=_compile.function_pointer(variant, q.device),
                 params=_params.FWD.pack(p), num_blocks=num_blocks,
                 tma_template=tma_template,
                 work_list=(_compile.function_pointer(_compile.VARLEN_SCHEDULE, q.device),
                            max_tiles, num_buckets, _params.SCHEDULE.pack(dict(
                                batch=batch, total_q=seqlen_q, block_m=variant.block_m,
                                num_buckets=num_buckets)))
                 if packed else None)


def _hopper_takes(family, d, d_v, paged, aligned):
    """Whether Hopper's kernel takes a head dim of v's own or one over 256: one head dim up
    to 512 (_checks refuses the rest), and DeepSeek's pair on contiguous K/V; both on
    aligned arrays. The rest (the latent pair always) run sm80's wide kernel."""
    return family == "sm90" and aligned and (
        d_v == d or paged is None and d <= _compile.MAX_HEAD_DIM)


def _wide_variant(dtype, d, d_v, mask_kind, score_mods, device):
    """The sm80 family's variant for a head dim of v's own or one above 256: on the tiles
    CUFA_WIDE_TILES asks for (a ValueError where the GPU cannot hold them), else
    _compile.WIDE_TILES where they fit a block's shared memory, else the portable ones."""
    forced = _compile.wide_tiles()
    limit = _runtime.smem_per_block(device)
    for tiles in (forced,) if forced else (_compile.WIDE_TILES, _compile.WIDE_TILES_PORTABLE):
        variant = _compile.fwd_variant(dtype, d, mask_kind, score_mods, head_dim_v=d_v,
                                       wide_tiles=tiles)
        if variant.smem_bytes <= limit:
            return variant
    asked = (f"{_compile.WIDE_TILES_ENV}={forced[0]}x{forced[1]}: the tiles" if forced else
             f"head dims {d} (q, k) and {d_v} (v): the smallest tiles")
    raise ValueError(f"{asked} take {variant.smem_bytes} bytes of shared memory, over this "
                     f"GPU's {limit} a block")


def _variant(q, k, v, seq_dim, head_dim, d, batch, seqlen_q, packed, mask_kind, score_mods,
             family, paged=None, keys_per_sequence=0, d_v=0):
    """(kernel variant, _tma.Template or None) of a plan. d_v: v's own head dim (not
    paged), else 0."""
    rows = _heuristics.sm90_rows(packed, seqlen_q, batch, d, mask_kind, keys_per_sequence)
    variant = _compile.fwd_variant(KERNEL_DTYPES[q.dtype], d, mask_kind, score_mods, family,
                                   rows, head_dim_v=d_v)
    if family != "sm90":
        return variant, None
    if paged is not None:
        tma_template = _tma.template(q.dtype, _paged_tma_views(variant, q, k, v, d))
    else:
        tma_template = _tma_template(variant, q, k, v, seq_dim, head_dim, d, packed, d_v=d_v)
    if tma_template is None:  # a layout the copy engine cannot describe: the portable kernels
        if d_v or d > _compile.MAX_HEAD_DIM:
            variant = _wide_variant(KERNEL_DTYPES[q.dtype], d, d_v or d, mask_kind, score_mods,
                                    q.device)
        else:
            variant = _compile.fwd_variant(KERNEL_DTYPES[q.dtype], d, mask_kind, score_mods,
                                           "sm80")
    return variant, tma_template


# FwdParams fields that follow from a plan's sizes, in _sizes' order
_SIZE_FIELDS = ("lse_batch_stride", "lse_head_stride", "batch", "seqlen_q", "seqlen_k",
                "num_m_blocks", "heads_per_group", "tail_group_head")
_BATCH_STRIDE_FIELDS = tuple(fields[0] for fields in _STRIDE_FIELDS)  # q, k, v, o
_set_sizes = _params.FWD.setter(_SIZE_FIELDS)  # (one run of FwdParams: one pack)
_set_descales = _params.FWD.setter(("k_descale", "v_descale"))  # (past the leading pointers)
_set_batch_strides_and_sizes = _params.FWD.setter(_BATCH_STRIDE_FIELDS + _SIZE_FIELDS)
_set_schedule_sizes = _params.SCHEDULE.setter(("batch", "total_q", "num_buckets"))


def _sizes(variant, batch, nheads, seqlen_q, seqlen_k, packed, device):
    """The launch values of a plan that follow from its sizes (batch, heads, sequence
    lengths) and tiles, shared by _plan and _Mover so that a moved plan is the plan:
    (values of _SIZE_FIELDS, num_blocks, max_tiles, num_buckets, scratch_bytes)."""
    block_m = variant.block_m
    num_m_blocks = -(-seqlen_q // block_m)
    # Packed batches: at most total_q / block_m + batch real tiles (each sequence rounds
    # up once); the device-built list says how many there are.
    max_tiles = seqlen_q // block_m + batch if packed else num_m_blocks * batch
    num_buckets = seqlen_q // block_m + 2  # packed: the schedule's counting sort
    if max_tiles * nheads * variant.ctas_per_tile > INT32_MAX:
        raise ValueError(f"problem too large: {max_tiles * nheads * variant.ctas_per_tile} "
                         "CTAs exceed the grid limit")
    num_blocks = max_tiles * nheads * variant.ctas_per_tile
    resident = None
    if variant.persistent:  # as many CTAs as fit on the SMs, each taking tiles until none are left
        resident = _runtime.sm_count(device) * variant.ctas_per_sm
        num_blocks = min(num_blocks, resident)
    # (the scheduling rules count tiles a wave: a tile in column halves is two CTAs' work)
    resident_tiles = resident and resident // variant.ctas_per_tile
    group_heads = _heuristics.heads_per_group(batch * nheads, seqlen_k, variant.head_dim,
                                              num_m_blocks, resident_tiles)
    tail_head = _heuristics.tail_group_head(batch * nheads, group_heads, num_m_blocks,
                                            resident_tiles, masked=variant.mask == "window")
    values = (0 if packed else nheads * seqlen_q, seqlen_q, batch, seqlen_q, seqlen_k,
              num_m_blocks, group_heads, tail_head)
    # packed: the work list's int32s (see _launch) and the 2-int tile counter after them
    scratch_bytes = (4 * (_work_list_ints(max_tiles, num_buckets) + 2) if packed
                     else 8 if variant.persistent else 0)
    return values, num_blocks, max_tiles, num_buckets, scratch_bytes


def _tma_template(variant, q, k, v, seq_dim, head_dim, d, packed, make=_tma.template, d_v=0):
    """q, k, v (and for packed batches the k/v tails) made into a _tma.Template by `make`
    (_tma.template, cached per layout; a moved plan's new shape: _tma.new_shape_template);
    None if the copy engine cannot describe them. d_v: v's own head dim, else 0."""
    return make(q.dtype, *_tma_views(variant, q, k, v, seq_dim, head_dim, d, packed, d_v))


def _tma_views(variant, q, k, v, seq_dim, head_dim, d, packed, d_v=0):
    """q, k, v (and for packed batches the k/v tails) as (batch, rows, heads, columns)
    views of _tma.template: (views, tail views)."""
    return tma_views(((q, variant.block_m), (k, variant.block_n), (v, variant.block_n)),
                     seq_dim, head_dim, d, packed, d_v)


def tma_views(arrays, seq_dim, head_dim, d, packed, d_v=0):
    """(array, box rows) pairs as (batch, rows, heads, columns) views of _tma.template, a
    packed batch's as one sequence of all rows with the tail views of all but the first:
    (views, tail views). Each view has d columns, the third d_v where given (v's own head
    dim). The forward's are q, k, v; the backward's streamed pairs (_bwd_plan) fill the
    same three places."""
    views, tails = [], []
    for place, (x, box_rows) in enumerate(arrays):
        cols = d_v if place == 2 and d_v else d
        rows, heads, row_stride, head_stride = (x.shape[seq_dim], x.shape[head_dim],
                                                x.strides[seq_dim], x.strides[head_dim])
        if packed:
            views.append(((1, rows, heads, cols), (0, row_stride, head_stride), box_rows))
            if place:  # (k's and v's places: a packed q needs none)
                tails.append(_tma.tail_view(rows, heads, cols, row_stride, head_stride,
                                            box_rows))
        else:
            views.append(((x.shape[0], rows, heads, cols),
                          (x.strides[0], row_stride, head_stride), box_rows))
    return tuple(views), tuple(tails)


# Paged caches on the Hopper kernels: TMA boxes of whole rows inside a page, at least 8
# rows (1 KB a panel: the 128-byte swizzle's period, so boxes stacked in a tile land as
# one box of the tile would); smaller pages take the portable kernels.
_PAGED_TMA_MIN_ROWS = 8


def _paged_box_rows(page_size, block_n):
    """Rows of a paged K/V box (fwd_sm90.cu, produce_paged_block): the page, or the largest
    power of two up to 128 that divides block_n where that is fewer, so that the boxes of a
    key block never cross a page."""
    return min(page_size, block_n & -block_n, 128)


def _paged_tma_views(variant, q, k, v, d):
    """_tma.template's views of a packed q, (total, heads, d), and a paged k and v, (pages,
    page_size, heads, d), each page a batch entry."""
    box_rows = _paged_box_rows(k.shape[1], variant.block_n)
    return (((1, q.shape[0], q.shape[1], d), (0,) + tuple(q.strides[:2]), variant.block_m),
            (k.shape, tuple(k.strides[:3]), box_rows), (v.shape, tuple(v.strides[:3]), box_rows))


def _execute(plan, q, k, v, out, o_ptr, return_lse, *, alibi=0, attn_mask=0, sink=0,
             packed=None, lse_out=None, stream=None, scratch=None, like=None):
    """Allocate the outputs (unless out=, or lse_out) and launch the plan on the caller's
    current stream. q, k, v, o_ptr (out's), alibi, attn_mask, sink: addresses; packed: the
    addresses of (cu_seqlens_q, cu_seqlens_k, seqused_k, block_table); stream, scratch:
    see dense; like: the caller's q (outputs')."""
    scratch_ptr = check_scratch(scratch, plan.scratch_bytes)
    with caller_stream(plan.framework, plan.device, stream) as stream:
        o, o_ptr, lse, lse_ptr = outputs(plan, out, o_ptr, lse_out, return_lse, stream,
                                         like if plan.out_like_q else None)
        if plan.variant is not None:
            _launch(plan, stream, q, k, v, o_ptr, lse_ptr, alibi, attn_mask, sink, packed,
                    scratch_ptr)
    return returned(plan, o, lse, return_lse)


def _work_list_ints(max_tiles, num_buckets):
    """A packed batch's int32 scratch before its tile counter: the int2 work list (8-byte
    aligned, first), its length, and the counting sort's 3 x num_buckets counters."""
    return 2 * max_tiles + 1 + 3 * num_buckets


def _launch(plan, stream, q, k, v, o_ptr, lse_ptr, alibi, attn_mask, sink, packed,
            scratch_ptr):
    """The plan's launches on `stream` (the device current); arguments as _execute's."""
    framework, device = plan.framework, plan.device
    counter = tile_list = tile_count = order = 0
    cu_q = cu_k = used = table = k_descale = v_descale = 0
    scratch = None
    if packed:
        cu_q, cu_k, used, table, k_descale, v_descale = packed
        schedule, max_tiles, num_buckets, schedule_record = plan.work_list
        # the work list, then the tile counter (2 ints, which the schedule kernel zeroes)
        ints = _work_list_ints(max_tiles, num_buckets)
        if scratch_ptr:
            tile_list = scratch_ptr
        else:  # (a paged batch: its decode order after them, kept by the decode launch,
            # and that launch's partials: asked for at once, so its ask cannot move them)
            scratch, tile_list = stream_workspace(framework, device, stream, plan.scratch_bytes)
        tile_count = tile_list + 8 * max_tiles
        if plan.variant.persistent:
            counter = tile_list + 4 * ints
        if plan.decode is not None:
            order = tile_list + 4 * (ints + 2)
    elif plan.variant.persistent:
        if scratch_ptr:  # XLA's buffer, perhaps replayed from a graph: zeroed in the stream
            import cupy
            counter = scratch_ptr
            stream_call(cupy.cuda.runtime.memsetAsync, counter, 0, 8, stream)
        else:
            scratch, counter = stream_tile_counter(framework, device, stream)
    record = plan.params
    if plan.variant.e4m3_kv:
        record = _set_descales(record, (k_descale, v_descale))
    params = _params.FWD.with_pointer_values(record, (
        q, k, v, o_ptr, lse_ptr, attn_mask, alibi, cu_q, cu_k, used, tile_list, tile_count,
        counter, table, sink))
    args = (params,)
    if plan.tma_template is not None:
        args = (params, _tma.with_addresses(plan.tma_template, q, k, v))
    if packed:
        driver_launch(schedule, 1, _compile.VARLEN_SCHEDULE.threads, 0, stream,
                      (_params.SCHEDULE.with_pointer_values(schedule_record, (
                          cu_q, tile_count + 4, tile_list, tile_count, counter, cu_k, used,
                          order)),))
    driver_launch(plan.function, plan.num_blocks, plan.variant.threads,
                  plan.variant.smem_bytes, stream, args)
    if plan.decode is not None:
        _decode_plan.launch_packed_decode(plan.decode, plan, stream, q, k, v, o_ptr, lse_ptr,
                                          alibi, sink, packed, scratch_ptr, order,
                                          plan.decode.scratch_offset)
    # (scratch, the counter's buffer, is held until the launches are queued: freed
    # earlier, another thread could be handed the same memory for work ordered before ours)
    del scratch


# -- the fp8 forward ------------------------------------------------------------------------
# q, k, v in e4m3 on Hopper's kernel (kE4m3 in fwd/fwd_sm90.cu): V transposed first into a
# workspace of V's size from the caller's allocator (_fp8.launch_transpose_v), then the
# forward, whose TMA maps view e4m3 rows as bfloat16 pairs. Planned at every call (no
# _Plan kept yet).

def fp8_dense(q, k, v, out, q_descale, k_descale, v_descale, *, softmax_scale, causal,
              window_size, return_lse, lse_out=None, stream=None, scratch=None):
    """flash_attn_func with q, k, v in float8_e4m3fn: out in bfloat16 (or out='s dtype).
    lse_out, stream, scratch: under jax.jit, as dense's (scratch of fp8_scratch_bytes)."""
    window, scale, _ = check_options(softmax_scale, causal, window_size, 0.0)
    (q, k, v, o), descales = _fp8_views((q, k, v, out), (q_descale, k_descale, v_descale))
    out_dtype = check_fp8_dense(q, k, v, o, out, descales)
    batch, seqlen_q, nheads, _ = q.shape
    return _fp8_forward(q, k, v, o, out, out_dtype, descales, window, scale, return_lse,
                        (batch, nheads, seqlen_q), batch, lse_out=lse_out, stream=stream,
                        scratch=scratch)


def fp8_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, out, q_descale,
               k_descale, v_descale, *, softmax_scale, causal, window_size, return_lse,
               lse_out=None, stream=None, scratch=None):
    """flash_attn_varlen_func with q, k, v in float8_e4m3fn (as fp8_dense)."""
    window, scale, _ = check_options(softmax_scale, causal, window_size, 0.0)
    (q, k, v, o, cu_q, cu_k, used, table), descales = _fp8_views(
        (q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table),
        (q_descale, k_descale, v_descale), ("q", "k", "v", "out", "cu_seqlens_q",
                                            "cu_seqlens_k", "seqused_k", "block_table"))
    batch, out_dtype, paged = check_fp8_packed(q, k, v, cu_q, cu_k, used, table, o, out,
                                               descales)
    if paged is not None:
        paged = dict(paged, table=table.ptr)
    return _fp8_forward(q, k, v, o, out, out_dtype, descales, window, scale, return_lse,
                        (q.shape[1], q.shape[0]), batch, (cu_q, cu_k, used), lse_out=lse_out,
                        stream=stream, scratch=scratch, paged=paged)


def fp8_scratch_bytes(q, k, batch, window, packed, out_dtype="bfloat16", paged=None):
    """The device scratch of an fp8 forward call (views of q and k, as checked; paged:
    check_block_table's dict for a paged k): the tile counter (padded batches) or the work
    list (packed), then V^T at the next 256 bytes, then a paged cache's gathered rows
    (_fp8_gathered_rows). Under jax.jit XLA allocates it (as dense's scratch), planned at trace
    time, where a GPU without the kernel is refused too; eager calls take V^T and the rows
    from the caller's allocator instead. 0 where nothing launches."""
    _check_fp8_device(q.device)
    rows = _fp8_gathered_rows(k, batch, paged)
    return _fp8_scratch(_fp8_layout(q, rows, batch, window, packed, out_dtype), rows, batch,
                        paged)


def _fp8_scratch(layout, rows, batch, paged):
    """fp8_scratch_bytes from the call's _fp8_layout and gathered rows."""
    if layout is None:
        return 0
    if paged is None:
        return layout[1] + layout[2]
    return _fp8_gather_offset(layout) + _fp8_gathered_bytes(rows, batch)


def _fp8_gather_offset(layout):
    """Where a paged call's gathered rows start in its scratch: after V^T, 256-aligned."""
    return _align(layout[1] + layout[2])


def _align(n, to=256):
    return -(-n // to) * to


# -- a paged cache (fp8 varlen with block_table): its pages gathered first into rows laid
#    out as a packed batch's k and v (batch * capacity rows: sequence b from row
#    b * capacity on), with those starts and the keys used of each after them
#    (gather_pages_e4m3); the work list, V's transpose and the forward then read them as a
#    packed batch's, in place of cu_seqlens_k and seqused_k --

def _fp8_gathered_rows(k, batch, paged):
    """k as the forward reads it: itself, or for a paged cache a view (no memory yet) of the
    gathered rows, (batch * capacity, nheads_k, d) contiguous."""
    if paged is None:
        return k
    shape = (batch * paged["capacity"],) + tuple(k.shape[2:])
    return _interop.DeviceArray(None, k.framework, 0, shape, _interop.contiguous_strides(shape),
                                k.dtype, k.device, k.itemsize)


def _fp8_gathered_bytes(rows, batch):
    """The gathered K and V rows, 256-byte aligned each, then the int32 starts (batch + 1)
    and keys used (batch) of the sequences."""
    return 2 * _align(math.prod(rows.shape)) + 4 * (2 * batch + 1)


def _check_fp8_device(device):
    if _compile.family_for(_runtime.compute_capability(device)) != "sm90":
        raise NotImplementedError("the fp8 forward (q, k, v in float8_e4m3fn) runs on Hopper "
                                  "GPUs (sm_90), on its e4m3 wgmma kernel; this GPU (or "
                                  f"{_compile.FAMILY_ENV}) has none")


def _fp8_layout(q, k, batch, window, packed, out_dtype):
    """(variant, V^T's offset in the scratch, V^T's bytes, padded keys, the sizes of
    _sizes) of an fp8 forward call, or None where nothing launches."""
    nheads, d, rows_q = q.shape[-2], q.shape[-1], q.shape[-3]
    if not (batch and nheads and rows_q):
        return None
    variant = _compile.fwd_fp8_variant(KERNEL_DTYPES[out_dtype], d, window_mask_kind(window))
    seqlen_k, nheads_k = k.shape[-3], k.shape[-2]
    padded = (_fp8.vt_packed_keys(seqlen_k, batch) if packed
              else _fp8.padded_keys(seqlen_k, variant.block_n))
    if padded > INT32_MAX or padded // 64 * nheads_k * (1 if packed else batch) > INT32_MAX:
        raise ValueError(f"the fp8 forward's V^T of {padded} keys a row (x {nheads_k} KV heads"
                         f"{'' if packed else f' x {batch} sequences'}) exceeds its int32 "
                         "indexing")
    sizes = _sizes(variant, batch, nheads, rows_q if packed else q.shape[1], seqlen_k,
                   bool(packed), q.device)
    head = sizes[-1] if packed else 8  # (the work list and its counter, or the counter)
    return (variant, -(-head // 256) * 256, nheads_k * d * padded * (1 if packed else batch),
            padded, sizes)


def _fp8_views(arrays, descales, names=("q", "k", "v", "out")):
    views = tuple(None if x is None else _interop.as_device_array(x, n)
                  for x, n in zip(arrays, names))
    return views, tuple(None if x is None else _interop.as_device_array(x, n) for x, n in zip(
        descales, ("q_descale", "k_descale", "v_descale")))


def _fp8_forward(q, k, v, o, out, out_dtype, descales, window, scale, return_lse, lse_shape,
                 batch, packed=None, lse_out=None, stream=None, scratch=None, paged=None):
    """The checked views' outputs and launches; packed: (cu_seqlens_q, cu_seqlens_k,
    seqused_k) views (q, k, v then (total, heads, d)); paged: check_block_table's dict and
    the table's address, k and v then the cache's pages; lse_out, stream, scratch: as
    fp8_dense's."""
    _check_fp8_device(q.device)
    rows = _fp8_gathered_rows(k, batch, paged)
    layout = _fp8_layout(q, rows, batch, window, packed, out_dtype)
    plan = _Plan(framework=q.framework, device=q.device, out_shape=q.shape, dtype=out_dtype,
                 lse_shape=lse_shape, variant=layout and layout[0])
    scratch_ptr = check_scratch(scratch, _fp8_scratch(layout, rows, batch, paged))
    with caller_stream(q.framework, q.device, stream) as stream:
        result, o_ptr, lse, lse_ptr = outputs(plan, out, o and o.ptr, lse_out, return_lse,
                                              stream)
        if layout is not None:
            gathered = None
            if paged is not None:
                gathered, k, v, packed = _fp8_gather(
                    plan, stream, k, v, rows, paged, batch, packed,
                    scratch_ptr and scratch_ptr + _fp8_gather_offset(layout))
            _fp8_launch(plan, stream, q, k, v, o_ptr, lse_ptr, descales, window, scale,
                        o.strides if o is not None else _interop.contiguous_strides(q.shape),
                        batch, packed, layout, scratch_ptr)
            del gathered  # (held until the launches are queued)
    return returned(plan, result, lse, return_lse)


def _fp8_gather(plan, stream, k_cache, v_cache, rows, paged, batch, packed, at):
    """gather_pages_e4m3's launch (the pages of k_cache, v_cache into `rows`' layout) into
    XLA's scratch at `at`, or (at 0) a buffer from the caller's allocator -> (that buffer
    or None, the K rows' and V rows' views, packed with the gathered sequences' starts and
    keys used in place of cu_seqlens_k and seqused_k)."""
    size = _align(math.prod(rows.shape))
    owner = None
    if not at:
        owner, at = _interop.allocate(plan.framework, (_fp8_gathered_bytes(rows, batch),),
                                      "uint8", plan.device, stream)
    k_rows, v_rows = (dataclasses.replace(rows, ptr=at + i * size) for i in (0, 1))
    cu_rows, used = (_interop.DeviceArray(None, rows.framework, ptr, (n,), (1,), "int32",
                                          rows.device, 4)
                     for ptr, n in ((at + 2 * size, batch + 1),
                                    (at + 2 * size + 4 * (batch + 1), batch)))
    cu_q, cu_k, seqused = packed
    _fp8.launch_gather_pages(k_cache, v_cache, paged, batch, k_rows.ptr, v_rows.ptr,
                             cu_rows.ptr, used.ptr, cu_k.ptr, seqused.ptr if seqused else 0,
                             plan.device, stream)
    return owner, k_rows, v_rows, (cu_q, cu_rows, used)


def _fp8_launch(plan, stream, q, k, v, o_ptr, lse_ptr, descales, window, scale, o_strides,
                batch, packed, layout, scratch_ptr):
    """V's transpose, then the fp8 forward (packed: the work list first, as _launch's);
    layout: _fp8_layout's; scratch_ptr: XLA's scratch (0: none)."""
    variant, device = plan.variant, plan.device
    _, vt_offset, vt_bytes, padded, sizes = layout
    if packed:  # (seen as one sequence of all rows: the maps' and strides' batch of one)
        q, k, v = (_interop.DeviceArray(x.obj, x.framework, x.ptr, (1,) + x.shape, (0,) + x.strides,
                                        x.dtype, x.device, x.itemsize) for x in (q, k, v))
        o_strides = (0,) + tuple(o_strides)
    _, seqlen_q, nheads, d = q.shape
    seqlen_k, nheads_k = k.shape[1], k.shape[2]
    box_n = variant.block_n
    # (a dimension of one element: its stride 0, which the maps take whatever it was; no
    # keys: k's map, never read, describes one row of a contiguous k)
    q_units, k_units = (tuple(0 if n == 1 else x // 2
                              for n, x in zip(a.shape[:3], a.strides[:3])) for a in (q, k))
    if not seqlen_k:
        k_units = (nheads_k * d // 2, nheads_k * d // 2, d // 2)
    views = (((q.shape[0], seqlen_q, nheads, d // 2), q_units, variant.block_m),
             ((k.shape[0], max(seqlen_k, 1), nheads_k, d // 2), k_units, box_n),
             _fp8.vt_map_view(1 if packed else batch, nheads_k, d, padded, variant.head_dim))
    # (packed: each sequence's last key block through a tail map of k, as 16-bit k's; the
    # fifth map, v's tail, is never read: V^T is padded with zeros)
    tails = ((_tma.tail_view(max(seqlen_k, 1), nheads_k, d // 2, k_units[1], k_units[2],
                             box_n),) * 2 if packed else ())
    template = _tma.template("bfloat16", views, tails)
    if template is None:
        raise NotImplementedError(f"the copy engine cannot describe q {q.shape} {q.strides} "
                                  f"or k {k.shape} {k.strides} as the fp8 forward reads them")
    values, num_blocks, max_tiles, num_buckets, scratch_bytes = sizes
    # V^T from the caller's allocator, a call's own (stream-ordered: freed once the
    # launches are queued, as outputs are), or from XLA's scratch after its counter or
    # work list
    workspace = scratch = counter_owner = None
    if scratch_ptr:
        vt = scratch_ptr + vt_offset
    else:
        workspace, vt = _interop.allocate(plan.framework, (vt_bytes,), "uint8", device, stream)
    cu_q = cu_k = used = tile_list = tile_count = 0
    if packed:
        cu_q, cu_k, used = (0 if x is None else x.ptr for x in packed)
        if scratch_ptr:
            tile_list = scratch_ptr
        else:
            scratch, tile_list = stream_workspace(plan.framework, device, stream, scratch_bytes)
        tile_count = tile_list + 8 * max_tiles
        counter = tile_list + 4 * _work_list_ints(max_tiles, num_buckets)
        driver_launch(_compile.function_pointer(_compile.VARLEN_SCHEDULE, device), 1,
                      _compile.VARLEN_SCHEDULE.threads, 0, stream,
                      (_params.SCHEDULE.with_pointer_values(_params.SCHEDULE.pack(dict(
                          batch=batch, total_q=seqlen_q, block_m=variant.block_m,
                          num_buckets=num_buckets)), (cu_q, tile_count + 4, tile_list,
                                                      tile_count, counter, cu_k, used, 0)),))
    elif scratch_ptr:  # XLA's buffer, perhaps replayed from a graph: zeroed in the stream
        import cupy
        counter = scratch_ptr
        stream_call(cupy.cuda.runtime.memsetAsync, counter, 0, 8, stream)
    else:
        counter_owner, counter = stream_tile_counter(plan.framework, device, stream)
    if seqlen_k:
        _fp8.launch_transpose_v(v.ptr, (batch,) + v.shape[1:], v.strides, vt, padded, device,
                                stream, cu_k, used)
    p = dict(nheads=nheads, nheads_k=nheads_k, head_dim=d, head_dim_v=d, bottom_right=1,
             kv_tail_maps=int(template.has_tails), **dict(zip(_SIZE_FIELDS, values)),
             **_params.score_fields(window, scale, 0.0, d, None))
    # (e4m3 rows move as 16-bit pairs: q's, k's and v's strides in those)
    for fields, strides, unit in zip(_STRIDE_FIELDS, (q.strides, k.strides, v.strides,
                                                      o_strides), (2, 2, 2, 1)):
        p.update(zip(fields, (strides[0] // unit, strides[1] // unit, strides[2] // unit)))
    q_descale, k_descale, v_descale = descales
    p.update(_decode_plan.descale_strides(k_descale, v_descale, q_descale))
    p.update((f"{name}_descale", x.ptr) for name, x in zip("qkv", descales) if x is not None)
    driver_launch(_compile.function_pointer(variant, device), num_blocks, variant.threads,
                  variant.smem_bytes, stream,
                  (_params.FWD.with_pointer_values(_params.FWD.pack(p), (
                      q.ptr, k.ptr, vt, o_ptr, lse_ptr, 0, 0, cu_q, cu_k, used, tile_list,
                      tile_count, counter, 0, 0)),
                   _tma.with_addresses(template, q.ptr, k.ptr, vt)))
    del workspace, scratch, counter_owner  # (held until the launches are queued)
