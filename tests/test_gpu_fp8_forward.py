"""GPU: the fp8 forward's pieces. transpose_v_e4m3 against cufa/_fp8.py's layout, byte for
byte, on strided V of odd lengths (vt poisoned first)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cufa import _compile, _fp8, _runtime  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture
def hopper():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if _compile.family_for(_runtime.compute_capability(0)) != "sm90":
        pytest.skip("the fp8 forward is Hopper's")


@pytest.mark.parametrize("batch, seqlen, heads, d", [(2, 70, 3, 64), (1, 1, 1, 128),
                                                     (3, 300, 2, 256), (1, 128, 4, 128)])
def test_transpose_v_matches_the_layout(hopper, batch, seqlen, heads, d):
    rng = np.random.default_rng(seqlen)
    wide = torch.from_numpy(rng.integers(0, 256, (batch, seqlen, heads + 1, d + 16),
                                         dtype=np.uint8)).cuda()
    v = wide[:, :, 1:, 16:]  # (strided: another head and 16 bytes before each row)
    padded = _fp8.padded_keys(seqlen)
    vt = torch.full((batch, heads, d, padded), 0xAB, dtype=torch.uint8, device="cuda")
    _fp8.launch_transpose_v(v.data_ptr(), tuple(v.shape), tuple(v.stride()), vt.data_ptr(),
                            padded, 0, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    want = _fp8.transposed_v(v.cpu().numpy(), padded)
    np.testing.assert_array_equal(vt.cpu().numpy(), want)
