//! ggml's tensor types and their dequantization to f32, transcribed from llama.cpp's
//! `dequantize_row_*` (ggml-quants.c). Each block is decoded on its own; blocks run in parallel.
//! Products are evaluated in the C code's order (no fused multiply-add) so results match it bit
//! for bit.

use anyhow::Result;
use half::{bf16, f16};
use rayon::prelude::*;

/// Elements per super-block of the k-quants.
pub(crate) const QK_K: usize = 256;

/// The ggml tensor types tandem can read (ids as in ggml.h's `enum ggml_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    BF16,
}

/// ggml's names of the types it defines that we do not decode, for the error message.
fn unsupported_name(id: u32) -> Option<&'static str> {
    Some(match id {
        9 => "Q8_1",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => return None,
    })
}

pub(crate) const SUPPORTED: [GgmlType; 13] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

impl GgmlType {
    pub(crate) fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q2K => 10,
            GgmlType::Q3K => 11,
            GgmlType::Q4K => 12,
            GgmlType::Q5K => 13,
            GgmlType::Q6K => 14,
            GgmlType::BF16 => 30,
        }
    }

    /// The type of a tensor-info type id; an unknown or undecodable id is an error naming it.
    pub(crate) fn from_id(id: u32) -> Result<GgmlType> {
        if let Some(t) = SUPPORTED.iter().find(|t| t.id() == id) {
            return Ok(*t);
        }
        let names: Vec<&str> = SUPPORTED.iter().map(|t| t.name()).collect();
        match unsupported_name(id) {
            Some(n) => anyhow::bail!(
                "tensor type {n} (id {id}) is not supported (supported: {})",
                names.join(", ")
            ),
            None => anyhow::bail!(
                "unknown tensor type id {id} (supported: {})",
                names.join(", ")
            ),
        }
    }

    /// ggml's name of the type.
    pub(crate) fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q2K => "Q2_K",
            GgmlType::Q3K => "Q3_K",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q5K => "Q5_K",
            GgmlType::Q6K => "Q6_K",
        }
    }

    pub fn from_name(name: &str) -> Option<GgmlType> {
        SUPPORTED.iter().copied().find(|t| t.name() == name)
    }

    /// Elements per block.
    pub(crate) fn block_elems(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => {
                32
            }
            GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => QK_K,
        }
    }

    /// Bytes per block (ggml's `type_size`).
    pub(crate) fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q5_1 => 24,
            GgmlType::Q8_0 => 34,
            GgmlType::Q2K => 84,
            GgmlType::Q3K => 110,
            GgmlType::Q4K => 144,
            GgmlType::Q5K => 176,
            GgmlType::Q6K => 210,
        }
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// Decodes `n` elements of type `t` from `bytes` (exactly `n / block_elems` blocks).
pub fn dequantize(t: GgmlType, bytes: &[u8], n: usize) -> Result<Vec<f32>> {
    let (be, bb) = (t.block_elems(), t.block_bytes());
    if !n.is_multiple_of(be) || bytes.len() != n / be * bb {
        anyhow::bail!(
            "{} data of {} bytes does not hold {n} elements (blocks of {be} elements in {bb} bytes)",
            t.name(),
            bytes.len()
        );
    }
    let mut out = vec![0f32; n];
    // Blocks of scalar types are single elements: decode in larger chunks to keep rayon's
    // per-task overhead small.
    let group = if be == 1 { 4096 } else { 1 };
    out.par_chunks_mut(be * group)
        .zip(bytes.par_chunks(bb * group))
        .for_each(|(y, x)| {
            for (y, x) in y.chunks_exact_mut(be).zip(x.chunks_exact(bb)) {
                decode_block(t, x, y);
            }
        });
    Ok(out)
}

fn decode_block(t: GgmlType, x: &[u8], y: &mut [f32]) {
    match t {
        GgmlType::F32 => y[0] = f32::from_le_bytes([x[0], x[1], x[2], x[3]]),
        GgmlType::F16 => y[0] = f16_at(x, 0),
        GgmlType::BF16 => y[0] = bf16::from_bits(u16::from_le_bytes([x[0], x[1]])).to_f32(),
        GgmlType::Q4_0 => q4_0(x, y),
        GgmlType::Q4_1 => q4_1(x, y),
        GgmlType::Q5_0 => q5_0(x, y),
        GgmlType::Q5_1 => q5_1(x, y),
        GgmlType::Q8_0 => q8_0(x, y),
        GgmlType::Q2K => q2_k(x, y),
        GgmlType::Q3K => q3_k(x, y),
        GgmlType::Q4K => q4_k(x, y),
        GgmlType::Q5K => q5_k(x, y),
        GgmlType::Q6K => q6_k(x, y),
    }
}

// block_q4_0 { f16 d; u8 qs[16] }: y = (nibble - 8) * d; low nibbles first, then high.
fn q4_0(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    let qs = &x[2..18];
    for j in 0..16 {
        y[j] = ((qs[j] & 0x0F) as i32 - 8) as f32 * d;
        y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

// block_q4_1 { f16 d, m; u8 qs[16] }: y = nibble * d + m.
fn q4_1(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    let m = f16_at(x, 2);
    let qs = &x[4..20];
    for j in 0..16 {
        y[j] = (qs[j] & 0x0F) as f32 * d + m;
        y[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

// block_q5_0 { f16 d; u8 qh[4]; u8 qs[16] }: y = (nibble | high bit << 4) - 16) * d.
fn q5_0(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    let qh = u32::from_le_bytes([x[2], x[3], x[4], x[5]]);
    let qs = &x[6..22];
    for j in 0..16 {
        let xh0 = (((qh >> j) << 4) & 0x10) as u8;
        let xh1 = ((qh >> (j + 12)) & 0x10) as u8;
        y[j] = (((qs[j] & 0x0F) | xh0) as i32 - 16) as f32 * d;
        y[j + 16] = (((qs[j] >> 4) | xh1) as i32 - 16) as f32 * d;
    }
}

// block_q5_1 { f16 d, m; u8 qh[4]; u8 qs[16] }: y = (nibble | high bit << 4) * d + m.
fn q5_1(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    let m = f16_at(x, 2);
    let qh = u32::from_le_bytes([x[4], x[5], x[6], x[7]]);
    let qs = &x[8..24];
    for j in 0..16 {
        let xh0 = (((qh >> j) << 4) & 0x10) as u8;
        let xh1 = ((qh >> (j + 12)) & 0x10) as u8;
        y[j] = ((qs[j] & 0x0F) | xh0) as f32 * d + m;
        y[j + 16] = ((qs[j] >> 4) | xh1) as f32 * d + m;
    }
}

// block_q8_0 { f16 d; i8 qs[32] }: y = q * d.
fn q8_0(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    for j in 0..32 {
        y[j] = (x[2 + j] as i8) as f32 * d;
    }
}

// block_q2_K { u8 scales[16]; u8 qs[64]; f16 d, dmin }: 16 groups of 16, each with a 4-bit scale
// and 4-bit min: y = d * sc * q2 - dmin * m.
fn q2_k(x: &[u8], y: &mut [f32]) {
    let scales = &x[0..16];
    let d = f16_at(x, 80);
    let min = f16_at(x, 82);
    let mut is = 0;
    let mut out = 0;
    for n in 0..2 {
        let q = &x[16 + 32 * n..16 + 32 * n + 32];
        for shift in [0, 2, 4, 6] {
            for half in 0..2 {
                let sc = scales[is];
                is += 1;
                let dl = d * (sc & 0x0F) as f32;
                let ml = min * (sc >> 4) as f32;
                for l in 0..16 {
                    y[out] = dl * ((q[l + 16 * half] >> shift) & 3) as f32 - ml;
                    out += 1;
                }
            }
        }
    }
}

// block_q3_K { u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d }: 16 groups of 16 with 6-bit
// signed scales; y = d * (sc - 32) * (q2 - (high bit clear ? 4 : 0)).
fn q3_k(x: &[u8], y: &mut [f32]) {
    const KMASK1: u32 = 0x0303_0303;
    const KMASK2: u32 = 0x0f0f_0f0f;
    let hm = &x[0..32];
    let d_all = f16_at(x, 108);
    let mut aux = [0u32; 4];
    for (k, a) in aux.iter_mut().take(3).enumerate() {
        *a = u32::from_le_bytes([x[96 + 4 * k], x[97 + 4 * k], x[98 + 4 * k], x[99 + 4 * k]]);
    }
    let tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & KMASK2) | (((tmp >> 4) & KMASK1) << 4);
    aux[3] = ((aux[1] >> 4) & KMASK2) | (((tmp >> 6) & KMASK1) << 4);
    aux[0] = (aux[0] & KMASK2) | ((tmp & KMASK1) << 4);
    aux[1] = (aux[1] & KMASK2) | (((tmp >> 2) & KMASK1) << 4);
    let mut scales = [0i8; 16];
    for (k, a) in aux.iter().enumerate() {
        for (b, byte) in a.to_le_bytes().iter().enumerate() {
            scales[4 * k + b] = *byte as i8;
        }
    }
    let mut m = 1u8;
    let mut is = 0;
    let mut out = 0;
    for n in 0..2 {
        let q = &x[32 + 32 * n..32 + 32 * n + 32];
        for shift in [0, 2, 4, 6] {
            for half in 0..2 {
                let dl = d_all * (scales[is] as i32 - 32) as f32;
                is += 1;
                for l in 0..16 {
                    let i = l + 16 * half;
                    let v = ((q[i] >> shift) & 3) as i32 - if hm[i] & m != 0 { 0 } else { 4 };
                    y[out] = dl * v as f32;
                    out += 1;
                }
            }
            m <<= 1;
        }
    }
}

// The 6-bit scale and min of sub-block j of a Q4_K/Q5_K block (ggml's get_scale_min_k4).
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

// block_q4_K { f16 d, dmin; u8 scales[12]; u8 qs[128] }: 8 groups of 32,
// y = d * sc * nibble - dmin * m.
fn q4_k(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    let min = f16_at(x, 2);
    let scales = &x[4..16];
    for g in 0..4 {
        let q = &x[16 + 32 * g..16 + 32 * g + 32];
        let (sc1, m1) = scale_min_k4(2 * g, scales);
        let (sc2, m2) = scale_min_k4(2 * g + 1, scales);
        let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
        for l in 0..32 {
            y[64 * g + l] = d1 * (q[l] & 0x0F) as f32 - m1;
            y[64 * g + 32 + l] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

// block_q5_K { f16 d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128] }: as Q4_K with a fifth bit
// from qh: y = d * sc * (nibble + 16 * bit) - dmin * m.
fn q5_k(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    let min = f16_at(x, 2);
    let scales = &x[4..16];
    let qh = &x[16..48];
    for g in 0..4 {
        let ql = &x[48 + 32 * g..48 + 32 * g + 32];
        let (u1, u2) = (1u8 << (2 * g), 2u8 << (2 * g));
        let (sc1, m1) = scale_min_k4(2 * g, scales);
        let (sc2, m2) = scale_min_k4(2 * g + 1, scales);
        let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            y[64 * g + l] = d1 * ((ql[l] & 0x0F) + h1) as f32 - m1;
            y[64 * g + 32 + l] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
        }
    }
}

// block_q6_K { u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d }: 16 groups of 16 with 8-bit
// scales; y = d * sc * (6-bit q - 32).
fn q6_k(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 208);
    for n in 0..2 {
        let ql = &x[64 * n..64 * n + 64];
        let qh = &x[128 + 32 * n..128 + 32 * n + 32];
        let sc = &x[192 + 8 * n..192 + 8 * n + 8];
        let y = &mut y[128 * n..128 * n + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}
