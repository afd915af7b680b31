"""CPU: unpad_input / pad_input on PyTorch CPU tensors (the same code runs on CUDA
tensors). Skipped where PyTorch is not installed."""
import numpy as np
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


_H, _M = torch.zeros(2, 5, 3), torch.ones(2, 5, dtype=torch.bool)
_P, _I = torch.zeros(4, 3), torch.tensor([0, 2, 5, 9])

MISUSE = [
    # (id, callable, args, kwargs, exception, message fragment)
    ("hidden rank 1", cufa.unpad_input, (torch.zeros(5), torch.ones(5)), {}, ValueError,
     "hidden must have rank >= 2"),
    ("hidden a list", cufa.unpad_input, ([[1.0]], _M), {}, TypeError, "hidden must be an array"),
    ("mask float", cufa.unpad_input, (_H, torch.ones(2, 5)), {}, TypeError,
     "attention_mask must be bool or integer, got float32"),
    ("mask 3-D", cufa.unpad_input, (_H, torch.ones(2, 5, 1, dtype=torch.bool)), {}, ValueError,
     "attention_mask has shape"),
    ("mask numpy", cufa.unpad_input, (_H, np.ones((2, 5), bool)), {}, TypeError,
     "attention_mask is a numpy.ndarray but hidden is a torch.Tensor"),
    ("mask a list", cufa.unpad_input, (_H, [[1] * 5] * 2), {}, TypeError, "attention_mask is a"),
    ("mask on meta", cufa.unpad_input, (_H, torch.ones(2, 5, dtype=torch.bool, device="meta")),
     {}, ValueError, "attention_mask is on meta but hidden is on cpu"),
    ("batch negative", cufa.pad_input, (_P, _I, -1, 5), {}, ValueError,
     "batch must be an int >= 0"),
    ("batch bool", cufa.pad_input, (_P, _I, True, 5), {}, ValueError, "batch must be an int"),
    ("seqlen float", cufa.pad_input, (_P, _I, 2, 5.0), {}, ValueError, "seqlen must be an int"),
    ("seqlen tensor", cufa.pad_input, (_P, _I, 2, torch.tensor(5)), {}, ValueError,
     "seqlen must be an int"),
    ("packed 0-D", cufa.pad_input, (torch.zeros(()), _I, 2, 5), {}, ValueError,
     "packed must have rank >= 1"),
    ("indices float", cufa.pad_input, (_P, _I.float(), 2, 5), {}, TypeError,
     "indices must be int64 or int32, got float32"),
    ("indices int16", cufa.pad_input, (_P, _I.short(), 2, 5), {}, TypeError,
     "indices must be int64 or int32, got int16"),
    ("indices 2-D", cufa.pad_input, (_P, _I[None], 2, 5), {}, ValueError, "indices must be 1-D"),
    ("indices too few", cufa.pad_input, (_P, _I[:3], 2, 5), {}, ValueError,
     "indices has 3 entries but packed has 4 rows"),
    ("indices numpy", cufa.pad_input, (_P, _I.numpy(), 2, 5), {}, TypeError,
     "indices is a numpy.ndarray but packed is a torch.Tensor"),
    ("indices on meta", cufa.pad_input, (_P, _I.to("meta"), 2, 5), {}, ValueError,
     "indices is on meta but packed is on cpu"),
]


@pytest.mark.parametrize("case", MISUSE, ids=[c[0] for c in MISUSE])
def test_misuse_names_the_argument(case):
    _, fn, args, kwargs, exc, msg = case
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert msg in str(info.value)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_out_of_range_indices_are_dropped(dtype):
    packed = torch.arange(1.0, 6.0)[:, None].expand(5, 2)
    indices = torch.tensor([3, -1, 10, 7, -10**12 if dtype == torch.int64 else -2**31],
                           dtype=dtype)
    out = cufa.pad_input(packed, indices, 2, 5)
    expected = torch.zeros(10, 2)
    expected[3], expected[7] = 1.0, 4.0
    assert out.shape == (2, 5, 2) and torch.equal(out.reshape(10, 2), expected)
    for bad in (-1, 10):
        with pytest.raises(ValueError, match=r"indices must lie in \[0, batch\*seqlen\) = "
                                             r"\[0, 10\); found values outside"):
            cufa.pad_input(packed[:2], torch.tensor([3, bad], dtype=dtype), 2, 5,
                           check_indices=True)
    ok = cufa.pad_input(packed[:2], torch.tensor([9, 0], dtype=dtype), 2, 5, check_indices=True)
    assert ok[1, 4, 0] == 1.0 and ok[0, 0, 0] == 2.0 and ok.sum() == 6.0


def test_empty_batch():
    out = cufa.pad_input(torch.zeros(0, 3), torch.zeros(0, dtype=torch.int64), 0, 7)
    assert out.shape == (0, 7, 3)
