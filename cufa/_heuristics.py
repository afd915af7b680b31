"""Every tuning rule: which kernel variant, tile class and split count a call takes."""
import functools
import math

from . import _checks, _compile, _runtime

# -- forward: the sm90 tile class -------------------------------------------------------------

SM90_LONG_MIN_SEQLEN = {"none": 1024, "window": 2048}
# d <= 64, causal or windowed: the long tiles differ from the middle class's only by the
# held P V wait (SM90_HOLD_PV_WAIT), which costs 1.4-3 % at 2k-4k rows and is even from 8k
# (NOTES.md step 56), so the long class starts there
SM90_LONG_MIN_SEQLEN_D64_WINDOW = 8192
SM90_SHORT_MAX_MEAN_SEQLEN = 512  # mean query rows per sequence up to which they are used
# Chunked prefill (a packed batch whose sequences have at least twice as many keys as query
# rows: a prompt's chunk after its cached prefix) from 128 query rows a sequence, head dims
# above 64: the middle class. Measured on an H100, causal, 32/8 heads, fp16, 8-32
# sequences (bench/probe_chunk_tiles.py, TFLOP/s, 64-row tiles -> 128-row): d = 128 128 x
# 2k 480 -> 545, 256 x 1k 453 -> 502, 256 x 4k 517 -> 587, 512 x 4k 523 -> 597; but 64 x 4k
# 487 -> 380. d = 64 keeps the short tiles (within +-3 % either way, 64 x 4k 382 -> 258).
SM90_CHUNK_MIN_MEAN_SEQLEN = 128
SM90_SHORT_DENSE_MAX_SEQLEN = 1024  # padded batches: query rows up to which (d <= 64)


def sm90_rows(packed, total_q, batch, head_dim, mask, keys_per_sequence=0):
    """The sm90 tile class of a batch, by its mean query rows a sequence: "short" for
    packed batches of at most SM90_SHORT_MAX_MEAN_SEQLEN (but chunked prefill from
    SM90_CHUNK_MIN_MEAN_SEQLEN at head dims above 64: keys_per_sequence, the mean keys a
    sequence of a packed batch, or a paged one's capacity, at least twice the query rows),
    and padded ones at head dims up to 64 with at most SM90_SHORT_DENSE_MAX_SEQLEN (step
    24 of NOTES: +2-5 % there, -15 % at d = 128); "long" from SM90_LONG_MIN_SEQLEN[mask]
    up (d <= 64 causal: SM90_LONG_MIN_SEQLEN_D64_WINDOW); else "mid". (A class without
    tiles for the head dim and mask takes the next longer's: fwd_variant.)
    CUFA_SM90_BLOCK_M (64, 128 or 192) overrides, for any batch."""
    forced = _compile._overrides[_compile.SM90_ROWS_ENV]
    if forced:
        if forced not in _compile.SM90_ROW_CLASSES:
            raise ValueError(f"{_compile.SM90_ROWS_ENV} must be one of "
                             f"{', '.join(_compile.SM90_ROW_CLASSES)}; "
                             f"got {forced!r}")
        return _compile.SM90_ROW_CLASSES[forced]
    if packed and total_q <= SM90_SHORT_MAX_MEAN_SEQLEN * batch:
        chunks = (head_dim > 64 and total_q >= SM90_CHUNK_MIN_MEAN_SEQLEN * batch
                  and keys_per_sequence * batch >= 2 * total_q)
        if not chunks:
            return "short"
    if not packed and head_dim <= 64 and total_q <= SM90_SHORT_DENSE_MAX_SEQLEN:
        return "short"
    per_sequence = total_q if not packed else total_q / batch
    long_from = (SM90_LONG_MIN_SEQLEN_D64_WINDOW if head_dim <= 64 and mask == "window"
                 else SM90_LONG_MIN_SEQLEN[mask])
    return "long" if per_sequence >= long_from else "mid"

# Heads of a padded batch scheduled together (_fwd_plan._sizes)
L2_BUDGET = 25 * 2**20  # bytes of K/V per scheduling group: half of an H100's L2
MIN_GROUP_HEADS = 12


def heads_per_group(heads, seqlen_k, head_dim, num_m_blocks, resident_ctas=None):
    """Heads scheduled together (padded batches; a group's tiles are its heads' query
    blocks, last first, heads inner): as many as keep their K/V within half of L2.
    resident_ctas: a persistent kernel's CTAs on the SMs at once (None: not persistent)."""
    group_heads = L2_BUDGET // ((seqlen_k if seqlen_k > 1 else 1) * head_dim * 4)
    if resident_ctas is not None:
        # and no more than the resident CTAs cover at once, so that a head's query blocks
        # run together and its K/V comes from DRAM once (short sequences: +2-8 % at 512
        # rows, bench/NOTES.md step 35), though at least MIN_GROUP_HEADS, whose K/V
        # spread the CTAs' reads over L2 (4 heads' K/V under 132 CTAs read 10 % slower)
        group_heads = min(group_heads, max(resident_ctas // num_m_blocks, MIN_GROUP_HEADS))
    return max(1, min(heads, group_heads))


# -- decode: kernel, split count, merge ----------------------------------------------------------

MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed costs outweigh what it adds


def pages_read_whole(page_shift, no_leftpad, window_left):
    """Pages of 256 whose tiles start on a page's row 0 (no leftpad, no left window) read
    one lookup a tile and take the contiguous split rule: batch-1 and 8-sequence rows
    2-4.5 % faster on an H100. Pages of 16 read 1-19 % slower on it (NOTES)."""
    return page_shift >= 8 and no_leftpad and window_left >= _checks.UNBOUNDED


def tma_units(d, units, num_splits, batch, capacity, device):
    """The (sequence, KV head) units a CTA of the TMA decode kernel takes, where it runs,
    else None. Measured
    on an H100 against the cp.async kernel (graph replays, fp16, d = 64; bench/NOTES.md):
    one unit a CTA where the one-CTA-an-SM split rule runs (1 x 128k 32/32 363 -> 346 us,
    8 x 16k 32/8 98.5 -> 95.6), two where the units outnumber the SMs up to twice and the
    batch is even (8 x 16k 32/32, 256 units: 367 -> 357 as heads h and h + H/2 of a
    sequence; 357.7 -> 350.8 as sequences z and z + B/2 of a head, whose CTAs at once read
    whole cache rows); more units read within ±2 % either way, so those keep cp.async, as
    does a CTA streaming fewer than TMA_MIN_KEYS keys (1 x 32k 32/8: 2048 a CTA, 2-3 %
    slower, where the ring's fill and drain weigh more). Hopper
    only (the copy engine), and where one CTA an SM keeps up with the memory
    (one_cta_keeps_up: the H100's rule, the only one measured); a contiguous cache whose
    strides a map can describe. CUFA_DECODE_TMA overrides the rule
    (_compile.decode_tma_forced)."""
    padded = _compile.padded_head_dim(d)
    forced = _compile.decode_tma_forced()
    if (padded not in _compile.DECODE_TMA_HEAD_DIMS or forced == 0
            or not tma_device(device, forced)):
        return None
    if not forced and capacity < TMA_MIN_KEYS * num_splits:
        return None
    sms = _runtime.sm_count(device)
    if forced:
        per_cta = forced
    elif units * num_splits <= sms:
        per_cta = 1
    elif num_splits == 1 and units <= 2 * sms and batch % 2 == 0:
        per_cta = 2
    else:
        return None
    return per_cta


TMA_MIN_KEYS = 4096  # cache positions a CTA of the TMA decode kernel streams, at least


def tma_device(device, forced=None):
    """Whether `device` runs the TMA decode kernel: Hopper's kernel family (not forced to
    the portable one) where one decode CTA an SM keeps up with the memory, or on any Hopper
    where CUFA_DECODE_TMA asks for it."""
    hopper = _compile.family_for(_runtime.compute_capability(device)) == "sm90"
    return hopper and (bool(forced) or one_cta_keeps_up(device))


def decode_kernel_and_splits(dtype, d, num_splits, units, capacity, device, paged=False):
    """The decode kernel and split count for `units` CTAs (batch x KV heads x query
    blocks). The shape with four CTAs an SM (_compile.DECODE_MORE_CTAS), unsplit, where
    num_splits is left to the planner and
    - the default shape would split the keys but this one holds every unit in one wave: at
      d = 64, 64 x 4k with 8 KV heads (512 units) took 199 -> 188 us with one token and
      209 -> 189 with four on an H100, with no combine;
    - or, on a contiguous cache (or pages of 256, which take its rules), the units take
      more than two waves of the default shape but at most two of this one (793 to 1056
      units on an H100: 128 x 2k with 8 KV heads, 1024 units, d = 128 360.8 -> 354.8 us,
      d = 64 188.8 -> 185.5, graph replays).
    With more waves it measured 0.5-3 % slower (256 x 1k 8 KV heads d = 128 360.1 ->
    362.4, 64 x 4k 32 KV heads 1392 -> 1411), so it is not the default."""
    kernel = _compile.decode_kernel(dtype, d)
    splits = split_count(num_splits, units, capacity, kernel, device, paged)
    wider = _compile.decode_kernel_with_more_ctas(dtype, d) if num_splits == 0 else None
    if splits > 1:
        if wider is not None and split_count(0, units, capacity, wider, device, paged) == 1:
            return wider, 1
        return kernel, splits
    if wider is None:
        return kernel, splits
    two_waves = 2 * _runtime.sm_count(device)  # (times the CTAs an SM holds)
    smem = _runtime.smem_per_sm(device)
    if (not paged and two_waves * kernel.ctas_per_sm_on(smem) < units
            <= two_waves * wider.ctas_per_sm_on(smem)):
        return wider, 1
    return kernel, splits


def split_count(num_splits, units, capacity, kernel, device, paged):
    """num_splits as given (capped), or for 0 chosen from the shapes (choose_num_splits)."""
    if num_splits == 0:
        num_splits = choose_num_splits(units, capacity, _runtime.sm_count(device),
                                       kernel.ctas_per_sm_on(_runtime.smem_per_sm(device)),
                                       one_per_sm=not paged and one_cta_keeps_up(device))
    return min(num_splits, _compile.MAX_SPLITS)


# One decode CTA an SM (choose_num_splits' one_per_sm) keeps an SM's share of the memory
# bandwidth busy only up to a point: on an H100 SXM (3.35 TB/s peak, 25 GB/s an SM) it
# read the batch-1 and 8-sequence caches 2-8 % faster than two or three CTAs an SM; on an
# H200 (4.8 TB/s, 36 GB/s an SM) 20-35 % slower (1 x 128k, 32 KV heads, d = 64: 368 us
# against 257 with the slot-fill split, bench/NOTES.md). The line sits between the two.
ONE_CTA_MAX_BYTES_PER_SM = 30e9
_keeps_up = {}


def one_cta_keeps_up(device):
    """Whether the device's peak memory bandwidth an SM is low enough for one decode CTA
    an SM to stream it (from its memory clock and bus width; unknown: yes)."""
    keeps = _keeps_up.get(device)
    if keeps is None:
        keeps = _keeps_up[device] = (_runtime.peak_bytes_per_s(device) or 0) / _runtime.sm_count(
            device) <= ONE_CTA_MAX_BYTES_PER_SM
    return keeps


@functools.lru_cache(maxsize=1024)  # a loop over up to 128 counts; a new signature asks
def choose_num_splits(units, max_keys, sm_count, ctas_per_sm, one_per_sm=True):
    """Splits of the keys for `units` CTAs (batch x KV heads x query blocks), from shapes
    only. Measured on an H100 with CUDA-graph replays, 5 interleaved rounds.

    A contiguous cache (one_per_sm, on a device whose bandwidth an SM one CTA keeps up
    with: _one_cta_keeps_up) with at most one unit an SM: one CTA an SM, the
    largest power of two with units x splits <= sm_count, where that covers at least 90 %
    of the SMs. 128 CTAs read faster than 256 at every batch-1 and 8-sequence row: 1 x
    128k, 8 KV heads, d = 64: 16 splits 97.4 us against 32 splits 102.2; 8 x 16k: 2 splits
    96.1 against 4 101.8; 1 x 128k, 32 KV heads: 4 splits 351.5 against 8 376.7; d = 128
    1 x 128k: 182.0 against 185.0. More units that still fit the CTA slots: unsplit (8 x
    16k, 32 KV heads, d = 64: 359.5 us against 374.8 in 3 splits over 1.9 waves; paged
    too: pages of 16 398 -> 376 us, of 256 385 -> 370).

    Otherwise, and for paged caches with at most one unit an SM (one CTA an SM read pages
    5-20 % slower, with the page ids loaded a step ahead too: 1 x 128k, 8 KV heads, d = 64,
    pages of 16 108 -> 117 us, of 256 104 -> 123; since tiles inside one page read as
    contiguous ones, pages of 256 take the rule above, _plan_kvcache): a last wave that
    fills few of the SMs' CTA slots costs nearly as long as a full one (512 CTAs on 396
    slots took 84 % of the copy bandwidth). Split while the CTAs make under two waves,
    into the fewest splits whose waves fill at least 90 % of the slots they take (else the
    best filling), each split with at least MIN_KEYS_PER_SPLIT keys of the cache's
    capacity; where those CTAs make one wave, the largest power of two not above that
    count (powers of two read faster than their neighbours: 1 x 128k, 32 KV heads, 8
    splits 380.7 us, 9 splits 434.0). Over several waves the fill decides."""
    slots = sm_count * ctas_per_sm
    if units == 0 or units >= 2 * slots:
        return 1
    most = max(1, min(max_keys // MIN_KEYS_PER_SPLIT, _compile.MAX_SPLITS))
    if one_per_sm and units <= sm_count:
        per_sm = 1 << (min(sm_count // units, most).bit_length() - 1)
        if 10 * units * per_sm >= 9 * sm_count:
            return per_sm
    if sm_count < units <= slots:
        return 1
    best, best_fill = 1, 0.0
    for splits in range(1, most + 1):
        waves = units * splits / slots
        fill = waves / math.ceil(waves)
        if fill >= 0.9:
            best = splits
            break
        if fill > best_fill + 1e-9:
            best, best_fill = splits, fill
    return 1 << (best.bit_length() - 1) if units * best <= slots else best


def merge_in_launch(kernel, d, num_splits, unit_rows):
    """Whether an eager call may merge its splits in the decode launch (the last split of
    each unit to finish): only where the decode CTA's threads cover the unit's merge in
    one pass, decode_combine's threads a row for each of its rows (at most DECODE_ROWS).
    Each pass more is about a memory latency more, in one CTA a unit while the others are
    done: 4 passes measured 2-5 us slower a call than the combine kernel, and 16 passes
    (1 x 128k, 4 tokens, 32/8) 10-25 %, where the launch saved is worth less (NOTES)."""
    rows = min(unit_rows, _compile.DECODE_ROWS)  # (0: no query rows, no decode launch)
    return (num_splits > 1 and rows > 0
            and rows * combine_row_threads(d, num_splits) <= kernel.threads)


def combine_row_threads(head_dim, num_splits):
    """decode_combine's threads a row for `num_splits` splits of rows of head_dim columns
    (DecodeParams.combine_row_threads): a warp while its lanes can have every split's read
    of a row in flight at once (4 reads a lane, and a lane a split's lse), else the CTA.
    The merge in the decode launch sums in the same order, so both give the same bits."""
    lanes_a_split = -(-head_dim // 8)  # a lane takes 8 columns of a split's row
    return 32 if num_splits <= min(32, 4 * (32 // lanes_a_split)) else _compile.COMBINE_THREADS


def combine_kernel(dtype, head_dim, num_splits):
    """decode_combine for `num_splits` splits of rows of head_dim columns."""
    return _compile.DecodeKernel("combine", dtype,
                                 rows=_compile.COMBINE_THREADS // combine_row_threads(head_dim, num_splits))
