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
    /// ControlNet residuals `[b, patches, hidden]` added to the image
    /// stream after joint block `i` (ComfyUI's control "output" list).
    pub control: Vec<Option<T<'a>>>,
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
    MmditInputs {
        t,
        context,
        y,
        control,
    }: MmditInputs<'a>,
    skip: &super::SkipLayers,
) -> Result<T<'a>, ShapeError> {
    let s = x.shape();
    let (b, h, w, p, hd) = (s[0], s[2], s[3], cfg.patch, cfg.hidden);
    let (gh, gw) = (h.div_ceil(p), w.div_ceil(p));
    let vb = Scope::new(g, prefix);
    let x = patch_embed(&vb.pp("x_embedder"), x, p, hd)?;
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
        // A skipped block passes both streams through (the last block's
        // context is not read after it).
        if !skip.double.contains(&i) {
            let cur = ctx.ok_or_else(|| ShapeError {
                op: "mmdit",
                message: "a pre-only context block before the last".into(),
                shapes: Vec::new(),
            })?;
            (ctx, x) = joint_block(&vb.pp("joint_blocks").pp(i), cfg, i, cur, x, c)?;
        }
        if let Some(add) = control.get(i).copied().flatten() {
            x = x.add(add)?;
        }
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

/// A Stability SD3.5 ControlNet's sizes, as ComfyUI's
/// `load_controlnet_sd35` reads them: the width is 64 × `y_embedder`'s
/// output rows / 64 (its `depth`), one 64-wide head per 64, blocks counted
/// from `transformer_blocks.N`; `double_y_emb` when `y_embedder` maps the
/// width to itself (the pooled vector then goes through the main model's
/// `y_embedder` first).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sd35ControlConfig {
    /// The blocks' sizes (MMDiT blocks with biased qkv, no QK norm).
    pub block: MmditConfig,
    pub blocks: usize,
    pub double_y_emb: bool,
    /// The residual list's length before ComfyUI repeats each block's
    /// (`main_model_double`: the depth above).
    pub main_double: usize,
}

/// Infers an SD3.5 ControlNet's config from its file's shapes.
pub fn sd35_control_config(s: &Shapes) -> Result<Sd35ControlConfig, DetectError> {
    let y = shape(s, "y_embedder.mlp.0.weight".into(), 2, "[hidden, adm]")?;
    let depth = y[0] / HEAD;
    if depth == 0 {
        return Err(DetectError::BadShape {
            name: "y_embedder.mlp.0.weight".into(),
            shape: y,
            expected: "at least 64 rows",
        });
    }
    let hidden = HEAD * depth;
    let hint = shape(
        s,
        "pos_embed_input.proj.weight".into(),
        4,
        "[hidden, channels, p, p]",
    )?;
    let mlp = shape(
        s,
        "transformer_blocks.0.mlp.fc1.weight".into(),
        2,
        "[mlp, hidden]",
    )?[0];
    let blocks = (0..)
        .take_while(|n| s.contains_key(&format!("transformer_blocks.{n}.attn.qkv.weight")))
        .count();
    Ok(Sd35ControlConfig {
        block: MmditConfig {
            in_channels: hint[1],
            out_channels: hint[1],
            patch: hint[2],
            hidden,
            heads: depth,
            blocks,
            mlp,
            adm_in: Some(y[1]),
            context_in: 0,
            pos_embed_max: 0,
            qk_norm: false,
            qkv_bias: true,
            dual_attention: Vec::new(),
        },
        blocks,
        double_y_emb: y[0] == y[1],
        main_double: depth,
    })
}

/// `x` `[b, c, h, w]` padded circularly to whole `p`×`p` patches, through
/// the strided convolution `proj`: `[b, patches, hidden]`.
fn patch_embed<'a>(vb: &Scope<'a>, x: T<'a>, p: usize, hidden: usize) -> Result<T<'a>, ShapeError> {
    let g = vb.graph();
    let s = x.shape();
    let (b, c, h, w) = (s[0], s[1], s[2], s[3]);
    let (gh, gw) = (h.div_ceil(p), w.div_ceil(p));
    let mut x = x;
    if gh * p != h {
        x = g.concat(&[x, x.slice(2, 0, gh * p - h)?], 2)?;
    }
    if gw * p != w {
        x = g.concat(&[x, x.slice(3, 0, gw * p - w)?], 3)?;
    }
    let proj = vb.pp("proj");
    x.conv2d(
        proj.get("weight", &[hidden, c, p, p])?,
        Some(proj.get("bias", &[hidden])?),
        Conv2dParams {
            stride: [p, p],
            padding: [0, 0],
            dilation: [1, 1],
            groups: 1,
        },
    )?
    .reshape(&[b, hidden, gh * gw])?
    .permute(&[0, 2, 1])
}

/// ComfyUI's `get_2d_sincos_pos_embed_torch(width, gw, gh)` as f32
/// `[gh·gw, width]`: grids over ±7.5·side/min-side around 7.5 (torch's
/// f32 `linspace`), each token `[sin, cos](w·ω) ‖ [sin, cos](h·ω)`, ω_i =
/// 1 / 10000^(i / (width/4)) for i < width/4.
pub fn sincos_pos_embed(width: usize, gw: usize, gh: usize) -> Vec<f32> {
    let small = gh.min(gw) as f64;
    let linspace = |half: f64, n: usize| -> Vec<f32> {
        let (start, end) = ((7.5 - half) as f32, (7.5 + half) as f32);
        if n == 1 {
            return vec![start];
        }
        let step = (end - start) / (n - 1) as f32;
        (0..n)
            .map(|i| {
                if i < n / 2 {
                    start + step * i as f32
                } else {
                    end - step * (n - 1 - i) as f32
                }
            })
            .collect()
    };
    let hs = linspace(gh as f64 / small * 7.5, gh);
    let ws = linspace(gw as f64 / small * 7.5, gw);
    let quarter = width / 4;
    let omega: Vec<f32> = (0..quarter)
        .map(|i| 1.0 / 10000f32.powf(i as f32 / quarter as f32))
        .collect();
    let mut out = Vec::with_capacity(gh * gw * width);
    for &py in &hs {
        for &px in &ws {
            for pos in [px, py] {
                out.extend(omega.iter().map(|&o| (pos * o).sin()));
                out.extend(omega.iter().map(|&o| (pos * o).cos()));
            }
        }
    }
    out
}

/// An SD3.5 ControlNet (ComfyUI's `ControlNetEmbedder`): the main model's
/// `x_embedder` (under `main`) on `x` plus the sin-cos position table
/// `pos` `[1, patches, width]`, or with a double `y` embedding its own
/// `x_embedder` alone;
/// `c` the timestep's embedding plus `y`'s (through the main model's
/// `y_embedder` first when double); `pos_embed_input` on the encoded
/// `hint` added; then each block on `(x, c)` (x carried on only without
/// the double embedding) through its `controlnet_blocks` Linear. Returns
/// one residual per block.
#[allow(clippy::too_many_arguments)]
pub fn sd35_controlnet<'a>(
    g: &'a GraphBuilder,
    cfg: &Sd35ControlConfig,
    main: &str,
    x: T<'a>,
    t: T<'a>,
    y: T<'a>,
    hint: T<'a>,
    pos: Option<T<'a>>,
) -> Result<Vec<T<'a>>, ShapeError> {
    let vb = Scope::new(g, "");
    let mv = Scope::new(g, main);
    let (bc, hd, p) = (&cfg.block, cfg.block.hidden, cfg.block.patch);
    // ComfyUI's pre_run copies the model's `x_embedder` into a net without
    // the double embedding; one with it keeps its own.
    let xe = if cfg.double_y_emb { &vb } else { &mv };
    let mut x = patch_embed(&xe.pp("x_embedder"), x, p, hd)?;
    if let Some(pos) = pos.filter(|_| !cfg.double_y_emb) {
        x = x.add(pos)?;
    }
    let mlp = |vb: &Scope<'a>, v: T<'a>, cin: usize| -> Result<T<'a>, ShapeError> {
        let h = vb.pp("mlp.0").linear(v, cin, hd)?.silu();
        vb.pp("mlp.2").linear(h, hd, hd)
    };
    let te = timestep_embedding(g, t, 256)?;
    let mut c = mlp(&vb.pp("t_embedder"), te, 256)?;
    let adm = bc.adm_in.unwrap_or(hd);
    let y = if cfg.double_y_emb {
        let main_adm = y.shape()[1];
        let y = mlp(&mv.pp("y_embedder"), y, main_adm)?;
        mlp(&vb.pp("y_embedder"), y, hd)?
    } else {
        mlp(&vb.pp("y_embedder"), y, adm)?
    };
    c = c.add(y)?;
    let x0 = x.add(patch_embed(&vb.pp("pos_embed_input"), hint, p, hd)?)?;
    let mut x = x0;
    let mut outs = Vec::with_capacity(cfg.blocks);
    for i in 0..cfg.blocks {
        let blk = vb.pp("transformer_blocks").pp(i);
        let m = ada(&blk, c, 6, hd)?;
        let [q, k, v] = qkv(&blk.pp("attn"), bc, modulate(x, m[0], m[1])?)?;
        let out = post(&blk, bc, x, attend(q, k, v)?, &m, None)?;
        outs.push(vb.pp("controlnet_blocks").pp(i).linear(out, hd, hd)?);
        if !cfg.double_y_emb {
            x = out;
        }
    }
    Ok(outs)
}
