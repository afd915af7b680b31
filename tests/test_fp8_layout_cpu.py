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


def test_packed_vt_regions_hold_each_sequence_apart():
    """vt_sequence_start: 128-aligned, and each sequence's region (its keys rounded up to
    128) ends before the next one starts, whatever the lengths (0 included); the packed
    transposed_v puts each sequence's own vt there."""
    rng = np.random.default_rng(1)
    for _ in range(200):
        lens = rng.integers(0, 400, rng.integers(1, 9))
        cu = np.concatenate([[0], np.cumsum(lens)])
        starts = [_fp8.vt_sequence_start(int(cu[b]), b) for b in range(len(lens))]
        ends = [s + (_fp8.padded_keys(n) if n else 0) for s, n in zip(starts, lens)]
        assert all(s % 128 == 0 for s in starts)
        assert all(e <= s for e, s in zip(ends, starts[1:]))
        assert ends[-1] <= _fp8.vt_packed_keys(int(cu[-1]), len(lens))
    lens, used = [70, 0, 200], [70, 0, 150]
    cu = np.concatenate([[0], np.cumsum(lens)])
    v = rng.integers(1, 255, (int(cu[-1]), 2, 32), dtype=np.uint8)
    vt = _fp8.transposed_v_packed(v, cu, used)
    for b, (n, u) in enumerate(zip(lens, used)):
        if n:
            s = _fp8.vt_sequence_start(int(cu[b]), b)
            one = _fp8.transposed_v(v[None, cu[b]:cu[b] + u], _fp8.padded_keys(n))[0]
            np.testing.assert_array_equal(vt[:, :, s:s + one.shape[-1]], one)
