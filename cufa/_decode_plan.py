"""KV-cache plans: attention of new tokens against a cache (decode, speculative decode,
appends; contiguous or paged; split-KV), the decode kernel's share of a paged packed batch,
and the merge of partial attention states. Plans are made once per call signature and kept
in _runtime.plans, as the forward's are."""
from dataclasses import dataclass

from . import _arrays, _compile, _heuristics, _interop, _params, _runtime, _tma
from ._checks import (FP8_CACHE, KERNEL_DTYPES, MERGE_DTYPES, ROTARY_DTYPES, check_cache_values,
                      check_kvcache, check_merge, check_num_splits, check_options)
from ._runtime import (caller_stream, check_scratch, driver_launch, outputs, plans, remember,
                       returned, stream_capturing, stream_split_counters, stream_workspace)

# with_kvcache's arrays, in order (the first three required)
ARRAYS = _arrays.KvCache._fields


def with_kvcache(arrays, *, cache_seqlen, softmax_scale, causal, window_size, softcap,
                 rotary_interleaved, num_splits, return_lse, check_inputs=False, lse_out=None,
                 stream=None, scratch=None):
    """flash_attn_with_kvcache on arrays or views, in ARRAYS order (out: the caller's out=
    or, under jax.jit, the output buffer's view); cache_seqlen: the int form of
    cache_seqlens, or None; lse_out, stream, scratch: as in _fwd_plan.dense (jax.jit)."""
    window, scale, softcap = check_options(softmax_scale, causal, window_size, softcap)
    if type(num_splits) is not int or num_splits < 0:  # (one test on the usual call; the
        check_num_splits(num_splits)                    # most is checked with a new plan)
    want_lse = return_lse or lse_out is not None
    options = (window, scale, softcap, rotary_interleaved, num_splits, cache_seqlen, want_lse)
    entries, ptrs = _interop.signature(arrays, ARRAYS)
    if ptrs[3] and ptrs[1] == ptrs[2]:  # (addresses are not in a plan's key: checked each call)
        raise ValueError("k_cache and v_cache are one array, and the call writes k and v into "
                         "them: pass a cache for each")
    key = ("kvcache", options) + entries
    plan = plans.get(key)
    views = None
    if plan is None or check_inputs:
        views = _arrays.KvCache._make(_interop.views(arrays, ARRAYS, entries, ptrs, 3))
    if plan is None:
        check_num_splits(num_splits)  # (num_splits is in the key: a new one is checked here)
        plan = remember(key, plan_kvcache(
            views, arrays[-1], cache_seqlen, window=window, scale=scale, softcap=softcap,
            interleaved=rotary_interleaved, num_splits=num_splits, want_lse=want_lse))
    if check_inputs:
        check_cache_values(plan, views.cache_seqlens, views.cache_leftpad, views.block_table,
                           views.cache_batch_idx, views.k_cache.shape[0])
    return _run(plan, ptrs, arrays[0], arrays[-1], lse_out, stream, scratch)


MERGE_ARRAYS = _arrays.Merge._fields


def merge(arrays, lse_out=None, stream=None):
    """merge_attention_states on arrays or views, in MERGE_ARRAYS order (out: the
    caller's out= or, under jax.jit, the output buffer's view; lse_out, stream: as in
    _fwd_plan.dense)."""
    entries, addresses = _interop.signature(arrays, MERGE_ARRAYS)
    key = ("merge",) + entries
    plan = plans.get(key)
    oa, la, ob, lb, o_ptr = addresses
    if plan is None:
        views = _interop.views(arrays, MERGE_ARRAYS, entries, addresses, 4)
        plan = remember(key, _plan_merge(_arrays.Merge._make(views), arrays[-1]))
    with caller_stream(plan.framework, plan.device, stream) as stream:
        o, o_ptr, lse, lse_ptr = outputs(plan, arrays[-1], o_ptr, lse_out, True, stream,
                                         arrays[0])  # (out has out_a's shape and dtype)
        if plan.blocks:
            params = _params.MERGE.with_pointer_values(plan.params, (  # MERGE_FIELDS' order
                oa, la, ob, lb, o_ptr, lse_ptr))
            driver_launch(plan.function, plan.blocks, 128, 0, stream, (params,))
    return returned(plan, o, lse, True)


# -- planning ------------------------------------------------------------------------------

@dataclass  # not frozen (see _fwd_plan._Plan); never changed once made
class _KvPlan:
    """What a call needs besides the arrays' addresses (see _fwd_plan._Plan)."""
    framework: str
    device: int
    out_shape: tuple
    dtype: str
    lse_shape: tuple
    want_lse: bool
    to_jax: bool               # the caller passed JAX arrays: outputs go back as JAX arrays
    params: bytes = b""
    launches: tuple = ()       # (kind, CUfunction, grid, threads, smem) in order
    merge_in_launch: bool = False  # an eager split call may merge in its decode launch
    workspace: tuple = (0, -1, -1, -1)  # float32s in all; offsets of o_partial, lse_partial
                                        # and the rotated q (-1: not used)
    rotary: bool = False
    maps: object = None        # the TMA decode kernel's K/V maps (_tma.Template), or None
    capacity: int = 0          # key positions a sequence can hold
    num_pages: int = 0
    seqlen_new: int = 0
    fixed_seqlen: object = None
    out_like_q: bool = True    # out has q's shape (not MLA's, whose rows are v's): a new one
                               # is allocated like q

    @property
    def scratch_bytes(self):
        """The workspace's bytes (jax.jit's scratch)."""
        return 4 * self.workspace[0]


def plan_kvcache(a, out, fixed, *, window, scale, softcap, interleaved, num_splits, want_lse):
    """The plan of a call's views (a: an _arrays.KvCache), the caller's out= and the int
    form of cache_seqlens (or None)."""
    paged, capacity, cache_rows, fixed, rotary_dim, seqlen_ro, aligned = check_kvcache(
        a, out, fixed)
    q, kc, vc, kn, vn, o = a.q, a.k_cache, a.v_cache, a.k, a.v, a.out
    cos, alibi, sink, leftpad = a.rotary_cos, a.alibi_slopes, a.learnable_sink, a.cache_leftpad
    fp8 = kc.dtype == FP8_CACHE
    batch, seqlen_q, nheads, d = q.shape
    nheads_k, dv = kc.shape[2], vc.shape[3]  # (dv: MLA's latent rows; else d)
    mla = a.qv is not None
    seqlen_new = kn.shape[1] if kn is not None else 0
    framework = "cupy" if q.framework == "dlpack" else q.framework
    outputs = dict(framework=framework, device=q.device, out_shape=q.shape[:-1] + (dv,),
                   dtype=q.dtype,
                   lse_shape=(batch, nheads, seqlen_q), want_lse=want_lse,
                   to_jax=_interop.returns_jax(q), out_like_q=dv == d)
    extra = dict(capacity=capacity, num_pages=paged["num_pages"] if paged else 0,
                 seqlen_new=seqlen_new, fixed_seqlen=fixed)
    if batch == 0 or nheads == 0:
        return _KvPlan(**outputs, **extra)

    group = nheads // nheads_k
    pairs = not mla and _heuristics.head_pairs(
        d, nheads_k, (kc.strides[2], vc.strides[2]), seqlen_q * group, fp8, aligned, q.device)
    maps = None  # (the TMA kernels': the decode kernel's, over 16-bit caches, and MLA's)
    rotary = rotary_dim > 0
    q_strides = _interop.contiguous_strides(q.shape) if rotary else q.strides  # (the kernel's q)
    if mla:
        kernel, maps, num_m_blocks, num_splits = _mla_kernel(
            q, q_strides, a.qv, kc, vc, softcap, fp8, seqlen_q * group, batch * nheads_k,
            capacity, num_splits)
    else:
        num_m_blocks = -(-seqlen_q * group // _compile.DECODE_ROWS)
        kernel, num_splits, pairs = _heuristics.decode_route(
            KERNEL_DTYPES[q.dtype], d, num_splits, batch * nheads_k * num_m_blocks, capacity,
            q.device, seqlen_q * group, pairs, paged=paged is not None and not
            _heuristics.pages_read_whole(paged["page_shift"], leftpad is None, window[0]),
            element_io=not aligned, fp8_cache=fp8)
    heads_a_cta = 2 if pairs else 1
    tiles_k = nheads_k // heads_a_cta  # (the grid's y)
    p = dict(batch=batch, seqlen_q=seqlen_q, nheads=nheads, nheads_k=nheads_k, group=group,
             head_dim=d, head_dim_v=dv, cache_seqlen_fixed=fixed or 0, seqlen_new=seqlen_new,
             capacity=capacity, cache_rows=cache_rows, num_splits=num_splits,
             combine_row_threads=_heuristics.combine_row_threads(dv, num_splits),
             num_m_blocks=num_m_blocks, rotary_dim=rotary_dim, seqlen_ro=seqlen_ro,
             rotary_dtype=ROTARY_DTYPES.get(cos.dtype, 0) if rotary else 0,
             rotary_interleaved=int(interleaved),
             rotary_q_per_token=int(min(window) < capacity), sink_dtype=_sink_dtype(sink),
             lse_batch_stride=nheads * seqlen_q, lse_head_stride=seqlen_q,
             **descale_strides(a.k_descale, a.v_descale),
             # (MLA's default scale: 1 / sqrt of the scores' 576 dims, as FlashAttention-3's)
             **_params.score_fields(window, scale, softcap, d + dv if mla else d, alibi))
    o_strides = o.strides if o is not None else _interop.contiguous_strides(outputs["out_shape"])
    for name, strides in (("q", q_strides), ("k", kc.strides), ("v", vc.strides),
                          ("o", o_strides), ("qv", a.qv.strides if mla else (0, 0, 0)),
                          ("q_source", q.strides if rotary else (0, 0, 0)),
                          ("k_new", kn.strides if kn is not None else (0, 0, 0)),
                          ("v_new", vn.strides if vn is not None else (0, 0, 0))):
        (p[f"{name}_batch_stride"], p[f"{name}_row_stride"],
         p[f"{name}_head_stride"]) = strides[:3]
    if paged:
        p["page_shift"], p["max_pages"] = paged["page_shift"], paged["max_pages"]
        p["block_table_batch_stride"] = paged["table_stride"]

    dt = KERNEL_DTYPES[q.dtype]
    launches = []
    rows = batch * seqlen_new * nheads_k + (batch * seqlen_q * nheads if rotary else 0)
    if rows:  # new keys to write, or q to rotate
        launches.append(_launch_entry(_compile.AppendVariant(dt, fp8), q.device,
                                      (-(-rows // 4), 1, 1)))
    if seqlen_q and not paged and aligned and not fp8 and not mla:
        kernel, maps = _tma_route(q.dtype, d, kc, vc, batch * nheads_k * num_m_blocks,
                                  num_splits, batch, capacity, q.device) or (kernel, None)
    merge_in_launch = (not mla and kernel.units <= 1 and kernel.ctas_per_unit == 1
                       and _heuristics.merge_in_launch(kernel, d, num_splits,
                                                       seqlen_q * group * heads_a_cta))
    if seqlen_q:  # (a TMA CTA of several units takes sequences z, z + grid z, ...)
        per_cta = max(kernel.units, 1)
        launches.append(_launch_entry(kernel, q.device, (
            num_m_blocks * num_splits * kernel.ctas_per_unit, tiles_k, -(-batch // per_cta))))
        if num_splits > 1:
            launches.append(_combine_entry(kernel, dv, num_splits, batch * seqlen_q * nheads,
                                           q.device, may_slice=not merge_in_launch))
    # the splits' outputs and lse, then the rotated q (16-byte rows)
    rows = batch * seqlen_q * nheads
    split = num_splits > 1 and seqlen_q
    workspace = _workspace(num_splits * rows * _partial_cols(dv) if split else 0,
                           num_splits * rows if split else 0,
                           (rows * d + 1) // 2 if rotary else 0)
    return _KvPlan(**outputs, **extra, params=_params.DECODE.pack(p),
                   launches=tuple(launches), workspace=workspace, rotary=rotary,
                   maps=maps, merge_in_launch=merge_in_launch)


def _mla_kernel(q, q_strides, qv, kc, vc, softcap, fp8, rows, units, capacity, num_splits):
    """(the MLA decode kernel, its maps' template or None, its query blocks, the split
    count) for a call with qv: `rows` (token, head) rows of each of `units` (sequence, KV
    head) pairs, over a 16-bit or (fp8) an e4m3 cache; Hopper's alone (wgmma). q_strides:
    those of the q the kernel reads (a rotated copy's, with rotary). The kernel takes Q
    and whole key blocks as TMA boxes where maps describe them all (_mla_maps)."""
    if softcap > 0:
        raise NotImplementedError("softcap is not supported with qv (MLA decode)")
    family = _compile.family_for(_runtime.compute_capability(q.device))
    if family != "sm90":
        raise NotImplementedError(
            "qv (MLA decode) runs on Hopper GPUs (sm_90), on its wgmma kernel; this GPU (or "
            f"{_compile.FAMILY_ENV}) takes the {family} kernels. Without qv, the same "
            "attention is q' = [qv, q] against k' = [v_cache, k_cache] with v_cache as values "
            "(a copy of the cache)")
    maps = _mla_maps(q.dtype, q.shape, q_strides, qv, kc, vc, fp8) if rows else None
    kernel = _compile.MlaVariant(KERNEL_DTYPES[q.dtype], tma=maps is not None, fp8_cache=fp8)
    num_m_blocks = -(-rows // _compile.MLA_ROWS)
    return kernel, maps, num_m_blocks, _heuristics.mla_splits(
        num_splits, units * num_m_blocks, units * rows, capacity, q.device, fp8)


def descale_strides(kd, vd, qd=None):
    """DecodeParams' (and FwdParams') descale strides of (batch, nheads_k) descales; 0 for
    one a tensor. qd: the fp8 forward's q_descale, whose fields only FwdParams has."""
    p = {}
    for name, x in (("k", kd), ("v", vd)) + ((("q", qd),) if qd is not None else ()):
        b, h = x.strides[:2] if x is not None and x.ndim == 2 else (0, 0)
        p[f"{name}_descale_batch_stride"], p[f"{name}_descale_head_stride"] = b, h
    return p


def _sink_dtype(sink):
    """DecodeParams' sink_dtype of the learnable sink's view (or None)."""
    return _params.SINK_DTYPES[sink.dtype] if sink is not None else 0


def _tma_route(dtype_name, d, kc, vc, units, num_splits, batch, capacity, device):
    """(the TMA decode kernel, its K/V maps' template) where _heuristics.tma_units has it
    run and a map can describe the cache (k's and v's strides alike), else None."""
    per_cta = _heuristics.tma_units(d, units, num_splits, batch, capacity, device)
    if per_cta is None:
        return None
    shape, strides = kc.shape, kc.strides[:3]
    if tuple(vc.strides[:3]) != tuple(strides):
        return None
    view = (tuple(shape), tuple(strides), _compile.DECODE_TMA_BOX_KEYS)
    template = _tma.template(dtype_name, (view, view, view))
    if template is None:
        return None
    return _compile.decode_tma_kernel(KERNEL_DTYPES[dtype_name], _compile.padded_head_dim(d),
                                      per_cta), template


def _mla_maps(dtype_name, q_shape, q_strides, qv, kc, vc, fp8):
    """The MLA kernel's maps' template: k_cache (the rope) and v_cache (the latent) as
    (pages or batch, rows, KV heads, columns) views in boxes of a key block's rows; qv and
    q (shape q_shape, strides q_strides) as (batch, heads, tokens, columns) views in
    boxes of a CTA's 64 rows (one token's heads), in the q slot and the first tail slot
    (both tails); None where a map cannot describe them all (the kernel then copies Q and
    every block itself). An e4m3 cache's latent goes as bytes: described as bfloat16 pairs
    (half the columns and strides; a 64-column box is 128 of its values), which the copy
    engine moves the same, its rope by the producer's copies (v's map in k's slot too).
    Every map is of 2-byte elements, whichever dtype it names."""
    batch, seqlen_q, nheads = q_shape[:3]
    q_views = [((batch, nheads, seqlen_q, x_shape[3]), (s[0], s[2], s[1]), _compile.MLA_ROWS)
               for x_shape, s in ((tuple(qv.shape), tuple(qv.strides)), (q_shape, q_strides))]
    if fp8:
        if any(s % 2 for s in vc.strides[:3]):
            return None
        dtype_name = "bfloat16"
        v_view = ((vc.shape[:3] + (vc.shape[3] // 2,)), tuple(s // 2 for s in vc.strides[:3]),
                  _compile.MLA_KEYS)
        k_view = v_view
    else:
        k_view, v_view = ((tuple(c.shape), tuple(c.strides[:3]), _compile.MLA_KEYS)
                          for c in (kc, vc))
    made = _tma.template(dtype_name, (q_views[0], k_view, v_view), (q_views[1], q_views[1]))
    return made if made is not None and made.has_tails else None


def _partial_cols(d):
    """Floats a row of a split's partial output: whole 8-column chunks (partial_cols in
    decode/epilogue.cuh)."""
    return -(-d // 8) * 8


def _workspace(*sizes):
    """One float32 buffer of parts of `sizes` floats, each on a 256-byte boundary:
    (floats in all, each part's offset or -1 for an empty one)."""
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total if n else -1)
        total += -(-n // 64) * 64
    return (total, *offsets)


_QV_FIELD = _params.DECODE.pointer_fields.index("qv")  # (its value's place in a record's)


def _launch_decode(record, launches, workspace, merge_in_launch, pointers, framework, device,
                   stream, scratch_ptr, reserved=0, maps=None):
    """`launches` ((kind, CUfunction, grid, threads, smem) entries) of one DecodeParams
    record on `stream`. pointers(at, counters) -> the record's pointer values
    (DECODE_FIELDS' order), `at` mapping a workspace offset (-1: none) to its address: in
    XLA's scratch_ptr under jax.jit, else in the stream's buffer; counters: the split
    counters' address, or 0. A split decode called eagerly merges its partials in its own
    launch where `merge_in_launch` (the stream's zeroed counters, one a unit), and the
    combine is not launched: a launch less of host time, and of GPU time too (one launch's
    span is shorter than the decode's, the combine's and the gap between them). Under
    jax.jit (whose replays must not depend on memory cufa keeps) and under graph capture
    (where the counters would need a memset node) decode_combine merges them. reserved:
    bytes at the start of the stream's buffer left untouched (a packed batch's work list
    and decode order, made by the launches before). maps: the TMA kernels' map
    template, pointed at the call's cache (the record's k and v), and MLA's at its qv and
    q too."""
    held, base = None, scratch_ptr
    # (one capture check a call: it is a driver call)
    capturing = None if scratch_ptr or not merge_in_launch else stream_capturing(stream)
    if not scratch_ptr and workspace[0]:
        held, base = stream_workspace(framework, device, stream, reserved + 4 * workspace[0],
                                      capturing)
        base += reserved
    counters = counters_held = 0
    if merge_in_launch and not scratch_ptr and not capturing:
        x, y, z = launches[-2][2]  # (a split call's launches end: decode, combine)
        counters_held, counters = stream_split_counters(framework, device, stream,
                                                        4 * x * y * z)
        launches = launches[:-1]
    values = pointers(lambda offset: base + 4 * offset if offset >= 0 else 0, counters)
    params = _params.DECODE.with_pointer_values(record, values)
    # (values are DECODE_FIELDS' order, q, k, v first. The decode kernel's maps hold k's
    # map in the q slot: it reads k and v. MLA's hold qv's there, and q's in the tail
    # slots, the only decode maps with tails)
    if maps is None:
        with_maps = (params, _tma.NO_MAPS)
    elif maps.has_tails:
        with_maps = (params, _tma.with_addresses(maps, values[_QV_FIELD], values[1], values[2],
                                                 tails=(values[0], values[0])))
    else:
        with_maps = (params, _tma.with_addresses(maps, values[1], values[1], values[2]))
    for kind, function, grid, threads, smem in launches:
        driver_launch(function, grid, threads, smem, stream,
                      with_maps if kind in ("decode_tma", "decode_mla") else (params,))
    # (the buffers held until the launches are queued: freed earlier, another thread could
    # be handed the same memory for work ordered before ours)
    del held, counters_held


@dataclass
class PackedDecode:
    """The decode kernel's share of a packed batch over a paged cache
    (_fwd_plan.plan_packed): every sequence of 1 to `rows` query rows, whose GQA group of
    heads then fills one 16-row tile and reads each KV byte once, instead of a 64- or
    128-row forward tile a query head. The forward kernel's work list leaves those sequences out."""
    rows: int
    launches: tuple         # (kind, CUfunction, grid, threads, smem): decode, then combine
                            # when split
    params: bytes
    workspace: tuple        # (float32s, offset of o_partial, of lse_partial; -1: none)
    merge_in_launch: bool = False  # an eager split call may merge in its decode launch
    scratch_offset: int = 0  # where they start in jax.jit's scratch (set by _fwd_plan)

    @property
    def scratch_bytes(self):
        """The workspace's bytes (jax.jit's scratch)."""
        return 4 * self.workspace[0]


def plan_packed_decode(q, k, v, o, alibi, sink, paged, *, batch, nheads, nheads_k, d, total_q,
                       window, scale, softcap, aligned=True, descales=None):
    """PackedDecode of validated views: q (total_q, nheads, d), k and v paged (pages,
    page_size, nheads_k, d), o the caller's out= view or None, sink the learnable sink's or
    None; paged from check_block_table; aligned: whether the arrays are chunk-aligned (else
    the element-wise I/O kernel); descales: (k_descale, v_descale) views where k and v are
    an e4m3 cache, else None."""
    group = nheads // nheads_k
    rows = max(1, _compile.DECODE_ROWS // group)
    num_m_blocks = -(-rows * group // _compile.DECODE_ROWS)
    capacity = paged["capacity"]
    kernel, num_splits = _heuristics.decode_kernel_and_splits(
        KERNEL_DTYPES[q.dtype], d, 0, batch * nheads_k * num_m_blocks, capacity, q.device,
        paged=True, element_io=not aligned, fp8_cache=descales is not None)
    o_strides = o.strides if o is not None else _interop.contiguous_strides(q.shape)
    p = dict(batch=batch, seqlen_q=rows, nheads=nheads, nheads_k=nheads_k, group=group,
             head_dim=d, head_dim_v=d, total_q=total_q, capacity=capacity, cache_rows=paged["num_pages"],
             page_shift=paged["page_shift"], max_pages=paged["max_pages"],
             block_table_batch_stride=paged["table_stride"], num_splits=num_splits,
             combine_row_threads=_heuristics.combine_row_threads(d, num_splits),
             num_m_blocks=num_m_blocks, lse_batch_stride=0, lse_head_stride=total_q,
             sink_dtype=_sink_dtype(sink),
             q_batch_stride=0, q_row_stride=q.strides[0], q_head_stride=q.strides[1],
             o_batch_stride=0, o_row_stride=o_strides[0], o_head_stride=o_strides[1],
             **_params.score_fields(window, scale, softcap, d, alibi),
             **(descale_strides(*descales) if descales is not None else {}))
    for name, x in (("k", k), ("v", v)):  # page stride as the batch stride
        (p[f"{name}_batch_stride"], p[f"{name}_row_stride"],
         p[f"{name}_head_stride"]) = x.strides[:3]
    partial_rows = batch * rows * nheads if num_splits > 1 else 0
    workspace = _workspace(num_splits * partial_rows * _partial_cols(d),
                           num_splits * partial_rows)
    launches = [_launch_entry(kernel, q.device, (num_m_blocks * num_splits * kernel.ctas_per_unit,
                                                 nheads_k, batch))]
    if partial_rows:
        launches.append(_combine_entry(kernel, d, num_splits, partial_rows, q.device))
    return PackedDecode(rows, tuple(launches), _params.DECODE.pack(p), workspace,
                        merge_in_launch=kernel.ctas_per_unit == 1 and _heuristics.merge_in_launch(
                            kernel, d, num_splits, rows * group))


def launch_packed_decode(route, plan, stream, q, k, v, o, lse, alibi, sink, packed, scratch_ptr,
                         order, reserved):
    """route's launches on `stream` after the forward's (_fwd_plan._launch's arguments): its
    partials in XLA's scratch under jax.jit, else in the stream's buffer past its first
    `reserved` bytes; order: the schedule's decode order (sequences, most keys first)."""
    cu_q, cu_k, used, table, k_descale, v_descale = packed
    _, o_part, lse_part = route.workspace
    _launch_decode(route.params, route.launches, route.workspace, route.merge_in_launch,
                   lambda at, counters: (
        q, k, v, o, lse, at(o_part), at(lse_part), 0, 0, 0, table, alibi, 0, 0, 0, 0, 0,
        cu_q, cu_k, used, counters, order, sink, k_descale, v_descale, 0), plan.framework,
                   plan.device, stream,
        scratch_ptr and scratch_ptr + route.scratch_offset, reserved)


def _combine_entry(decode, d, num_splits, rows, device, may_slice=False):
    """decode_combine's launch for the partials of the `decode` kernel (may_slice: the
    decode launch never merges them itself; see _heuristics.combine_kernel)."""
    kernel = _heuristics.combine_kernel(decode.dtype, d, num_splits, decode.element_io,
                                        may_slice)
    return _launch_entry(kernel, device, (-(-rows // kernel.rows),
                                          kernel.slices(_partial_cols(d)), 1))


def _launch_entry(kernel, device, grid):
    return (kernel.kind, _compile.function_pointer(kernel, device), grid, kernel.threads,
            kernel.smem_bytes)


def _plan_merge(a, out):
    packed, batch, rows, nheads, lse_shape = check_merge(a, out)
    oa, la, ob, lb, o = a.out_a, a.lse_a, a.out_b, a.lse_b, a.out

    def batched(strides):  # packed arrays have no batch dimension: its stride is 0
        return (0,) + tuple(strides) if packed else tuple(strides)

    p = dict(batch=batch, seqlen=rows, nheads=nheads, head_dim=oa.shape[-1])
    o_strides = o.strides if o is not None else _interop.contiguous_strides(oa.shape)
    for name, strides in (("out_a", oa.strides), ("out_b", ob.strides), ("out", o_strides)):
        for dim, s in zip(("batch", "row", "head", "col"), batched(strides)):
            p[f"{name}_{dim}_stride"] = s
    for name, strides in (("lse_a", la.strides), ("lse_b", lb.strides),
                          ("lse", _interop.contiguous_strides(lse_shape))):
        for dim, s in zip(("batch", "head", "row"), batched(strides)):
            p[f"{name}_{dim}_stride"] = s
    framework = "cupy" if oa.framework == "dlpack" else oa.framework
    count = batch * rows * nheads
    kernel = _compile.MergeVariant(MERGE_DTYPES[oa.dtype])
    return _MergePlan(framework, oa.device, oa.shape, oa.dtype, lse_shape,
                      _params.MERGE.pack(p),
                      _compile.function_pointer(kernel, oa.device) if count else 0,
                      -(-count // 4), _interop.returns_jax(oa))


@dataclass  # not frozen (see _fwd_plan._Plan); never changed once made
class _MergePlan:
    framework: str
    device: int
    out_shape: tuple
    dtype: str
    lse_shape: tuple
    params: bytes
    function: int
    blocks: int
    to_jax: bool


# -- launch --------------------------------------------------------------------------------

def _run(plan, ptrs, q_array, out, lse_out, stream, scratch):
    """ptrs: the arrays' addresses in ARRAYS order; q_array: the caller's q."""
    scratch_ptr = check_scratch(scratch, plan.scratch_bytes)
    q, kc, vc, kn, vn, cos, sin, seqlens, idx, leftpad, table, alibi, sink, kd, vd, qv, o_ptr = ptrs
    with caller_stream(plan.framework, plan.device, stream) as stream:
        o, o_ptr, lse, lse_ptr = outputs(plan, out, o_ptr, lse_out, plan.want_lse, stream,
                                         q_array if plan.out_like_q else None)
        if plan.launches:
            _, o_part, lse_part, q_rot = plan.workspace
            _launch_decode(plan.params, plan.launches, plan.workspace, plan.merge_in_launch,
                           lambda at, counters: (
                at(q_rot) if plan.rotary else q, kc, vc, o_ptr, lse_ptr, at(o_part),
                at(lse_part), seqlens, idx, leftpad, table, alibi, kn, vn,
                q if plan.rotary else 0, cos, sin, 0, 0, 0, counters, 0, sink, kd, vd, qv),
                           plan.framework,
                plan.device, stream, scratch_ptr, maps=plan.maps)
    return returned(plan, o, lse, plan.want_lse)
