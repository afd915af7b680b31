"""Shared by the transformers integration's tests (CPU: tests/test_transformers_cpu.py, with
the float64 reference standing in for the kernels; GPU: tests/test_gpu_transformers.py):
tiny random-weight configs of real model families, built here (no downloads), padded and
packed batches, and the per-position logit comparison.

The rule for logits (the issue's): the model on sdpa (eager where the family needs it) in
float32 is the reference; the same weights in 16-bit on sdpa/eager measure what one
low-precision run moves each position's logits by; cufa's model may move them at most 2x
that, plus a floor of a few roundings of the position's largest logit (a position whose
16-bit error is small by luck)."""
import copy
import types

import numpy as np
import torch

from cufa import reference

# family -> (config class name, the reference attention, extra config fields)
FAMILIES = {
    "llama": ("LlamaConfig", "sdpa", dict(num_attention_heads=4, num_key_value_heads=2)),
    "mistral": ("MistralConfig", "sdpa", dict(num_attention_heads=4, num_key_value_heads=2,
                                              sliding_window=24)),
    "qwen2": ("Qwen2Config", "sdpa", dict(num_attention_heads=7, num_key_value_heads=1,
                                          hidden_size=56 * 2)),
    "gemma2": ("Gemma2Config", "eager", dict(num_attention_heads=4, num_key_value_heads=2,
                                             head_dim=32, sliding_window=24,
                                             query_pre_attn_scalar=64,
                                             attn_logit_softcapping=2.0,
                                             final_logit_softcapping=30.0)),
    "gpt_oss": ("GptOssConfig", "eager", dict(num_attention_heads=4, num_key_value_heads=2,
                                              head_dim=32, sliding_window=24,
                                              num_local_experts=4, num_experts_per_tok=2,
                                              intermediate_size=64)),
    "gemma3": ("Gemma3TextConfig", "eager", dict(num_attention_heads=4, num_key_value_heads=1,
                                                 head_dim=32, sliding_window=24,
                                                 query_pre_attn_scalar=48)),
    # a head dim that is not a multiple of 8: cufa's element-wise kernels
    "llama_hd20": ("LlamaConfig", "sdpa", dict(num_attention_heads=4, num_key_value_heads=2,
                                               head_dim=20)),
}


def tiny_config(family, **overrides):
    import transformers
    name, _, extra = FAMILIES[family]
    fields = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  max_position_embeddings=256, tie_word_embeddings=False)
    fields.update(extra, **overrides)
    config = getattr(transformers, name)(**fields)
    if hasattr(config, "layer_types") and config.layer_types is not None:
        # both kinds of layer in two layers: sliding first, then full
        kinds = ("sliding_attention", "full_attention")
        if getattr(config, "sliding_window", None):
            config.layer_types = [kinds[i % 2] for i in range(config.num_hidden_layers)]
    return config


def reference_attention(family):
    return FAMILIES[family][1]


def build(family, attn_implementation, dtype, device, seed=0, std=0.15, **overrides):
    """The family's tiny model with seeded random weights (the same for every dtype and
    attention implementation), in eval mode; overrides: config fields."""
    import transformers
    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation, dtype=torch.float32)
    # Every weight drawn (some families start a few at 0), large enough that attention is
    # peaked (a window one key off, a missing softcap or a default scale moves the logits
    # past the bound); gpt-oss's sinks at the scale of a score, so that they matter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 1.0 if name.endswith("sinks") else std)
    return model.to(device=device, dtype=dtype).eval()


def left_padded(batch, seqlen, pads, vocab=128, seed=1, device="cpu"):
    """input_ids (batch, seqlen) and a 2-D attention mask with pads[b] leading zeros."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, seqlen), generator=g)
    mask = torch.ones(batch, seqlen, dtype=torch.long)
    for b, p in enumerate(pads):
        mask[b, :p] = 0
        ids[b, :p] = 0
    return ids.to(device), mask.to(device)


def right_padded(batch, seqlen, pads, vocab=128, seed=2, device="cpu"):
    ids, mask = left_padded(batch, seqlen, pads, vocab, seed, device)
    return ids.flip(1), mask.flip(1)


def packed(lengths, vocab=128, seed=3, device="cpu"):
    """One row of several sequences back to back: input_ids and position_ids (1, total)
    with the positions restarting at each sequence."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (1, sum(lengths)), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids.to(device), positions.to(device)


def position_errors(logits, ref):
    """max |logits - ref| at each (batch, position): float64 (batch, seqlen)."""
    return (logits.double() - ref.double()).abs().amax(-1).cpu().numpy()


def assert_logits_close(cufa_logits, lowp_logits, ref_logits, dtype, real, label,
                        roundings=4.0):
    """cufa's logits within 2x the 16-bit reference model's error of the float32 one,
    plus `roundings` roundings of the position's largest logit, at every real position
    (real: boolean (batch, seqlen); padding positions carry no meaning)."""
    eps = float(torch.finfo(dtype).eps)
    err = position_errors(cufa_logits, ref_logits)
    err_lp = position_errors(lowp_logits, ref_logits)
    scale = ref_logits.double().abs().amax(-1).cpu().numpy()
    bound = 2 * err_lp + roundings * eps * scale + 1e-6
    real = np.asarray(real.cpu() if isinstance(real, torch.Tensor) else real, dtype=bool)
    ratio = np.where(real, err / bound, 0.0)
    worst = np.unravel_index(int(ratio.argmax()), ratio.shape)
    assert ratio.max() <= 1, (
        f"{label}: logits over the bound at {int((ratio > 1).sum())} of {int(real.sum())} "
        f"positions; worst {tuple(int(i) for i in worst)}: err {err[worst]:.3e} > bound "
        f"{bound[worst]:.3e} ({ratio[worst]:.2f} x), the 16-bit model's err "
        f"{err_lp[worst]:.3e}")
    return float(ratio.max())


# -- the float64 reference as the kernels (CPU tests) -------------------------------------

def _np(x):
    return None if x is None else x.detach().double().cpu().numpy()


def _back(out, like):
    return torch.from_numpy(np.ascontiguousarray(out)).to(like.dtype).to(like.device)


def _sink(options):
    return _np(options.pop("learnable_sink", None))


ENTRY_POINTS = ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
                "scaled_dot_product_attention")


def reference_kernels(calls=None):
    """A stand-in for the cufa module with the float64 reference behind its four entry
    points, recording each call's entry point in `calls` (a list) when given."""
    def flash_attn_func(q, k, v, deterministic=False, **options):  # (the backward's)
        sink = _sink(options)
        out, _ = reference.attention(_np(q), _np(k), _np(v), learnable_sink=sink, **options)
        return _back(out, q)

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, deterministic=False,
                               **options):
        sink = _sink(options)
        out = np.zeros(q.shape)
        cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
        assert max_q == max(np.diff(cu_q), default=0), (max_q, cu_q)
        assert max_k == max(np.diff(cu_k), default=0), (max_k, cu_k)
        for b in range(len(cu_q) - 1):
            rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            o, _ = reference.attention(_np(q[rq])[None], _np(k[rk])[None], _np(v[rk])[None],
                                       learnable_sink=sink, **options)
            out[rq] = o[0]
        return _back(out, q)

    def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, cache_leftpad=None,
                                **options):
        sink = _sink(options)
        out, *_ = reference.kvcache_attention(
            _np(q), _np(k_cache), _np(v_cache), cache_seqlens=cache_seqlens.cpu().numpy(),
            cache_leftpad=None if cache_leftpad is None else cache_leftpad.cpu().numpy(),
            learnable_sink=sink, **options)
        return _back(out, q)

    def scaled_dot_product_attention(query, key, value, attn_mask=None, scale=None,
                                     enable_gqa=False, learnable_sink=None):
        mask = attn_mask.cpu().numpy() if attn_mask.dtype == torch.bool else _np(attn_mask)
        out = reference.sdpa(_np(query), _np(key), _np(value), attn_mask=mask, scale=scale,
                             learnable_sink=_np(learnable_sink))
        return _back(out, query)

    kernels = types.SimpleNamespace(
        flash_attn_func=flash_attn_func, flash_attn_varlen_func=flash_attn_varlen_func,
        flash_attn_with_kvcache=flash_attn_with_kvcache,
        scaled_dot_product_attention=scaled_dot_product_attention)
    return kernels if calls is None else recording(kernels, calls)


# -- scenarios, each run on the three models (float32 reference, 16-bit reference, cufa) ---

def _models(family, dtype, device, prepare=None, **overrides):
    """(reference in float32, reference in dtype, cufa's) models; prepare(model): applied
    to cufa's (e.g. split_layers)."""
    ref = reference_attention(family)
    model = build(family, "cufa", dtype, device, **overrides)
    return (build(family, ref, torch.float32, device, **overrides),
            build(family, ref, dtype, device, **overrides),
            prepare(model) if prepare else model)


def split_layers(device, first=1, like_accelerate=False):
    """prepare= for a model split over two GPUs, as device_map="auto" splits one: decoder
    layers from `first` on moved to `device`, with hooks that bring their inputs there and
    their outputs back. The mask, a cufa plan, is left where it was made (the layers move
    it), or with like_accelerate moved by its .to(device), as accelerate's hooks move
    anything that has one."""
    def to(x, where):
        if isinstance(x, torch.Tensor) or like_accelerate and hasattr(x, "to") and not (
                isinstance(x, torch.nn.Module)):
            return x.to(where)
        if isinstance(x, (tuple, list)):
            return type(x)(to(y, where) for y in x)
        if isinstance(x, dict):
            return {k: to(v, where) for k, v in x.items()}
        return x

    def prepare(model):
        for layer in model.model.layers[first:]:
            home = next(layer.parameters()).device
            layer.to(device)
            layer.register_forward_pre_hook(lambda m, args, kw: (to(args, device), to(kw, device)),
                                            with_kwargs=True)
            layer.register_forward_hook(lambda m, args, out, home=home: to(out, home))
        return model
    return prepare


def check_prefill(family, dtype, device, batch_kind, label="", prepare=None, **overrides):
    """One forward of a batch: 'left', 'right' (padding), 'left_short' (left padding, at
    most 16 tokens: the decode-sized route), 'holes' (padding inside a sequence), 'none'
    (no padding, no mask) or 'packed' (sequences back to back, two rows, no cache).
    Returns the worst ratio. prepare: as _models'; overrides: config fields."""
    models = _models(family, dtype, device, prepare, **overrides)
    kwargs, real = {}, None
    if batch_kind == "packed":
        rows = [packed([7, 30, 1, 19], device=device), packed([40, 17], seed=4, device=device)]
        ids, positions = (torch.cat(x) for x in zip(*rows))
        kwargs = dict(position_ids=positions, use_cache=False)
        real = torch.ones_like(ids, dtype=torch.bool)
    elif batch_kind in ("left_short", "holes"):
        short = batch_kind == "left_short"
        ids, mask = left_padded(3, 13 if short else 41, [0, 5, 9] if short else [0, 0, 0],
                                device=device)
        if not short:
            mask[0, 8:20] = 0
            mask[2, 30:31] = 0
        kwargs = dict(attention_mask=mask)
        real = mask.bool()
    elif batch_kind == "none":
        ids, _ = left_padded(2, 37, [0, 0], device=device)
        real = torch.ones_like(ids, dtype=torch.bool)
    else:
        make = left_padded if batch_kind == "left" else right_padded
        ids, mask = make(3, 41, [0, 6, 29], device=device)
        kwargs = dict(attention_mask=mask)
        real = mask.bool()
    with torch.no_grad():
        ref, lowp, got = (m(input_ids=ids, **kwargs).logits for m in models)
    return assert_logits_close(got, lowp, ref, dtype, real,
                               f"{label}{family} {batch_kind} prefill")


def check_flattened_kwargs(family, dtype, device, label=""):
    """Packed rows described by flash-attn's keyword arguments (cu_seq_lens_q/k,
    max_length_q/k, as transformers' DataCollatorWithFlattening passes them) on a model
    that keeps a cache, where transformers builds no packed mask: cufa must take the
    sequences from the arguments. Reference: the same rows on sdpa/eager without a cache
    (transformers' packed mask)."""
    ref32, lowp, model = _models(family, dtype, device)
    lengths = [7, 30, 1, 19]
    ids, positions = packed(lengths, device=device)
    cu = torch.tensor([0] + list(np.cumsum(lengths)), dtype=torch.int32, device=device)
    flat = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths),
                max_length_k=max(lengths))
    with torch.no_grad():
        ref, low = (m(input_ids=ids, position_ids=positions, use_cache=False).logits
                    for m in (ref32, lowp))
        got = model(input_ids=ids, position_ids=positions, use_cache=True, **flat).logits
    return assert_logits_close(got, low, ref, dtype, torch.ones_like(ids, dtype=torch.bool),
                               f"{label}{family} flattened rows by cu_seq_lens")


def check_chunked_prefill(family, dtype, device, label=""):
    """A left-padded prompt fed in two chunks on one dynamic cache (the second chunk's 23
    queries attend to the cache and themselves), against one forward over the whole."""
    ref32, lowp, model = _models(family, dtype, device)
    ids, mask = left_padded(3, 48, [0, 4, 13], device=device)
    with torch.no_grad():
        ref, low = (m(input_ids=ids, attention_mask=mask).logits[:, 25:] for m in (ref32, lowp))
        first = model(input_ids=ids[:, :25], attention_mask=mask[:, :25], use_cache=True)
        got = model(input_ids=ids[:, 25:], attention_mask=mask,
                    past_key_values=first.past_key_values, use_cache=True).logits
    return assert_logits_close(got, low, ref, dtype, mask[:, 25:].bool(),
                               f"{label}{family} chunked prefill")


def check_encoder_decoder(dtype, device, encoder_padding=True, label=""):
    """A tiny Bart (encoder, decoder, cross-attention): a right-padded encoder batch (or no
    encoder mask) and 9 decoder tokens; then 12 greedy tokens, each step's logits against
    the reference models' one forward with the generated decoder tokens."""
    import transformers
    config = transformers.BartConfig(
        vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=96,
        decoder_ffn_dim=96, max_position_embeddings=128, pad_token_id=0,
        decoder_start_token_id=2, forced_eos_token_id=None)
    models = []
    for impl, dt in (("sdpa", torch.float32), ("sdpa", dtype), ("cufa", dtype)):
        torch.manual_seed(0)
        m = transformers.BartForConditionalGeneration(copy.deepcopy(config))  # (one each:
        # set_attn_implementation writes the config)
        m.set_attn_implementation(impl)
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0.0, 0.15)
        models.append(m.to(device=device, dtype=dt).eval())
    ids, mask = right_padded(3, 33, [0, 7, 20], device=device)
    enc = dict(attention_mask=mask) if encoder_padding else {}
    dec = torch.randint(3, 128, (3, 9), generator=torch.Generator().manual_seed(6)).to(device)
    with torch.no_grad():
        ref, low, got = (m(input_ids=ids, decoder_input_ids=dec, **enc).logits for m in models)
        ratio = assert_logits_close(got, low, ref, dtype, torch.ones(3, 9, dtype=torch.bool),
                                    f"{label}bart forward")
        run = models[2].generate(input_ids=ids, max_new_tokens=12, do_sample=False,
                                 num_beams=1, output_logits=True,
                                 return_dict_in_generate=True, **enc)
        steps = torch.stack(run.logits, 1)
        tokens = run.sequences[:, :-1]
        ref, low = (m(input_ids=ids, decoder_input_ids=tokens, **enc).logits
                    for m in models[:2])
    return max(ratio, assert_logits_close(steps, low, ref, dtype,
                                          torch.ones(steps.shape[:2], dtype=torch.bool),
                                          f"{label}bart generation"))


def check_generation(family, dtype, device, cache="dynamic", new_tokens=32, label="",
                     compiled=False, prepare=None, **overrides):
    """Greedy generation of a left-padded batch on cufa (a prefill, then decode steps on
    the cache); each step's logits against the reference models' one forward over the
    whole generated sequence (teacher forcing, so near-tied logits cannot make the
    references follow another path). compiled: a static cache's decode steps under
    torch.compile, as generate() does by itself on a GPU (else it is told not to).
    prepare: as _models'; overrides: config fields."""
    ref32, lowp, model = _models(family, dtype, device, prepare, **overrides)
    ids, mask = left_padded(3, 30, [0, 4, 13], device=device)
    options = dict(max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                   return_dict_in_generate=True, pad_token_id=0)
    if cache == "static":
        options["cache_implementation"] = "static"
        options["disable_compile"] = not compiled
    with torch.no_grad():
        run = model.generate(input_ids=ids, attention_mask=mask, **options)
        steps = torch.stack(run.logits, 1)   # (batch, new_tokens, vocab)
        full = run.sequences
        full_mask = torch.cat([mask, torch.ones_like(full[:, ids.shape[1]:])], 1)
        window = slice(ids.shape[1] - 1, full.shape[1] - 1)
        ref = ref32(input_ids=full, attention_mask=full_mask).logits[:, window]
        low = lowp(input_ids=full, attention_mask=full_mask).logits[:, window]
    real = torch.ones(steps.shape[:2], dtype=torch.bool)
    return assert_logits_close(steps, low, ref, dtype, real,
                               f"{label}{family} {cache}-cache generation")


def wrapped(kernels, before):
    """kernels (the cufa module or a stand-in) with before(name, kwargs) called ahead of
    each entry point (it may change the keyword arguments)."""
    def wrap(name):
        fn = getattr(kernels, name)

        def call(*args, **kwargs):
            before(name, kwargs)
            return fn(*args, **kwargs)
        return call
    return types.SimpleNamespace(**{n: wrap(n) for n in ENTRY_POINTS})


def recording(kernels, calls):
    """kernels behind wrappers that note each entry point called in `calls`."""
    return wrapped(kernels, lambda name, kwargs: calls.append(name))
