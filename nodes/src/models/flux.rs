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

use super::detect::{DetectError, Shapes};
use super::unet::timestep_embedding;
use sdkit_compute::tensor::{GraphBuilder, Scope, ShapeError, T};

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
}

/// Patch side.
pub const PATCH: usize = 2;

fn shape(
    s: &Shapes,
    name: String,
    rank: usize,
    expected: &'static str,
) -> Result<Vec<usize>, DetectError> {
    let sh = s
        .get(&name)
        .ok_or(DetectError::Missing { name: name.clone() })?;
    if sh.len() != rank {
        return Err(DetectError::BadShape {
            name,
            shape: sh.clone(),
            expected,
        });
    }
    Ok(sh.clone())
}

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
    let out = shape(
        s,
        k("final_layer.linear.weight"),
        2,
        "[channels × 4, hidden]",
    )?;
    let mlp = shape(s, k("double_blocks.0.img_mlp.0.weight"), 2, "[mlp, hidden]")?[0];
    let vec_in = shape(s, k("vector_in.in_layer.weight"), 2, "[hidden, vec_in]")?[1];
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
        guidance: s.contains_key(&k("guidance_in.in_layer.weight")),
        qkv_bias: s.contains_key(&k("double_blocks.0.img_attn.qkv.bias")),
        axes_dim,
        theta: 10000,
    })
}

/// Patch grid of an `h × w` latent (padded up to even sides).
pub fn grid(h: usize, w: usize) -> (usize, usize) {
    (h.div_ceil(PATCH), w.div_ceil(PATCH))
}

/// The RoPE rotations `[1, txt + rows·cols, head_dim/2, 2, 2]` for `txt`
/// text tokens at position (0, 0, 0) then the image patches at (0, row,
/// col), as ComfyUI's `EmbedND`: per axis, angle `pos · θ^(−2i/dim)` in
/// f64, cos/sin rounded to f32; matrices `[[cos, −sin], [sin, cos]]`.
pub fn rope_table(cfg: &FluxConfig, txt: usize, rows: usize, cols: usize) -> Vec<f32> {
    let half = cfg.head_dim / 2;
    let mut out = Vec::with_capacity((txt + rows * cols) * half * 4);
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

fn double_block<'a>(
    vb: &Scope<'a>,
    cfg: &FluxConfig,
    img: T<'a>,
    txt: T<'a>,
    vec: T<'a>,
    pe: T<'a>,
) -> Result<(T<'a>, T<'a>), ShapeError> {
    let (hd, n) = (cfg.hidden, cfg.heads);
    let txt_len = txt.shape()[1];
    let im = modulation(&vb.pp("img_mod"), vec, 6, hd)?;
    let tm = modulation(&vb.pp("txt_mod"), vec, 6, hd)?;
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
    vec: T<'a>,
    pe: T<'a>,
) -> Result<T<'a>, ShapeError> {
    let hd = cfg.hidden;
    let m = modulation(&vb.pp("modulation"), vec, 3, hd)?;
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

/// The inputs of [`flux`] beside the latent.
pub struct FluxInputs<'a> {
    /// ComfyUI's timestep (σ for Flux) `[b]`.
    pub t: T<'a>,
    /// T5 context `[b, txt, context_in]`.
    pub context: T<'a>,
    /// Pooled CLIP-L `[b, vec_in]`.
    pub y: T<'a>,
    /// Guidance `[b]` (dev models).
    pub guidance: Option<T<'a>>,
    /// [`rope_table`] as `[1, txt + patches, head_dim/2, 2, 2]`.
    pub pe: T<'a>,
}

/// The model: `x` `[b, in_channels, h, w]` → `[b, out_channels, h, w]`.
/// Odd sides are padded circularly to whole patches and cropped after,
/// as ComfyUI's `pad_to_patch_size`.
pub fn flux<'a>(
    g: &'a GraphBuilder,
    cfg: &FluxConfig,
    prefix: &str,
    x: T<'a>,
    inp: FluxInputs<'a>,
) -> Result<T<'a>, ShapeError> {
    let s = x.shape();
    let (b, c, h, w) = (s[0], s[1], s[2], s[3]);
    let (gh, gw) = grid(h, w);
    let vb = Scope::new(g, prefix);
    let hd = cfg.hidden;
    // Circular padding: the first row/column repeated after the last.
    let mut x = x;
    if gh * PATCH != h {
        x = g.concat(&[x, x.slice(2, 0, gh * PATCH - h)?], 2)?;
    }
    if gw * PATCH != w {
        x = g.concat(&[x, x.slice(3, 0, gw * PATCH - w)?], 3)?;
    }
    // b c (h ph) (w pw) -> b (h w) (c ph pw)
    let img = x
        .reshape(&[b * c, gh, PATCH, gw, PATCH])?
        .permute(&[0, 1, 3, 2, 4])?
        .reshape(&[b, c, gh * gw, PATCH * PATCH])?
        .permute(&[0, 2, 1, 3])?
        .reshape(&[b, gh * gw, c * PATCH * PATCH])?;
    let mut img = vb.pp("img_in").linear(img, c * PATCH * PATCH, hd)?;
    let temb = timestep_embedding(g, inp.t.mul_scalar(1000.0), 256)?;
    let mut vec = mlp_embedder(&vb.pp("time_in"), temb, 256, hd)?;
    if let (true, Some(gd)) = (cfg.guidance, inp.guidance) {
        let gemb = timestep_embedding(g, gd.mul_scalar(1000.0), 256)?;
        vec = vec.add(mlp_embedder(&vb.pp("guidance_in"), gemb, 256, hd)?)?;
    }
    vec = vec.add(mlp_embedder(&vb.pp("vector_in"), inp.y, cfg.vec_in, hd)?)?;
    let mut txt = vb.pp("txt_in").linear(inp.context, cfg.context_in, hd)?;
    let txt_len = txt.shape()[1];
    for i in 0..cfg.depth {
        (img, txt) = double_block(&vb.pp("double_blocks").pp(i), cfg, img, txt, vec, inp.pe)?;
    }
    let mut joint = g.concat(&[txt, img], 1)?;
    for i in 0..cfg.depth_single {
        joint = single_block(&vb.pp("single_blocks").pp(i), cfg, joint, vec, inp.pe)?;
    }
    let img = joint.slice(1, txt_len, txt_len + gh * gw)?;
    // Final layer: adaLN (shift, scale) from SiLU(vec), then the linear.
    let fl = vb.pp("final_layer");
    let ada = fl
        .pp("adaLN_modulation.1")
        .linear(vec.silu(), hd, 2 * hd)?
        .reshape(&[b, 1, 2 * hd])?;
    let img = modulate(img, ada.slice(2, 0, hd)?, ada.slice(2, hd, 2 * hd)?)?;
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
