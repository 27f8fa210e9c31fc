"""NVFP4 codes and scales against the independent NumPy reference, bit for bit; stochastic
rounding; the group-aligned rows and the Hadamard transform of the weight-gradient operands.

Legend: R rows, n elements along the blocked axis, M rows sorted by group, K columns, G groups.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dropless.quant import nvfp4 as nv
from dropless.quant import nvfp4_gmm as ng
from tests._support import nvfp4_numpy_reference as ref


def _codes(x, **kw):
    r = nv.quantize(jnp.asarray(x), -1, **kw)
    scales = np.asarray(jax.lax.bitcast_convert_type(r.scale, jnp.uint8))
    return np.asarray(r.q), scales, np.float32(r.tensor_scale)


def assert_rows_match(x_RN, tensor_scale=True, bits_RN=None):
    x_RN = np.asarray(x_RN, np.float32)
    q, s, sd = _codes(x_RN, tensor_scale=tensor_scale,
                      sr_bits=None if bits_RN is None else jnp.asarray(bits_RN))
    rq, rs, rsd = ref.quantize_rows(x_RN, tensor_scale, bits_RN)
    np.testing.assert_array_equal(s, rs)
    np.testing.assert_array_equal(q, rq)
    assert sd.tobytes() == rsd.tobytes()


# Rows whose block holds 6.0 get scale 1 without the tensor scale, so y = x: every tie, the
# subnormal 0.5, saturation above 6 and signed zeros are E2M1's own rounding.
EDGE_ROW = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.0, -0.25, 5.5, 7.0, -100.0,
            2.0 ** -130, 0.2500001, 4.9999995]


def test_e2m1_ties_saturation_and_signed_zeros():
    q, s, _ = _codes(np.array([EDGE_ROW], np.float32), tensor_scale=False)
    # scale: amax 100/6 = 16.7 -> e4m3 16.0 (code 0x58: exponent 4 + bias 7, mantissa 0)
    assert s.tolist() == [[0x58]]
    assert_rows_match([EDGE_ROW], tensor_scale=False)
    # amax 6.3: 6.3 / 6 = 1.05 rounds down to E4M3 1.0, so y = x and 6.3 saturates to 6
    six = [[6.0] + EDGE_ROW[1:11] + [6.3, -6.3, 2.0 ** -130, 0.2500001, 4.9999995]]
    q, s, _ = _codes(np.array(six, np.float32), tensor_scale=False)
    assert s.tolist() == [[0x38]]          # scale 1.0
    # 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4, -0->-0, -0.25->-0, 5.5->6,
    # 6.3->6, -6.3->-6, f32 subnormal->0, just above the 0.25 tie->0.5, just below 5->4
    mags = [6, 0, 1, 1, 2, 2, 4, 4, 0, 0, 6, 6, 6, 0, 0.5, 4]
    np.testing.assert_array_equal(np.abs(nv.e2m1_decode(jnp.asarray(q))[0]), mags)
    assert q[0, 8] == 8 and q[0, 9] == 8 and q[0, 12] == 15
    assert_rows_match(six, tensor_scale=False)


def test_e4m3_scale_edges():
    rows = [
        [6 * 500.0] + [1.0] * 15,            # block scale 500 saturates to 448: y > 6 clamps
        [6 * 2.0 ** -8] + [0.0] * 15,        # subnormal E4M3 scale 2**-8
        [6 * 2.0 ** -10] + [0.0] * 15,       # half the smallest subnormal: ties to scale 0
        [6 * 2.0 ** -10 * 1.01] + [0.0] * 15,  # just above: the smallest subnormal 2**-9
        [6 * 1e-5] + [3e-5] * 15,            # scale rounds to 0: the whole block is 0
        [6 * 1.0625] + [1.0] * 15,           # a tie between E4M3 1.0 and 1.125 -> 1.0
        [0.0] * 16,
    ]
    assert_rows_match(rows, tensor_scale=False)
    _, s, _ = _codes(np.array(rows, np.float32), tensor_scale=False)
    assert s[:, 0].tolist() == [0x7E, 0x02, 0x00, 0x01, 0x00, 0x38, 0x00]
    assert_rows_match(rows, tensor_scale=True)


def test_tensor_scale_maps_the_largest_block_onto_448():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((8, 64)) * 2.0 ** rng.integers(-20, 20, (8, 1))).astype(np.float32)
    q, s, sd = _codes(x)
    assert s.max() == 0x7E                   # 448: the tensor amax's block
    assert_rows_match(x)
    assert_rows_match(x, tensor_scale=False)


def test_nan_inf_blocks_and_float32_subnormals():
    x = np.ones((3, 32), np.float32)
    x[0, 3] = np.nan
    x[1, 20] = np.inf
    x[2, :16] = 2.0 ** -140                  # float32 subnormals count as zero
    x[2, 16] = -np.inf
    q, s, _ = _codes(x)
    # amax over the finite elements is 1: s_enc = 2688, an all-ones block's scale 448 (0x7E)
    assert s.tolist() == [[0x7F, 0x7E], [0x7E, 0x7F], [0x00, 0x7F]]
    assert_rows_match(x)
    np.testing.assert_array_equal(np.isnan(np.asarray(nv.dequantize(nv.quantize(x)))),
                                  np.repeat([[1, 0], [0, 1], [0, 1]], 16, axis=1).astype(bool))


def test_any_float32_bit_pattern():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 2 ** 32, (24, 48), dtype=np.uint64).astype(np.uint32).view(np.float32)
    assert_rows_match(x)
    assert_rows_match(x, tensor_scale=False)
    wide = (rng.standard_normal((16, 40)) * 2.0 ** rng.integers(-60, 60, (16, 40))
            ).astype(np.float32)
    assert_rows_match(wide)


def test_stochastic_rounding_matches_reference_given_the_same_bits():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 40)).astype(np.float32)
    bits = rng.integers(0, 2 ** 32, x.shape, dtype=np.uint64).astype(np.uint32)
    assert_rows_match(x, bits_RN=bits)
    assert_rows_match(x, tensor_scale=False, bits_RN=bits)


def test_stochastic_rounding_is_unbiased():
    # 1.2 lies between E2M1 1.0 and 1.5: up with probability 0.4, so the mean is 1.2; with the
    # tensor scale off and 6.0 in every block, y = x exactly
    n = 8192
    x = np.tile(np.array([6.0] + [1.2, -2.6, 0.3, 4.9] * 3 + [5.0, 0.1, 3.3], np.float32),
                (n, 1))
    bits = jax.random.bits(jax.random.key(7), x.shape, jnp.uint32)
    v = np.asarray(nv.fake_quantize(jnp.asarray(x), tensor_scale=False, sr_bits=bits))
    mean = v.mean(0)
    # each column's draws are Bernoulli(frac) times a step of 0.5/1/2: 5 sigma bounds
    step = np.where(np.abs(x[0]) < 2, 0.5, np.where(np.abs(x[0]) < 4, 1.0, 2.0))
    np.testing.assert_allclose(mean, x[0], atol=float(5 * step.max() * 0.5 / np.sqrt(n)))
    rne = np.asarray(nv.fake_quantize(jnp.asarray(x[:1]), tensor_scale=False))[0]
    assert abs(rne[1] - 1.2) > 0.15        # RNE is biased on this value, SR is not


def test_sr_bits_are_reproducible_and_counter_dependent():
    dy = jax.random.normal(jax.random.key(0), (32, 16))
    bits = jax.jit(ng.sr_bits)       # seed, counter and tag traced: one compilation
    a = bits(0, jnp.uint32(5), dy, ng.TAG_DGRAD)
    np.testing.assert_array_equal(a, bits(0, jnp.uint32(5), dy, ng.TAG_DGRAD))
    np.testing.assert_array_equal(a, jax.jit(ng.sr_bits, static_argnums=(0, 3))(
        0, jnp.uint32(5), dy, ng.TAG_DGRAD))
    for other in (bits(0, jnp.uint32(6), dy, ng.TAG_DGRAD),
                  bits(1, jnp.uint32(5), dy, ng.TAG_DGRAD),
                  bits(0, jnp.uint32(5), dy, ng.TAG_WGRAD),
                  bits(0, jnp.uint32(5), dy.at[3, 4].add(1.0), ng.TAG_DGRAD)):
        assert np.mean(np.asarray(a) == np.asarray(other)) < 0.01


@pytest.mark.parametrize("n", [1, 15, 17, 33])
def test_lengths_that_are_not_multiples_of_16_and_axes(n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal((5, n)).astype(np.float32)
    assert_rows_match(x)
    r0 = nv.quantize(jnp.asarray(x.T), 0)
    r1 = nv.quantize(jnp.asarray(x), 1)
    np.testing.assert_array_equal(np.asarray(r0.q).T, r1.q)
    np.testing.assert_array_equal(np.asarray(r0.scale.astype(jnp.float32)).T,
                                  r1.scale.astype(jnp.float32))


def test_2d_tiles_match_reference_and_dequantize():
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((2, 40, 24)) * 2.0 ** rng.integers(-8, 8, (2, 1, 24))
         ).astype(np.float32)
    r = nv.quantize(jnp.asarray(w), blocks="2d")
    rq, rs, rsd = ref.quantize_tiles(w)
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(r.scale, jnp.uint8)),
                                  rs)
    np.testing.assert_array_equal(r.q, rq)
    assert np.float32(r.tensor_scale) == rsd
    np.testing.assert_array_equal(np.asarray(nv.dequantize(r, blocks="2d")),
                                  ref.dequantize_tiles(rq, rs, rsd).astype(np.float32))
    np.testing.assert_array_equal(nv.fake_quantize(jnp.asarray(w), blocks="2d"),
                                  nv.dequantize(r, blocks="2d"))


def test_bf16_input_and_dequantize_match_reference():
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((4, 48)), jnp.bfloat16)
    r = nv.quantize(x)
    rq, rs, rsd = ref.quantize_rows(np.asarray(x.astype(jnp.float32)))
    np.testing.assert_array_equal(r.q, rq)
    np.testing.assert_array_equal(np.asarray(nv.dequantize(r)),
                                  ref.dequantize_rows(rq, rs, rsd).astype(np.float32))


def test_bad_arguments_name_themselves():
    x = jnp.ones((2, 16))
    with pytest.raises(ValueError, match="blocks='3d'"):
        nv.quantize(x, blocks="3d")
    with pytest.raises(ValueError, match="axis=2"):
        nv.quantize(x, 2)
    with pytest.raises(ValueError, match="floating"):
        nv.quantize(jnp.ones((2, 16), jnp.int32))
    with pytest.raises(ValueError, match="sr_bits"):
        nv.quantize(x, sr_bits=jnp.ones((2, 15), jnp.uint32))


def test_group_aligned_rows_by_hand():
    # sizes [1, 0, 20] over 24 rows: padded sizes [16, 0, 32]; rows 21..23 are past the sum
    dest, padded, p = nv.group_aligned_rows(jnp.array([1, 0, 20]), 24)
    assert p == 80 and padded.tolist() == [16, 0, 32]
    assert dest.tolist() == [0] + list(range(16, 36)) + [80] * 3


def test_group_aligned_rows_never_mix_groups():
    rng = np.random.default_rng(5)
    m = 120
    x = np.arange(1, m + 1, dtype=np.float32)[:, None]

    @jax.jit                          # traced sizes: one compilation for every draw
    def aligned(sizes):
        dest, padded, p = nv.group_aligned_rows(sizes, m)
        return nv.to_aligned(jnp.asarray(x), dest, p), padded

    for _ in range(12):
        sizes = rng.integers(0, 30, 5)
        sizes[-1] = max(0, min(sizes[-1], m - sizes[:-1].sum()))   # sum <= m: a tail or none
        got, padded = aligned(jnp.asarray(sizes, jnp.int32))
        got = np.asarray(got)
        want, want_padded = ref.aligned_rows(x, sizes)
        assert got.shape[0] == 16 * -(-(m + 15 * 5) // 16)
        assert padded.tolist() == want_padded
        np.testing.assert_array_equal(got[:len(want)], want)
        assert not got[len(want):].any()


def test_hadamard_is_orthogonal_and_keeps_the_weight_gradient():
    h = np.asarray(nv.hadamard_matrix(0))
    np.testing.assert_array_equal(h @ h.T, np.eye(16))
    signs = np.sign(h[0]) * 1.0               # row 0 of H16 is all ones: signs are row 0
    rng = np.random.default_rng(6)
    x = rng.standard_normal((32, 8)).astype(np.float32)
    dy = rng.standard_normal((32, 4)).astype(np.float32)
    hx = np.asarray(nv.hadamard_rows(jnp.asarray(x), jnp.asarray(h)))
    np.testing.assert_allclose(hx, ref.hadamard_rows(x, signs), rtol=0, atol=2e-6)
    hdy = np.asarray(nv.hadamard_rows(jnp.asarray(dy), jnp.asarray(h)))
    for b in (slice(0, 16), slice(16, 32)):
        np.testing.assert_allclose(hx[b].T @ hdy[b], x[b].T @ dy[b], atol=1e-5)
    assert not np.array_equal(nv.hadamard_matrix(1), h)
