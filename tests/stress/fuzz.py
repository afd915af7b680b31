"""Randomized differential test against the float64 reference, for a chosen time.

    python3 tests/stress/fuzz.py --minutes 9 --seed 1 --out fuzz.md   # run, write a summary
    python3 tests/stress/fuzz.py --seed 1 --case 1234                 # replay one case
    python3 tests/stress/fuzz.py --seed 1 --dry-run 5000              # draw only (no GPU)

Each case draws from its own generator, seeded by (seed, case index), so any failure is
reproducible from the two numbers it prints. Kinds: padded batches (flash_attn_func),
packed batches (flash_attn_varlen_func, with empty sequences, seqused_k, and paged keys
through block_table), SDPA with masks, KV-cache calls (contiguous and paged caches,
appends, rotary, leftpad, cache_batch_idx, splits: tests/test_gpu_kvcache.py's random
cases, with leftpad on paged caches too) and merges of attention states (strided parts,
parts without keys, out= aliasing a part). fp16 and bf16, any head dim 1..256 (half of
the cases a multiple of 8), lengths 0..600 (odd ones on purpose), GQA, every mask kind and
score mod, windows with -1 on either side (right sides past the keys too), learnable
sinks in each dtype, strided layouts and unaligned ones (strides no multiple of 8, a start
2 bytes off 16: the element-wise I/O kernels). out=, where a call takes it, is filled
with NaN before the call; keys a call must not read hold NaN. Outputs are checked with
the GPU tests' pass rule (tests/_attention_check.py), merges against the float64 formula.

--dry-run draws the cases and counts them by kind without launching anything, so the
drawing can be checked on a machine without a GPU. The summary (--out) names the tree
(CUFA_TREE from the environment, else `git describe`), the device, the seed, the minutes,
the cases by kind and each failure with the command that replays it. (The GPU machine's
copy of a checkout can carry an older .git than its files: there, give CUFA_TREE the
commit as this side names it, written into the command.)
"""
import argparse
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
ROOT = os.path.dirname(TESTS)
sys.path[:0] = [ROOT, TESTS]

import torch  # noqa: E402

import cufa  # noqa: E402
from cufa import reference  # noqa: E402
from _attention_check import (  # noqa: E402
    DTYPES, check_attention, check_merge, cu_seqlens, i32, make_sink, randn)
import test_gpu_kvcache  # noqa: E402

NAN = float("nan")
LENGTHS = (0, 1, 2, 7, 31, 64, 65, 127, 128, 129, 191, 257, 600)
PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
KINDS = {"dense": 0.2, "varlen": 0.25, "sdpa": 0.15, "kvcache": 0.3, "merge": 0.1}
# Every count the summary shows, zeros included: a kind that is never drawn shows as 0.
TAGS = (
    "dense", "varlen", "sdpa", "kvcache", "merge",
    "kvcache contiguous", "kvcache paged", "kvcache append", "kvcache rotary",
    "kvcache leftpad", "kvcache leftpad, paged", "kvcache num_splits > 1",
    "kvcache cache_batch_idx",
    "varlen seqused_k", "varlen block_table", "varlen block_table + seqused_k",
    "varlen block_table, k and v interleaved in one cache",
    "dense out=", "varlen out=", "kvcache out=", "merge out=", "merge out= is a part",
    "merge strided", "causal", "window", "window (-1, right)", "window (left, -1)",
    "softcap", "alibi", "learnable_sink", "head dim not a multiple of 8", "unaligned layout",
    "learnable_sink + rotary", "learnable_sink + leftpad", "learnable_sink + cache_batch_idx",
    "learnable_sink + seqused_k", "learnable_sink + head dim not a multiple of 8",
)
SINK_DTYPES = ("float32", "float16", "bfloat16")
REPLAY = "python3 tests/stress/fuzz.py --seed {seed} --case {case}"


def pick(rng, options):
    return options[int(rng.integers(len(options)))]


# -- drawing a case (numbers only, no arrays) -------------------------------------------------

def draw_masks(rng):
    m = {}
    if rng.random() < 0.5:
        m["causal"] = True
    w = int(rng.integers(0, 4))
    if w:  # w = 1: (left, -1); 2: (-1, right), right often past every key; 3: both drawn
        right = int(rng.integers(-1, 40)) if rng.random() < 0.5 else int(rng.integers(0, 700))
        m["window_size"] = (int(rng.integers(-1, 80)) if w != 2 else -1,
                            right if w != 1 else -1)
    if rng.random() < 0.3:
        m["softcap"] = pick(rng, (1.0, 5.0, 50.0))
    if rng.random() < 0.3:
        m["alibi"] = pick(rng, ("heads", "batch"))
    if rng.random() < 0.3:
        m["softmax_scale"] = float(rng.uniform(0.01, 1.0))
    if rng.random() < 0.3:
        m["sink"] = pick(rng, SINK_DTYPES)
    return m


def draw_head_dim(rng):
    """Half the cases a multiple of 8 (the 16-byte kernels), half any head dim 1..256."""
    return 8 * int(rng.integers(1, 33)) if rng.random() < 0.5 else int(rng.integers(1, 257))


def draw(rng):
    """One case's parameters: a dict with its kind."""
    kind = str(rng.choice(list(KINDS), p=list(KINDS.values())))
    if kind == "kvcache":
        spec = test_gpu_kvcache.random_spec(rng)
        if spec["page_size"] and rng.random() < 0.3:  # (random_spec pads contiguous caches only)
            spec["leftpad"] = [int(rng.integers(0, n + 1)) for n in spec["lens"]]
        return dict(kind=kind, spec=spec)
    if kind == "merge":
        packed = bool(rng.random() < 0.5)
        return dict(kind=kind, dtype=pick(rng, ("float16", "bfloat16", "float32")),
                    packed=packed, batch=1 if packed else int(rng.integers(1, 4)),
                    rows=pick(rng, LENGTHS), heads=int(rng.integers(1, 9)),
                    d=int(rng.integers(1, 257)),
                    layout=pick(rng, ("contiguous", "transposed", "padded")),
                    out=pick(rng, (None, "new", "out_a", "out_b")))
    h_k = pick(rng, (1, 2, 4))
    s = dict(kind=kind, dtype=pick(rng, list(DTYPES)), d=draw_head_dim(rng),
             heads=(h_k * pick(rng, (1, 2, 3)), h_k))
    if kind == "dense":
        s.update(batch=int(rng.integers(1, 4)), sq=pick(rng, LENGTHS[1:]),
                 sk=pick(rng, LENGTHS[1:]),
                 layout=pick(rng, ("bshd", "bhsd", "padded", "odd", "shifted")),
                 masks=draw_masks(rng), out=bool(rng.random() < 0.5),
                 lse=bool(rng.random() < 0.7))
    elif kind == "varlen":
        b = int(rng.integers(1, 9))
        lens_k = [pick(rng, LENGTHS) for _ in range(b)]
        s.update(lens_q=[pick(rng, LENGTHS) for _ in range(b)], lens_k=lens_k,
                 masks=draw_masks(rng), out=bool(rng.random() < 0.5),
                 lse=bool(rng.random() < 0.7), layout=pick(rng, ("bshd", "odd")))
        if rng.random() < 0.3:
            s["seqused_k"] = [int(rng.integers(0, n + 1)) for n in lens_k]
        if rng.random() < 0.3:
            s.update(page_size=pick(rng, PAGE_SIZES), kv_interleaved=bool(rng.random() < 0.3))
    else:
        mask = None
        b, sq, sk = int(rng.integers(1, 3)), pick(rng, LENGTHS[1:]), pick(rng, LENGTHS[1:])
        if rng.random() < 0.7:
            shape = [b, s["heads"][0], sq, sk]
            for axis in range(3):
                if rng.random() < 0.5:
                    shape[axis] = 1
            mask = dict(shape=shape, additive=bool(rng.random() < 0.5))
        s.update(batch=b, sq=sq, sk=sk, mask=mask, causal=bool(rng.random() < 0.5))
        if rng.random() < 0.3:
            s["sink"] = pick(rng, SINK_DTYPES)
    return s


# the sink beside what else a call takes: the tags that say so
SINK_WITH = {"kvcache rotary": "rotary", "kvcache leftpad": "leftpad",
             "kvcache cache_batch_idx": "cache_batch_idx", "varlen seqused_k": "seqused_k",
             "head dim not a multiple of 8": "head dim not a multiple of 8"}


def tags(s):
    """The counts (TAGS) a case adds to."""
    t = kind_tags(s)
    if "learnable_sink" in t:
        t += [f"learnable_sink + {SINK_WITH[name]}" for name in t if name in SINK_WITH]
    return t


def kind_tags(s):
    kind = s["kind"]
    t = [kind]
    if kind == "kvcache":
        k = s["spec"]
        t += ["kvcache paged" if k["page_size"] else "kvcache contiguous", "kvcache out="]
        t += [name for name, on in (
            ("kvcache append", k["new"]), ("kvcache rotary", k.get("rotary")),
            ("kvcache leftpad", k.get("leftpad")),
            ("kvcache leftpad, paged", k.get("leftpad") and k["page_size"]),
            ("kvcache num_splits > 1", k["num_splits"] > 1),
            ("kvcache cache_batch_idx", k.get("batch_idx")),
            ("causal", k["causal"]), ("softcap", "softcap" in k), ("alibi", "alibi" in k),
            ("learnable_sink", k.get("sink")), ("head dim not a multiple of 8", k["d"] % 8))
              if on]
        return t + window_tags(k.get("window_size"))
    if kind == "merge":
        return t + [name for name, on in (
            ("merge out=", s["out"]), ("merge out= is a part", s["out"] in ("out_a", "out_b")),
            ("merge strided", s["layout"] != "contiguous")) if on]
    if kind == "varlen":
        t += [name for name, on in (
            ("varlen seqused_k", "seqused_k" in s), ("varlen block_table", "page_size" in s),
            ("varlen block_table + seqused_k", "page_size" in s and "seqused_k" in s),
            ("varlen block_table, k and v interleaved in one cache", s.get("kv_interleaved")))
              if on]
    if s.get("out"):
        t.append(f"{kind} out=")
    m = s.get("masks", {})
    t += [name for name, on in (
        ("causal", m.get("causal") or s.get("causal")), ("softcap", "softcap" in m),
        ("alibi", "alibi" in m), ("learnable_sink", m.get("sink") or s.get("sink")),
        ("head dim not a multiple of 8", s["d"] % 8),
        ("unaligned layout", s.get("layout") in ("odd", "shifted"))) if on]
    return t + window_tags(m.get("window_size"))


def window_tags(window):
    if window is None:
        return []
    left, right = window
    return ["window"] + (["window (-1, right)"] if left < 0 <= right else []) + (
        ["window (left, -1)"] if right < 0 <= left else [])


# -- running a case ---------------------------------------------------------------------------

def mask_kwargs(masks, rng, h, batch):
    """The call's keyword arguments from draw_masks' (alibi slopes and the sink made here)."""
    kw = {n: v for n, v in masks.items() if n not in ("alibi", "sink")}
    if "alibi" in masks:
        shape = (h,) if masks["alibi"] == "heads" else (batch, h)
        kw["alibi_slopes"] = torch.from_numpy(rng.uniform(0, 2, shape).astype(np.float32)).cuda()
    if "sink" in masks:
        kw["learnable_sink"] = make_sink(rng, h, masks["sink"])
    return kw


def poisoned_like(x):
    return torch.full_like(x, NAN)


def run_dense(s, rng, label):
    (h, hk), d, dtype, b = s["heads"], s["d"], s["dtype"], s["batch"]
    q = randn(rng, (b, s["sq"], h, d), dtype, layout=s["layout"])
    k, v = (randn(rng, (b, s["sk"], hk, d), dtype, layout=s["layout"]) for _ in range(2))
    kw = mask_kwargs(s["masks"], rng, h, b)
    out = poisoned_like(q) if s["out"] else None
    res = cufa.flash_attn_func(q, k, v, return_lse=s["lse"], out=out, **kw)
    res, lse = res if s["lse"] else (res, None)
    assert out is None or res is out, f"{label}: out= was not returned"
    check_attention(res, lse, q, k, v, label=label, **kw)


def run_varlen(s, rng, label):
    """Sequence i attends to its first keys[i] keys (seqused_k, else its cu_seqlens_k
    length): rows of k and v past them, in the packed rows or in its pages, hold NaN."""
    (h, hk), d, dtype = s["heads"], s["d"], s["dtype"]
    lens_q, lens_k = s["lens_q"], s["lens_k"]
    b = len(lens_q)
    keys = s.get("seqused_k", lens_k)
    layout = s.get("layout", "bshd")
    q = randn(rng, (1, sum(lens_q), h, d), dtype, layout=layout)[0]
    extra = {}
    page = s.get("page_size")
    if page:
        capacity = page * max(1, -(-max(lens_k) // page))
        k_seq, v_seq = (randn(rng, (b, capacity, hk, d), dtype) for _ in range(2))
        for x in (k_seq, v_seq):
            for i, n in enumerate(keys):
                x[i, n:] = NAN
        table, num_pages = reference.paged_layout(b, capacity, page, rng)
        k_arg, v_arg = (reference.to_paged(x, table, num_pages, fill=NAN) for x in (k_seq, v_seq))
        if s["kv_interleaved"]:  # one (pages, 2, page, heads, d) cache: FlashInfer's layout
            kv = torch.stack([k_arg, v_arg], dim=1)
            k_arg, v_arg = kv[:, 0], kv[:, 1]
        extra["block_table"] = i32(table)

        def seq_keys(i):
            return k_seq[i:i + 1, :keys[i]], v_seq[i:i + 1, :keys[i]]
    else:
        k_arg, v_arg = (randn(rng, (1, sum(lens_k), hk, d), dtype, layout=layout)[0]
                        for _ in range(2))
        ck = np.concatenate([[0], np.cumsum(lens_k)])
        for x in (k_arg, v_arg):
            for i, n in enumerate(keys):
                x[ck[i] + n:ck[i + 1]] = NAN

        def seq_keys(i):
            return k_arg[ck[i]:ck[i] + keys[i]][None], v_arg[ck[i]:ck[i] + keys[i]][None]
    if "seqused_k" in s:
        extra["seqused_k"] = i32(keys)
    kw = mask_kwargs(s["masks"], rng, h, b)
    out = poisoned_like(q) if s["out"] else None
    res = cufa.flash_attn_varlen_func(q, k_arg, v_arg, cu_seqlens(lens_q), cu_seqlens(lens_k),
                                      max(lens_q), max(lens_k), return_lse=s["lse"], out=out,
                                      **kw, **extra)
    res, lse = res if s["lse"] else (res, None)
    assert out is None or res is out, f"{label}: out= was not returned"
    cq = np.concatenate([[0], np.cumsum(lens_q)])
    for i in range(b):
        if lens_q[i] == 0:
            continue
        kw_i = dict(kw)
        if "alibi_slopes" in kw and kw["alibi_slopes"].ndim == 2:
            kw_i["alibi_slopes"] = kw["alibi_slopes"][i]
        rows = slice(cq[i], cq[i + 1])
        check_attention(res[rows][None], None if lse is None else lse[:, rows][None],
                        q[rows][None], *seq_keys(i), label=f"{label}: seq {i}", **kw_i)


def run_sdpa(s, rng, label):
    (h, hk), d, dtype, b, sq, sk = s["heads"], s["d"], s["dtype"], s["batch"], s["sq"], s["sk"]
    q = randn(rng, (b, sq, h, d), dtype).transpose(1, 2)
    k, v = (randn(rng, (b, sk, hk, d), dtype).transpose(1, 2) for _ in range(2))
    mask = None
    if s["mask"]:
        mask = torch.from_numpy(rng.random(s["mask"]["shape"]) > 0.2).cuda()
        if s["mask"]["additive"]:
            mask = torch.where(mask, 0.0, -5.0).to(torch.float32)
    sink = {"learnable_sink": make_sink(rng, h, s["sink"])} if s.get("sink") else {}
    out = cufa.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=s["causal"],
                                            enable_gqa=True, **sink)
    tr = (lambda x: x.transpose(1, 2))
    check_attention(tr(out), None, tr(q), tr(k), tr(v), attn_mask=mask, causal=s["causal"],
                    diag_offset=0, label=label, **sink)


def run_kvcache(s, rng, label):
    test_gpu_kvcache.run_case(rng, label, **s["spec"])


def run_merge(s, rng, label):
    """Two parts with random lse; about a tenth of the rows each: part a without keys,
    part b without keys, neither, part a marked +inf (flash-attn 2's no-key mark), and
    lse 60 apart. A part's rows without keys hold NaN: they must not be read."""
    dtype = getattr(torch, s["dtype"])
    b, rows, h, d = s["batch"], s["rows"], s["heads"], s["d"]
    out_shape = (rows, h, d) if s["packed"] else (b, rows, h, d)
    lse_shape = (h, rows) if s["packed"] else (b, h, rows)

    def part():
        x = torch.from_numpy(rng.standard_normal(out_shape, dtype=np.float32)).to("cuda", dtype)
        lse = torch.from_numpy(rng.standard_normal(lse_shape, dtype=np.float32) * 3).cuda()
        if s["layout"] == "transposed":  # heads and features swapped in memory; lse reversed
            x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
            lse = lse.permute(*reversed(range(lse.ndim))).contiguous().permute(
                *reversed(range(lse.ndim)))
        elif s["layout"] == "padded":  # rows 3 elements longer than d
            x = torch.nn.functional.pad(x, (0, 3))[..., :d]
        return x, lse

    (o_a, lse_a), (o_b, lse_b) = part(), part()
    kind = torch.from_numpy(rng.choice(6, lse_shape, p=[0.5, 0.1, 0.1, 0.1, 0.1, 0.1])).cuda()
    lse_a[kind == 1] = -np.inf
    lse_b[kind == 2] = -np.inf
    lse_a[kind == 3] = lse_b[kind == 3] = -np.inf
    lse_a[kind == 4] = np.inf
    lse_a[kind == 5], lse_b[kind == 5] = 30.0, -30.0
    as_out = (lambda m: m.T) if s["packed"] else (lambda m: m.transpose(1, 2))
    o_a[as_out((kind == 1) | (kind == 3) | (kind == 4))] = NAN
    o_b[as_out((kind == 2) | (kind == 3))] = NAN
    parts = (o_a, lse_a, o_b, lse_b)
    before = tuple(x.clone() for x in parts)
    out = {None: None, "new": None, "out_a": o_a, "out_b": o_b}[s["out"]]
    if s["out"] == "new":
        out = poisoned_like(o_a)
    res, lse = cufa.merge_attention_states(*parts, out=out)
    assert out is None or res is out, f"{label}: out= was not returned"
    check_merge(res, lse, before, label=label)


RUN = dict(dense=run_dense, varlen=run_varlen, sdpa=run_sdpa, kvcache=run_kvcache,
           merge=run_merge)


def case(seed, index):
    """(case's generator, its parameters), the generator left where the arrays start."""
    rng = np.random.default_rng([seed, index])
    return rng, draw(rng)


def run_case(seed, index):
    rng, s = case(seed, index)
    RUN[s["kind"]](s, rng, f"{s['kind']} case {index}")
    return s


# -- the run and its summary ------------------------------------------------------------------

def tree_name():
    if os.environ.get("CUFA_TREE"):
        return os.environ["CUFA_TREE"]
    try:
        return subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git here; pass CUFA_TREE)"


def summary(args, device, minutes, counts, failed, failures, cases):
    lines = [
        "# cufa fuzz run", "",
        f"- command: `{' '.join(['python3', 'tests/stress/fuzz.py'] + sys.argv[1:])}`",
        f"- tree: {tree_name()}",
        f"- device: {device}",
        f"- seed: {args.seed}; minutes: {minutes:.2f} ran"
        + (f" of {args.minutes:g} asked" if args.dry_run is None else ""),
        f"- cases: {cases}, failed: {len(failures)}", "",
        "A case counts under every row that applies (a paged append with rotary adds to four).",
        "", "| cases of kind | ran | failed |", "| --- | ---: | ---: |"]
    lines += [f"| {t} | {counts[t]} | {failed[t]} |" for t in TAGS]
    if failures:
        lines += ["", "## Failures", ""]
        for index, message, s in failures:
            lines += [f"- case {index}: {message}", f"  - parameters: `{s}`",
                      f"  - replay: `{REPLAY.format(seed=args.seed, case=index)}`"]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--case", type=int, help="replay this one case")
    parser.add_argument("--dry-run", type=int, metavar="N",
                        help="draw N cases and count them by kind; launch nothing")
    parser.add_argument("--out", help="write the summary (markdown) here too")
    parser.add_argument("--max-failures", type=int, default=20,
                        help="stop after this many failed cases")
    args = parser.parse_args()
    if args.case is not None:
        s = run_case(args.seed, args.case)
        print(f"case {args.case} passed: {s}")
        return 0
    device = ("none (dry run: cases drawn, nothing launched)" if args.dry_run is not None
              else torch.cuda.get_device_name())
    counts, failed = dict.fromkeys(TAGS, 0), dict.fromkeys(TAGS, 0)
    failures = []
    start = time.monotonic()
    deadline = start + 60 * args.minutes
    index = 0
    while (index < args.dry_run if args.dry_run is not None
           else time.monotonic() < deadline and len(failures) < args.max_failures):
        rng, s = case(args.seed, index)
        for t in tags(s):
            counts[t] += 1
        if args.dry_run is None:
            try:
                RUN[s["kind"]](s, rng, f"{s['kind']} case {index}")
            # keep going: one run should show every kind of failure (an error from cufa
            # on a legal case too)
            except Exception as e:  # noqa: BLE001
                message = str(e) if isinstance(e, AssertionError) else f"{type(e).__name__}: {e}"
                message = " ".join(message.split())[:600]
                failures.append((index, message, s))
                for t in tags(s):
                    failed[t] += 1
                print(f"FAILED seed={args.seed} case={index}: {message}", flush=True)
                print("replay:", REPLAY.format(seed=args.seed, case=index), flush=True)
        index += 1
    text = summary(args, device, (time.monotonic() - start) / 60, counts, failed, failures,
                   index)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
