"""flash-attn 2 on cufa's kernels. A one-line switch::

    import cufa.compat.flash_attn as flash_attn     # in place of: import flash_attn
    from cufa.compat.flash_attn import flash_attn_func, flash_attn_with_kvcache

The seven public functions take flash-attn 2's arguments, defaults and return shapes;
``flash_attn_interface``, ``bert_padding`` and ``layers.rotary`` mirror flash-attn's
modules of those names (see flash_attn_interface for what differs by design). Needs
PyTorch, as flash-attn does; ``import cufa`` alone does not import it.
"""
try:
    import torch  # noqa: F401
except ImportError as e:  # say what is missing, not where the first torch name failed
    raise ImportError(
        "cufa.compat.flash_attn needs PyTorch, as flash-attn does (`import cufa` alone does "
        "not): pip install torch (for CPU-only machines, the CPU build: pip install torch "
        "--index-url https://download.pytorch.org/whl/cpu)") from e

from . import bert_padding, flash_attn_interface, layers  # noqa: E402,F401 (flash-attn's modules)
from .flash_attn_interface import (  # noqa: E402
    flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)

__version__ = "2.8.4"  # the flash-attn release whose interface this follows

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]
