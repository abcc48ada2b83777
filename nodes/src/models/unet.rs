//! The diffusion UNet (ldm `UNetModel.forward`, as ComfyUI runs it for
//! SD1/SD2/SDXL-style checkpoints) as a tensor graph with the checkpoint's
//! key names: heads by count or by width, the ADM (`label_emb`) vector of
//! SDXL. No ControlNet or patches.
//!
//! Numerical details follow comfy/ldm/modules/diffusionmodules/openaimodel.py
//! and comfy/ldm/modules/attention.py:
//! - ResBlocks and the final `out.0` use GroupNorm(32) with PyTorch's default
//!   eps 1e-5; only the SpatialTransformer's `norm` uses eps 1e-6.
//! - Transformer LayerNorms use the default eps 1e-5; the feed-forward is
//!   GEGLU with exact (erf) GELU.
//! - The timestep embedding is `[cos(t·f), sin(t·f)]` (cos first) with
//!   `f_i = exp(-ln(10000)·i / half)`.

use super::detect::{Heads, UnetConfig};
use sdkit_compute::tensor::{GraphBuilder, Scope, ShapeError, UpsampleMode, T};

type R<'a> = Result<T<'a>, ShapeError>;

fn bad(op: &'static str, message: String, shapes: &[&[usize]]) -> ShapeError {
    ShapeError {
        op,
        message,
        shapes: shapes.iter().map(|s| s.to_vec()).collect(),
    }
}

/// What every block of one UNet shares.
struct Ctx {
    heads: Heads,
    use_linear: bool,
    emb_dim: usize,
}

impl Ctx {
    /// ResBlock without scale-shift norm or up/down: `emb_act` is the
    /// already SiLU-activated embedding (shared by every block, since
    /// `emb_layers` starts with the SiLU).
    fn resblock<'a>(
        &self,
        vb: &Scope<'a>,
        x: T<'a>,
        emb_act: T<'a>,
        cin: usize,
        cout: usize,
    ) -> R<'a> {
        let h = vb.pp("in_layers.0").group_norm(x, 32, cin, 1e-5)?.silu();
        let h = vb.pp("in_layers.2").conv2d(h, cin, cout, 3, 1)?;
        let e = vb.pp("emb_layers.1").linear(emb_act, self.emb_dim, cout)?;
        let b = e.shape()[0];
        let h = h.add(e.reshape(&[b, cout, 1, 1])?)?;
        let h = vb.pp("out_layers.0").group_norm(h, 32, cout, 1e-5)?.silu();
        let h = vb.pp("out_layers.3").conv2d(h, cout, cout, 3, 1)?;
        let skip = if cin == cout {
            x
        } else {
            vb.pp("skip_connection").conv2d(x, cin, cout, 1, 1)?
        };
        skip.add(h)
    }

    /// CrossAttention: `x` `[b, s, c]` attends to `kv` `[b, skv, c_kv]`
    /// (itself for self-attention); q/k/v have no bias, `to_out.0` has.
    fn attention<'a>(&self, vb: &Scope<'a>, x: T<'a>, kv: T<'a>, c: usize) -> R<'a> {
        let c_kv = kv.shape()[2];
        let q = vb.pp("to_q").linear_no_bias(x, c, c)?;
        let k = vb.pp("to_k").linear_no_bias(kv, c_kv, c)?;
        let v = vb.pp("to_v").linear_no_bias(kv, c_kv, c)?;
        let o = super::multi_head_attention(q, k, v, self.heads.at(c), None)?;
        vb.pp("to_out.0").linear(o, c, c)
    }

    /// BasicTransformerBlock: self-attention, cross-attention on the
    /// context, GEGLU feed-forward, each pre-normed and residual.
    fn transformer_block<'a>(&self, vb: &Scope<'a>, x: T<'a>, context: T<'a>, c: usize) -> R<'a> {
        let n = vb.pp("norm1").layer_norm(x, c, 1e-5)?;
        let x = self.attention(&vb.pp("attn1"), n, n, c)?.add(x)?;
        let n = vb.pp("norm2").layer_norm(x, c, 1e-5)?;
        let x = self.attention(&vb.pp("attn2"), n, context, c)?.add(x)?;
        let n = vb.pp("norm3").layer_norm(x, c, 1e-5)?;
        let inner = 4 * c;
        let p = vb.pp("ff.net.0.proj").linear(n, c, 2 * inner)?;
        // GEGLU: the first half is the value, the second the gate.
        let ff = p
            .slice(2, 0, inner)?
            .mul(p.slice(2, inner, 2 * inner)?.gelu_erf())?;
        vb.pp("ff.net.2").linear(ff, inner, c)?.add(x)
    }

    /// SpatialTransformer with `depth` blocks; projections are 1×1 convs
    /// (SD1) or linears (SD2/SDXL), applied before/after the token reshape
    /// respectively, as ComfyUI does.
    fn spatial_transformer<'a>(
        &self,
        vb: &Scope<'a>,
        x: T<'a>,
        context: T<'a>,
        c: usize,
        depth: usize,
    ) -> R<'a> {
        let s = x.shape();
        let (b, hh, ww) = (s[0], s[2], s[3]);
        let mut h = vb.pp("norm").group_norm(x, 32, c, 1e-6)?;
        if !self.use_linear {
            h = vb.pp("proj_in").conv2d(h, c, c, 1, 1)?;
        }
        h = h.reshape(&[b, c, hh * ww])?.permute(&[0, 2, 1])?;
        if self.use_linear {
            h = vb.pp("proj_in").linear(h, c, c)?;
        }
        for i in 0..depth {
            h = self.transformer_block(&vb.pp("transformer_blocks").pp(i), h, context, c)?;
        }
        if self.use_linear {
            h = vb.pp("proj_out").linear(h, c, c)?;
        }
        h = h.permute(&[0, 2, 1])?.reshape(&[b, c, hh, ww])?;
        if !self.use_linear {
            h = vb.pp("proj_out").conv2d(h, c, c, 1, 1)?;
        }
        h.add(x)
    }
}

/// `[0, 1, …, n-1]` as an f32 vector built from graph ops: there is no
/// range op, so a `[1]` zero is doubled by concatenating `r` with `r + len`
/// (exact in f32 for any realistic `n`) and then trimmed.
pub(crate) fn range<'a>(g: &'a GraphBuilder, n: usize) -> R<'a> {
    let mut r = g.constant(0.0).reshape(&[1])?;
    let mut len = 1;
    while len < n {
        r = g.concat(&[r, r.add_scalar(len as f32)], 0)?;
        len *= 2;
    }
    if len > n {
        r = r.slice(0, 0, n)?;
    }
    Ok(r)
}

/// ComfyUI's `timestep_embedding(t, dim)` (max period 10000, cos half
/// first): `timesteps` `[b]` → `[b, dim]`. The frequencies are computed in
/// the graph in the same f32 order as PyTorch (`i * -ln(10000)`, `/ half`,
/// `exp`), so only the backend's `exp`/`sin`/`cos` rounding can differ.
pub fn timestep_embedding<'a>(g: &'a GraphBuilder, timesteps: T<'a>, dim: usize) -> R<'a> {
    let ts = timesteps.shape();
    if ts.len() != 1 || dim < 2 {
        return Err(bad(
            "timestep_embedding",
            format!("needs timesteps [b] and dim ≥ 2 (dim {dim})"),
            &[&ts],
        ));
    }
    let half = dim / 2;
    let freqs = range(g, half)?
        .mul_scalar(-(10000f64.ln() as f32))
        .div(g.constant(half as f32))?
        .exp()
        .reshape(&[1, half])?;
    let args = timesteps.reshape(&[ts[0], 1])?.mul(freqs)?;
    let emb = g.concat(&[args.cos(), args.sin()], 1)?;
    if dim % 2 == 1 {
        emb.pad(&[(0, 0), (0, 1)], 0.0)
    } else {
        Ok(emb)
    }
}

/// Whether `c` channels split into `heads`' attention heads.
fn heads_fit(heads: Heads, c: usize, xs: &[usize]) -> Result<(), ShapeError> {
    let n = heads.at(c);
    if c.is_multiple_of(n) {
        Ok(())
    } else {
        Err(bad(
            "unet",
            format!("{c} channels do not split into {n} heads"),
            &[xs],
        ))
    }
}

/// Residuals control models add inside the UNet (ComfyUI's
/// `apply_control`): `input[k]` after input block `k` (T2I-Adapters),
/// `output[i]` to input block `i`'s skip as the output blocks pop it
/// (ControlNets), `middle` after the middle block.
#[derive(Default)]
pub struct ControlResiduals<'a> {
    pub input: Vec<Option<T<'a>>>,
    pub output: Vec<T<'a>>,
    pub middle: Option<T<'a>>,
}

/// The UNet's first half: the time (and ADM) embedding, the input blocks
/// and the middle block. A ControlNet is this half with its hint added
/// after input block 0 (`hint`), so both build it here.
pub struct Encoded<'a> {
    /// The SiLU of the embedding every ResBlock takes.
    pub emb_act: T<'a>,
    /// Each input block's output, in order (the skips).
    pub skips: Vec<T<'a>>,
    /// The middle block's output.
    pub middle: T<'a>,
    /// Its channel count.
    pub channels: usize,
}

/// The shapes of [`Encoded::skips`] and of the middle block's output for
/// a `[b, _, h, w]` input: what a ControlNet's residuals must match.
pub fn skip_shapes(
    cfg: &UnetConfig,
    b: usize,
    h: usize,
    w: usize,
) -> (Vec<Vec<usize>>, Vec<usize>) {
    let mc = cfg.model_channels;
    let (mut h, mut w, mut ch) = (h, w, mc);
    let mut skips = vec![vec![b, mc, h, w]];
    let levels = cfg.channel_mult.len();
    for (level, &mult) in cfg.channel_mult.iter().enumerate() {
        for _ in 0..cfg.num_res_blocks.get(level).copied().unwrap_or(0) {
            ch = mult * mc;
            skips.push(vec![b, ch, h, w]);
        }
        if level + 1 != levels {
            // A 3×3 stride-2 convolution with padding 1.
            (h, w) = (h.div_ceil(2), w.div_ceil(2));
            skips.push(vec![b, ch, h, w]);
        }
    }
    (skips, vec![b, ch, h, w])
}

/// Builds [`Encoded`] from the weights under `vb`; see [`unet`].
#[allow(clippy::too_many_arguments)]
pub fn encode<'a>(
    g: &'a GraphBuilder,
    cfg: &UnetConfig,
    heads: Heads,
    vb: &Scope<'a>,
    x: T<'a>,
    timesteps: T<'a>,
    context: T<'a>,
    y: Option<T<'a>>,
    hint: Option<T<'a>>,
    input_residuals: &[Option<T<'a>>],
    extra_emb: Option<T<'a>>,
) -> Result<Encoded<'a>, ShapeError> {
    let (xs, cs) = (x.shape(), context.shape());
    let levels = cfg.channel_mult.len();
    let n_res: usize = cfg.num_res_blocks.iter().sum();
    let valid = xs.len() == 4
        && xs[1] == cfg.in_channels
        && cs.len() == 3
        && cs[0] == xs[0]
        && cfg.context_dim.is_none_or(|d| d == cs[2])
        && heads.at(cfg.model_channels) > 0
        && levels > 0
        && cfg.num_res_blocks.len() == levels
        && cfg.transformer_depth.len() == n_res;
    if !valid {
        return Err(bad(
            "unet",
            format!(
                "inputs or config do not fit: x must be [b, {}, h, w], context \
                 [b, tokens, {:?}], and the per-block lists must match \
                 num_res_blocks {:?}",
                cfg.in_channels, cfg.context_dim, cfg.num_res_blocks
            ),
            &[&xs, &cs],
        ));
    }
    let mc = cfg.model_channels;
    let cx = Ctx {
        heads,
        use_linear: cfg.use_linear_in_transformer,
        emb_dim: 4 * mc,
    };
    let check_heads = |c: usize| heads_fit(heads, c, &xs);

    let t_emb = timestep_embedding(g, timesteps, mc)?;
    let emb = vb.pp("time_embed.0").linear(t_emb, mc, 4 * mc)?.silu();
    let mut emb = vb.pp("time_embed.2").linear(emb, 4 * mc, 4 * mc)?;
    // A union ControlNet's type embedding, added before the ADM's.
    if let Some(e) = extra_emb {
        emb = emb.add(e)?;
    }
    match (cfg.adm_in_channels, y) {
        (None, None) => {}
        (Some(adm), Some(y)) => {
            if y.shape() != [xs[0], adm] {
                return Err(bad(
                    "unet",
                    format!("the ADM vector y must be [{}, {adm}]", xs[0]),
                    &[&y.shape()],
                ));
            }
            let label = vb.pp("label_emb.0");
            let l = label.pp(0).linear(y, adm, 4 * mc)?.silu();
            emb = emb.add(label.pp(2).linear(l, 4 * mc, 4 * mc)?)?;
        }
        (Some(adm), None) => {
            return Err(bad(
                "unet",
                format!("this UNet takes an ADM vector y of {adm} values (label_emb)"),
                &[&xs],
            ))
        }
        (None, Some(y)) => {
            return Err(bad(
                "unet",
                "an ADM vector y was given to a UNet without label_emb".into(),
                &[&y.shape()],
            ))
        }
    }
    let emb_act = emb.silu();

    let inputs = vb.pp("input_blocks");
    let mut h = inputs.pp("0.0").conv2d(x, cfg.in_channels, mc, 3, 1)?;
    if let Some(hint) = hint {
        h = h.add(hint)?;
    }
    let residual = |h: T<'a>, k: usize| match input_residuals.get(k) {
        Some(Some(r)) => h.add(*r),
        _ => Ok(h),
    };
    h = residual(h, 0)?;
    let mut skips = vec![h];
    let mut ch = mc;
    let mut id = 1;
    let mut depths = cfg.transformer_depth.iter();
    for (level, &mult) in cfg.channel_mult.iter().enumerate() {
        for _ in 0..cfg.num_res_blocks[level] {
            let cout = mult * mc;
            let block = inputs.pp(id);
            h = cx.resblock(&block.pp(0), h, emb_act, ch, cout)?;
            ch = cout;
            let depth = depths.next().copied().unwrap_or(0);
            if depth > 0 {
                check_heads(ch)?;
                h = cx.spatial_transformer(&block.pp(1), h, context, ch, depth)?;
            }
            h = residual(h, id)?;
            skips.push(h);
            id += 1;
        }
        if level + 1 != levels {
            h = inputs.pp(id).pp("0.op").conv2d(h, ch, ch, 3, 2)?;
            h = residual(h, id)?;
            skips.push(h);
            id += 1;
        }
    }

    let middle = vb.pp("middle_block");
    h = cx.resblock(&middle.pp(0), h, emb_act, ch, ch)?;
    if let Some(depth) = cfg.transformer_depth_middle {
        check_heads(ch)?;
        h = cx.spatial_transformer(&middle.pp(1), h, context, ch, depth)?;
        h = cx.resblock(&middle.pp(2), h, emb_act, ch, ch)?;
    }
    Ok(Encoded {
        emb_act,
        skips,
        middle: h,
        channels: ch,
    })
}

/// The UNet: `x` `[b, in_channels, h, w]`, `timesteps` `[b]`, `context`
/// `[b, tokens, context_dim]` → `[b, out_channels, h, w]`, weights under
/// `prefix` (e.g. `model.diffusion_model.`). `heads` splits each
/// transformer's channels into attention heads. `y` `[b, adm_in_channels]`
/// is the ADM vector a model with `label_emb` takes (SDXL: pooled text
/// and size embeddings), added to the timestep embedding as ComfyUI's
/// `num_classes == "sequential"` does. `control` adds a ControlNet's
/// residuals.
#[allow(clippy::too_many_arguments)]
pub fn unet<'a>(
    g: &'a GraphBuilder,
    cfg: &UnetConfig,
    heads: Heads,
    prefix: &str,
    x: T<'a>,
    timesteps: T<'a>,
    context: T<'a>,
    y: Option<T<'a>>,
    control: Option<ControlResiduals<'a>>,
) -> R<'a> {
    let xs = x.shape();
    let levels = cfg.channel_mult.len();
    let n_res: usize = cfg.num_res_blocks.iter().sum();
    if cfg.transformer_depth_output.len() != n_res + levels {
        return Err(bad(
            "unet",
            format!(
                "transformer_depth_output has {} entries; num_res_blocks {:?} needs {}",
                cfg.transformer_depth_output.len(),
                cfg.num_res_blocks,
                n_res + levels
            ),
            &[&xs],
        ));
    }
    let vb = Scope::new(g, prefix);
    let control = control.unwrap_or_default();
    let enc = encode(
        g,
        cfg,
        heads,
        &vb,
        x,
        timesteps,
        context,
        y,
        None,
        &control.input,
        None,
    )?;
    let mc = cfg.model_channels;
    let cx = Ctx {
        heads,
        use_linear: cfg.use_linear_in_transformer,
        emb_dim: 4 * mc,
    };
    let check_heads = |c: usize| heads_fit(heads, c, &xs);
    let emb_act = enc.emb_act;
    let mut skips = enc.skips;
    let mut h = enc.middle;
    let mut ch = enc.channels;
    let (mut control_out, control_mid) = (control.output, control.middle);
    if let Some(m) = control_mid {
        h = h.add(m)?;
    }

    // ComfyUI pops the output depths from the end: output block k uses
    // transformer_depth_output[len - 1 - k].
    let mut out_depths = cfg.transformer_depth_output.iter().rev();
    let mut id = 0;
    for level in (0..levels).rev() {
        for i in 0..=cfg.num_res_blocks[level] {
            let Some(mut skip) = skips.pop() else {
                return Err(bad("unet", "ran out of skip connections".into(), &[&xs]));
            };
            // The ControlNet residual for this skip: ComfyUI pops both
            // lists from the end together.
            if let Some(r) = control_out.pop() {
                skip = skip.add(r)?;
            }
            let ich = skip.shape()[1];
            h = g.concat(&[h, skip], 1)?;
            let cout = mc * cfg.channel_mult[level];
            let block = vb.pp("output_blocks").pp(id);
            h = cx.resblock(&block.pp(0), h, emb_act, ch + ich, cout)?;
            ch = cout;
            let mut layer = 1;
            let depth = out_depths.next().copied().unwrap_or(0);
            if depth > 0 {
                check_heads(ch)?;
                h = cx.spatial_transformer(&block.pp(1), h, context, ch, depth)?;
                layer += 1;
            }
            if level > 0 && i == cfg.num_res_blocks[level] {
                // Upsample to the next skip's size (2x, or the odd size the
                // downsampling produced), as ComfyUI passes `output_shape`.
                let (oh, ow) = match skips.last() {
                    Some(s) => {
                        let s = s.shape();
                        (s[2], s[3])
                    }
                    None => {
                        let s = h.shape();
                        (2 * s[2], 2 * s[3])
                    }
                };
                h = h.upsample(UpsampleMode::Nearest, oh, ow)?;
                h = block.pp(layer).pp("conv").conv2d(h, ch, ch, 3, 1)?;
            }
            id += 1;
        }
    }

    let h = vb.pp("out.0").group_norm(h, 32, ch, 1e-5)?.silu();
    vb.pp("out.2").conv2d(h, ch, cfg.out_channels, 3, 1)
}
