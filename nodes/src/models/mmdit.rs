//! SD3 / SD3.5's MMDiT as a tensor graph, with the key names of
//! `sd3_medium` / `sd3.5_*` checkpoints (`joint_blocks.N.{context_block,
//! x_block}`, `x_embedder`, `pos_embed`, `t_embedder`, `y_embedder`,
//! `context_embedder`, `final_layer`), as ComfyUI's
//! `comfy/ldm/modules/diffusionmodules/mmdit.py` runs it.
//!
//! The latent is cut into p×p patches by a strided convolution and given
//! the centre crop of a learned position table; each joint block
//! modulates (shift, scale, gate from SiLU(c)) a context stream and an
//! image stream and attends over both (context first). The last block's
//! context side only feeds the attention. SD3.5 Large adds RMS-normed
//! queries and keys; SD3.5 Medium's first blocks (MMDiT-X) add a second,
//! image-only attention on the same normalised input.

use super::detect::{shape_of as shape, DetectError, Shapes};
use super::unet::timestep_embedding;
use sdkit_compute::tensor::{Conv2dParams, GraphBuilder, Scope, ShapeError, T};

/// An MMDiT's sizes, all from shapes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MmditConfig {
    pub in_channels: usize,
    pub out_channels: usize,
    pub patch: usize,
    pub hidden: usize,
    /// ComfyUI's rule: 64-wide heads (`num_heads = depth = hidden / 64`).
    pub heads: usize,
    pub blocks: usize,
    pub mlp: usize,
    /// The pooled vector's width (`y_embedder`; CLIP-L ‖ CLIP-G: 2048).
    pub adm_in: Option<usize>,
    /// The context's width (`context_embedder`; T5-XXL: 4096).
    pub context_in: usize,
    /// Side of the square position table.
    pub pos_embed_max: usize,
    pub qk_norm: bool,
    pub qkv_bias: bool,
    /// Blocks whose image side has MMDiT-X's second attention.
    pub dual_attention: Vec<usize>,
}

const HEAD: usize = 64;

/// Infers an MMDiT's config from the shapes under `prefix`.
pub fn mmdit_config(s: &Shapes, prefix: &str) -> Result<MmditConfig, DetectError> {
    let k = |n: &str| format!("{prefix}{n}");
    let xe = shape(
        s,
        k("x_embedder.proj.weight"),
        4,
        "[hidden, channels, p, p]",
    )?;
    let (hidden, in_channels, patch) = (xe[0], xe[1], xe[2]);
    if hidden < HEAD || !hidden.is_multiple_of(HEAD) || patch == 0 {
        return Err(DetectError::BadShape {
            name: k("x_embedder.proj.weight"),
            shape: xe,
            expected: "a hidden width that is a multiple of 64 and a patch size",
        });
    }
    let out = shape(
        s,
        k("final_layer.linear.weight"),
        2,
        "[p² × channels, hidden]",
    )?;
    let pos = shape(s, k("pos_embed"), 3, "[1, side², hidden]")?;
    let side = (pos[1] as f64).sqrt().round() as usize;
    let context_in = shape(s, k("context_embedder.weight"), 2, "[hidden, context]")?[1];
    let mlp = shape(
        s,
        k("joint_blocks.0.x_block.mlp.fc1.weight"),
        2,
        "[mlp, hidden]",
    )?[0];
    let adm_in = match s.get(&k("y_embedder.mlp.0.weight")) {
        Some(sh) if sh.len() == 2 => Some(sh[1]),
        _ => None,
    };
    let blocks = (0..)
        .take_while(|n| s.contains_key(&k(&format!("joint_blocks.{n}.x_block.attn.qkv.weight"))))
        .count();
    let dual_attention = (0..blocks)
        .filter(|n| s.contains_key(&k(&format!("joint_blocks.{n}.x_block.attn2.qkv.weight"))))
        .collect();
    Ok(MmditConfig {
        in_channels,
        out_channels: out[0] / (patch * patch),
        patch,
        hidden,
        heads: hidden / HEAD,
        blocks,
        mlp,
        adm_in,
        context_in,
        pos_embed_max: side,
        qk_norm: s.contains_key(&k("joint_blocks.0.x_block.attn.ln_q.weight")),
        qkv_bias: s.contains_key(&k("joint_blocks.0.x_block.attn.qkv.bias")),
        dual_attention,
    })
}

/// `n` modulation chunks `[b, 1, hidden]` of `adaLN_modulation.1(SiLU(c))`.
fn ada<'a>(vb: &Scope<'a>, c: T<'a>, n: usize, hidden: usize) -> Result<Vec<T<'a>>, ShapeError> {
    let b = c.shape()[0];
    let m = vb
        .pp("adaLN_modulation.1")
        .linear(c.silu(), hidden, n * hidden)?
        .reshape(&[b, 1, n * hidden])?;
    (0..n)
        .map(|i| m.slice(2, i * hidden, (i + 1) * hidden))
        .collect()
}

/// `LayerNorm(x) · (1 + scale) + shift` (no affine, eps 1e-6).
fn modulate<'a>(x: T<'a>, shift: T<'a>, scale: T<'a>) -> Result<T<'a>, ShapeError> {
    x.layer_norm(None, None, 1e-6)?
        .mul(scale.add_scalar(1.0))?
        .add(shift)
}

/// q, k, v `[b, heads, len, 64]` of `attn` on `h` `[b, len, hidden]`.
fn qkv<'a>(attn: &Scope<'a>, cfg: &MmditConfig, h: T<'a>) -> Result<[T<'a>; 3], ShapeError> {
    let s = h.shape();
    let (b, len, hd) = (s[0], s[1], cfg.hidden);
    let p = if cfg.qkv_bias {
        attn.pp("qkv").linear(h, hd, 3 * hd)?
    } else {
        attn.pp("qkv").linear_no_bias(h, hd, 3 * hd)?
    };
    let p = p.reshape(&[b, len, 3, hd])?;
    let part = |i: usize| -> Result<T<'a>, ShapeError> {
        p.slice(2, i, i + 1)?
            .reshape(&[b, len, cfg.heads, HEAD])?
            .permute(&[0, 2, 1, 3])
    };
    let (mut q, mut k) = (part(0)?, part(1)?);
    if cfg.qk_norm {
        q = q.rms_norm(Some(attn.pp("ln_q").get("weight", &[HEAD])?), 1e-6)?;
        k = k.rms_norm(Some(attn.pp("ln_k").get("weight", &[HEAD])?), 1e-6)?;
    }
    Ok([q, k, part(2)?])
}

/// Attention output heads merged back: `[b, len, hidden]`.
fn attend<'a>(q: T<'a>, k: T<'a>, v: T<'a>) -> Result<T<'a>, ShapeError> {
    let s = q.shape();
    q.attention(k, v, None, 1.0 / (HEAD as f32).sqrt())?
        .permute(&[0, 2, 1, 3])?
        .reshape(&[s[0], s[2], s[1] * s[3]])
}

/// `x + gate·proj(attn)`, then the gated MLP on the modulated norm.
fn post<'a>(
    vb: &Scope<'a>,
    cfg: &MmditConfig,
    x: T<'a>,
    attn: T<'a>,
    m: &[T<'a>],
    extra: Option<(T<'a>, T<'a>)>,
) -> Result<T<'a>, ShapeError> {
    let hd = cfg.hidden;
    let mut x = x.add(m[2].mul(vb.pp("attn.proj").linear(attn, hd, hd)?)?)?;
    if let Some((attn2, gate2)) = extra {
        x = x.add(gate2.mul(vb.pp("attn2.proj").linear(attn2, hd, hd)?)?)?;
    }
    let h = modulate(x, m[3], m[4])?;
    let h = vb.pp("mlp.fc1").linear(h, hd, cfg.mlp)?.gelu();
    let h = vb.pp("mlp.fc2").linear(h, cfg.mlp, hd)?;
    x.add(m[5].mul(h)?)
}

fn joint_block<'a>(
    vb: &Scope<'a>,
    cfg: &MmditConfig,
    i: usize,
    ctx: T<'a>,
    x: T<'a>,
    c: T<'a>,
) -> Result<(Option<T<'a>>, T<'a>), ShapeError> {
    let g = vb.graph();
    let hd = cfg.hidden;
    let last = i + 1 == cfg.blocks;
    let dual = cfg.dual_attention.contains(&i);
    let cb = vb.pp("context_block");
    let xb = vb.pp("x_block");
    let cm = ada(&cb, c, if last { 2 } else { 6 }, hd)?;
    let xm = ada(&xb, c, if dual { 9 } else { 6 }, hd)?;
    let [cq, ck, cv] = qkv(&cb.pp("attn"), cfg, modulate(ctx, cm[0], cm[1])?)?;
    let xn = x.layer_norm(None, None, 1e-6)?;
    let xh = xn.mul(xm[1].add_scalar(1.0))?.add(xm[0])?;
    let [xq, xk, xv] = qkv(&xb.pp("attn"), cfg, xh)?;
    let q = g.concat(&[cq, xq], 2)?;
    let k = g.concat(&[ck, xk], 2)?;
    let v = g.concat(&[cv, xv], 2)?;
    let a = attend(q, k, v)?;
    let ctx_len = ctx.shape()[1];
    let total = a.shape()[1];
    let x_attn = a.slice(1, ctx_len, total)?;
    let extra = if dual {
        let h2 = xn.mul(xm[7].add_scalar(1.0))?.add(xm[6])?;
        let [q2, k2, v2] = qkv(&xb.pp("attn2"), cfg, h2)?;
        Some((attend(q2, k2, v2)?, xm[8]))
    } else {
        None
    };
    let x = post(&xb, cfg, x, x_attn, &xm, extra)?;
    let ctx = if last {
        None
    } else {
        Some(post(&cb, cfg, ctx, a.slice(1, 0, ctx_len)?, &cm, None)?)
    };
    Ok((ctx, x))
}

/// The inputs of [`mmdit`] beside the latent.
pub struct MmditInputs<'a> {
    /// ComfyUI's timestep (1000·σ) `[b]`.
    pub t: T<'a>,
    /// `[b, tokens, context_in]`.
    pub context: T<'a>,
    /// The pooled vector `[b, adm_in]`.
    pub y: Option<T<'a>>,
}

/// The model: `x` `[b, in_channels, h, w]`, `t` `[b]` (ComfyUI's timestep,
/// 1000·σ), `context` `[b, tokens, context_in]`, `y` `[b, adm_in]` →
/// `[b, out_channels, h, w]`; the joint blocks `skip.double` names pass
/// their streams through. Odd sides are padded circularly to whole
/// patches and cropped after.
pub fn mmdit<'a>(
    g: &'a GraphBuilder,
    cfg: &MmditConfig,
    prefix: &str,
    x: T<'a>,
    MmditInputs { t, context, y }: MmditInputs<'a>,
    skip: &super::SkipLayers,
) -> Result<T<'a>, ShapeError> {
    let s = x.shape();
    let (b, h, w, p, hd) = (s[0], s[2], s[3], cfg.patch, cfg.hidden);
    let (gh, gw) = (h.div_ceil(p), w.div_ceil(p));
    let vb = Scope::new(g, prefix);
    let mut x = x;
    if gh * p != h {
        x = g.concat(&[x, x.slice(2, 0, gh * p - h)?], 2)?;
    }
    if gw * p != w {
        x = g.concat(&[x, x.slice(3, 0, gw * p - w)?], 3)?;
    }
    let emb = vb.pp("x_embedder.proj");
    let x = x.conv2d(
        emb.get("weight", &[hd, cfg.in_channels, p, p])?,
        Some(emb.get("bias", &[hd])?),
        Conv2dParams {
            stride: [p, p],
            padding: [0, 0],
            dilation: [1, 1],
            groups: 1,
        },
    )?;
    let x = x.reshape(&[b, hd, gh * gw])?.permute(&[0, 2, 1])?;
    // The centre crop of the position table.
    let m = cfg.pos_embed_max;
    if gh > m || gw > m {
        return Err(ShapeError {
            op: "mmdit",
            message: format!("a {gh}×{gw}-patch latent is larger than the {m}×{m} position table"),
            shapes: vec![s.clone()],
        });
    }
    let (top, left) = ((m - gh) / 2, (m - gw) / 2);
    let pos = vb
        .get("pos_embed", &[1, m * m, hd])?
        .reshape(&[m, m, hd])?
        .slice(0, top, top + gh)?
        .slice(1, left, left + gw)?
        .reshape(&[1, gh * gw, hd])?;
    let mut x = x.add(pos)?;
    let te = timestep_embedding(g, t, 256)?;
    let mlp = |name: &str, v: T<'a>, cin: usize| -> Result<T<'a>, ShapeError> {
        let h = vb.pp(name).pp("mlp.0").linear(v, cin, hd)?.silu();
        vb.pp(name).pp("mlp.2").linear(h, hd, hd)
    };
    let mut c = mlp("t_embedder", te, 256)?;
    if let (Some(y), Some(adm)) = (y, cfg.adm_in) {
        c = c.add(mlp("y_embedder", y, adm)?)?;
    }
    let mut ctx = Some(
        vb.pp("context_embedder")
            .linear(context, cfg.context_in, hd)?,
    );
    for i in 0..cfg.blocks {
        if skip.double.contains(&i) {
            // Both streams pass through (the last block's context is
            // not read after it).
            continue;
        }
        let cur = ctx.ok_or_else(|| ShapeError {
            op: "mmdit",
            message: "a pre-only context block before the last".into(),
            shapes: Vec::new(),
        })?;
        (ctx, x) = joint_block(&vb.pp("joint_blocks").pp(i), cfg, i, cur, x, c)?;
    }
    let fl = vb.pp("final_layer");
    let m = ada(&fl, c, 2, hd)?;
    let x = modulate(x, m[0], m[1])?;
    let oc = cfg.out_channels;
    let x = fl.pp("linear").linear(x, hd, p * p * oc)?;
    // n (h w) (p q c) -> n c (h p) (w q), through [n·h, w, p, q, c].
    let out = x
        .reshape(&[b * gh, gw, p, p, oc])?
        .permute(&[0, 2, 1, 3, 4])?
        .reshape(&[b, gh * p, gw * p, oc])?
        .permute(&[0, 3, 1, 2])?;
    if gh * p != h || gw * p != w {
        out.slice(2, 0, h)?.slice(3, 0, w)
    } else {
        Ok(out)
    }
}
