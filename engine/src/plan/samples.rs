//! Sample graphs with the structure of Stable Diffusion's blocks (ldm's
//! ResBlock and SpatialTransformer), for planner inspection (`sdkit plan`),
//! planner tests and benchmarks. Weights are named graph inputs with the
//! real key suffixes, so the same builders can later run on real weights.

use crate::tensor::{Conv2dParams, GraphBuilder, ShapeError, TensorGraph, T};

fn conv_p(pad: usize, stride: usize) -> Conv2dParams {
    Conv2dParams {
        stride: [stride; 2],
        padding: [pad; 2],
        dilation: [1; 2],
        groups: 1,
    }
}

fn conv<'a>(
    g: &'a GraphBuilder,
    x: T<'a>,
    name: &str,
    cin: usize,
    cout: usize,
    k: usize,
    stride: usize,
) -> Result<T<'a>, ShapeError> {
    let w = g.weight(&format!("{name}.weight"), &[cout, cin, k, k])?;
    let b = g.weight(&format!("{name}.bias"), &[cout])?;
    x.conv2d(w, Some(b), conv_p(k / 2, stride))
}

fn group_norm<'a>(
    g: &'a GraphBuilder,
    x: T<'a>,
    name: &str,
    c: usize,
) -> Result<T<'a>, ShapeError> {
    let w = g.weight(&format!("{name}.weight"), &[c])?;
    let b = g.weight(&format!("{name}.bias"), &[c])?;
    x.group_norm(32, Some(w), Some(b), 1e-5)
}

fn linear<'a>(
    g: &'a GraphBuilder,
    x: T<'a>,
    name: &str,
    cin: usize,
    cout: usize,
    bias: bool,
) -> Result<T<'a>, ShapeError> {
    let w = g.weight(&format!("{name}.weight"), &[cout, cin])?;
    let b = if bias {
        Some(g.weight(&format!("{name}.bias"), &[cout])?)
    } else {
        None
    };
    x.linear(w, b)
}

fn layer_norm<'a>(
    g: &'a GraphBuilder,
    x: T<'a>,
    name: &str,
    c: usize,
) -> Result<T<'a>, ShapeError> {
    let w = g.weight(&format!("{name}.weight"), &[c])?;
    let b = g.weight(&format!("{name}.bias"), &[c])?;
    x.layer_norm(Some(w), Some(b), 1e-5)
}

/// ldm's ResBlock: GN-SiLU-conv, + timestep embedding, GN-SiLU-conv, + skip.
pub fn resblock<'a>(
    g: &'a GraphBuilder,
    x: T<'a>,
    emb: T<'a>,
    name: &str,
    cin: usize,
    cout: usize,
    emb_dim: usize,
) -> Result<T<'a>, ShapeError> {
    let h = group_norm(g, x, &format!("{name}.in_layers.0"), cin)?.silu();
    let h = conv(g, h, &format!("{name}.in_layers.2"), cin, cout, 3, 1)?;
    let e = linear(
        g,
        emb.silu(),
        &format!("{name}.emb_layers.1"),
        emb_dim,
        cout,
        true,
    )?;
    let b = e.shape()[0];
    let h = h.add(e.reshape(&[b, cout, 1, 1])?)?;
    let h = group_norm(g, h, &format!("{name}.out_layers.0"), cout)?.silu();
    let h = conv(g, h, &format!("{name}.out_layers.3"), cout, cout, 3, 1)?;
    let skip = if cin == cout {
        x
    } else {
        conv(g, x, &format!("{name}.skip_connection"), cin, cout, 1, 1)?
    };
    skip.add(h)
}

/// Multi-head attention over `[b, s, c]` queries and `[b, s_kv, c_kv]`
/// context, as ldm's CrossAttention (q/k/v without bias, out with bias).
fn cross_attention<'a>(
    g: &'a GraphBuilder,
    x: T<'a>,
    ctx: T<'a>,
    name: &str,
    c: usize,
    c_ctx: usize,
    heads: usize,
) -> Result<T<'a>, ShapeError> {
    let (b, s) = (x.shape()[0], x.shape()[1]);
    let skv = ctx.shape()[1];
    let d = c / heads;
    let split = |t: T<'a>, len: usize| -> Result<T<'a>, ShapeError> {
        t.reshape(&[b, len, heads, d])?.permute(&[0, 2, 1, 3])
    };
    let q = split(linear(g, x, &format!("{name}.to_q"), c, c, false)?, s)?;
    let k = split(
        linear(g, ctx, &format!("{name}.to_k"), c_ctx, c, false)?,
        skv,
    )?;
    let v = split(
        linear(g, ctx, &format!("{name}.to_v"), c_ctx, c, false)?,
        skv,
    )?;
    let o = q.attention(k, v, None, 1.0 / (d as f32).sqrt())?;
    let o = o.permute(&[0, 2, 1, 3])?.reshape(&[b, s, c])?;
    linear(g, o, &format!("{name}.to_out.0"), c, c, true)
}

/// ldm's SpatialTransformer with one BasicTransformerBlock (SD1 layout:
/// 1×1 conv projections, GEGLU feed-forward).
pub fn spatial_transformer<'a>(
    g: &'a GraphBuilder,
    x: T<'a>,
    ctx: T<'a>,
    name: &str,
    c: usize,
    c_ctx: usize,
    heads: usize,
) -> Result<T<'a>, ShapeError> {
    let s = x.shape();
    let (b, hh, ww) = (s[0], s[2], s[3]);
    let h = group_norm(g, x, &format!("{name}.norm"), c)?;
    let h = conv(g, h, &format!("{name}.proj_in"), c, c, 1, 1)?;
    let h = h.reshape(&[b, c, hh * ww])?.permute(&[0, 2, 1])?;
    let blk = format!("{name}.transformer_blocks.0");
    let n1 = layer_norm(g, h, &format!("{blk}.norm1"), c)?;
    let h = cross_attention(g, n1, n1, &format!("{blk}.attn1"), c, c, heads)?.add(h)?;
    let n2 = layer_norm(g, h, &format!("{blk}.norm2"), c)?;
    let h = cross_attention(g, n2, ctx, &format!("{blk}.attn2"), c, c_ctx, heads)?.add(h)?;
    let n3 = layer_norm(g, h, &format!("{blk}.norm3"), c)?;
    let proj = linear(g, n3, &format!("{blk}.ff.net.0.proj"), c, 8 * c, true)?;
    let (a, gate) = (proj.slice(2, 0, 4 * c)?, proj.slice(2, 4 * c, 8 * c)?);
    let ff = a.mul(gate.gelu_erf())?;
    let h = linear(g, ff, &format!("{blk}.ff.net.2"), 4 * c, c, true)?.add(h)?;
    let h = h.permute(&[0, 2, 1])?.reshape(&[b, c, hh, ww])?;
    conv(g, h, &format!("{name}.proj_out"), c, c, 1, 1)?.add(x)
}

/// One ResBlock as a whole graph: inputs `x [b, c, h, w]`, `emb [b, e]`.
pub fn resblock_graph(
    b: usize,
    c: usize,
    hw: usize,
    emb: usize,
) -> Result<TensorGraph, ShapeError> {
    let g = GraphBuilder::new();
    let x = g.input("x", &[b, c, hw, hw])?;
    let e = g.input("emb", &[b, emb])?;
    let y = resblock(&g, x, e, "block", c, c, emb)?;
    Ok(g.finish(&[y]))
}

/// One SpatialTransformer as a whole graph.
pub fn transformer_graph(
    b: usize,
    c: usize,
    hw: usize,
    ctx_len: usize,
    c_ctx: usize,
    heads: usize,
) -> Result<TensorGraph, ShapeError> {
    let g = GraphBuilder::new();
    let x = g.input("x", &[b, c, hw, hw])?;
    let ctx = g.input("context", &[b, ctx_len, c_ctx])?;
    let y = spatial_transformer(&g, x, ctx, "block", c, c_ctx, heads)?;
    Ok(g.finish(&[y]))
}

/// A UNet-shaped graph: the SD1 level structure (ResBlock + transformer per
/// level, downsampling convs, skip concatenations on the way up, nearest
/// upsampling), at a configurable width and resolution. Used to check the
/// memory planner on realistic lifetimes.
pub fn unet_like_graph(
    b: usize,
    base: usize,
    hw: usize,
    levels: usize,
) -> Result<TensorGraph, ShapeError> {
    let g = GraphBuilder::new();
    let emb_dim = 4 * base;
    let x = g.input("x", &[b, 4, hw, hw])?;
    let emb = g.input("emb", &[b, emb_dim])?;
    let ctx = g.input("context", &[b, 77, 64])?;
    let mut h = conv(&g, x, "input_blocks.0.0", 4, base, 3, 1)?;
    let mut skips = vec![(h, base)];
    let mut c = base;
    let mut size = hw;
    for l in 0..levels {
        let cout = base * (l + 1);
        h = resblock(&g, h, emb, &format!("down.{l}.res"), c, cout, emb_dim)?;
        c = cout;
        h = spatial_transformer(&g, h, ctx, &format!("down.{l}.attn"), c, 64, 8)?;
        skips.push((h, c));
        if l + 1 < levels {
            h = conv(&g, h, &format!("down.{l}.op"), c, c, 3, 2)?;
            size /= 2;
            skips.push((h, c));
        }
    }
    h = resblock(&g, h, emb, "middle.0", c, c, emb_dim)?;
    h = spatial_transformer(&g, h, ctx, "middle.1", c, 64, 8)?;
    for l in (0..levels).rev() {
        for j in 0..2 {
            let Some((s, sc)) = skips.pop() else { break };
            let cat = g.concat(&[h, s], 1)?;
            let cout = base * (l + 1);
            h = resblock(
                &g,
                cat,
                emb,
                &format!("up.{l}.{j}.res"),
                c + sc,
                cout,
                emb_dim,
            )?;
            c = cout;
            h = spatial_transformer(&g, h, ctx, &format!("up.{l}.{j}.attn"), c, 64, 8)?;
        }
        if l > 0 {
            size *= 2;
            h = h.upsample(crate::tensor::UpsampleMode::Nearest, size, size)?;
            h = conv(&g, h, &format!("up.{l}.upsample"), c, c, 3, 1)?;
        }
    }
    let h = group_norm(&g, h, "out.0", c)?.silu();
    let y = conv(&g, h, "out.2", c, 4, 3, 1)?;
    Ok(g.finish(&[y]))
}
