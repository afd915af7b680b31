"""Other libraries' interfaces on cufa's kernels, for a one-line switch:
``import cufa.compat.flash_attn as flash_attn`` in place of ``import flash_attn``.
Nothing here is imported by ``import cufa``."""
