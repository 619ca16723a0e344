//! Conversion between `f32` and a KV store's element bytes, for every [`KvDtype`].
//!
//! Store bytes are always little-endian, whatever the host, so a page read on one machine can be
//! written on another. The conversions are:
//!
//! | dtype | bytes | f32 → store | store → f32 |
//! |---|---|---|---|
//! | [`KvDtype::F32`] | 4 | byte copy | byte copy |
//! | [`KvDtype::F16`] | 2 | round to nearest even (`half`, vectorised with F16C where present) | exact |
//! | [`KvDtype::Bf16`] | 2 | round to nearest even (`half`) | exact |
//! | [`KvDtype::Fp8E4m3`] | 1 | `fp8(x / scale)`, round to nearest even, saturating at ±448 | `fp8 × scale` |
//! | [`KvDtype::Fp8E5m2`] | 1 | `fp8(x / scale)`, round to nearest even, saturating at ±57344 | `fp8 × scale` |
//!
//! fp8 encoding follows NVIDIA's `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, …)`, which is what
//! device kernels use: every non-NaN value beyond the largest finite fp8 value (infinities
//! included) becomes that value with its sign, and NaN stays NaN. e4m3 here is the "fn" variant
//! (`float8_e4m3fn` in PyTorch): no infinities, one NaN pattern per sign (`S.1111.111`).
//!
//! The scale only applies to fp8 dtypes (SGLang's per-layer `k_scale` / `v_scale`); the other
//! dtypes ignore it, as SGLang only scales when it stores fp8.
//!
//! Lengths are the caller's duty (the store validates every request before converting): the
//! functions check them with `debug_assert_eq!` only.

use float8::{F8E4M3, F8E5M2};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::KvDtype;

/// Largest finite e4m3fn value.
const E4M3_MAX: f32 = 448.0;
/// Largest finite e5m2 value.
const E5M2_MAX: f32 = 57344.0;

/// Elements converted per step through a stack buffer on the slow (unaligned or big-endian) path.
const CHUNK: usize = 256;

/// Every e4m3 byte decoded to f32, computed at compile time.
static E4M3_TO_F32: [f32; 256] = {
    let mut t = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = F8E4M3::from_bits(i as u8).to_f32();
        i += 1;
    }
    t
};

/// Every e5m2 byte decoded to f32, computed at compile time.
static E5M2_TO_F32: [f32; 256] = {
    let mut t = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = F8E5M2::from_bits(i as u8).to_f32();
        i += 1;
    }
    t
};

/// Encodes `src` into `dst` as store bytes of `dtype` (little-endian), writing
/// `src.len() * dtype.bytes()` bytes.
///
/// For fp8 dtypes each element is stored as `fp8(x / scale)`, rounded to nearest even and
/// saturating: finite or infinite values beyond the format's largest finite value become ±448
/// (e4m3fn) or ±57344 (e5m2); NaN stays NaN. For F32, F16 and Bf16 `scale` is ignored (F32 is
/// a plain byte copy; F16 and Bf16 round to nearest even).
///
/// `dst.len()` must equal `src.len() * dtype.bytes()` (checked in debug builds only).
pub fn encode_f32(dtype: KvDtype, src: &[f32], scale: f32, dst: &mut [u8]) {
    debug_assert_eq!(
        dst.len(),
        src.len() * dtype.bytes(),
        "encode_f32: destination length"
    );
    let dst = &mut dst[..src.len() * dtype.bytes()];
    match dtype {
        KvDtype::F32 => encode_f32_plain(src, dst),
        KvDtype::F16 => encode_half::<f16>(src, dst),
        KvDtype::Bf16 => encode_half::<bf16>(src, dst),
        KvDtype::Fp8E4m3 => {
            encode_fp8(src, scale, dst, E4M3_MAX, |x| F8E4M3::from_f32(x).to_bits())
        }
        KvDtype::Fp8E5m2 => {
            encode_fp8(src, scale, dst, E5M2_MAX, |x| F8E5M2::from_f32(x).to_bits())
        }
    }
}

/// Decodes store bytes of `dtype` (little-endian) in `src` into `dst`, reading
/// `dst.len() * dtype.bytes()` bytes: the inverse of [`encode_f32`].
///
/// For fp8 dtypes each element reads as `fp8 × scale`; for F32, F16 and Bf16 `scale` is ignored
/// and the conversion is exact.
///
/// `src.len()` must equal `dst.len() * dtype.bytes()` (checked in debug builds only).
pub fn decode_to_f32(dtype: KvDtype, src: &[u8], scale: f32, dst: &mut [f32]) {
    debug_assert_eq!(
        src.len(),
        dst.len() * dtype.bytes(),
        "decode_to_f32: source length"
    );
    let src = &src[..dst.len() * dtype.bytes()];
    match dtype {
        KvDtype::F32 => decode_f32_plain(src, dst),
        KvDtype::F16 => decode_half::<f16>(src, dst),
        KvDtype::Bf16 => decode_half::<bf16>(src, dst),
        KvDtype::Fp8E4m3 => decode_fp8(src, scale, dst, &E4M3_TO_F32),
        KvDtype::Fp8E5m2 => decode_fp8(src, scale, dst, &E5M2_TO_F32),
    }
}

/// The largest relative error `|decode(encode(x)) − x| / |x|` of a round trip through `dtype`,
/// for values whose stored magnitude (`|x| / scale` for fp8) lies in the format's normal range.
///
/// Rounding to nearest moves a value by at most half a unit in the last place. A normal value
/// `x ≥ 2^e` has an ulp of `2^(e − m)` with `m` explicit mantissa bits, so the relative error is
/// at most `2^−(m+1)`: f16 (`m = 10`) `2^−11`, bf16 (`m = 7`) `2^−8`, e4m3 (`m = 3`) `2^−4`, e5m2
/// (`m = 2`) `2^−3`; f32 is stored as is, so 0. (The fp8 scale division and multiplication each
/// add at most `2^−24` relative, negligible against these bounds.) Subnormal values have larger
/// relative errors, and values beyond the largest finite value saturate.
pub fn max_relative_error(dtype: KvDtype) -> f32 {
    match dtype {
        KvDtype::F32 => 0.0,
        KvDtype::F16 => 1.0 / 2048.0,   // 2^-11
        KvDtype::Bf16 => 1.0 / 256.0,   // 2^-8
        KvDtype::Fp8E4m3 => 1.0 / 16.0, // 2^-4
        KvDtype::Fp8E5m2 => 1.0 / 8.0,  // 2^-3
    }
}

fn encode_f32_plain(src: &[f32], dst: &mut [u8]) {
    if cfg!(target_endian = "little") {
        dst.copy_from_slice(bytemuck::cast_slice(src));
    } else {
        for (d, x) in dst.chunks_exact_mut(4).zip(src) {
            d.copy_from_slice(&x.to_le_bytes());
        }
    }
}

fn decode_f32_plain(src: &[u8], dst: &mut [f32]) {
    if cfg!(target_endian = "little") {
        bytemuck::cast_slice_mut::<f32, u8>(dst).copy_from_slice(src);
    } else {
        for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
            *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        }
    }
}

/// The 16-bit float types, converted through `half`'s slice routines.
trait Half: bytemuck::Pod + Default {
    fn to_le(self) -> [u8; 2];
    fn from_le(bytes: [u8; 2]) -> Self;
}

impl Half for f16 {
    fn to_le(self) -> [u8; 2] {
        self.to_le_bytes()
    }
    fn from_le(bytes: [u8; 2]) -> Self {
        f16::from_le_bytes(bytes)
    }
}

impl Half for bf16 {
    fn to_le(self) -> [u8; 2] {
        self.to_le_bytes()
    }
    fn from_le(bytes: [u8; 2]) -> Self {
        bf16::from_le_bytes(bytes)
    }
}

fn encode_half<H>(src: &[f32], dst: &mut [u8])
where
    H: Half,
    [H]: HalfFloatSliceExt,
{
    if cfg!(target_endian = "little") {
        if let Ok(halves) = bytemuck::try_cast_slice_mut::<u8, H>(dst) {
            halves.convert_from_f32_slice(src);
            return;
        }
    }
    // Unaligned destination or big-endian host: convert through a stack buffer.
    let mut buf = [H::default(); CHUNK];
    for (s, d) in src.chunks(CHUNK).zip(dst.chunks_mut(CHUNK * 2)) {
        let b = &mut buf[..s.len()];
        b.convert_from_f32_slice(s);
        for (out, h) in d.chunks_exact_mut(2).zip(b.iter()) {
            out.copy_from_slice(&h.to_le());
        }
    }
}

fn decode_half<H>(src: &[u8], dst: &mut [f32])
where
    H: Half,
    [H]: HalfFloatSliceExt,
{
    if cfg!(target_endian = "little") {
        if let Ok(halves) = bytemuck::try_cast_slice::<u8, H>(src) {
            halves.convert_to_f32_slice(dst);
            return;
        }
    }
    let mut buf = [H::default(); CHUNK];
    for (s, d) in src.chunks(CHUNK * 2).zip(dst.chunks_mut(CHUNK)) {
        let b = &mut buf[..d.len()];
        for (h, bytes) in b.iter_mut().zip(s.chunks_exact(2)) {
            *h = H::from_le([bytes[0], bytes[1]]);
        }
        b.convert_to_f32_slice(d);
    }
}

fn encode_fp8(src: &[f32], scale: f32, dst: &mut [u8], max: f32, to_fp8: impl Fn(f32) -> u8) {
    // `clamp` keeps NaN as NaN; the fp8 conversion itself also saturates (SATFINITE), clamping
    // first just makes the contract independent of the fp8 crate's choice.
    if scale == 1.0 {
        for (d, &x) in dst.iter_mut().zip(src) {
            *d = to_fp8(x.clamp(-max, max));
        }
    } else {
        for (d, &x) in dst.iter_mut().zip(src) {
            *d = to_fp8((x / scale).clamp(-max, max));
        }
    }
}

fn decode_fp8(src: &[u8], scale: f32, dst: &mut [f32], table: &[f32; 256]) {
    for (d, &b) in dst.iter_mut().zip(src) {
        *d = table[b as usize] * scale;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::rng::SplitMix64;

    /// log2 of the smallest normal and (a bit under) the largest finite stored magnitude.
    fn normal_exponents(dtype: KvDtype) -> (f32, f32) {
        match dtype {
            KvDtype::F32 => (-30.0, 30.0),
            KvDtype::F16 => (-14.0, 15.9),
            KvDtype::Bf16 => (-30.0, 30.0),
            KvDtype::Fp8E4m3 => (-6.0, 8.7),
            KvDtype::Fp8E5m2 => (-14.0, 15.7),
        }
    }

    /// Random non-zero values of random sign spanning the whole normal range of `dtype`, times
    /// `scale`.
    fn values(dtype: KvDtype, n: usize, scale: f32, seed: u64) -> Vec<f32> {
        let (lo, hi) = normal_exponents(dtype);
        let mut s = SplitMix64::new(seed);
        (0..n)
            .map(|_| {
                let mag = (lo + (hi - lo) * s.next_f32()).exp2() * scale;
                if s.next_u64() & 1 == 0 {
                    mag
                } else {
                    -mag
                }
            })
            .collect()
    }

    fn round_trip(dtype: KvDtype, src: &[f32], scale: f32) -> (Vec<u8>, Vec<f32>) {
        let mut bytes = vec![0u8; src.len() * dtype.bytes()];
        encode_f32(dtype, src, scale, &mut bytes);
        let mut back = vec![0f32; src.len()];
        decode_to_f32(dtype, &bytes, scale, &mut back);
        (bytes, back)
    }

    fn assert_within_bound(dtype: KvDtype, src: &[f32], back: &[f32]) {
        let bound = max_relative_error(dtype);
        for (&x, &y) in src.iter().zip(back) {
            let rel = (y - x).abs() / x.abs();
            assert!(
                rel <= bound * (1.0 + 1e-6),
                "{dtype}: {x} came back as {y} (relative error {rel} > {bound})"
            );
        }
    }

    #[test]
    fn round_trip_within_bound_for_every_dtype() {
        for dtype in KvDtype::ALL {
            let src = values(dtype, 4096, 1.0, 7);
            let (bytes, back) = round_trip(dtype, &src, 1.0);
            assert_eq!(bytes.len(), src.len() * dtype.bytes());
            assert_within_bound(dtype, &src, &back);
            let (lo, hi) = normal_exponents(dtype);
            let mags: Vec<f32> = src.iter().map(|x| x.abs().log2()).collect();
            // The values really span the range (several orders of magnitude).
            assert!(mags.iter().cloned().fold(f32::INFINITY, f32::min) < lo + 1.0);
            assert!(mags.iter().cloned().fold(f32::NEG_INFINITY, f32::max) > hi - 1.0);
        }
    }

    #[test]
    fn f32_is_exact_and_little_endian() {
        let src = values(KvDtype::F32, 257, 1.0, 11);
        let (bytes, back) = round_trip(KvDtype::F32, &src, 3.0);
        assert_eq!(
            src.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            back.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        assert_eq!(&bytes[..4], &src[0].to_le_bytes());
    }

    #[test]
    fn sixteen_bit_bytes_are_little_endian() {
        let mut b = [0u8; 4];
        encode_f32(KvDtype::F16, &[1.0, -2.0], 1.0, &mut b);
        assert_eq!(b, [0x00, 0x3C, 0x00, 0xC0]);
        encode_f32(KvDtype::Bf16, &[1.0, -2.0], 1.0, &mut b);
        assert_eq!(b, [0x80, 0x3F, 0x00, 0xC0]);
    }

    #[test]
    fn unaligned_sixteen_bit_buffers_convert_the_same() {
        for dtype in [KvDtype::F16, KvDtype::Bf16] {
            let src = values(dtype, 700, 1.0, 3);
            let (aligned, back) = round_trip(dtype, &src, 1.0);
            // Offset by one byte so the fast (cast) path cannot be taken.
            let mut raw = vec![0u8; aligned.len() + 1];
            encode_f32(dtype, &src, 1.0, &mut raw[1..]);
            assert_eq!(&raw[1..], &aligned[..]);
            let mut back2 = vec![0f32; src.len()];
            decode_to_f32(dtype, &raw[1..], 1.0, &mut back2);
            assert_eq!(back, back2);
        }
    }

    #[test]
    fn scale_is_ignored_for_non_fp8() {
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Bf16] {
            let src = values(dtype, 64, 1.0, 5);
            let (b1, _) = round_trip(dtype, &src, 1.0);
            let (b2, back) = round_trip(dtype, &src, 8.0);
            assert_eq!(b1, b2, "{dtype}");
            assert_within_bound(dtype, &src, &back);
        }
    }

    #[test]
    fn fp8_saturates_at_the_largest_finite_value() {
        for (dtype, max) in [(KvDtype::Fp8E4m3, E4M3_MAX), (KvDtype::Fp8E5m2, E5M2_MAX)] {
            let src = [
                max,
                -max,
                max * 1.01,
                max * 1000.0,
                -max * 3.0,
                f32::MAX,
                f32::INFINITY,
                f32::NEG_INFINITY,
            ];
            let (_, back) = round_trip(dtype, &src, 1.0);
            assert_eq!(back, [max, -max, max, max, -max, max, max, -max], "{dtype}");
            // Scaled: x / scale beyond max saturates to max × scale.
            let (_, back) = round_trip(dtype, &[max * 100.0, -max * 100.0], 2.0);
            assert_eq!(back, [max * 2.0, -max * 2.0], "{dtype}");
        }
    }

    #[test]
    fn fp8_with_a_scale_stores_values_beyond_its_range() {
        // 1000 > 448 saturates in e4m3 without a scale, survives with scale 4 (1000 / 4 = 250).
        let (_, unscaled) = round_trip(KvDtype::Fp8E4m3, &[1000.0], 1.0);
        assert_eq!(unscaled, [448.0]);
        let (bytes, scaled) = round_trip(KvDtype::Fp8E4m3, &[1000.0], 4.0);
        assert_eq!(bytes, [F8E4M3::from_f32(250.0).to_bits()]);
        assert_within_bound(KvDtype::Fp8E4m3, &[1000.0], &scaled);
        // Random values scaled up by 16 and 0.25 stay within the bound with the matching scale.
        for dtype in [KvDtype::Fp8E4m3, KvDtype::Fp8E5m2] {
            for scale in [16.0, 0.25, 3.0] {
                let src = values(dtype, 2048, scale, 13);
                let (_, back) = round_trip(dtype, &src, scale);
                assert_within_bound(dtype, &src, &back);
            }
        }
    }

    #[test]
    fn nan_is_preserved() {
        for dtype in KvDtype::ALL {
            for scale in [1.0, 2.0] {
                let (_, back) = round_trip(dtype, &[f32::NAN, -f32::NAN, 1.0], scale);
                assert!(back[0].is_nan() && back[1].is_nan(), "{dtype}: {back:?}");
                assert_eq!(back[2], 1.0);
            }
        }
    }

    #[test]
    fn fp8_tables_match_the_format() {
        assert_eq!(E4M3_TO_F32[0x7E], 448.0);
        assert!(E4M3_TO_F32[0x7F].is_nan() && E4M3_TO_F32[0xFF].is_nan());
        assert_eq!(E4M3_TO_F32[0x38], 1.0);
        assert_eq!(E4M3_TO_F32[0x01], 2f32.powi(-9));
        assert_eq!(E5M2_TO_F32[0x7B], 57344.0);
        assert_eq!(E5M2_TO_F32[0x7C], f32::INFINITY);
        assert!(E5M2_TO_F32[0x7D].is_nan());
        assert_eq!(E5M2_TO_F32[0x3C], 1.0);
        assert_eq!(E5M2_TO_F32[0x80], 0.0);
        assert!(E5M2_TO_F32[0x80].is_sign_negative());
        // Every finite byte round-trips exactly.
        for (dtype, table) in [
            (KvDtype::Fp8E4m3, &E4M3_TO_F32),
            (KvDtype::Fp8E5m2, &E5M2_TO_F32),
        ] {
            for b in 0..=255u8 {
                let x = table[b as usize];
                if x.is_finite() {
                    let mut out = [0u8];
                    encode_f32(dtype, &[x], 1.0, &mut out);
                    assert_eq!(out[0], b, "{dtype}: {x}");
                }
            }
        }
    }
}
