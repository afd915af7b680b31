"""cufa: exact FlashAttention for any Python GPU framework.

CUDA kernels compiled at run time with NVRTC (through CuPy); inputs and outputs are
the caller's own arrays (PyTorch, CuPy, JAX, any ``__dlpack__`` object), zero-copy.
"""
from ._compile import all_variants
from ._torch_ops import register_if_torch_loaded as _register_torch_ops
from .api import flash_attn_func, flash_attn_varlen_func, scaled_dot_product_attention
from .kvcache import flash_attn_with_kvcache, merge_attention_states
from .padding import pad_input, unpad_input

_register_torch_ops()  # only if torch is already imported: torch.compile can trace cufa calls

__version__ = "0.1.0"

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "scaled_dot_product_attention",
           "flash_attn_with_kvcache", "merge_attention_states", "unpad_input", "pad_input",
           "all_variants", "__version__"]
