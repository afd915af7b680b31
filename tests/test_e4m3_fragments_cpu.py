"""The e4m3 fragment layouts (common/e4m3_mma.cuh), lane by lane, in NumPy: the
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


def e4m3_offset(head_dim, row, chunk):  # common/e4m3_mma.cuh's E4m3Tile
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


def cvt_half2(low, high):
    """cvt.rn.f16x2.e4m3x2 (sm_89 on): two e4m3 bytes to an fp16 pair, exactly."""
    return int(np.array([low, high], dtype=np.uint8).view(E4M3).astype(np.float16).view(np.uint32)[0])


def pairs_by_cvt(w):
    """e4m3x4_to_pairs by conversion: bytes 0, 2 and 1, 3, values as they are."""
    b = w.to_bytes(4, "little")
    return cvt_half2(b[0], b[2]), cvt_half2(b[1], b[3])


def halves_by_cvt(w):
    """e4m3x4_to_half2_halves: bytes 0, 1 and 2, 3, values as they are."""
    b = w.to_bytes(4, "little")
    return cvt_half2(b[0], b[1]), cvt_half2(b[2], b[3])


def byte_perm(x, y, selector):
    b = (x | y << 32).to_bytes(8, "little")
    return int.from_bytes(bytes(b[(selector >> 4 * i) & 7] for i in range(4)), "little")


def pack_half2(lo, hi):
    return int(np.array([lo, hi], dtype=np.float16).view(np.uint32)[0])


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("rows, keys, by_cvt", [(16, 16, False), (32, 64, False), (64, 32, False),
                                                (16, 16, True)],
                         ids=["decode shifts", "fwd 2x8 tiles", "fwd 4x4 tiles", "decode cvt"])
def test_e4m3_fragments_give_q_k_and_p_v(head_dim, rows, keys, by_cvt):
    """One warp's kMTiles = rows / 16 row tiles against kNTiles = keys / 8 key tiles: the
    decode kernel's shape (16, 16) and the forward's (its warps' row slices). by_cvt: the
    decode kernel from sm_89 on (kCvt): keys widened a word's halves at a time, Q in
    order_q_for_e4m3_keys<..., kHalves>'s order, V's pairs by conversion, no 2^8 scale."""
    ROWS, KEYS = rows, keys
    m_tiles, n_tiles = rows // 16, keys // 8
    rng = np.random.default_rng(head_dim + rows + keys)
    q = rng.standard_normal((ROWS, head_dim)).astype(np.float16)
    k8, v8 = (rng.standard_normal((KEYS, head_dim)).astype(E4M3) for _ in range(2))
    scale = 1.0 if by_cvt else 2.0 ** 8  # e4m3_to_half_scale(): the fragments' values over it
    value_pairs = pairs_by_cvt if by_cvt else pairs

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
            if by_cvt:  # new word t = old word 2t, new word 4 + t = old word 2t + 1
                lo, hi = w[0::2], w[1::2]
            else:
                lo = [byte_perm(w[2 * i], w[2 * i + 1], 0x5410) for i in range(4)]
                hi = [byte_perm(w[2 * i], w[2 * i + 1], 0x7632) for i in range(4)]
            sq[first:first + 16] = b"".join(x.to_bytes(4, "little") for x in lo)
            sq[second:second + 16] = b"".join(x.to_bytes(4, "little") for x in hi)

    # -- gemm_qk_e4m3 --
    row_bytes = ((head_dim // 16) | 1) * 16
    s = [np.zeros((m_tiles, n_tiles, 4)) for _ in range(32)]
    k_lane = [e4m3_offset(head_dim, (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1) for lane in range(32)]
    for kp in range(head_dim // 32):
        b = [ldmatrix_x4(sk, [a + np_ * 16 * row_bytes + kp * 32 for a in k_lane])
             for np_ in range(n_tiles // 2)]
        for h in range(2):
            a = [ldmatrix_x4(sq, [swizzle_offset(head_dim, mt * 16 + (lane & 15),
                                                 2 * (2 * kp + h) + (lane >> 4)) for lane in range(32)])
                 for mt in range(m_tiles)]
            for np_ in range(n_tiles // 2):
                for nt, m in ((2 * np_, h), (2 * np_ + 1, 2 + h)):
                    even_odd = [(halves_by_cvt if by_cvt else pairs)(b[np_][lane][m])
                                for lane in range(32)]
                    for mt in range(m_tiles):
                        c = [s[lane][mt, nt] for lane in range(32)]
                        mma(c, a[mt], [e for e, _ in even_odd], [o for _, o in even_odd])
    got_s = np.zeros((ROWS, KEYS))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for mt in range(m_tiles):
            for nt in range(n_tiles):
                r = 16 * mt + g
                got_s[r, 8 * nt + 2 * t:8 * nt + 2 * t + 2] = s[lane][mt, nt, 0:2]
                got_s[r + 8, 8 * nt + 2 * t:8 * nt + 2 * t + 2] = s[lane][mt, nt, 2:4]
    want_s = q.astype(np.float64) @ k8.astype(np.float64).T / scale
    np.testing.assert_allclose(got_s, want_s, rtol=1e-12, atol=1e-12)

    # -- gemm_pv_e4m3, P = some fp16 weights in the S accumulators' layout --
    p = rng.uniform(0, 1, (ROWS, KEYS)).astype(np.float16)
    o = [np.zeros((m_tiles, head_dim // 8, 4)) for _ in range(32)]
    v_lane = [e4m3_offset(head_dim, (lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4) for lane in range(32)]
    for ks in range(n_tiles // 2):
        a = [[[0] * 4 for _ in range(32)] for _ in range(m_tiles)]
        for mt in range(m_tiles):
            for lane in range(32):
                g, t, k0 = 16 * mt + lane // 4, lane % 4, 16 * ks
                a[mt][lane] = [pack_half2(p[g, k0 + 2 * t], p[g, k0 + 2 * t + 1]),
                               pack_half2(p[g + 8, k0 + 2 * t], p[g + 8, k0 + 2 * t + 1]),
                               pack_half2(p[g, k0 + 8 + 2 * t], p[g, k0 + 9 + 2 * t]),
                               pack_half2(p[g + 8, k0 + 8 + 2 * t], p[g + 8, k0 + 9 + 2 * t])]
        for cp in range(head_dim // 32):
            b = ldmatrix_x4(sv, [x + ks * 16 * row_bytes + cp * 32 for x in v_lane], trans=True)
            for h in range(2):
                c = 2 * cp + h
                for tile, selector in ((2 * c, 0x6240), (2 * c + 1, 0x7351)):
                    even_odd = [value_pairs(byte_perm(b[lane][2 * h], b[lane][2 * h + 1], selector))
                                for lane in range(32)]
                    for mt in range(m_tiles):
                        acc = [o[lane][mt, tile] for lane in range(32)]
                        mma(acc, a[mt], [e for e, _ in even_odd], [x for _, x in even_odd])

    # -- e4m3_output_dims: lane t of row g holds dims 16c + 4t .. + 3; the forward's
    #    write_output puts them at chunk 2c + t / 2, 4 (t % 2) elements in --
    got_o = np.zeros((ROWS, head_dim))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for mt in range(m_tiles):
            for i, row in ((0, 16 * mt + g), (1, 16 * mt + g + 8)):
                for c in range(head_dim // 16):
                    first = 8 * (2 * c + (t >> 1)) + 4 * (t & 1)
                    assert first == 16 * c + 4 * t
                    got_o[row, first:first + 4] = [
                        o[lane][mt, 2 * c, 2 * i], o[lane][mt, 2 * c + 1, 2 * i],
                        o[lane][mt, 2 * c, 2 * i + 1], o[lane][mt, 2 * c + 1, 2 * i + 1]]
    want_o = p.astype(np.float64) @ v8.astype(np.float64) / scale
    np.testing.assert_allclose(got_o, want_o, rtol=1e-12, atol=1e-12)


def test_e4m3_tile_rows_fall_in_eight_bank_groups():
    """The 8 rows an ldmatrix phase reads at one chunk: 8 different 16-byte bank groups."""
    for head_dim in range(32, 257, 32):
        for chunk in range(head_dim // 16):
            for first in (0, 8):
                groups = {(e4m3_offset(head_dim, first + r, chunk) // 16) % 8 for r in range(8)}
                assert len(groups) == 8, (head_dim, chunk)
