"""Every tuning rule: which tile class, kernel variant and split count a call takes, and
how its work is grouped. Each rule is stated with one worked example; the examples use an
H100 SXM (132 SMs, 228 KB of shared memory an SM, 3.35 TB/s). The measurements behind the
rules are in docs/decisions.md and docs/benchmarks.md; the variants the rules choose among
are _compile's catalog."""
import functools
import math

from . import _checks, _compile, _runtime

# -- forward (sm90): the tile class of a batch ---------------------------------------------------
# Three classes, by the mean query rows a sequence: "short" (64-row tiles, two CTAs an SM:
# half the row rounding of a 128-row tile), "mid" (128-row tiles) and "long" (192-row
# tiles, three consumer warpgroups, where the last tile's rounding is a small share of a
# long sequence). A class without tiles for a head dim and mask takes the next longer's
# (_compile.fwd_variant).

SM90_SHORT_MAX_MEAN_SEQLEN = 512    # packed batches: short up to this mean
SM90_SHORT_DENSE_MAX_SEQLEN = 1024  # padded batches at head dims up to 64: short up to this
SM90_CHUNK_MIN_MEAN_SEQLEN = 128    # chunked prefill at head dims above 64: mid from this mean
SM90_LONG_MIN_SEQLEN = {"none": 1024, "window": 2048}  # long from this mean, by mask
# Head dims up to 64 with a causal or local mask: the long tiles there are the mid class's
# with the P V wait held below the exponentials (_compile.SM90_HOLD_PV_WAIT), which pays
# only on long sequences, so the long class starts later.
SM90_LONG_MIN_SEQLEN_D64_WINDOW = 8192


def sm90_rows(packed, total_q, batch, head_dim, mask, keys_per_sequence=0):
    """The sm90 tile class of a batch of `batch` sequences and total_q query rows.

    - Packed batches with a mean of at most SM90_SHORT_MAX_MEAN_SEQLEN rows: "short";
      but chunked prefill (each sequence has at least twice as many keys as query rows,
      keys_per_sequence being the mean keys, or a paged cache's capacity) from
      SM90_CHUNK_MIN_MEAN_SEQLEN rows at head dims above 64 goes on by length, since a
      chunk's tile reads many key blocks and the wider tiles do more work a block.
    - Padded batches at head dims up to 64 with at most SM90_SHORT_DENSE_MAX_SEQLEN rows:
      "short".
    - Otherwise "long" from SM90_LONG_MIN_SEQLEN[mask] rows a sequence (head dims up to 64
      with a mask: SM90_LONG_MIN_SEQLEN_D64_WINDOW), else "mid".

    Example: a padded causal batch at d = 128 is "mid" with 1536 rows a sequence and
    "long" with 4096; 8 packed sequences of 2048 rows in all at d = 64 are "short"; the
    same at d = 128, each a chunk of 256 rows after a prefix of 4096 keys, are "mid".
    CUFA_SM90_BLOCK_M (64, 128 or 192) forces a class, for any batch.
    """
    forced = _compile._overrides[_compile.SM90_ROWS_ENV]
    if forced:
        if forced not in _compile.SM90_ROW_CLASSES:
            raise ValueError(f"{_compile.SM90_ROWS_ENV} must be one of "
                             f"{', '.join(_compile.SM90_ROW_CLASSES)}; got {forced!r}")
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


# -- forward: heads scheduled together --------------------------------------------------------

L2_BUDGET = 25 * 2**20  # bytes of K/V a scheduling group: half of an H100's L2
MIN_GROUP_HEADS = 12


def heads_per_group(heads, seqlen_k, head_dim, num_m_blocks, resident_ctas=None):
    """The heads of a padded batch scheduled together (a group's tiles are its heads' query
    blocks, last first, heads inner): as many as keep their K/V within L2_BUDGET. On a
    persistent kernel (resident_ctas: its CTAs on the SMs at once) also no more than the
    resident CTAs cover at once, so that a head's query blocks run together and its K/V
    comes from DRAM once; but at least MIN_GROUP_HEADS, whose K/V spread the CTAs' reads
    over more of L2. heads: batch x heads, the most there are.

    Example: d = 128, 512 keys, 128-row tiles (4 query blocks a head, one CTA on each of
    132 SMs): L2 holds 100 heads' K/V, the CTAs cover 132 // 4 = 33 heads: 33 a group.
    """
    group_heads = L2_BUDGET // ((seqlen_k if seqlen_k > 1 else 1) * head_dim * 4)
    if resident_ctas is not None:
        group_heads = min(group_heads, max(resident_ctas // num_m_blocks, MIN_GROUP_HEADS))
    return max(1, min(heads, group_heads))


# A causal launch's last group holds at least TAIL_BALANCE tiles a CTA: its heaviest
# tile costs twice the mean, so the group's work a CTA is then at least that tile, and
# the CTAs that draw those finish with the rest (bench/results/ab_h200_tail_group.md; on
# an H200, d = 256 causal 8k: groups of 3, 3, 3, 3, 3 and 1 heads 590 TFLOP/s, two of 8
# 634; 3 or 4 tiles a CTA no faster than 2).
TAIL_BALANCE = 2


def tail_group_head(heads, group_heads, num_m_blocks, resident_ctas=None, masked=False):
    """The first of `heads` (batch x heads) in the launch's last scheduling group, which
    holds every head from there on: the heads_per_group groups, with the last one that
    falls short of a group's heads as the tail. A persistent launch under a causal or
    local mask (masked) gets a tail group of at least TAIL_BALANCE x resident_ctas /
    num_m_blocks heads (all of them where there are fewer): its tiles cost from 1 to
    num_m_blocks key blocks, and the CTAs that draw the heaviest must not be left
    running alone at the end. Without a mask the tiles cost alike: the groups as they are.

    Example: d = 256, 2 x 8 heads of 8k causal on 128-row tiles (64 a head), groups of 3
    (L2), 132 CTAs: the tail needs 5 heads, so groups of 3, 3, 3 and 7 (tail from head 9)
    rather than 3, 3, 3, 3, 3 and 1.
    """
    tail_min = 0
    if masked and resident_ctas is not None:
        tail_min = math.ceil(TAIL_BALANCE * resident_ctas / max(num_m_blocks, 1))
    full_groups = max(heads - tail_min, 0) // group_heads
    return full_groups * group_heads


# -- backward: the order of its blocks ---------------------------------------------------------

def bwd_groups(heads, blocks, bytes_per_head, resident_ctas, masked):
    """(heads_per_group, tail_group_head) of a backward launch over `heads` (batch x heads)
    of `blocks` blocks each (dk/dv: a KV head's key blocks; dq: a head's query blocks), in
    get_tile's order. Without a mask (masked False) the blocks cost alike: one head at a
    time, whose Q and dout (dk/dv) or K and V (dq) stay in L2 while its blocks run. Under a
    causal or local mask as the forward's: groups of as many heads as keep bytes_per_head
    each within L2_BUDGET, each group's heaviest blocks first, and a tail group that ends
    the launch balanced (tail_group_head, resident_ctas the CTAs that run at once). One head
    at a time had left the SMs idle for 5-6 % of a causal launch at 1k and 4k tokens (the
    last heads' heaviest blocks running alone at the end: bench/results/bwd_block_order_h200.md).

    Example: d = 128 causal, 16 x 16 heads of 1k keys, 128-key blocks (8 a head), 132 CTAs:
    Q, dout and dq's sums take 1 MB a head, so groups of 25 heads, and the tail group needs
    33 heads (2 x 132 blocks): groups from heads 0, 25, .., 175, the tail from 200.
    """
    if not masked or heads <= 1:
        return 1, heads
    group_heads = max(1, min(heads, L2_BUDGET // max(bytes_per_head, 1)))
    return group_heads, tail_group_head(heads, group_heads, blocks, resident_ctas, masked=True)


# -- decode: one CTA an SM -----------------------------------------------------------------------

# One decode CTA an SM streams an SM's share of the memory bandwidth only up to a point:
# at most this many bytes a second an SM, the line between the H100 (where one CTA an SM
# reads fastest) and the H200 (where it reads slower than two or three).
ONE_CTA_MAX_BYTES_PER_SM = 30e9
_keeps_up = {}


def one_cta_keeps_up(device):
    """Whether the device's peak memory bandwidth an SM (from its memory clock and bus
    width; unknown: yes) is at most ONE_CTA_MAX_BYTES_PER_SM.

    Example: an H100 SXM, 3.35 TB/s over 132 SMs, 25 GB/s an SM: yes; an H200, 4.8 TB/s
    over 132 SMs, 36 GB/s an SM: no.
    """
    keeps = _keeps_up.get(device)
    if keeps is None:
        keeps = _keeps_up[device] = (_runtime.peak_bytes_per_s(device) or 0) / _runtime.sm_count(
            device) <= ONE_CTA_MAX_BYTES_PER_SM
    return keeps


# -- decode: the split count ---------------------------------------------------------------------

MIN_KEYS_PER_SPLIT = 256  # below this a split's fixed costs outweigh what it adds


@functools.lru_cache(maxsize=1024)  # a loop over up to 128 counts; a new signature asks
def choose_num_splits(units, max_keys, sm_count, ctas_per_sm, one_per_sm=True, fill_waves=True):
    """Splits of the keys for `units` CTAs (batch x KV heads x query blocks), from shapes
    only (never from device values, so a CUDA graph can replay a call with new lengths).

    - One CTA an SM (one_per_sm: a contiguous cache, or pages read whole, on a device
      where one_cta_keeps_up) with at most one unit an SM: the largest power of two with
      units x splits <= sm_count, where that covers at least 90 % of the SMs.
    - Units that fit the CTA slots (more than the SMs, at most sm_count x ctas_per_sm):
      unsplit.
    - Otherwise, while the CTAs make under two waves: the fewest splits whose waves fill
      at least 90 % of the slots they take (else the best filling), each split with at
      least MIN_KEYS_PER_SPLIT keys of max_keys (the cache's capacity), since a last wave
      that fills few slots costs nearly as long as a full one; where those CTAs make one
      wave, the largest power of two of splits that still makes one wave (the power of
      two below that count left up to half the slots empty: 15 splits of 16 units on 264
      slots became 8). From two waves up: unsplit.
    - Without fill_waves (the e4m3 decode kernels: FILL_WAVES_E4M3), never past one wave:
      from one wave up unsplit; under it the largest power of two of splits that keeps one
      wave, where that fills 90 % of the slots, else the most splits that fit in one.

    Example, 132 SMs, 3 CTAs an SM (396 slots): 1 x 128k keys with 8 KV heads (8 units)
    splits 16 ways contiguous (128 CTAs, one an SM), 32 ways paged (45 splits fill 91 %
    of the slots in one wave; the power of two below is 32); 8 x 16k with 32 KV heads (256
    units) runs unsplit.
    """
    slots = sm_count * ctas_per_sm
    if units == 0 or units >= 2 * slots or (units > slots and not fill_waves):
        return 1
    most = max(1, min(max_keys // MIN_KEYS_PER_SPLIT, _compile.MAX_SPLITS))
    if one_per_sm and units <= sm_count:
        per_sm = 1 << (min(sm_count // units, most).bit_length() - 1)
        if 10 * units * per_sm >= 9 * sm_count:
            return per_sm
    if sm_count < units <= slots:
        return 1
    if not fill_waves:  # one wave at most: a power of two of splits where that fills 90 %
        fit = min(slots // units, most)  # of the slots, else as many as fit
        power = 1 << (fit.bit_length() - 1)
        return power if 10 * units * power >= 9 * slots else fit
    best, best_fill = 1, 0.0
    for splits in range(1, most + 1):
        waves = units * splits / slots
        fill = waves / math.ceil(waves)
        if fill >= 0.9:
            best = splits
            break
        if fill > best_fill + 1e-9:
            best, best_fill = splits, fill
    if units * best > slots:
        return best
    return 1 << (min(slots // units, most).bit_length() - 1)


# Whether the e4m3 decode kernels' keys are split to fill a last wave between one and two
# waves of CTAs. They run 4 CTAs an SM, and a part wave's CTAs each take more of the
# bandwidth: on an H200 (fp16 q, one token, 528 slots) unsplit read faster than 2 or 3
# splits at 768 and 1024 CTAs (d = 64 head pairs 64.5 against 71.7 and 73.9 us at 192 x 1k
# with 32/8 heads, 78.7 against 91.1 and 92.8 at 256 x 1k; d = 128 144.9 against 156.4
# and 157.4 at 128 x 2k), or as fast (d = 128, 96 x 2k: 121.9 against 120.8 and 124.1).
FILL_WAVES_E4M3 = False
# The CTAs an SM that an e4m3 decode's split count aims for under one wave (the split
# rule's ctas_per_sm for those kernels). Two read as fast as their four, or faster: on an
# H200 (fp16 q, one token, 32/8 heads, us), 1 x 128k at d = 128 76.1 in 256 CTAs against
# 80.7 in 512, 1 x 32k 30.9 against 32.2, 8 x 16k 74.6 against 77.3 (d = 64 head pairs
# 45.5 against 46.8); 1 x 128k at d = 64 48.0 either way.
E4M3_SPLIT_CTAS_PER_SM = 2


def split_count(num_splits, units, capacity, kernel, device, paged):
    """num_splits as given (capped at _compile.MAX_SPLITS), or for 0 choose_num_splits'
    count for `kernel`'s CTAs an SM on `device` (an e4m3 cache's: at most
    E4M3_SPLIT_CTAS_PER_SM of them, and FILL_WAVES_E4M3)."""
    if num_splits == 0:
        ctas = kernel.ctas_per_sm_on(_runtime.smem_per_sm(device))
        e4m3 = getattr(kernel, "fp8_cache", False)
        num_splits = choose_num_splits(
            units, capacity, _runtime.sm_count(device),
            min(ctas, E4M3_SPLIT_CTAS_PER_SM) if e4m3 else ctas,
            one_per_sm=not paged and one_cta_keeps_up(device),
            fill_waves=FILL_WAVES_E4M3 or not e4m3)
    return min(num_splits, _compile.MAX_SPLITS)


# The MLA split rule's costs, in key blocks of one CTA (_compile.MLA_KEYS keys each): the
# combine launch, and for each split of each CTA its share of it: a fixed part, and a part
# by the query rows whose partial output (2 KB a row) it writes and the combine reads. Fit
# on an H200 (bench/profile/mla_splits.py, bench/results/mla_decode_h200.md): a block took
# ~0.87 us, the combine ~3.2 us plus ~0.09 us a 64-row CTA and ~0.055 us a 16-row one;
# 128 heads 1 x 8k: 21.1 us at 32 splits against 22.6 at 66; 32 x 1k: 37.0 unsplit
# against 42.1 at 2; 16 heads 1 x 8k: 15.0 at 64 against 16.7 at 128.
MLA_COMBINE_BLOCKS = 3.7
MLA_SHARE_BLOCKS = 0.05
MLA_ROW_SHARE_BLOCKS = 0.05 / 64
# An e4m3 cache's block in 16-bit blocks (its producer widens it): one CTA read a 1k or 16k
# cache at 1.45-1.59 us a block against 0.95 (H200), so the fixed costs above weigh less:
# 128 heads 32 x 1k 51.4 us at 2 splits against 59.0 unsplit, 16 heads 1 x 1k 12.1 at 32
# against 14.2 at 16.
MLA_E4M3_BLOCK_COST = 1.6


def mla_splits(num_splits, ctas, rows, capacity, device, fp8_cache=False):
    """The MLA decode kernel's split count: num_splits as given (capped at
    _compile.MAX_SPLITS), or for 0 the count, of those that keep the CTAs within one wave
    (`ctas` a split, one an SM: its shared memory), that takes the least time by the
    blocks a CTA reads of the `capacity` keys, plus where split the combine's costs
    (MLA_COMBINE_BLOCKS, and MLA_SHARE_BLOCKS a CTA and MLA_ROW_SHARE_BLOCKS a row of
    the `rows` query rows a split; over an e4m3 cache, fp8_cache, in its blocks of
    MLA_E4M3_BLOCK_COST). Its work is the matrix units' (~240 FLOPs a cache byte
    at 128 heads), so an idle SM is lost time; but a split's partial rows (128 KB a CTA of
    64 rows) outweigh a few blocks of keys.

    Example, 132 SMs: one sequence of 128 heads (2 CTAs, 128 rows) over 8192 keys (256
    blocks): 32 splits, 8 blocks a CTA (64 splits: 4 blocks, but 128 CTAs' shares to
    merge); 128 sequences: unsplit.
    """
    if num_splits:
        return min(num_splits, _compile.MAX_SPLITS)
    blocks = max(1, -(-capacity // _compile.MLA_KEYS))
    ctas = max(ctas, 1)
    most = max(1, min(_runtime.sm_count(device) // ctas, blocks, _compile.MAX_SPLITS))
    block = MLA_E4M3_BLOCK_COST if fp8_cache else 1.0
    share = (MLA_SHARE_BLOCKS * ctas + MLA_ROW_SHARE_BLOCKS * rows) / block

    def cost(splits):
        merge = MLA_COMBINE_BLOCKS / block + share * splits if splits > 1 else 0
        return -(-blocks // splits) + merge

    return min(range(1, most + 1), key=cost)  # (the fewest splits among equals)


def pages_read_whole(page_shift, no_leftpad, window_left):
    """Whether a paged cache takes a contiguous cache's split rule: pages of 256 keys whose
    tiles start on a page's row 0 (no leftpad, no left window bound) read one page id a
    tile, as fast as a contiguous cache; smaller pages read a page id every few rows.

    Example: pages of 256 with causal masking: yes; with a window (4096, 0) or a leftpad,
    or pages of 16: no.
    """
    return page_shift >= 8 and no_leftpad and window_left >= _checks.UNBOUNDED


# -- decode: the kernel --------------------------------------------------------------------------

def head_pairs(d, nheads_k, head_strides, unit_rows, fp8_cache, aligned, device=None):
    """Whether a decode takes two KV heads a CTA (_compile.PAIRED_HEAD_DIM; the kernel's
    kHeadPairs). At d = 64 an e4m3 cache's head slice of a cache row is 64 bytes, half a
    128-byte line, and CTAs of one head each read them at 49-66 % of copy bandwidth where
    d = 128's read 72-88 % (H200). Two heads side by side (k's and v's head strides
    head_dim) make whole lines; their query rows (GQA group x new tokens, `unit_rows`) must
    fit half of the kernel's 16-row tile, and the heads pair up (an even count). Between
    one and two waves of pairs they run unsplit (FILL_WAVES_E4M3), faster than one head a
    CTA (H200, 32/8 heads, one token: 256 x 1k 78.7 against 94.4 us, 192 x 1k 64.5
    against 72.4; 32/32 heads, 64 x 4k: 276 against 383).

    Example, 132 SMs, 32/8 heads, one token, the standard (.., nheads_k, 64) layout: 64 x
    4k (256 pairs, under a wave), 256 x 1k (1024 pairs, 1.9 waves of 4 CTAs an SM) and
    1 x 128k (4 pairs, split): pairs. 8 new tokens with 32/8 heads (32 rows a head), a
    head-major cache (head stride n x 64) or 7 KV heads: one head a CTA.

    A 16-bit cache's head slice at d = 64 is a whole line, and two heads' 256 bytes a row
    read 1-3 % faster where one decode CTA an SM does not keep up with the memory
    (one_cta_keeps_up false: an H200; fp16, one token, 32/8 heads, us: 64 x 4k 125.1
    against 128.8, 128 x 2k 127.4 against 129.2, 1 x 128k 70.8 against 72.4; 32/32 heads,
    1 x 32k 68.8 against 69.8); they take pairs there (device: the call's), with the
    split rule and four-CTA shape of d = 128's kernel, unless CUFA_DECODE_TMA forces the
    TMA kernel, which takes one head a CTA. Elsewhere (an H100, whose single-unit rows the
    TMA kernel reads) one head a CTA, as measured there.
    """
    if not (aligned and d == _compile.PAIRED_HEAD_DIM and nheads_k % 2 == 0
            and all(s == d for s in head_strides)
            and 0 < unit_rows <= _compile.DECODE_ROWS // 2):
        return False
    if fp8_cache:
        return True
    return (device is not None and not one_cta_keeps_up(device)
            and not _compile.decode_tma_forced())


def decode_kernel_and_splits(dtype, d, num_splits, units, capacity, device, paged=False,
                             element_io=False, fp8_cache=False, pairs=False):
    """The decode kernel and split count for `units` CTAs (batch x KV heads x query
    blocks; pairs: head_pairs' units of two KV heads): the default shape
    (_compile.decode_kernel; element_io: its element-wise I/O variant, fp8_cache: its
    e4m3-cache variant, the one shape each has, or with pairs its kernel of head pairs) and
    split_count's count, but the shape with four CTAs an SM (_compile.DECODE_MORE_CTAS),
    unsplit, where num_splits is left to the planner and
    - the default shape would split the keys while this one holds every unit in one wave
      (no split and no merge); or
    - on a contiguous cache (or pages read whole), the units take more than two waves of
      the default shape but at most two of this one.
    Over more waves than that it reads slower, so it is not the default.

    Example, d = 64, 132 SMs (default 3 CTAs an SM, 396 slots; four-CTA shape 528): 64 x
    4k with 8 KV heads (512 units) would split 3 ways on the default shape and runs
    unsplit on the four-CTA one; 128 x 2k with 8 KV heads (1024 units: over 792, at most
    1056) runs on the four-CTA shape too; 256 x 1k (2048 units) on the default shape.
    """
    kernel = _compile.decode_kernel(dtype, d, element_io, fp8_cache,
                                    _compile.family_for(_runtime.compute_capability(device)),
                                    head_pairs=pairs)
    splits = split_count(num_splits, units * kernel.ctas_per_unit, capacity, kernel, device,
                         paged)
    wider = (_compile.decode_kernel_with_more_ctas(dtype, d, pairs)
             if num_splits == 0 and not element_io and not fp8_cache else None)
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


def decode_route(dtype, d, num_splits, units, capacity, device, head_rows, pairs, **options):
    """(kernel, split count, whether it takes head pairs) of a decode over `units` (batch
    x KV heads x query blocks) with head_rows query rows a head: decode_kernel_and_splits
    over the units' pairs where head_pairs allowed them (pairs), but a 16-bit cache's
    pairs only where they keep the in-launch merge (pairs_keep_the_merge), else one head
    a CTA. options: decode_kernel_and_splits' paged, element_io and fp8_cache."""
    if pairs:
        kernel, splits = decode_kernel_and_splits(dtype, d, num_splits, units // 2, capacity,
                                                  device, pairs=True, **options)
        if options.get("fp8_cache") or pairs_keep_the_merge(kernel, d, splits, head_rows):
            return kernel, splits, True
    return (*decode_kernel_and_splits(dtype, d, num_splits, units, capacity, device, **options),
            False)


TMA_MIN_KEYS = 4096  # cache positions a CTA of the TMA decode kernel streams, at least


def tma_device(device, forced=None):
    """Whether `device` runs the TMA decode kernel: Hopper's kernel family (not forced to
    the portable one) where one decode CTA an SM keeps up with the memory, or on any Hopper
    where CUFA_DECODE_TMA asks for it."""
    hopper = _compile.family_for(_runtime.compute_capability(device)) == "sm90"
    return hopper and (bool(forced) or one_cta_keeps_up(device))


def tma_units(d, units, num_splits, batch, capacity, device):
    """The (sequence, KV head) units a CTA of the TMA decode kernel takes, or None where
    the cp.async kernel runs. The TMA kernel runs at the head dims it has
    (_compile.DECODE_TMA_HEAD_DIMS) on a tma_device, where each CTA streams at least
    TMA_MIN_KEYS cache positions (fewer, and the ring's fill and drain weigh more):
    - one unit a CTA where the CTAs fit the SMs, one an SM (the split rule of
      choose_num_splits);
    - two units a CTA where the units, unsplit, outnumber the SMs at most twice and the
      batch is even (a CTA takes sequences z and z + batch / 2 of one head, so the CTAs
      running at once read whole cache rows).
    Elsewhere the two kernels read alike. (The planner also needs k's and v's strides to
    match, for one map.) CUFA_DECODE_TMA (_compile.decode_tma_forced) overrides: 0 never,
    1 or 2 units a CTA wherever the kernel can run.

    Example, d = 64 on an H100: 1 x 128k with 8 KV heads (8 units x 16 splits, 8192 keys a
    CTA): one unit a CTA; 8 x 16k with 32 KV heads (256 units, unsplit): two; 1 x 32k with
    8 KV heads (16 splits, 2048 keys a CTA): the cp.async kernel.
    """
    padded = _compile.padded_head_dim(d)
    forced = _compile.decode_tma_forced()
    if (padded not in _compile.DECODE_TMA_HEAD_DIMS or forced == 0
            or not tma_device(device, forced)):
        return None
    if not forced and capacity < TMA_MIN_KEYS * num_splits:
        return None
    sms = _runtime.sm_count(device)
    if forced:
        return forced
    if units * num_splits <= sms:
        return 1
    if num_splits == 1 and units <= 2 * sms and batch % 2 == 0:
        return 2
    return None


# -- decode: merging the splits ------------------------------------------------------------------

def combine_row_threads(head_dim, num_splits):
    """decode_combine's threads a row (DecodeParams.combine_row_threads): a warp while its
    lanes can have every split's read of a row in flight at once (a lane reads 8 columns
    of a split, 4 reads in flight, and holds one split's lse), else the CTA's. The merge in
    the decode launch sums in the same order, so both give the same bits.

    Example: d = 128 (16 lanes a split's row, 2 splits a warp x 4 reads): a warp a row up
    to 8 splits, the CTA's 128 threads from 9.
    """
    lanes_a_split = -(-head_dim // 8)  # a lane takes 8 columns of a split's row
    return 32 if num_splits <= min(32, 4 * (32 // lanes_a_split)) else _compile.COMBINE_THREADS


def combine_kernel(dtype, head_dim, num_splits, element_io=False, may_slice=False):
    """decode_combine for `num_splits` splits of rows of head_dim columns (element_io: the
    partials of the element-wise I/O decode kernel). A CTA a row reads
    COMBINE_EARLY splits of each of its 128 / (head_dim / 8) split groups at once; where
    that takes more than two rounds of memory latency, and the caller allows it
    (may_slice: no merge in the decode launch, whose sums run in the whole row's order),
    each CTA takes COMBINE_SLICE_COLS columns of its row, so that more of the row's reads
    are in flight at once, in more CTAs.

    Example: head_dim 512 (MLA's), 128 splits: 2 groups x 4 = 8 splits a round, 16 rounds
    in one CTA; sliced, 8 groups x 4 = 32 splits a round, 4 rounds in each of 4 CTAs.
    head_dim 128, or 16 splits of 512: whole rows.
    """
    rows = _compile.COMBINE_THREADS // combine_row_threads(head_dim, num_splits)
    groups = _compile.COMBINE_THREADS // -(-head_dim // 8)
    sliced = (may_slice and rows == 1 and head_dim > _compile.COMBINE_SLICE_COLS
              and num_splits > 2 * _compile.COMBINE_EARLY * groups)
    return _compile.CombineVariant(dtype, rows=rows, element_io=element_io,
                                   slice_cols=_compile.COMBINE_SLICE_COLS if sliced else 0)


def pairs_keep_the_merge(kernel, d, num_splits, head_rows):
    """Whether a 16-bit cache's head pairs (`kernel`, split num_splits ways) keep what one
    head a CTA would have: an eager call's merge in the decode launch (merge_in_launch).
    A pair holds twice a head's rows (head_rows), and where they take the CTA more than
    one pass the merge moves to decode_combine, a launch more, which cost more than the
    pairs gain (H200, fp16: 1 x 32k with 32/8 heads, one token, 27.1 -> 27.9 us; 32/32
    heads, four tokens, 69.3 -> 71.4). Unsplit pairs have no merge to keep.

    Example: one token, 32/8 heads (4 rows a head, 8 a pair) over 64 splits: 8 rows x a
    warp each > the pair kernel's 128 threads: one head a CTA; 32/32 heads (2 rows a
    pair): pairs."""
    return num_splits <= 1 or merge_in_launch(kernel, d, num_splits, 2 * head_rows)


def merge_in_launch(kernel, d, num_splits, unit_rows):
    """Whether an eager split call merges its splits in the decode launch (the last split
    of each unit to finish merges them; no combine launch): only where the decode CTA's
    threads cover the unit's rows (at most _compile.DECODE_ROWS) in one pass at
    combine_row_threads a row. Each pass more adds a memory latency to the one CTA a unit
    that merges while the others are done, which costs more than the launch saved.

    Example: d = 64, 16 splits, one token with 4 query heads a KV head (4 rows): 4 x 32
    threads = the decode CTA's 128, one pass: merged in the launch; d = 128, 16 splits:
    4 x 128 > 128, so decode_combine merges.
    """
    rows = min(unit_rows, _compile.DECODE_ROWS)  # (0: no query rows, no decode launch)
    return (num_splits > 1 and rows > 0
            and rows * combine_row_threads(d, num_splits) <= kernel.threads)
