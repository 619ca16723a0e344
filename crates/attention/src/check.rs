//! Input validation shared by every [`Backend`](crate::Backend), so that all backends refuse
//! the same inputs with the same errors (as [`kv_pool::store::check`] does for KV stores).
//! Each function checks everything one trait method needs, from tensor shapes (device-neutral:
//! plain `&[usize]`), and returns the dimensions the method works with.

use kv_pool::store::check as store_check;
use kv_pool::{KvKind, KvLayout};

use crate::backend::TensorDtype;
use crate::error::{AttentionError, Result};
use crate::metadata::BatchMetadata;
use crate::params::AttentionParams;
use crate::rope::RopeConfig;

fn shape_err(what: &'static str, expected: &[usize], got: &[usize]) -> AttentionError {
    AttentionError::ShapeMismatch {
        what,
        expected: expected.to_vec(),
        got: got.to_vec(),
    }
}

/// Refuses a weight kept in 16 bits ([`Backend::upload_weight`](crate::Backend::upload_weight))
/// where `op` takes f32 tensors (everything but a matmul's weight, an embedding table and a
/// mixture of experts' stacked experts).
pub fn f32_tensor(op: &str, dtype: TensorDtype) -> Result<()> {
    match dtype {
        TensorDtype::F32 => Ok(()),
        _ => Err(AttentionError::Unsupported(format!(
            "{op} takes f32 tensors, not a {dtype:?} weight"
        ))),
    }
}

/// `got` is exactly `expected`.
pub fn shape(what: &'static str, got: &[usize], expected: &[usize]) -> Result<()> {
    if got != expected {
        return Err(shape_err(what, expected, got));
    }
    Ok(())
}

/// `got` has `rank` dimensions (the error shows the expected rank as zeros).
pub fn rank(what: &'static str, got: &[usize], rank: usize) -> Result<()> {
    if got.len() != rank {
        return Err(shape_err(what, &vec![0; rank], got));
    }
    Ok(())
}

/// [`Backend::reshape`](crate::Backend::reshape): the element counts agree.
pub fn reshape(from: &[usize], to: &[usize]) -> Result<()> {
    if to.iter().product::<usize>() != from.iter().product::<usize>() {
        return Err(shape_err("reshape", to, from));
    }
    Ok(())
}

/// [`Backend::matmul`](crate::Backend::matmul): `x [m, k]`, `w [n, k]`; returns `(m, k, n)`.
pub fn matmul(x: &[usize], w: &[usize]) -> Result<(usize, usize, usize)> {
    rank("x", x, 2)?;
    rank("w", w, 2)?;
    let (m, k, n) = (x[0], x[1], w[0]);
    shape("w", w, &[n, k])?;
    Ok((m, k, n))
}

/// [`Backend::bmm`](crate::Backend::bmm): `x [n, heads, k]`, `w [heads, m, k]`; returns
/// `(n, heads, k, m)`.
pub fn bmm(x: &[usize], w: &[usize]) -> Result<(usize, usize, usize, usize)> {
    rank("x", x, 3)?;
    rank("w", w, 3)?;
    let (n, heads, k, m) = (x[0], x[1], x[2], w[1]);
    shape("w", w, &[heads, m, k])?;
    Ok((n, heads, k, m))
}

/// [`Backend::rms_norm`](crate::Backend::rms_norm): `x [rows, d]`, `weight [d]`; returns
/// `(rows, d)`.
pub fn rms_norm(x: &[usize], weight: &[usize]) -> Result<(usize, usize)> {
    rank("x", x, 2)?;
    shape("weight", weight, &[x[1]])?;
    Ok((x[0], x[1]))
}

/// [`Backend::rotary`](crate::Backend::rotary): a valid `cfg`, `x [n, heads, head_dim]` and
/// `n` positions; returns the inverse frequencies.
pub fn rotary(x: &[usize], positions: usize, cfg: &RopeConfig) -> Result<Vec<f64>> {
    let inv = cfg.inv_freqs()?;
    rank("x", x, 3)?;
    shape("x", x, &[x[0], x[1], cfg.head_dim])?;
    if positions != x[0] {
        return Err(AttentionError::LengthMismatch {
            what: "positions",
            expected: x[0],
            got: positions,
        });
    }
    Ok(inv)
}

/// [`Backend::silu_mul`](crate::Backend::silu_mul): `x [m, 2d]`; returns `(m, d)`.
pub fn silu_mul(x: &[usize]) -> Result<(usize, usize)> {
    rank("x", x, 2)?;
    let (m, two_d) = (x[0], x[1]);
    if two_d % 2 != 0 {
        return Err(shape_err("x (last dim must be even)", &[m, two_d + 1], x));
    }
    Ok((m, two_d / 2))
}

/// [`Backend::add_assign`](crate::Backend::add_assign): equal shapes.
pub fn add_assign(x: &[usize], y: &[usize]) -> Result<()> {
    shape("y", y, x)
}

/// [`Backend::embedding`](crate::Backend::embedding): `table [vocab, d]`, every id below
/// `vocab`; returns `(vocab, d)`.
pub fn embedding(table: &[usize], ids: &[u32]) -> Result<(usize, usize)> {
    rank("table", table, 2)?;
    let (vocab, d) = (table[0], table[1]);
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        return Err(AttentionError::InvalidConfig {
            field: "ids",
            reason: format!("id {bad} out of range for a table of {vocab} rows"),
        });
    }
    Ok((vocab, d))
}

/// [`Backend::concat_last`](crate::Backend::concat_last): `a [.., da]` and `b [.., db]` with
/// the same leading dimensions; returns `(rows, da, db)` (`rows` the product of the leading
/// dimensions).
pub fn concat_last(a: &[usize], b: &[usize]) -> Result<(usize, usize, usize)> {
    let lead_ok = !a.is_empty() && a.len() == b.len() && a[..a.len() - 1] == b[..b.len() - 1];
    if !lead_ok {
        return Err(shape_err("concat_last b (leading dims of a)", a, b));
    }
    let rows = a[..a.len() - 1].iter().product();
    Ok((rows, a[a.len() - 1], b[b.len() - 1]))
}

/// A plan (its metadata) against the store it attends over: the layer exists, the page sizes
/// agree, every slot is a row of the store.
pub fn plan(layer: usize, meta: &BatchMetadata, layout: &KvLayout) -> Result<()> {
    store_check::layer(layout, layer)?;
    if meta.page_size() != layout.page_size {
        return Err(AttentionError::PageSizeMismatch {
            plan: meta.page_size(),
            store: layout.page_size,
        });
    }
    if let Some(max) = meta.max_slot() {
        store_check::slots(layout, &[max])?;
    }
    Ok(())
}

/// The geometry of a validated [`Backend::attention`](crate::Backend::attention) call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MhaGeometry {
    /// Query heads (a positive multiple of `kv_heads`).
    pub q_heads: usize,
    /// KV heads of the store.
    pub kv_heads: usize,
    /// Elements per query and key head (`d`).
    pub head_dim: usize,
    /// Elements per value head (`dv`; the output is `[n, q_heads, dv]`).
    pub v_head_dim: usize,
    /// DoubleSparse label channels per KV head (`None` for MHA stores); when `Some`, the
    /// params' DoubleSparse configuration has been checked against it.
    pub heavy_channels: Option<usize>,
}

/// [`Backend::attention`](crate::Backend::attention): the plan against the store, an MHA or
/// DoubleSparse store, `q [n, q_heads, d]` with `q_heads` a multiple of the store's KV heads,
/// `k [n, kv_heads, d]`, `v [n, kv_heads, dv]`, and DoubleSparse parameters exactly when the
/// store has labels (`top_k ≥ 1`, `kv_heads × heavy_channels` channels below `d`).
pub fn attention(
    layer: usize,
    meta: &BatchMetadata,
    layout: &KvLayout,
    (q, k, v): (&[usize], &[usize], &[usize]),
    params: &AttentionParams,
) -> Result<MhaGeometry> {
    plan(layer, meta, layout)?;
    let (kv_heads, d, dv, heavy) = match layout.shape.kind {
        KvKind::Mha {
            kv_heads,
            head_dim,
            v_head_dim,
        } => (kv_heads, head_dim, v_head_dim, None),
        KvKind::DoubleSparse {
            kv_heads,
            head_dim,
            v_head_dim,
            heavy_channels,
        } => (
            kv_heads,
            head_dim,
            v_head_dim,
            Some(heavy_channels as usize),
        ),
        KvKind::Mla { .. } => {
            return Err(AttentionError::Unsupported(
                "an MLA store needs attention_mla".into(),
            ))
        }
    };
    let (kv_heads, d, dv) = (kv_heads as usize, d as usize, dv as usize);
    let n = meta.num_tokens();
    rank("q", q, 3)?;
    let q_heads = q[1];
    if q_heads == 0 || q_heads % kv_heads != 0 {
        return Err(AttentionError::HeadsNotMultiple { q_heads, kv_heads });
    }
    shape("q", q, &[n, q_heads, d])?;
    shape("k", k, &[n, kv_heads, d])?;
    shape("v", v, &[n, kv_heads, dv])?;
    match (heavy, &params.double_sparse) {
        (None, None) => {}
        (None, Some(_)) => {
            return Err(AttentionError::Unsupported(
                "double_sparse parameters given for a store without labels".into(),
            ))
        }
        (Some(_), None) => {
            return Err(AttentionError::InvalidConfig {
                field: "double_sparse",
                reason: "a DoubleSparse store needs its channels and top_k".into(),
            })
        }
        (Some(hc), Some(ds)) => {
            if ds.top_k == 0 {
                return Err(AttentionError::InvalidConfig {
                    field: "top_k",
                    reason: "must be at least 1".into(),
                });
            }
            if ds.channels.len() != kv_heads * hc {
                return Err(AttentionError::LengthMismatch {
                    what: "channels",
                    expected: kv_heads * hc,
                    got: ds.channels.len(),
                });
            }
            if let Some(&c) = ds.channels.iter().find(|&&c| c as usize >= d) {
                return Err(AttentionError::InvalidConfig {
                    field: "channels",
                    reason: format!("channel {c} out of range for head_dim {d}"),
                });
            }
        }
    }
    Ok(MhaGeometry {
        q_heads,
        kv_heads,
        head_dim: d,
        v_head_dim: dv,
        heavy_channels: heavy,
    })
}

/// [`Backend::attention_mla`](crate::Backend::attention_mla): the plan against the store, an
/// MLA store, no DoubleSparse parameters, `q [n, heads, kv_lora_rank + rope_dim]` with
/// `heads ≥ 1`, `latent [n, kv_lora_rank + rope_dim]`. Returns `(heads, d, dv)` with
/// `d = kv_lora_rank + rope_dim` and `dv = kv_lora_rank`.
pub fn attention_mla(
    layer: usize,
    meta: &BatchMetadata,
    layout: &KvLayout,
    q: &[usize],
    latent: &[usize],
    params: &AttentionParams,
) -> Result<(usize, usize, usize)> {
    plan(layer, meta, layout)?;
    let KvKind::Mla {
        kv_lora_rank,
        qk_rope_head_dim,
    } = layout.shape.kind
    else {
        return Err(AttentionError::Unsupported(
            "attention_mla needs an MLA store".into(),
        ));
    };
    if params.double_sparse.is_some() {
        return Err(AttentionError::Unsupported(
            "double_sparse parameters given for an MLA store".into(),
        ));
    }
    let (dv, d) = (
        kv_lora_rank as usize,
        kv_lora_rank as usize + qk_rope_head_dim as usize,
    );
    let n = meta.num_tokens();
    rank("q", q, 3)?;
    let heads = q[1];
    if heads == 0 {
        return Err(AttentionError::HeadsNotMultiple {
            q_heads: 0,
            kv_heads: 1,
        });
    }
    shape("q", q, &[n, heads, d])?;
    shape("latent", latent, &[n, d])?;
    Ok((heads, d, dv))
}
