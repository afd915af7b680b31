"""CPU: the fp8 forward's transposed V (cufa/_fp8.py, mirrored by
kernels_cu/fwd/transpose_v_e4m3.cu): the key order of a 32-key step, against the wgmma
fragment layouts it has to join, and vt's layout."""
import numpy as np

from cufa import _compile, _fp8


def test_vt_key_order_joins_the_score_and_operand_fragments():
    """A lane (t = lane % 4) holds the scores of keys 8j + 2t + {0, 1} (the fp32
    accumulator's columns); P's e4m3 A fragment wants k-indices 4t + {0..3} in register 0
    and 16 + 4t + {0..3} in register 2. Packing j = 0, 1 into register 0 and j = 2, 3 into
    register 2 is right exactly where vt's column k holds key vt_key_of(k)."""
    order = [_fp8.vt_key_of(k) for k in range(32)]
    assert sorted(order) == list(range(32))  # a permutation of the step's keys
    for t in range(4):
        held = [8 * j + 2 * t + e for j in range(4) for e in range(2)]  # the lane's keys, in order
        reg0 = [order[4 * t + i] for i in range(4)]
        reg2 = [order[16 + 4 * t + i] for i in range(4)]
        assert reg0 + reg2 == held


def test_transposed_v_layout():
    rng = np.random.default_rng(0)
    v = rng.integers(1, 255, (2, 70, 3, 32), dtype=np.uint8)
    vt = _fp8.transposed_v(v, _fp8.padded_keys(70))
    assert vt.shape == (2, 3, 32, 128)
    for key in range(128):
        step, k = divmod(key, 32)
        source = 32 * step + _fp8.vt_key_of(k)
        want = v[:, source] if source < 70 else 0  # (batch, heads, d)
        np.testing.assert_array_equal(vt[:, :, :, key], want)


def test_transpose_kernel_in_the_catalog():
    kernel = _compile.TransposeVVariant()
    assert kernel in set(_compile.all_variants()) and kernel.archs == ("sm_90",)
    assert kernel.key == "transpose_v_e4m3" and kernel.elem_bytes == 1
