"""CPU: unpad_input / pad_input on PyTorch CPU tensors (the same code runs on CUDA
tensors). Skipped where PyTorch is not installed."""
import pytest

torch = pytest.importorskip("torch")

import cufa  # noqa: E402


def test_roundtrip_with_holes_and_empty_rows():
    torch.manual_seed(0)
    hidden = torch.randn(4, 9, 3)
    mask = torch.tensor([[1] * 9, [0] * 9, [1, 1, 0, 1, 0, 0, 0, 0, 1], [1] * 4 + [0] * 5])
    packed, indices, cu, max_len = cufa.unpad_input(hidden, mask)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 9, 9, 13, 17]
    assert max_len == 9 and packed.shape == (17, 3) and indices.dtype == torch.int64
    assert torch.equal(packed[9:13], hidden[2, [0, 1, 3, 8]])
    assert torch.equal(cufa.pad_input(packed, indices, 4, 9), hidden * mask[..., None])


def test_mask_shape_must_match():
    with pytest.raises(ValueError, match="attention_mask has shape"):
        cufa.unpad_input(torch.zeros(2, 5, 3), torch.ones(2, 4))
