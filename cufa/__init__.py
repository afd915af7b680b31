"""cufa: exact FlashAttention for any Python GPU framework.

CUDA kernels compiled at run time with NVRTC (through CuPy); inputs and outputs are
the caller's own arrays (PyTorch, CuPy, JAX, any ``__dlpack__`` object), zero-copy.
"""
from . import _interop, _torch_ops, reference
from ._compile import all_variants
from .api import (flash_attn_backward, flash_attn_func, flash_attn_varlen_backward,
                  flash_attn_varlen_func, flash_attn_with_kvcache, merge_attention_states,
                  scaled_dot_product_attention)
from .padding import pad_input, unpad_input

# torch.compile can trace cufa calls once the ops are registered: now if torch is imported,
# else at the first torch tensor cufa sees
_interop.on_torch_tensor = _torch_ops.register_if_torch_loaded
_torch_ops.register_if_torch_loaded()

__version__ = "0.1.0"

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "scaled_dot_product_attention",
           "flash_attn_with_kvcache", "merge_attention_states", "flash_attn_backward",
           "flash_attn_varlen_backward", "unpad_input", "pad_input",
           "all_variants", "reference", "__version__"]
