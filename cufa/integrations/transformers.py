"""cufa as an attention backend of Hugging Face transformers: ``attn_implementation="cufa"``.

    import cufa.integrations.transformers as cufa_transformers
    cufa_transformers.register()            # once, before the model is built
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="cufa",
                                                 dtype=torch.bfloat16, device_map="cuda")
    model.set_attn_implementation("cufa")   # or switch a model already loaded

register() adds "cufa" to transformers' attention registry (``AttentionInterface``) and
its mask registry (``AttentionMaskInterface``). Nothing else needs to be installed.

**The mask, once a forward.** transformers builds each kind of mask (full layers, sliding
layers) once a forward through the mask registry. cufa's entry reads what transformers
describes there — the mask function (causal or not, a sliding window, packed sequences),
the 2-D padding mask, the cache's offsets — and turns it into a ``KeyPlan``: the window in
cufa's convention, how many key columns hold tokens, and where padding sits (one run of
real keys a sequence as its first and last key; other padding as the rows to gather). The
layers then call the kernels with no host work beyond picking one:

- no padding: ``flash_attn_func``; a decode step (at most ``DECODE_QUERIES`` new tokens)
  ``flash_attn_with_kvcache`` over transformers' cache tensors, read in place;
- left padding (what ``generate`` uses): decode steps as above with ``cache_leftpad``, no
  copy; prefill through ``flash_attn_varlen_func`` on the gathered tokens;
- any other padding: ``flash_attn_varlen_func`` on the gathered tokens (gathered a layer,
  as flash-attn's transformers path does; the output is scattered back, zeros at padding),
  except a gap inside a sequence under a sliding window (a window counts columns);
- cross-attention (keys that are not the queries' own, as an encoder's): every key, an
  encoder mask's real keys read in place on decode steps where they are one run;
- packed sequences (``position_ids`` that restart, no padding; transformers detects them
  when the model runs without a KV cache, as for its sdpa backend), and flash-attn's
  ``cu_seq_lens_q/k`` keyword arguments: ``flash_attn_varlen_func`` on the rows as they are;
- a mask function cufa does not recognize (an image-token overlay, chunked attention, a
  custom ``and_mask_function``), a 4-D mask passed by the caller (boolean or additive
  float), or a padding mask inside ``torch.compile(model)``: the mask is made as for
  transformers' sdpa backend (batch, 1, q, kv) and read tile by tile by
  ``cufa.scaled_dot_product_attention``.

Each layer's own arguments go to the kernels: ``scaling``, ``softcap`` (Gemma 2),
``s_aux`` as ``learnable_sink`` (gpt-oss), GQA/MQA heads, any head dim cufa takes (1-256).
What cufa does not do raises ``NotImplementedError`` and names the fallback, ``sdpa``:
dropout in training mode, a backward pass (cufa has none yet: run under ``torch.no_grad()``
or ``torch.inference_mode()``), ``softcap`` together with a 4-D mask.
"""
import dataclasses
import os

try:
    import torch
    from transformers import AttentionInterface
    from transformers import masking_utils
except ImportError as e:  # say what is missing, not where the first name failed
    raise ImportError("cufa.integrations.transformers needs PyTorch and Hugging Face "
                      "transformers: pip install torch transformers") from e

import cufa as _kernels  # (the public functions; tests may put the float64 reference here)

NAME = "cufa"
# A call with at most this many new query tokens is a decode step: the KV-cache kernels
# read transformers' cache in place and split its keys over the SMs; more tokens are a
# prefill for the forward kernels.
DECODE_QUERIES = 16
FALLBACK = 'attn_implementation="sdpa"'


def register(name=NAME):
    """Add ``name`` to transformers' attention and mask registries (idempotent)."""
    AttentionInterface.register(name, attention)
    masking_utils.AttentionMaskInterface.register(name, mask)
    return name


# -- the mask: once a forward --------------------------------------------------------------

@dataclasses.dataclass(eq=False)
class KeyPlan:
    """What the layers of one mask kind need, from transformers' mask description.

    window: (left, right) in cufa's convention (-1: unbounded; causal is right = 0), keys
    j of query i (both as absolute positions) with i - left <= j <= i + right. num_keys:
    the key columns that hold tokens (a static cache's tensors are longer); the queries
    are the last q_length of them (for self-attention). padding: None, "run" (each
    sequence's keys are one run of columns, leftpad .. key_lens - 1: left padding, or any
    one run for keys that are not the queries' own) or "gather" (the real rows).
    packed: (cu_seqlens, max_seqlen) of packed sequences in the flattened rows.
    """
    window: tuple
    num_keys: int
    q_length: int
    batch: int
    columns: int                # the 2-D padding mask's: kv_offset + num_keys
    padding: str = None
    key_lens: object = None     # int32 (batch,): each sequence's key end (decode steps)
    leftpad: object = None      # int32 (batch,)
    gather: object = None       # _Gathered
    packed: tuple = None
    elsewhere: dict = dataclasses.field(default_factory=dict)  # device -> copy there

    @property
    def causal(self):
        return self.window[1] == 0

    def on(self, device):
        """This plan with its tensors on `device`. A model split over GPUs (device_map)
        makes the mask once a forward, on the first layer's device; each other device's
        layers get a copy, made once (a few small index tensors)."""
        if device.type == "cuda" and device.index is None:  # ("cuda": the current one)
            device = torch.device("cuda", torch.cuda.current_device())
        tensors = [x for x in (self.key_lens, self.leftpad, self.gather and self.gather.cu_q,
                               self.packed and self.packed[0]) if x is not None]
        if all(x.device == device for x in tensors):
            return self
        moved = self.elsewhere.get(device)
        if moved is None:
            def to(x):
                if isinstance(x, torch.Tensor):
                    return x.to(device)
                return type(x)(map(to, x)) if isinstance(x, tuple) else x
            gather = self.gather and dataclasses.replace(
                self.gather, **{f.name: to(getattr(self.gather, f.name))
                                for f in dataclasses.fields(self.gather)})
            moved = self.elsewhere[device] = dataclasses.replace(
                self, key_lens=to(self.key_lens), leftpad=to(self.leftpad), gather=gather,
                packed=to(self.packed), elsewhere={})
        return moved

    # generate() with a static cache makes the masks before the forward and hands them to
    # the model as its attention_mask, which the model's mask functions then read as a
    # 2-D padding mask: the plan passes that reading as itself (mask() returns it).
    ndim = 2

    @property
    def shape(self):
        return (self.batch, self.columns)

    def to(self, *args, **kwargs):
        """(accelerate's hooks move a layer's inputs with .to(device))"""
        device = kwargs.get("device", args[0] if args else None)
        if isinstance(device, torch.Tensor):  # (x.to(other): other's device)
            device = device.device
        if device is None or isinstance(device, torch.dtype):
            return self
        return self.on(torch.device(device))


@dataclasses.dataclass(eq=False)
class _Gathered:
    """Padding gathered away: the (batch, position) of each real query and key row, and
    the packed batch's cu_seqlens and longest sequences."""
    q_rows: tuple
    k_rows: tuple
    cu_q: object
    cu_k: object
    max_q: int
    max_k: int


def _closure(fn):
    """The free variables a mask function closed over, by name."""
    return dict(zip(fn.__code__.co_freevars,
                    (c.cell_contents for c in (fn.__closure__ or ()))))


def _intersect(a, b):
    """Two windows (left, right; -1 unbounded) -> the window of keys both keep."""
    return tuple(y if x < 0 else x if y < 0 else min(x, y) for x, y in zip(a, b))


def describe(mask_function):
    """transformers' mask function -> (window, packed_sequence_mask or None), or None for a
    function cufa does not recognize. Recognized: the causal and bidirectional functions,
    the sliding-window overlays (causal: j > i - w; bidirectional: |i - j| <= w), packed
    sequences (with the positions remapped to each sequence's own, as transformers 5.2x
    does: the same pattern, since a packed sequence's positions step by one), and and_masks
    of them."""
    found = _describe(mask_function)
    if found is None or found[2] and found[1] is None:  # (positions remapped, not packed)
        return None
    return found[:2]


def _describe(fn):
    """-> (window, packed_sequence_mask or None, whether positions are remapped) or None."""
    if fn is masking_utils.causal_mask_function:
        return (-1, 0), None, False
    if fn is masking_utils.bidirectional_mask_function:
        return (-1, -1), None, False
    name = getattr(fn, "__qualname__", "")
    free = _closure(fn) if hasattr(fn, "__code__") else {}
    if name.startswith("sliding_window_overlay."):
        return (free["sliding_window"] - 1, -1), None, False
    if name.startswith("sliding_window_bidirectional_overlay."):
        return (free["sliding_window"], free["sliding_window"]), None, False
    if name.startswith("packed_sequence_mask_function."):
        return (-1, -1), free["packed_sequence_mask"], False
    if name.startswith("remap_positions_for_packed_sequence.") and "mask_function" in free:
        inner = _describe(free["mask_function"])
        return None if inner is None else (inner[0], inner[1], True)
    if name.startswith("and_masks.") and "mask_functions" in free:
        window, packed, remapped = (-1, -1), None, False
        for part in free["mask_functions"]:
            found = _describe(part)
            if found is None or found[1] is not None and packed is not None:
                return None
            window = _intersect(window, found[0])
            packed = packed if found[1] is None else found[1]
            remapped = remapped or found[2]
        return window, packed, remapped
    return None


def mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
         mask_function=masking_utils.causal_mask_function, attention_mask=None, **kwargs):
    """transformers' mask registry entry for cufa -> KeyPlan, or a 4-D boolean mask where
    the pattern is one cufa's arguments cannot state (then read by cufa's SDPA)."""
    if isinstance(attention_mask, KeyPlan):  # (made before this forward: see KeyPlan.ndim)
        if attention_mask.q_length != q_length:
            raise ValueError(f"the attention mask was made for {attention_mask.q_length} "
                             f"queries; this forward has {q_length}")
        return attention_mask
    found = describe(mask_function)
    plan = None
    # Inside torch.compile a padding mask would need its values read (a sync, and shapes
    # from data): only a batch without one gets a plan there.
    if found is not None and (attention_mask is None or not _compiling()):
        plan = _key_plan(found, batch_size, q_length, kv_length, q_offset, kv_offset,
                         attention_mask, kwargs.get("device", "cpu"))
    if plan is not None:
        return plan
    return masking_utils.sdpa_mask(
        batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
        kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
        allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
        use_vmap=kwargs.get("use_vmap", False), device=kwargs.get("device", "cpu"))


def _compiling():
    return torch.compiler.is_compiling()


def _key_plan(found, batch, q_length, kv_length, q_offset, kv_offset, attention_mask, device):
    """The KeyPlan of a recognized pattern; None where the offsets or the padding mask do
    not line up with the keys as this module reads them (the 4-D mask then)."""
    window, packed = found
    if isinstance(q_offset, torch.Tensor) and _compiling():
        return None  # (a static cache's offset is a tensor: its value is data there)
    q_offset = int(q_offset)
    cross = window == (-1, -1) and q_offset == 0 and kv_offset == 0 and kv_length != q_length
    if cross:
        # Keys that are not the queries' own (cross-attention to an encoder, a prefix):
        # with no window, which key a query sits beside does not matter; all keys count.
        num_keys = kv_length
    else:
        # The queries are the last q_length of the keys that hold tokens: key column c is
        # position kv_offset + c, query row t position q_offset + t (a static cache's key
        # tensors run on past the last query: those columns are empty).
        num_keys = q_offset + q_length - kv_offset
        if not q_length <= num_keys <= kv_length:
            return None
    plan = KeyPlan(window=window, num_keys=num_keys, q_length=q_length, batch=batch,
                   columns=kv_offset + num_keys)
    if q_length <= DECODE_QUERIES:  # (a tensor: a compiled decode step reads no length)
        device = attention_mask.device if attention_mask is not None else device
        plan.key_lens = torch.full((batch,), num_keys, dtype=torch.int32, device=device)
    if packed is not None:
        if attention_mask is not None or num_keys != q_length:
            return None
        plan.packed = _packed_rows(packed)
        return plan
    if attention_mask is None:
        return plan
    if attention_mask.ndim != 2 or attention_mask.shape[1] != kv_offset + num_keys:
        return None
    keys = attention_mask[:, kv_offset:].to(torch.bool)
    lens = keys.sum(1, dtype=torch.int32)
    columns = torch.arange(num_keys, device=keys.device)
    first = torch.where(lens > 0, keys.to(torch.int8).argmax(1).to(torch.int32), 0)
    run = (columns >= first[:, None]) & (columns < (first + lens)[:, None])
    ends_last = ((first + lens == num_keys) | (lens == 0)).all()  # (with one run: left padding)
    # (one sync a forward)
    every, one_run, ends_last = torch.stack([keys.all(), (keys == run).all(),
                                             ends_last]).tolist()
    left = one_run and ends_last
    if every:
        return plan
    if not one_run and window != (-1, -1) and window != (-1, 0):
        # A window over gathered tokens would count real tokens, where transformers' masks
        # count columns: a gap inside a sequence changes which keys it keeps.
        return None
    if left or cross and one_run:  # (cross: no window, so any one run is as good)
        plan.padding = "run"
        plan.leftpad = first
        if plan.key_lens is not None:
            plan.key_lens = first + lens
    else:
        plan.padding = "gather"
    if plan.padding == "gather" or q_length > DECODE_QUERIES:
        plan.gather = _gathered(keys, lens, q_length, cross)
    return plan


def _gathered(keys, key_lens, q_length, cross):
    """cross: the queries are not among the keys (every query row is real)."""
    queries = (torch.ones(keys.shape[0], q_length, dtype=torch.bool, device=keys.device)
               if cross else keys[:, keys.shape[1] - q_length:])
    query_lens = queries.sum(1, dtype=torch.int32)
    cu_q = torch.nn.functional.pad(query_lens.cumsum(0, dtype=torch.int32), (1, 0))
    cu_k = torch.nn.functional.pad(key_lens.cumsum(0, dtype=torch.int32), (1, 0))
    max_q, max_k = torch.stack([query_lens.max(), key_lens.max()]).tolist()
    return _Gathered(q_rows=queries.nonzero(as_tuple=True), k_rows=keys.nonzero(as_tuple=True),
                     cu_q=cu_q, cu_k=cu_k, max_q=max_q, max_k=max_k)


def _packed_rows(sequence_ids):
    """(batch, seqlen) ids of packed sequences, 0, 0, 1, 1, 1, 2, ... a row -> cu_seqlens
    and the longest sequence over the batch's rows flattened."""
    per_row = sequence_ids[:, -1] + 1
    first = torch.nn.functional.pad(per_row.cumsum(0), (1, 0))[:-1]
    ids = (sequence_ids + first[:, None]).flatten()
    lens = torch.bincount(ids, minlength=int(per_row.sum())).to(torch.int32)
    cu = torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
    return cu, int(lens.max())


# -- the attention: every layer ----------------------------------------------------------

def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
              sliding_window=None, softcap=None, is_causal=None, s_aux=None, **kwargs):
    """transformers' attention registry entry for cufa. query (batch, heads, q, head_dim),
    key and value (batch, heads_k, kv, head_dim); -> ((batch, q, heads, head_dim), None)."""
    _refuse_unsupported(module, query, key, value, dropout, kwargs)
    target = _kernel_dtype(query, module)
    if any(x.dtype != target for x in (query, key, value)):  # (PEFT keeps norms in float32)
        query, key, value = (x.to(target) for x in (query, key, value))
    head_dim, v_head_dim = query.shape[-1], value.shape[-1]
    if v_head_dim != head_dim:  # (e.g. MLA: cufa takes one head dim, as flash-attn does)
        if v_head_dim > head_dim:
            raise NotImplementedError(f"value head dim {v_head_dim} > query head dim "
                                      f"{head_dim}: use {FALLBACK}")
        value = torch.nn.functional.pad(value, (0, head_dim - v_head_dim))
    options = dict(softmax_scale=scaling, softcap=softcap or 0.0, learnable_sink=s_aux)
    if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim != 2:
        if head_dim > 256:
            raise NotImplementedError(f"head dim {head_dim} over 256 with a 4-D attention "
                                      f"mask: cufa's SDPA-layout kernels stop at 256; use "
                                      f"{FALLBACK}")
        out = _masked(query, key, value, attention_mask, options)
    else:  # (a 2-D mask: a layer called with the padding mask itself, as flash-attn takes it)
        plan = attention_mask if isinstance(attention_mask, KeyPlan) else _plan_from_arguments(
            module, query, key, sliding_window, is_causal, attention_mask)
        plan = plan.on(query.device)
        out = _run(plan, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                   options, kwargs)
    if v_head_dim != head_dim:
        out = out[..., :v_head_dim]
    return out, None


def _refuse_unsupported(module, query, key, value, dropout, kwargs):
    if dropout and module.training:
        raise NotImplementedError(f"cufa has no attention dropout (dropout={dropout} in "
                                  f"training mode): use {FALLBACK}, or model.eval()")
    if kwargs.get("output_attentions"):
        raise NotImplementedError("cufa never forms the attention weights "
                                  '(output_attentions=True): use attn_implementation="eager"')
    for name, what in (("position_bias", "a relative position bias (T5-style)"),
                       ("sinks", "per-token sink logits")):
        if kwargs.get(name) is not None:  # (eager adds it to the scores: never drop it)
            raise NotImplementedError(f"this model passes {what} as `{name}`, which cufa's "
                                      f'kernels do not add to the scores: use {FALLBACK} or '
                                      'attn_implementation="eager"')
    if max(query.shape[-1], value.shape[-1]) > 256 and torch.is_grad_enabled() and any(
            x.requires_grad for x in (query, key, value)):  # (a training step's first call)
        raise NotImplementedError(f"head dim {query.shape[-1]} over 256 while autograd "
                                  f"records: cufa's backward stops at 256; use {FALLBACK}")


def _kernel_dtype(query, module):
    if query.dtype in (torch.float16, torch.bfloat16):
        return query.dtype
    if torch.is_autocast_enabled(query.device.type):
        return torch.get_autocast_dtype(query.device.type)
    for layer in module.modules():
        weight = getattr(layer, "weight", None)
        if isinstance(layer, torch.nn.Linear) and weight.dtype in (torch.float16,
                                                                   torch.bfloat16):
            return weight.dtype
    dtype = getattr(getattr(module, "config", None), "dtype", None)  # (quantized weights)
    if dtype in (torch.float16, torch.bfloat16):
        return dtype
    raise TypeError(f"cufa computes in float16 or bfloat16; this model's attention runs in "
                    f"{query.dtype}: load it with dtype=torch.bfloat16 (or float16), or use "
                    f"{FALLBACK}")


def _plan_from_arguments(module, query, key, sliding_window, is_causal, padding=None):
    """A call that bypassed the mask registry (no mask, or a 2-D padding mask of its own):
    the layer's own arguments say the pattern, the keys end with the queries."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    window = (-1, 0 if causal else -1)
    if sliding_window:  # (transformers' overlays: causal j > i - w, else |i - j| <= w)
        window = _intersect(window, (sliding_window - 1, -1) if causal else
                            (sliding_window, sliding_window))
    batch, q_length, kv_length = query.shape[0], query.shape[2], key.shape[2]
    plan = _key_plan((window, None), batch, q_length, kv_length, kv_length - q_length, 0,
                     padding, query.device)
    if plan is None:
        raise ValueError(f"the attention mask has shape {tuple(padding.shape)}; a 2-D mask "
                         f"must be (batch, keys) = ({batch}, {kv_length})")
    return plan


def _run(plan, q, k, v, options, kwargs):
    """q (batch, q, heads, d), k and v (batch, kv, heads_k, d), views of transformers'
    tensors -> out (batch, q, heads, d)."""
    batch, q_length = q.shape[:2]
    # (a compiled decode step reads no length of the plan: each would be a recompile)
    if not _compiling() and (q_length != plan.q_length or k.shape[1] < plan.num_keys):
        raise ValueError(f"the mask was made for {plan.q_length} queries and {plan.num_keys} "
                         f"keys; this layer has {q_length} queries and {k.shape[1]} keys")
    causal, window = plan.causal, (plan.window[0], -1 if plan.causal else plan.window[1])
    common = dict(causal=causal, window_size=window, **options)
    trained = dict(common, deterministic=_deterministic(kwargs))  # (the backward's choice)
    # (a padding mask wins over cu_seq_lens, as in transformers' flash-attention path)
    flattened = (_cu_seq_lens(kwargs, q.device) if plan.packed is None and plan.padding is None
                 else None)
    if plan.packed is not None or flattened is not None:
        if plan.packed is not None:
            (cu_q, max_q), (cu_k, max_k) = plan.packed, plan.packed
        else:
            cu_q, cu_k, max_q, max_k = flattened
            if k.shape[1] != q_length:
                raise ValueError(f"cu_seq_lens_q/k describe packed rows of the queries, but "
                                 f"this layer has {k.shape[1]} keys for {q_length} queries "
                                 "(a cache that holds earlier tokens): run packed rows "
                                 "without a cache (use_cache=False)")
        rows = batch * q_length
        out = _kernels.flash_attn_varlen_func(
            q.reshape(rows, *q.shape[2:]), k.reshape(rows, *k.shape[2:]),
            v.reshape(rows, *v.shape[2:]), cu_q, cu_k, max_q, max_k, **trained)
        return out.view(q.shape)
    if plan.padding == "gather" or plan.padding == "run" and q_length > DECODE_QUERIES:
        g = plan.gather
        out = _kernels.flash_attn_varlen_func(q[g.q_rows], k[g.k_rows], v[g.k_rows], g.cu_q,
                                              g.cu_k, g.max_q, g.max_k, **trained)
        full = out.new_zeros(q.shape)
        full[g.q_rows] = out
        return full
    if q_length <= DECODE_QUERIES:
        if not (torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))):
            return _kernels.flash_attn_with_kvcache(q, k, v, cache_seqlens=plan.key_lens,
                                                    cache_leftpad=plan.leftpad, **common)
        # (training: the KV-cache kernel has no backward; flash_attn_func has, where no
        # sequence is padded)
        if plan.padding is not None:
            raise NotImplementedError(
                f"training on padded sequences of at most {DECODE_QUERIES} tokens: cufa's "
                f"backward does not take this route; use {FALLBACK}")
    n = plan.num_keys
    return _kernels.flash_attn_func(q, k[:, :n], v[:, :n], **trained)


def _deterministic(kwargs):
    """Whether the backward must give the same bits every run, as transformers asks its
    flash-attention kernels: the layer's `deterministic` keyword, else
    FLASH_ATTENTION_DETERMINISTIC=1 (SDPA's route, a 4-D mask, is deterministic: it never
    fuses dq)."""
    flag = kwargs.get("deterministic")
    if flag is None:
        flag = os.environ.get("FLASH_ATTENTION_DETERMINISTIC", "0") == "1"
    return bool(flag)


def _cu_seq_lens(kwargs, device):
    """flash-attn's packed-batch keyword arguments, as transformers' collators pass them
    (DataCollatorWithFlattening), or None; cu_seqlens on the layer's `device`."""
    names = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    found = [kwargs.get(n) for n in names]
    if any(x is None for x in found):
        return None
    cu_q, cu_k, max_q, max_k = found
    return (cu_q.to(device, torch.int32), cu_k.to(device, torch.int32), int(max_q), int(max_k))


def _masked(query, key, value, attention_mask, options):
    """A 4-D mask (batch or 1, heads or 1, q, kv), boolean or additive: cufa's SDPA."""
    if attention_mask.ndim != 4:
        raise ValueError(f"the attention mask has shape {tuple(attention_mask.shape)}; cufa "
                         "takes a 2-D padding mask (batch, keys) or a 4-D mask (batch, heads, "
                         "queries, keys)")
    if options["softcap"]:
        raise NotImplementedError(f"softcap with a 4-D attention mask: cufa's SDPA has no "
                                  f"softcap; use {FALLBACK} or eager")
    kv = attention_mask.shape[-1]
    if key.shape[2] < kv:
        raise ValueError(f"the attention mask covers {kv} keys but the layer has "
                         f"{key.shape[2]}")
    out = _kernels.scaled_dot_product_attention(
        query, key[:, :, :kv], value[:, :, :kv], attn_mask=attention_mask,
        scale=options["softmax_scale"], enable_gqa=query.shape[1] != key.shape[1],
        learnable_sink=options["learnable_sink"])
    return out.transpose(1, 2)


__all__ = ["register", "attention", "mask", "describe", "KeyPlan", "NAME", "DECODE_QUERIES"]
