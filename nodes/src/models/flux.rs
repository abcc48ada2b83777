//! The Flux transformer (Flux.1 dev and schnell) as a tensor graph, with
//! the key names of `flux1-dev.safetensors`, as ComfyUI's
//! `comfy/ldm/flux` runs it.
//!
//! The latent is cut into 2×2 patches; image tokens and T5 text tokens go
//! through double-stream blocks (each stream its own weights, one joint
//! attention over text then image) and single-stream blocks (one
//! parallel attention + MLP layer over the joined sequence), every block
//! modulated (shift, scale, gate) from one vector: the timestep's, the
//! guidance's (dev) and the pooled CLIP-L output's embeddings summed.
//! Queries and keys are RMS-normed per head and rotated by a 3-axis RoPE
//! over (index, row, column) positions; text tokens sit at position 0.
//!
//! Chroma is the same network with the per-block modulation layers (and
//! the time, guidance and pooled-vector embedders) replaced by one
//! "distilled guidance" approximator: an MLP that maps (timestep,
//! guidance, row index) embeddings to 344 modulation vectors, sliced per
//! block as ComfyUI's `get_modulations` does.

use super::detect::{shape_of as shape, DetectError, Shapes};
use super::unet::timestep_embedding;
use sdkit_compute::tensor::{Conv2dParams, GraphBuilder, Scope, ShapeError, T};

/// A Flux model's sizes, all from shapes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FluxConfig {
    /// Latent channels (before patching).
    pub in_channels: usize,
    pub out_channels: usize,
    pub hidden: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub mlp: usize,
    pub depth: usize,
    pub depth_single: usize,
    /// The pooled text vector's width (`vector_in`; CLIP-L: 768).
    pub vec_in: usize,
    /// The text context's width (`txt_in`; T5-XXL: 4096).
    pub context_in: usize,
    /// Dev has a guidance embedding; schnell does not.
    pub guidance: bool,
    pub qkv_bias: bool,
    /// RoPE widths of the (index, row, column) axes: [16, 56, 56] for
    /// 128-wide heads, scaled with the head width.
    pub axes_dim: [usize; 3],
    pub theta: u32,
    /// Chroma's modulation approximator, where the file has one.
    pub approximator: Option<Approximator>,
}

/// Chroma's `distilled_guidance_layer` sizes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Approximator {
    /// 64: 16 + 16 + 32 embedding channels.
    pub in_dim: usize,
    pub hidden: usize,
    pub layers: usize,
}

/// Rows of Chroma's modulation table (3 per single block, 12 per double
/// block, 2 for the final layer, for the full model's 38 and 19).
pub const CHROMA_MODULATIONS: usize = 344;

/// Patch side.
pub const PATCH: usize = 2;

fn count(s: &Shapes, prefix: &str) -> usize {
    (0..)
        .take_while(|n| {
            let p = format!("{prefix}{n}.");
            s.range(p.clone()..)
                .next()
                .is_some_and(|(k, _)| k.starts_with(&p))
        })
        .count()
}

/// Infers a Flux model's config from the shapes under `prefix`.
pub fn flux_config(s: &Shapes, prefix: &str) -> Result<FluxConfig, DetectError> {
    let k = |n: &str| format!("{prefix}{n}");
    let img_in = shape(s, k("img_in.weight"), 2, "[hidden, channels × 4]")?;
    let hidden = img_in[0];
    let norm = shape(
        s,
        k("double_blocks.0.img_attn.norm.query_norm.scale"),
        1,
        "[head_dim]",
    )?;
    let head_dim = norm[0];
    let bad = |name: String, shape: Vec<usize>, expected| DetectError::BadShape {
        name,
        shape,
        expected,
    };
    if head_dim == 0 || !hidden.is_multiple_of(head_dim) || !(16 * head_dim).is_multiple_of(128 * 2)
    {
        return Err(bad(
            k("double_blocks.0.img_attn.norm.query_norm.scale"),
            norm,
            "a head width dividing the hidden width, a multiple of 16 (RoPE axes 16:56:56)",
        ));
    }
    // A ControlNet has no final layer: it puts out what it takes.
    let out = if s.contains_key(&k("final_layer.linear.weight")) {
        shape(
            s,
            k("final_layer.linear.weight"),
            2,
            "[channels × 4, hidden]",
        )?
    } else {
        img_in.clone()
    };
    let mlp = shape(s, k("double_blocks.0.img_mlp.0.weight"), 2, "[mlp, hidden]")?[0];
    let approximator = if s.contains_key(&k("distilled_guidance_layer.in_proj.weight")) {
        let inp = shape(
            s,
            k("distilled_guidance_layer.in_proj.weight"),
            2,
            "[hidden, 64]",
        )?;
        Some(Approximator {
            in_dim: inp[1],
            hidden: inp[0],
            layers: count(s, &k("distilled_guidance_layer.layers.")),
        })
    } else {
        None
    };
    // Chroma has no pooled-vector input.
    let vec_in = match approximator {
        Some(_) => 0,
        None => shape(s, k("vector_in.in_layer.weight"), 2, "[hidden, vec_in]")?[1],
    };
    let context_in = shape(s, k("txt_in.weight"), 2, "[hidden, context]")?[1];
    let axes_dim = [
        16 * head_dim / 128,
        56 * head_dim / 128,
        56 * head_dim / 128,
    ];
    Ok(FluxConfig {
        in_channels: img_in[1] / (PATCH * PATCH),
        out_channels: out[0] / (PATCH * PATCH),
        hidden,
        heads: hidden / head_dim,
        head_dim,
        mlp,
        depth: count(s, &k("double_blocks.")),
        depth_single: count(s, &k("single_blocks.")),
        vec_in,
        context_in,
        // Chroma's approximator always takes a guidance (0 by default).
        guidance: approximator.is_some() || s.contains_key(&k("guidance_in.in_layer.weight")),
        qkv_bias: s.contains_key(&k("double_blocks.0.img_attn.qkv.bias")),
        axes_dim,
        theta: 10000,
        approximator,
    })
}

/// Patch grid of an `h × w` latent (padded up to even sides).
pub fn grid(h: usize, w: usize) -> (usize, usize) {
    (h.div_ceil(PATCH), w.div_ceil(PATCH))
}

/// How Kontext places reference latents in RoPE space
/// (`ref_latents_method`; FluxKontextMultiReferenceLatentMethod).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RefMethod {
    /// Index 1, each reference beside or below the previous ones.
    #[default]
    Offset,
    /// Index 1, 2, … per reference, all at (0, 0).
    Index,
    /// Index 0, past the image's own grid (UXO/USO).
    Uxo,
}

/// One grid of patches in RoPE space: position `(index, h0 + row, w0 +
/// col)` for `rows × cols` patches.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Placement {
    pub index: f64,
    pub h0: usize,
    pub w0: usize,
    pub rows: usize,
    pub cols: usize,
}

/// Where ComfyUI's Flux `_forward` puts the patches of reference latents
/// of `(h, w)` latent pixels each, for an image of `h × w` latent pixels:
/// offsets are in latent pixels, rounded to patches as `process_img`
/// does.
pub fn ref_placements(
    (h, w): (usize, usize),
    refs: &[(usize, usize)],
    method: RefMethod,
) -> Vec<Placement> {
    let (rows, cols) = grid(h, w);
    let patches = |v: usize| (v + PATCH / 2) / PATCH;
    let (mut sh, mut sw, mut index) = (0usize, 0usize, 0usize);
    refs.iter()
        .map(|&(rh, rw)| {
            let (ho, wo) = match method {
                RefMethod::Index => {
                    index += 1;
                    (0, 0)
                }
                RefMethod::Uxo => {
                    index = 0;
                    let at = (rows * PATCH + sh, cols * PATCH + sw);
                    sh += rh;
                    sw += rw;
                    at
                }
                RefMethod::Offset => {
                    index = 1;
                    let at = if rh + sh > rw + sw { (0, sw) } else { (sh, 0) };
                    sh = sh.max(rh + at.0);
                    sw = sw.max(rw + at.1);
                    at
                }
            };
            let (r, c) = grid(rh, rw);
            Placement {
                index: index as f64,
                h0: patches(ho),
                w0: patches(wo),
                rows: r,
                cols: c,
            }
        })
        .collect()
}

/// The RoPE rotations `[1, txt + rows·cols, head_dim/2, 2, 2]` for `txt`
/// text tokens at position (0, 0, 0) then the image patches at (0, row,
/// col), as ComfyUI's `EmbedND`: per axis, angle `pos · θ^(−2i/dim)` in
/// f64, cos/sin rounded to f32; matrices `[[cos, −sin], [sin, cos]]`.
pub fn rope_table(cfg: &FluxConfig, txt: usize, rows: usize, cols: usize) -> Vec<f32> {
    rope_table_with(cfg, txt, rows, cols, &[])
}

/// [`rope_table`] followed by the patches of reference latents (Kontext)
/// at their [`Placement`]s.
pub fn rope_table_with(
    cfg: &FluxConfig,
    txt: usize,
    rows: usize,
    cols: usize,
    refs: &[Placement],
) -> Vec<f32> {
    let half = cfg.head_dim / 2;
    let extra: usize = refs.iter().map(|p| p.rows * p.cols).sum();
    let mut out = Vec::with_capacity((txt + rows * cols + extra) * half * 4);
    // ComfyUI: scale = linspace(0, (dim − 2)/dim, dim/2) in f64, omega =
    // 1/θ^scale; the position (an f32) times omega in f64.
    let omegas: Vec<Vec<f64>> = cfg
        .axes_dim
        .iter()
        .map(|&dim| {
            let n = dim / 2;
            (0..n)
                .map(|i| {
                    let end = (dim as f64 - 2.0) / dim as f64;
                    let scale = if n > 1 {
                        // torch.linspace: start + i·step, the upper half
                        // computed from the end (as torch does).
                        let step = end / (n - 1) as f64;
                        if i < n / 2 {
                            i as f64 * step
                        } else {
                            end - (n - 1 - i) as f64 * step
                        }
                    } else {
                        0.0
                    };
                    1.0 / f64::from(cfg.theta).powf(scale)
                })
                .collect()
        })
        .collect();
    let mut push = |pos: [f64; 3]| {
        for (axis, om) in omegas.iter().enumerate() {
            for &o in om {
                let a = pos[axis] * o;
                let (c, s) = (a.cos() as f32, a.sin() as f32);
                out.extend_from_slice(&[c, -s, s, c]);
            }
        }
    };
    for _ in 0..txt {
        push([0.0; 3]);
    }
    for r in 0..rows {
        for c in 0..cols {
            push([0.0, r as f64, c as f64]);
        }
    }
    for p in refs {
        for r in 0..p.rows {
            for c in 0..p.cols {
                push([p.index, (p.h0 + r) as f64, (p.w0 + c) as f64]);
            }
        }
    }
    out
}

/// `in_layer` → SiLU → `out_layer`.
fn mlp_embedder<'a>(
    vb: &Scope<'a>,
    x: T<'a>,
    cin: usize,
    hidden: usize,
) -> Result<T<'a>, ShapeError> {
    let h = vb.pp("in_layer").linear(x, cin, hidden)?.silu();
    vb.pp("out_layer").linear(h, hidden, hidden)
}

/// The modulation chunks `[b, 1, hidden]` of `lin(silu(vec))`.
fn modulation<'a>(
    vb: &Scope<'a>,
    vec: T<'a>,
    n: usize,
    hidden: usize,
) -> Result<Vec<T<'a>>, ShapeError> {
    let b = vec.shape()[0];
    let m = vb
        .pp("lin")
        .linear(vec.silu(), hidden, n * hidden)?
        .reshape(&[b, 1, n * hidden])?;
    (0..n)
        .map(|i| m.slice(2, i * hidden, (i + 1) * hidden))
        .collect()
}

/// `LayerNorm(x) · (1 + scale) + shift` (no affine LayerNorm, eps 1e-6).
fn modulate<'a>(x: T<'a>, shift: T<'a>, scale: T<'a>) -> Result<T<'a>, ShapeError> {
    x.layer_norm(None, None, 1e-6)?
        .mul(scale.add_scalar(1.0))?
        .add(shift)
}

/// q, k, v `[b, heads, len, head_dim]` of a fused qkv projection
/// `[b, len, 3·hidden]`, q and k RMS-normed by `norm`.
fn qkv<'a>(
    norm: &Scope<'a>,
    t: T<'a>,
    heads: usize,
    d: usize,
) -> Result<(T<'a>, T<'a>, T<'a>), ShapeError> {
    let s = t.shape();
    let (b, len) = (s[0], s[1]);
    let t = t.reshape(&[b, len, 3, heads * d])?;
    let part = |i: usize| -> Result<T<'a>, ShapeError> {
        t.slice(2, i, i + 1)?
            .reshape(&[b, len, heads, d])?
            .permute(&[0, 2, 1, 3])
    };
    let q = part(0)?.rms_norm(Some(norm.pp("query_norm").get("scale", &[d])?), 1e-6)?;
    let k = part(1)?.rms_norm(Some(norm.pp("key_norm").get("scale", &[d])?), 1e-6)?;
    Ok((q, k, part(2)?))
}

/// RoPE on q and k, attention, heads merged back: `[b, len, hidden]`.
fn attend<'a>(q: T<'a>, k: T<'a>, v: T<'a>, pe: T<'a>) -> Result<T<'a>, ShapeError> {
    let s = q.shape();
    let (b, h, len, d) = (s[0], s[1], s[2], s[3]);
    let q = q.rope(pe)?;
    let k = k.rope(pe)?;
    q.attention(k, v, None, 1.0 / (d as f32).sqrt())?
        .permute(&[0, 2, 1, 3])?
        .reshape(&[b, len, h * d])
}

/// The MLP of a double block's stream: Linear → GELU(tanh) → Linear.
fn stream_mlp<'a>(
    vb: &Scope<'a>,
    x: T<'a>,
    hidden: usize,
    mlp: usize,
) -> Result<T<'a>, ShapeError> {
    let h = vb.pp(0).linear(x, hidden, mlp)?.gelu();
    vb.pp(2).linear(h, mlp, hidden)
}

/// Where a block's (shift, scale, gate) chunks come from: Flux's own
/// modulation layers over `vec`, or rows of Chroma's table `[b, 344, hidden]`.
#[derive(Clone, Copy)]
enum Mods<'a> {
    Vec(T<'a>),
    Table(T<'a>),
}

/// The `n` chunks `[b, 1, hidden]` of a block: from its `name` layer, or
/// from table rows `row..row + n`.
fn mods<'a>(
    vb: &Scope<'a>,
    m: Mods<'a>,
    name: &str,
    row: usize,
    n: usize,
    hidden: usize,
) -> Result<Vec<T<'a>>, ShapeError> {
    match m {
        Mods::Vec(vec) => modulation(&vb.pp(name), vec, n, hidden),
        Mods::Table(t) => (row..row + n).map(|r| t.slice(1, r, r + 1)).collect(),
    }
}

fn double_block<'a>(
    vb: &Scope<'a>,
    cfg: &FluxConfig,
    img: T<'a>,
    txt: T<'a>,
    m: Mods<'a>,
    i: usize,
    pe: T<'a>,
) -> Result<(T<'a>, T<'a>), ShapeError> {
    let (hd, n) = (cfg.hidden, cfg.heads);
    let txt_len = txt.shape()[1];
    // Chroma: singles first (3 rows each), then image (6 each), then text.
    let img_row = 3 * cfg.depth_single + 6 * i;
    let im = mods(vb, m, "img_mod", img_row, 6, hd)?;
    let tm = mods(vb, m, "txt_mod", img_row + 6 * cfg.depth, 6, hd)?;
    let stream = |x: T<'a>, m: &[T<'a>], name: &str| {
        let a = vb.pp(format!("{name}_attn"));
        let h = modulate(x, m[0], m[1])?;
        let proj = if cfg.qkv_bias {
            a.pp("qkv").linear(h, hd, 3 * hd)?
        } else {
            a.pp("qkv").linear_no_bias(h, hd, 3 * hd)?
        };
        qkv(&a.pp("norm"), proj, n, cfg.head_dim)
    };
    let (iq, ik, iv) = stream(img, &im, "img")?;
    let (tq, tk, tv) = stream(txt, &tm, "txt")?;
    let g = vb.graph();
    let q = g.concat(&[tq, iq], 2)?;
    let k = g.concat(&[tk, ik], 2)?;
    let v = g.concat(&[tv, iv], 2)?;
    let attn = attend(q, k, v, pe)?;
    let total = attn.shape()[1];
    let t_attn = attn.slice(1, 0, txt_len)?;
    let i_attn = attn.slice(1, txt_len, total)?;
    let finish = |x: T<'a>, a: T<'a>, m: &[T<'a>], name: &str| -> Result<T<'a>, ShapeError> {
        let proj = vb.pp(format!("{name}_attn")).pp("proj").linear(a, hd, hd)?;
        let x = x.add(proj.mul(m[2])?)?;
        let h = modulate(x, m[3], m[4])?;
        let h = stream_mlp(&vb.pp(format!("{name}_mlp")), h, hd, cfg.mlp)?;
        x.add(h.mul(m[5])?)
    };
    let img = finish(img, i_attn, &im, "img")?;
    let txt = finish(txt, t_attn, &tm, "txt")?;
    Ok((img, txt))
}

fn single_block<'a>(
    vb: &Scope<'a>,
    cfg: &FluxConfig,
    x: T<'a>,
    md: Mods<'a>,
    i: usize,
    pe: T<'a>,
) -> Result<T<'a>, ShapeError> {
    let hd = cfg.hidden;
    let m = mods(vb, md, "modulation", 3 * i, 3, hd)?;
    let h = modulate(x, m[0], m[1])?;
    let h = vb.pp("linear1").linear(h, hd, 3 * hd + cfg.mlp)?;
    let (q, k, v) = qkv(
        &vb.pp("norm"),
        h.slice(2, 0, 3 * hd)?,
        cfg.heads,
        cfg.head_dim,
    )?;
    let attn = attend(q, k, v, pe)?;
    let mlp = h.slice(2, 3 * hd, 3 * hd + cfg.mlp)?.gelu();
    let cat = vb.graph().concat(&[attn, mlp], 2)?;
    let out = vb.pp("linear2").linear(cat, hd + cfg.mlp, hd)?;
    x.add(out.mul(m[2])?)
}

/// Chroma's modulation table `[b, 344, hidden]`: each row's input is the
/// timestep's and guidance's 16-wide embeddings and the row index's
/// 32-wide one (Flux's `timestep_embedding`, ×1000), through `in_proj`,
/// residual RMS-normed MLP layers and `out_proj`.
fn approximate<'a>(
    g: &'a GraphBuilder,
    vb: &Scope<'a>,
    a: &Approximator,
    hidden: usize,
    t: T<'a>,
    guidance: Option<T<'a>>,
    index: T<'a>,
) -> Result<T<'a>, ShapeError> {
    let b = t.shape()[0];
    let n = CHROMA_MODULATIONS;
    let guidance = match guidance {
        Some(gd) => gd,
        None => t.mul_scalar(0.0),
    };
    let te = timestep_embedding(g, t.mul_scalar(1000.0), 16)?;
    let ge = timestep_embedding(g, guidance.mul_scalar(1000.0), 16)?;
    let tg = g
        .concat(&[te, ge], 1)?
        .reshape(&[b, 1, 32])?
        .expand(&[b, n, 32])?;
    let idx = index.reshape(&[1, n, 32])?.expand(&[b, n, 32])?;
    let x = g.concat(&[tg, idx], 2)?;
    let d = vb.pp("distilled_guidance_layer");
    let mut x = d.pp("in_proj").linear(x, a.in_dim, a.hidden)?;
    for l in 0..a.layers {
        let norm = d.pp("norms").pp(l).get("scale", &[a.hidden])?;
        let h = x.rms_norm(Some(norm), 1e-6)?;
        x = x.add(mlp_embedder(&d.pp("layers").pp(l), h, a.hidden, a.hidden)?)?;
    }
    d.pp("out_proj").linear(x, a.hidden, hidden)
}

/// The inputs of [`flux`] beside the latent.
pub struct FluxInputs<'a> {
    /// ComfyUI's timestep (σ for Flux) `[b]`.
    pub t: T<'a>,
    /// T5 context `[b, txt, context_in]`.
    pub context: T<'a>,
    /// Pooled CLIP-L `[b, vec_in]` (not Chroma).
    pub y: Option<T<'a>>,
    /// Guidance `[b]` (dev models and Chroma).
    pub guidance: Option<T<'a>>,
    /// Dev models: 1 where a row takes the guidance embedding, 0 where
    /// FluxDisableGuidance left it out (`[b]`; None: every row does).
    pub guidance_on: Option<T<'a>>,
    /// [`rope_table`] as `[1, txt + patches, head_dim/2, 2, 2]`.
    pub pe: T<'a>,
    /// Chroma: [`chroma_index_table`] as `[344, 32]`.
    pub chroma_index: Option<T<'a>>,
    /// Kontext's reference latents `[b, c, h, w]` in model space: their
    /// patches follow the image's (the `pe` rows after the image's are
    /// theirs), and only the image's come out.
    pub refs: Vec<T<'a>>,
    /// ControlNet residuals.
    pub control: FluxControl<'a>,
}

impl<'a> FluxInputs<'a> {
    /// The inputs every Flux-shaped network takes for `rows` rows of a
    /// `[tokens, dim]` context: `t`, `context`, `pooled` where the
    /// network has a vector input and `guidance` where it is guided; the
    /// rest unset (no guidance switch, Chroma table, references or
    /// ControlNet) for the caller to fill.
    pub fn text(
        g: &'a GraphBuilder,
        cfg: &FluxConfig,
        rows: usize,
        (tokens, dim): (usize, usize),
        pe: T<'a>,
    ) -> Result<Self, ShapeError> {
        Ok(FluxInputs {
            t: g.input("t", &[rows])?,
            context: g.input("context", &[rows, tokens, dim])?,
            y: if cfg.vec_in > 0 {
                Some(g.input("pooled", &[rows, cfg.vec_in])?)
            } else {
                None
            },
            guidance: if cfg.guidance {
                Some(g.input("guidance", &[rows])?)
            } else {
                None
            },
            guidance_on: None,
            pe,
            chroma_index: None,
            refs: Vec::new(),
            control: FluxControl::default(),
        })
    }
}

/// The ControlNet residuals a Flux model adds (ComfyUI's control
/// "input" and "output" lists), each `[b, image tokens, hidden]`: after
/// double block `i`, `double[i]` onto the first image tokens; after single
/// block `i`, `single[i]` onto the image tokens after the text.
#[derive(Default)]
pub struct FluxControl<'a> {
    pub double: Vec<Option<T<'a>>>,
    pub single: Vec<Option<T<'a>>>,
}

/// `x[:, at..at + n] += add` along the tokens (`n`: `add`'s tokens).
fn add_tokens<'a>(
    g: &'a GraphBuilder,
    x: T<'a>,
    at: usize,
    add: T<'a>,
) -> Result<T<'a>, ShapeError> {
    let (len, n) = (x.shape()[1], add.shape()[1]);
    if at == 0 && n == len {
        return x.add(add);
    }
    let mut parts = Vec::with_capacity(3);
    if at > 0 {
        parts.push(x.slice(1, 0, at)?);
    }
    parts.push(x.slice(1, at, at + n)?.add(add)?);
    if at + n < len {
        parts.push(x.slice(1, at + n, len)?);
    }
    g.concat(&parts, 1)
}

/// Flux's `vec`: the timestep's embedding, the guidance's (dev; rows whose
/// `guidance_on` is 0 without it), the pooled vector's.
#[allow(clippy::too_many_arguments)]
fn flux_vec<'a>(
    g: &'a GraphBuilder,
    vb: &Scope<'a>,
    cfg: &FluxConfig,
    t: T<'a>,
    guidance: Option<T<'a>>,
    guidance_on: Option<T<'a>>,
    y: Option<T<'a>>,
) -> Result<T<'a>, ShapeError> {
    let hd = cfg.hidden;
    let b = t.shape()[0];
    let temb = timestep_embedding(g, t.mul_scalar(1000.0), 256)?;
    let mut vec = mlp_embedder(&vb.pp("time_in"), temb, 256, hd)?;
    if let (true, Some(gd)) = (cfg.guidance, guidance) {
        let gemb = timestep_embedding(g, gd.mul_scalar(1000.0), 256)?;
        let mut emb = mlp_embedder(&vb.pp("guidance_in"), gemb, 256, hd)?;
        if let Some(on) = guidance_on {
            // × 1 keeps a row exact, × 0 drops its embedding.
            emb = emb.mul(on.reshape(&[b, 1])?)?;
        }
        vec = vec.add(emb)?;
    }
    if let Some(y) = y {
        vec = vec.add(mlp_embedder(&vb.pp("vector_in"), y, cfg.vec_in, hd)?)?;
    }
    Ok(vec)
}

/// The row-index embeddings of Chroma's approximator input, `[344, 32]`:
/// Flux's `timestep_embedding(1000·k, 32)` computed on the host as torch
/// does in f32 (argument rounded to f32, cos then sin). Arguments reach
/// 343,000 radians, where GPU sin/cos lose their accuracy, so the table is
/// an input rather than part of the graph.
pub fn chroma_index_table() -> Vec<f32> {
    let half = 16;
    let freqs: Vec<f32> = (0..half)
        .map(|i| (-(10000f64.ln() as f32) * i as f32 / half as f32).exp())
        .collect();
    let mut out = Vec::with_capacity(CHROMA_MODULATIONS * 2 * half);
    for k in 0..CHROMA_MODULATIONS {
        let t = (k * 1000) as f32;
        let args: Vec<f64> = freqs.iter().map(|&f| f64::from(t * f)).collect();
        out.extend(args.iter().map(|a| a.cos() as f32));
        out.extend(args.iter().map(|a| a.sin() as f32));
    }
    out
}

/// `[b, c, h, w]` → its patches `[b, rows·cols, c·4]` (`b c (h ph) (w
/// pw) -> b (h w) (c ph pw)`), odd sides padded circularly first (the
/// first row/column repeated after the last), as `pad_to_patch_size`.
fn patchify<'a>(g: &'a GraphBuilder, x: T<'a>) -> Result<T<'a>, ShapeError> {
    let s = x.shape();
    let (b, c, h, w) = (s[0], s[1], s[2], s[3]);
    let (gh, gw) = grid(h, w);
    let mut x = x;
    if gh * PATCH != h {
        x = g.concat(&[x, x.slice(2, 0, gh * PATCH - h)?], 2)?;
    }
    if gw * PATCH != w {
        x = g.concat(&[x, x.slice(3, 0, gw * PATCH - w)?], 3)?;
    }
    x.reshape(&[b * c, gh, PATCH, gw, PATCH])?
        .permute(&[0, 1, 3, 2, 4])?
        .reshape(&[b, c, gh * gw, PATCH * PATCH])?
        .permute(&[0, 2, 1, 3])?
        .reshape(&[b, gh * gw, c * PATCH * PATCH])
}

/// The model: `x` `[b, in_channels, h, w]` → `[b, out_channels, h, w]`.
/// Odd sides are padded circularly to whole patches and cropped after,
/// as ComfyUI's `pad_to_patch_size`. The blocks `skip` names pass their
/// streams through.
pub fn flux<'a>(
    g: &'a GraphBuilder,
    cfg: &FluxConfig,
    prefix: &str,
    x: T<'a>,
    inp: FluxInputs<'a>,
    skip: &super::SkipLayers,
) -> Result<T<'a>, ShapeError> {
    let s = x.shape();
    let (b, c, h, w) = (s[0], s[1], s[2], s[3]);
    let (gh, gw) = grid(h, w);
    let vb = Scope::new(g, prefix);
    let hd = cfg.hidden;
    let mut img = patchify(g, x)?;
    for r in &inp.refs {
        img = g.concat(&[img, patchify(g, *r)?], 1)?;
    }
    let mut img = vb.pp("img_in").linear(img, c * PATCH * PATCH, hd)?;
    let m = match &cfg.approximator {
        Some(a) => {
            let index = inp.chroma_index.ok_or_else(|| ShapeError {
                op: "flux",
                message: "Chroma needs its modulation index table".into(),
                shapes: Vec::new(),
            })?;
            Mods::Table(approximate(g, &vb, a, hd, inp.t, inp.guidance, index)?)
        }
        None => Mods::Vec(flux_vec(
            g,
            &vb,
            cfg,
            inp.t,
            inp.guidance,
            inp.guidance_on,
            inp.y,
        )?),
    };
    let mut txt = vb.pp("txt_in").linear(inp.context, cfg.context_in, hd)?;
    let txt_len = txt.shape()[1];
    let control = |list: &[Option<T<'a>>], i: usize| list.get(i).copied().flatten();
    for i in 0..cfg.depth {
        if !skip.double.contains(&i) {
            (img, txt) = double_block(&vb.pp("double_blocks").pp(i), cfg, img, txt, m, i, inp.pe)?;
        }
        if let Some(add) = control(&inp.control.double, i) {
            img = add_tokens(g, img, 0, add)?;
        }
    }
    let mut joint = g.concat(&[txt, img], 1)?;
    for i in 0..cfg.depth_single {
        if !skip.single.contains(&i) {
            joint = single_block(&vb.pp("single_blocks").pp(i), cfg, joint, m, i, inp.pe)?;
        }
        if let Some(add) = control(&inp.control.single, i) {
            joint = add_tokens(g, joint, txt_len, add)?;
        }
    }
    let img = joint.slice(1, txt_len, txt_len + gh * gw)?;
    // Final layer: (shift, scale) from SiLU(vec) through adaLN, or
    // Chroma's last two table rows; then the linear.
    let fl = vb.pp("final_layer");
    let (shift, scale) = match m {
        Mods::Vec(vec) => {
            let ada = fl
                .pp("adaLN_modulation.1")
                .linear(vec.silu(), hd, 2 * hd)?
                .reshape(&[b, 1, 2 * hd])?;
            (ada.slice(2, 0, hd)?, ada.slice(2, hd, 2 * hd)?)
        }
        Mods::Table(t) => (
            t.slice(1, CHROMA_MODULATIONS - 2, CHROMA_MODULATIONS - 1)?,
            t.slice(1, CHROMA_MODULATIONS - 1, CHROMA_MODULATIONS)?,
        ),
    };
    let img = modulate(img, shift, scale)?;
    let oc = cfg.out_channels;
    let out = fl.pp("linear").linear(img, hd, oc * PATCH * PATCH)?;
    // b (h w) (c ph pw) -> b c (h ph) (w pw), cropped to h × w.
    let out = out
        .reshape(&[b, gh * gw, oc, PATCH * PATCH])?
        .permute(&[0, 2, 1, 3])?
        .reshape(&[b * oc, gh, gw, PATCH, PATCH])?
        .permute(&[0, 1, 3, 2, 4])?
        .reshape(&[b, oc, gh * PATCH, gw * PATCH])?;
    if gh * PATCH != h || gw * PATCH != w {
        out.slice(2, 0, h)?.slice(3, 0, w)
    } else {
        Ok(out)
    }
}

/// The 16-channel convolutions of an XLabs ControlNet's `input_hint_block`
/// (ComfyUI's `nn.Sequential` indices, SiLU between): (index, input
/// channels, stride), 3×3 with padding 1.
const XLABS_HINT_CONVS: [(usize, usize, usize); 8] = [
    (0, 3, 1),
    (2, 16, 1),
    (4, 16, 2),
    (6, 16, 1),
    (8, 16, 2),
    (10, 16, 1),
    (12, 16, 2),
    (14, 16, 1),
];

/// Channels of an XLabs hint block's output.
const XLABS_HINT_OUT: usize = 16;

/// A Flux ControlNet (ComfyUI's `ControlNetFlux`): `hint` — an image
/// `[1 or b, 3, 8h, 8w]` in 0..1 taken to −1..1 through XLabs' hint
/// convolutions to `[·, 16, h, w]`, or (`latent`) the encoded latent
/// `[·, channels, h, w]` — is patchified and projected (`pos_embed_input`)
/// onto the image tokens after `img_in`; a union type's embedding
/// (`mode`: its row index, and the table's rows) goes before the text
/// tokens (`pe` then has its row); the Flux blocks run as the model's, and each block's image
/// tokens through its `controlnet_blocks` / `controlnet_single_blocks`
/// Linear are its residuals. Returns (double block residuals, single block
/// residuals), one per block of the net.
pub fn flux_controlnet<'a>(
    g: &'a GraphBuilder,
    cfg: &FluxConfig,
    x: T<'a>,
    inp: FluxInputs<'a>,
    hint: T<'a>,
    latent: bool,
    mode: Option<(T<'a>, usize)>,
) -> Result<(Vec<T<'a>>, Vec<T<'a>>), ShapeError> {
    let (s, hs) = (x.shape(), hint.shape());
    let (b, c, h, w) = (s[0], s[1], s[2], s[3]);
    let vb = Scope::new(g, "");
    let hd = cfg.hidden;
    let cond = if latent {
        if hs.len() != 4 || hs[1] != c || hs[2] != h || hs[3] != w {
            return Err(ShapeError {
                op: "flux controlnet",
                message: format!("the latent hint must be [batch, {c}, {h}, {w}], got {hs:?}"),
                shapes: vec![hs, s],
            });
        }
        vb.pp("pos_embed_input")
            .linear(patchify(g, hint)?, c * PATCH * PATCH, hd)?
    } else {
        if hs.len() != 4 || hs[2] != 8 * h || hs[3] != 8 * w || h % PATCH != 0 || w % PATCH != 0 {
            return Err(ShapeError {
                op: "flux controlnet",
                message: format!(
                    "the hint must be [batch, 3, 8·h, 8·w] for a latent of even sides, got {hs:?} for {s:?}"
                ),
                shapes: vec![hs, s],
            });
        }
        let mut hint = hint.mul_scalar(2.0).add_scalar(-1.0);
        for (k, &(at, cin, stride)) in XLABS_HINT_CONVS.iter().enumerate() {
            if k > 0 {
                hint = hint.silu();
            }
            let conv = vb.pp("input_hint_block").pp(at);
            hint = hint.conv2d(
                conv.get("weight", &[XLABS_HINT_OUT, cin, 3, 3])?,
                Some(conv.get("bias", &[XLABS_HINT_OUT])?),
                Conv2dParams {
                    stride: [stride, stride],
                    padding: [1, 1],
                    dilation: [1, 1],
                    groups: 1,
                },
            )?;
        }
        vb.pp("pos_embed_input")
            .linear(patchify(g, hint)?, XLABS_HINT_OUT * PATCH * PATCH, hd)?
    };
    let img = vb
        .pp("img_in")
        .linear(patchify(g, x)?, c * PATCH * PATCH, hd)?;
    let mut img = img.add(cond)?;
    let m = Mods::Vec(flux_vec(g, &vb, cfg, inp.t, inp.guidance, None, inp.y)?);
    let mut txt = vb.pp("txt_in").linear(inp.context, cfg.context_in, hd)?;
    if let Some((ids, rows)) = mode {
        let k = ids.shape()[0];
        let table = vb.get("controlnet_mode_embedder.weight", &[rows, hd])?;
        let emb = table
            .gather(ids)?
            .reshape(&[1, k, hd])?
            .expand(&[b, k, hd])?;
        txt = g.concat(&[emb, txt], 1)?;
    }
    let txt_len = txt.shape()[1];
    let mut double = Vec::with_capacity(cfg.depth);
    for i in 0..cfg.depth {
        (img, txt) = double_block(&vb.pp("double_blocks").pp(i), cfg, img, txt, m, i, inp.pe)?;
        double.push(vb.pp("controlnet_blocks").pp(i).linear(img, hd, hd)?);
    }
    let mut joint = g.concat(&[txt, img], 1)?;
    let len = joint.shape()[1];
    let mut single = Vec::with_capacity(cfg.depth_single);
    for i in 0..cfg.depth_single {
        joint = single_block(&vb.pp("single_blocks").pp(i), cfg, joint, m, i, inp.pe)?;
        let tokens = joint.slice(1, txt_len, len)?;
        single.push(
            vb.pp("controlnet_single_blocks")
                .pp(i)
                .linear(tokens, hd, hd)?,
        );
    }
    Ok((double, single))
}
