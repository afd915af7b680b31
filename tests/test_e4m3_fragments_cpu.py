"""The e4m3 decode's fragment layouts (decode/e4m3_mma.cuh), lane by lane, in NumPy: the
shared-memory tiles as bytes, ldmatrix and mma.m16n8k16 as the PTX manual lays out their
fragments, the kernel's index arithmetic step for step. A wrong byte order, permute
selector or column map shows here as a wrong product, without a GPU."""
import numpy as np
import pytest

from test_fp8_cache_cpu import e4m3x4_to_pairs

ml_dtypes = pytest.importorskip("ml_dtypes")
E4M3 = ml_dtypes.float8_e4m3fn
ROWS = KEYS = 16


def swizzle_offset(head_dim, row, chunk):  # common/mma_tiles.cuh's Swizzle (16-bit tiles)
    chunks = head_dim // 8
    span = 8 if chunks % 8 == 0 else 4
    swz = (row & 7) if span == 8 else ((row >> 1) & 3)
    return (row * chunks + (chunk ^ swz)) * 16


def e4m3_offset(head_dim, row, chunk):  # decode/cache.cuh's E4m3Tile
    return (row * ((head_dim // 16) | 1) + chunk) * 16


def word(smem, at):
    return int.from_bytes(bytes(smem[at:at + 4]), "little")


def ldmatrix_x4(smem, lane_addr, trans=False):
    """regs[lane][m]: matrix m's rows come from lanes 8m..8m+7 (16 bytes each). Lane l gets
    word l % 4 of row l // 4, or (.trans, 16-bit elements) elements (2(l % 4), l // 4) and
    (2(l % 4) + 1, l // 4) as its low and high halves."""
    regs = [[0] * 4 for _ in range(32)]
    for m in range(4):
        rows = [lane_addr[8 * m + i] for i in range(8)]
        for lane in range(32):
            g, t = lane // 4, lane % 4
            if not trans:
                regs[lane][m] = word(smem, rows[g] + 4 * t)
            else:
                lo = int.from_bytes(bytes(smem[rows[2 * t] + 2 * g:rows[2 * t] + 2 * g + 2]), "little")
                hi = int.from_bytes(bytes(smem[rows[2 * t + 1] + 2 * g:rows[2 * t + 1] + 2 * g + 2]), "little")
                regs[lane][m] = lo | hi << 16
    return regs


def halves(w):
    return np.array([w & 0xFFFF, w >> 16], dtype=np.uint16).view(np.float16).astype(np.float64)


def mma(c, a, b0, b1):
    """c[lane] (4 floats) += A B for mma.m16n8k16 with a[lane] (4 regs), b0/b1[lane]."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        A[g, 2 * t:2 * t + 2] = halves(a[lane][0])
        A[g + 8, 2 * t:2 * t + 2] = halves(a[lane][1])
        A[g, 2 * t + 8:2 * t + 10] = halves(a[lane][2])
        A[g + 8, 2 * t + 8:2 * t + 10] = halves(a[lane][3])
        B[2 * t:2 * t + 2, g] = halves(b0[lane])
        B[2 * t + 8:2 * t + 10, g] = halves(b1[lane])
    C = A @ B
    for lane in range(32):
        g, t = lane // 4, lane % 4
        c[lane] += np.array([C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]])


def pairs(w):
    """e4m3x4_to_pairs' two registers (fp16): (even, odd), low half first."""
    even_lo, even_hi, odd_lo, odd_hi = e4m3x4_to_pairs(w, bf16=False)
    return even_lo | even_hi << 16, odd_lo | odd_hi << 16


def byte_perm(x, y, selector):
    b = (x | y << 32).to_bytes(8, "little")
    return int.from_bytes(bytes(b[(selector >> 4 * i) & 7] for i in range(4)), "little")


def pack_half2(lo, hi):
    return int(np.array([lo, hi], dtype=np.float16).view(np.uint32)[0])


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
def test_e4m3_fragments_give_q_k_and_p_v(head_dim):
    rng = np.random.default_rng(head_dim)
    q = rng.standard_normal((ROWS, head_dim)).astype(np.float16)
    k8, v8 = (rng.standard_normal((KEYS, head_dim)).astype(E4M3) for _ in range(2))
    scale = 2.0 ** 8  # e4m3_to_half_scale(): the fragments hold the values over it

    # -- shared memory: Q swizzled (16-bit), K and V tiles as E4m3Tile rows --
    sq = bytearray(ROWS * head_dim * 2)
    for r in range(ROWS):
        for c in range(head_dim // 8):
            at = swizzle_offset(head_dim, r, c)
            sq[at:at + 16] = q[r, 8 * c:8 * c + 8].tobytes()
    tile_bytes = KEYS * ((head_dim // 16) | 1) * 16
    sk, sv = bytearray(tile_bytes), bytearray(tile_bytes)
    for r in range(KEYS):
        for c in range(head_dim // 16):
            at = e4m3_offset(head_dim, r, c)
            sk[at:at + 16] = k8[r, 16 * c:16 * c + 16].view(np.uint8).tobytes()
            sv[at:at + 16] = v8[r, 16 * c:16 * c + 16].view(np.uint8).tobytes()

    # -- order_q_for_e4m3_keys --
    for r in range(ROWS):
        for blk in range(head_dim // 16):
            first, second = (swizzle_offset(head_dim, r, 2 * blk + h) for h in (0, 1))
            w = [word(sq, first + 4 * i) for i in range(4)] + [word(sq, second + 4 * i) for i in range(4)]
            lo = [byte_perm(w[2 * i], w[2 * i + 1], 0x5410) for i in range(4)]
            hi = [byte_perm(w[2 * i], w[2 * i + 1], 0x7632) for i in range(4)]
            sq[first:first + 16] = b"".join(x.to_bytes(4, "little") for x in lo)
            sq[second:second + 16] = b"".join(x.to_bytes(4, "little") for x in hi)

    # -- gemm_qk_e4m3 --
    s = [np.zeros((2, 4)) for _ in range(32)]
    k_lane = [e4m3_offset(head_dim, (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1) for lane in range(32)]
    for kp in range(head_dim // 32):
        b = ldmatrix_x4(sk, [a + kp * 32 for a in k_lane])
        for h in range(2):
            a = ldmatrix_x4(sq, [swizzle_offset(head_dim, lane & 15, 2 * (2 * kp + h) + (lane >> 4))
                                 for lane in range(32)])
            for nt, m in ((0, h), (1, 2 + h)):
                even_odd = [pairs(b[lane][m]) for lane in range(32)]
                c = [s[lane][nt] for lane in range(32)]
                mma(c, a, [e for e, _ in even_odd], [o for _, o in even_odd])
    got_s = np.zeros((ROWS, KEYS))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for nt in range(2):
            got_s[g, 8 * nt + 2 * t:8 * nt + 2 * t + 2] = s[lane][nt][0:2]
            got_s[g + 8, 8 * nt + 2 * t:8 * nt + 2 * t + 2] = s[lane][nt][2:4]
    want_s = q.astype(np.float64) @ k8.astype(np.float64).T / scale
    np.testing.assert_allclose(got_s, want_s, rtol=1e-12, atol=1e-12)

    # -- gemm_pv_e4m3, P = some fp16 weights in the S accumulators' layout --
    p = rng.uniform(0, 1, (ROWS, KEYS)).astype(np.float16)
    a = [[0] * 4 for _ in range(32)]
    for lane in range(32):
        g, t = lane // 4, lane % 4
        a[lane] = [pack_half2(p[g, 2 * t], p[g, 2 * t + 1]), pack_half2(p[g + 8, 2 * t], p[g + 8, 2 * t + 1]),
                   pack_half2(p[g, 8 + 2 * t], p[g, 9 + 2 * t]), pack_half2(p[g + 8, 8 + 2 * t], p[g + 8, 9 + 2 * t])]
    o = [np.zeros((head_dim // 8, 4)) for _ in range(32)]
    v_lane = [e4m3_offset(head_dim, (lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4) for lane in range(32)]
    for cp in range(head_dim // 32):
        b = ldmatrix_x4(sv, [x + cp * 32 for x in v_lane], trans=True)
        for h in range(2):
            c = 2 * cp + h
            for tile, selector in ((2 * c, 0x6240), (2 * c + 1, 0x7351)):
                even_odd = [pairs(byte_perm(b[lane][2 * h], b[lane][2 * h + 1], selector)) for lane in range(32)]
                acc = [o[lane][tile] for lane in range(32)]
                mma(acc, a, [e for e, _ in even_odd], [x for _, x in even_odd])

    # -- stage_warp_outputs' kE4m3Columns: lane t of row g holds dims 16c + 4t .. + 3 --
    got_o = np.zeros((ROWS, head_dim))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i, row in ((0, g), (1, g + 8)):
            for c in range(head_dim // 16):
                got_o[row, 16 * c + 4 * t:16 * c + 4 * t + 4] = [
                    o[lane][2 * c][2 * i], o[lane][2 * c + 1][2 * i],
                    o[lane][2 * c][2 * i + 1], o[lane][2 * c + 1][2 * i + 1]]
    want_o = p.astype(np.float64) @ v8.astype(np.float64) / scale
    np.testing.assert_allclose(got_o, want_o, rtol=1e-12, atol=1e-12)


def test_e4m3_tile_rows_fall_in_eight_bank_groups():
    """The 8 rows an ldmatrix phase reads at one chunk: 8 different 16-byte bank groups."""
    for head_dim in range(32, 257, 32):
        for chunk in range(head_dim // 16):
            for first in (0, 8):
                groups = {(e4m3_offset(head_dim, first + r, chunk) // 16) % 8 for r in range(8)}
                assert len(groups) == 8, (head_dim, chunk)
