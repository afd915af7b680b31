"""flash-attn 2's ``layers``: ``rotary`` (apply_rotary_emb and its qkv / kv forms,
RotaryEmbedding)."""
from . import rotary  # noqa: F401 (flash_attn.layers.rotary, as an attribute too)
