//! The T5 v1.1 encoder (T5-XXL: the text encoder of SD3, Flux and Chroma)
//! as a tensor graph, with the key names of `t5xxl_*.safetensors`
//! (`shared.weight`, `encoder.block.N.layer.0.SelfAttention.q.weight`,
//! ...), as ComfyUI's `comfy/text_encoders/t5.py` runs it.
//!
//! Pre-norm blocks with RMS norms (no mean, no bias, eps 1e-6); attention
//! without the 1/√d scale, biased by a learned per-head table over
//! bucketed relative positions (the first block's table, shared by every
//! block); a gated-GELU (tanh) feed-forward; a final RMS norm.

use super::clip::ClipLayer;
use super::detect::{shape_of, DetectError, Shapes};
use sdkit_compute::tensor::{GraphBuilder, Scope, ShapeError, T};

/// Sizes of a T5 encoder, all from shapes but the bucket range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct T5Config {
    pub vocab: usize,
    pub width: usize,
    pub layers: usize,
    pub heads: usize,
    /// Width of one head (`d_kv`).
    pub head_dim: usize,
    pub ff: usize,
    pub buckets: usize,
    /// Relative distances beyond this share the last bucket (128 in every
    /// T5; not visible in shapes).
    pub max_distance: usize,
    /// The token table's name relative to the prefix (`shared.weight`, or
    /// `encoder.embed_tokens.weight` in files saved without it).
    pub table: &'static str,
}

const BIAS: &str = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight";

/// The T5 encoder under `prefix`, if its keys are there (recognised by
/// the gated feed-forward's `wi_1`, as T5 v1.1 has it).
pub fn t5_config(s: &Shapes, prefix: &str) -> Result<Option<T5Config>, DetectError> {
    let key = |k: &str| format!("{prefix}{k}");
    if !s.contains_key(&key("encoder.block.0.layer.1.DenseReluDense.wi_1.weight")) {
        return Ok(None);
    }
    let get = |k: &str, expected: &'static str, rank: usize| shape_of(s, key(k), rank, expected);
    let table = if s.contains_key(&key("shared.weight")) {
        "shared.weight"
    } else {
        "encoder.embed_tokens.weight"
    };
    let t = get(table, "[vocab, width]", 2)?;
    let bias = get(BIAS, "[buckets, heads]", 2)?;
    let q = get(
        "encoder.block.0.layer.0.SelfAttention.q.weight",
        "[heads × d_kv, width]",
        2,
    )?;
    let ff = get(
        "encoder.block.0.layer.1.DenseReluDense.wi_0.weight",
        "[ff, width]",
        2,
    )?;
    let heads = bias[1].max(1);
    let layers = (0..)
        .take_while(|n| {
            s.contains_key(&key(&format!(
                "encoder.block.{n}.layer.0.layer_norm.weight"
            )))
        })
        .count();
    if !q[0].is_multiple_of(heads) {
        return Err(DetectError::BadShape {
            name: key("encoder.block.0.layer.0.SelfAttention.q.weight"),
            shape: q,
            expected: "rows a multiple of the relative-attention heads",
        });
    }
    Ok(Some(T5Config {
        vocab: t[0],
        width: t[1],
        layers,
        heads,
        head_dim: q[0] / heads,
        ff: ff[0],
        buckets: bias[0],
        max_distance: 128,
        table,
    }))
}

/// `_relative_position_bucket` (bidirectional) of T5: `key − query`
/// distances, half the buckets per sign; below half of those exact, above
/// logarithmic up to `max_distance`. Computed as ComfyUI does (f32 log).
pub fn relative_bucket(distance: i64, buckets: usize, max_distance: usize) -> usize {
    let half = (buckets / 2) as i64;
    let mut bucket = if distance > 0 { half } else { 0 };
    let n = distance.abs();
    let max_exact = half / 2;
    if n < max_exact {
        bucket += n;
    } else {
        // torch: log(n.float() / max_exact) / math.log(max_distance /
        // max_exact) * (half − max_exact), truncated to long; the first
        // factor is f32, the product promoted with Python floats in f32.
        let ratio = (n as f32 / max_exact as f32).ln();
        let scale = (max_distance as f64 / max_exact as f64).ln() as f32;
        let large = max_exact + (ratio / scale * (half - max_exact) as f32) as i64;
        bucket += large.min(half - 1);
    }
    bucket as usize
}

/// The bucket of every (query, key) pair of a `len`-token sequence, as the
/// f32 ids [`encoder`]'s `buckets` input takes (row-major `[len, len]`).
pub fn bucket_ids(len: usize, cfg: &T5Config) -> Vec<f32> {
    let mut ids = Vec::with_capacity(len * len);
    for q in 0..len as i64 {
        for k in 0..len as i64 {
            ids.push(relative_bucket(k - q, cfg.buckets, cfg.max_distance) as f32);
        }
    }
    ids
}

/// The encoder from token embeddings `x` `[rows, len, width]` (rows of
/// the token table, looked up by the caller). `buckets` `[len·len]` is
/// [`bucket_ids`]; `mask` `[rows, 1, len, len]`, where given, is added to
/// the scores (Chroma's padding mask: 0 or a large negative). `layer`
/// picks the hidden state (an earlier one final-normed when `norm_hidden`,
/// as ComfyUI's `final_layer_norm_intermediate`).
#[allow(clippy::too_many_arguments)]
pub fn encoder<'a>(
    g: &'a GraphBuilder,
    cfg: &T5Config,
    prefix: &str,
    mut x: T<'a>,
    buckets: T<'a>,
    mask: Option<T<'a>>,
    layer: ClipLayer,
    norm_hidden: bool,
) -> Result<T<'a>, ShapeError> {
    let s = x.shape();
    let (rows, len, w) = (s[0], s[1], s[2]);
    let (h, d) = (cfg.heads, cfg.head_dim);
    let inner = h * d;
    let vb = Scope::new(g, prefix);
    // The position bias [1, heads, len, len], from the first block's table.
    let mut bias = vb
        .get(BIAS, &[cfg.buckets, h])?
        .gather(buckets)?
        .reshape(&[len, len, h])?
        .permute(&[2, 0, 1])?
        .reshape(&[1, h, len, len])?;
    if let Some(m) = mask {
        bias = bias.add(m)?;
    }
    let rms = |p: &Scope<'a>, t: T<'a>| -> Result<T<'a>, ShapeError> {
        t.rms_norm(Some(p.get("weight", &[w])?), 1e-6)
    };
    let heads = |t: T<'a>| -> Result<T<'a>, ShapeError> {
        t.reshape(&[rows, len, h, d])?.permute(&[0, 2, 1, 3])
    };
    let run = layer.layers_run(cfg.layers);
    let mut hidden = None;
    for l in 0..run {
        let p = vb.pp("encoder.block").pp(l).pp("layer");
        let a = p.pp(0);
        let n = rms(&a.pp("layer_norm"), x)?;
        let att = a.pp("SelfAttention");
        let q = heads(att.pp("q").linear_no_bias(n, w, inner)?)?;
        let k = heads(att.pp("k").linear_no_bias(n, w, inner)?)?;
        let v = heads(att.pp("v").linear_no_bias(n, w, inner)?)?;
        let scores = q.matmul(k.transpose(2, 3)?)?.add(bias)?.softmax(3)?;
        let o = scores
            .matmul(v)?
            .permute(&[0, 2, 1, 3])?
            .reshape(&[rows, len, inner])?;
        x = x.add(att.pp("o").linear_no_bias(o, inner, w)?)?;
        let f = p.pp(1);
        let n = rms(&f.pp("layer_norm"), x)?;
        let ff = f.pp("DenseReluDense");
        let gate = ff.pp("wi_0").linear_no_bias(n, w, cfg.ff)?.gelu();
        let lin = ff.pp("wi_1").linear_no_bias(n, w, cfg.ff)?;
        x = x.add(ff.pp("wo").linear_no_bias(gate.mul(lin)?, cfg.ff, w)?)?;
        if l + 1 == run {
            hidden = Some(x);
        }
    }
    let last = vb.pp("encoder.final_layer_norm");
    match (layer, hidden) {
        (ClipLayer::FromEnd(_), Some(h)) if !norm_hidden => Ok(h),
        (_, Some(h)) => rms(&last, h),
        (_, None) => rms(&last, x),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_as_t5_computes_them() {
        // transformers' T5Attention._relative_position_bucket, 32 buckets,
        // max distance 128, bidirectional.
        let want = [
            (0, 0),
            (1, 17),
            (-1, 1),
            (7, 23),
            (8, 24),
            (-8, 8),
            (12, 25),
            (20, 26),
            (-40, 12),
            (100, 31),
            (127, 31),
            (500, 31),
            (-500, 15),
        ];
        for (d, b) in want {
            assert_eq!(relative_bucket(d, 32, 128), b, "distance {d}");
        }
        // Every distance in −300..=300, from the same function in torch.
        let torch: Vec<usize> = TORCH_BUCKETS
            .split(',')
            .map(|v| v.parse().expect("bucket"))
            .collect();
        for (i, &b) in torch.iter().enumerate() {
            let d = i as i64 - 300;
            assert_eq!(relative_bucket(d, 32, 128), b, "distance {d}");
        }
    }

    const TORCH_BUCKETS: &str = "15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,15,14,14,14,14,14,14,14,14,14,14,14,14,14,14,14,14,14,14,14,14,14,14,14,14,14,14,14,13,13,13,13,13,13,13,13,13,13,13,13,13,13,13,13,13,13,12,12,12,12,12,12,12,12,12,12,12,12,12,12,11,11,11,11,11,11,11,11,11,10,10,10,10,10,10,10,9,9,9,9,8,8,8,8,7,6,5,4,3,2,1,0,17,18,19,20,21,22,23,24,24,24,24,25,25,25,25,26,26,26,26,26,26,26,27,27,27,27,27,27,27,27,27,28,28,28,28,28,28,28,28,28,28,28,28,28,28,29,29,29,29,29,29,29,29,29,29,29,29,29,29,29,29,29,29,30,30,30,30,30,30,30,30,30,30,30,30,30,30,30,30,30,30,30,30,30,30,30,30,30,30,30,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31,31";
}
