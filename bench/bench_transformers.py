"""A transformers model on cufa against the same model on sdpa: prefill and decode tokens/s.

One random-weight Llama-style model (default: 16 layers, hidden 2048, 16 query / 4 KV
heads of 128, MLP 5632, bf16), switched between attention implementations with
set_attn_implementation, so every row runs the same weights:

- prefill: one forward over batch x context tokens (no cache, logits of the last token
  only, as generate() asks); and a left-padded batch, lengths spread over context/2 ..
  context (cufa: varlen on the real tokens; sdpa: a 4-D mask);
- decode: steps of one token a sequence on a cache prefilled to the context, dynamic
  (transformers' DynamicCache, which grows by a copy each step in both) and static, eager.

Each implementation's step time is the median of interleaved rounds (the order shuffled
each round); "none" is the model with attention replaced by a zero output, so the columns
attn share (1 - none / implementation) say how much of a step is attention at all.
    python3 bench/bench_transformers.py [--layers 16] [--batch 8] [--context 4096]
        [--steps 32] [--rounds 3] [--json FILE]
"""
import argparse
import json
import random
import statistics
import sys
import time

import _timing

IMPLS = ("sdpa", "cufa", "none")


def build(torch, args):
    import transformers
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.mlp,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        max_position_embeddings=2 * args.context + args.steps)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="sdpa", dtype=torch.bfloat16)
    return model.eval()


def register_none(torch):
    """'none': the attention output replaced by zeros (the step without attention)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    def attention(module, query, key, value, attention_mask, **kwargs):
        b, h, q, d = query.shape
        return query.new_zeros(b, q, h, d), None
    AttentionInterface.register("none", attention)
    AttentionMaskInterface.register("none", lambda *a, **k: None)


def timed_steps(torch, step, reps):
    """Median wall time (ms) of reps calls of step(), a sync after each (the host's work
    counts, as for a server waiting on each step)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def prefill_rows(torch, model, args):
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(3, 32000, (args.batch, args.context), device="cuda", generator=g)
    lens = torch.linspace(args.context // 2, args.context, args.batch).long()
    mask = (torch.arange(args.context)[None] >= (args.context - lens)[:, None]).long().cuda()
    rows = {}
    for name, kwargs, tokens in (("prefill", {}, args.batch * args.context),
                                 ("prefill, left-padded", dict(attention_mask=mask),
                                  int(lens.sum()))):
        def step(kwargs=kwargs):
            model(input_ids=ids, use_cache=False, logits_to_keep=1, **kwargs)
        rows[name] = (step, tokens, None)
    return rows


def decode_rows(torch, model, args):
    import transformers
    g = torch.Generator(device="cuda").manual_seed(2)
    prompt = torch.randint(3, 32000, (args.batch, args.context), device="cuda", generator=g)
    token = prompt[:, -1:]

    def setup(kind):
        if kind == "static":
            cache = transformers.StaticCache(config=model.config,
                                             max_cache_len=args.context + args.steps + 8)
        else:
            cache = transformers.DynamicCache(config=model.config)
        model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return cache

    rows = {}
    for kind in ("dynamic", "static"):
        state = {}

        def prepare(kind=kind, state=state):
            state["cache"] = setup(kind)

        def step(state=state):
            model(input_ids=token, past_key_values=state["cache"], use_cache=True)
        rows[f"decode, {kind} cache"] = (step, args.batch, prepare)
    return rows


def run(torch, model, rows, args):
    """row -> impl -> median ms a step, the impls interleaved over rounds."""
    results = {row: {impl: [] for impl in IMPLS} for row in rows}
    order = random.Random(0)
    total = len(rows) * args.rounds * len(IMPLS)
    done = 0
    for row, (step, _, prepare) in rows.items():
        for _ in range(args.rounds):
            impls = list(IMPLS)
            order.shuffle(impls)
            for impl in impls:
                model.set_attn_implementation(impl)
                if prepare is not None:
                    prepare()   # (a cache prefilled to the context, untimed)
                reps = args.steps if prepare is not None else args.prefill_reps
                step()  # warm: plans, compiles, allocator
                results[row][impl].append(timed_steps(torch, step, reps))
                done += 1
                _timing.progress(done, total, row)
    return {row: {impl: statistics.median(v) for impl, v in d.items()}
            for row, d in results.items()}


def table(results, rows, args, device):
    lines = [f"# transformers on cufa and on sdpa ({device})", "",
             f"Llama-style, {args.layers} layers, hidden {args.hidden}, {args.heads}/"
             f"{args.kv_heads} heads of {args.hidden // args.heads}, bf16; batch "
             f"{args.batch}, context {args.context}; median of {args.rounds} interleaved "
             "rounds.", "",
             "| step | sdpa ms | cufa ms | none ms | sdpa tok/s | cufa tok/s | cufa / sdpa "
             "| attn share sdpa | attn share cufa |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row, t in results.items():
        tokens = rows[row][1]
        share = {i: max(0.0, 1 - t["none"] / t[i]) for i in ("sdpa", "cufa")}
        lines.append(
            f"| {row} | {t['sdpa']:.2f} | {t['cufa']:.2f} | {t['none']:.2f} | "
            f"{tokens / t['sdpa'] * 1e3:,.0f} | {tokens / t['cufa'] * 1e3:,.0f} | "
            f"{t['sdpa'] / t['cufa']:.2f} | {share['sdpa']:.0%} | {share['cufa']:.0%} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--mlp", type=int, default=5632)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--prefill-reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args(argv)
    torch = _timing.require_torch_cuda("bench_transformers.py")
    import cufa.integrations.transformers as cufa_transformers
    cufa_transformers.register()
    register_none(torch)
    model = build(torch, args)
    rows = {**prefill_rows(torch, model, args), **decode_rows(torch, model, args)}
    with torch.inference_mode():
        results = run(torch, model, rows, args)
    device = torch.cuda.get_device_name()
    print(table(results, rows, args, device))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "args": vars(args), "ms": results}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
