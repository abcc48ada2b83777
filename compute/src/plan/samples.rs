//! Sample graphs with the structure of Stable Diffusion's blocks (ldm's
//! ResBlock and SpatialTransformer), for planner inspection (`sdkit plan`),
//! planner tests and benchmarks. Weights are named graph inputs with the
//! real key suffixes, so the same builders can later run on real weights.

use crate::tensor::{GraphBuilder, Scope, ShapeError, TensorGraph, T};

/// ldm's ResBlock: GN-SiLU-conv, + timestep embedding, GN-SiLU-conv, + skip.
fn resblock<'a>(
    vb: &Scope<'a>,
    x: T<'a>,
    emb: T<'a>,
    cin: usize,
    cout: usize,
    emb_dim: usize,
) -> Result<T<'a>, ShapeError> {
    let h = vb.pp("in_layers.0").group_norm(x, 32, cin, 1e-5)?.silu();
    let h = vb.pp("in_layers.2").conv2d(h, cin, cout, 3, 1)?;
    let e = vb.pp("emb_layers.1").linear(emb.silu(), emb_dim, cout)?;
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

/// Multi-head attention over `[b, s, c]` queries and `[b, s_kv, c_kv]`
/// context, as ldm's CrossAttention (q/k/v without bias, out with bias).
fn cross_attention<'a>(
    vb: &Scope<'a>,
    x: T<'a>,
    ctx: T<'a>,
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
    let q = split(vb.pp("to_q").linear_no_bias(x, c, c)?, s)?;
    let k = split(vb.pp("to_k").linear_no_bias(ctx, c_ctx, c)?, skv)?;
    let v = split(vb.pp("to_v").linear_no_bias(ctx, c_ctx, c)?, skv)?;
    let o = q.attention(k, v, None, 1.0 / (d as f32).sqrt())?;
    let o = o.permute(&[0, 2, 1, 3])?.reshape(&[b, s, c])?;
    vb.pp("to_out.0").linear(o, c, c)
}

/// ldm's SpatialTransformer with one BasicTransformerBlock (SD1 layout:
/// 1×1 conv projections, GEGLU feed-forward).
fn spatial_transformer<'a>(
    vb: &Scope<'a>,
    x: T<'a>,
    ctx: T<'a>,
    c: usize,
    c_ctx: usize,
    heads: usize,
) -> Result<T<'a>, ShapeError> {
    let s = x.shape();
    let (b, hh, ww) = (s[0], s[2], s[3]);
    let h = vb.pp("norm").group_norm(x, 32, c, 1e-5)?;
    let h = vb.pp("proj_in").conv2d(h, c, c, 1, 1)?;
    let h = h.reshape(&[b, c, hh * ww])?.permute(&[0, 2, 1])?;
    let blk = vb.pp("transformer_blocks.0");
    let n1 = blk.pp("norm1").layer_norm(h, c, 1e-5)?;
    let h = cross_attention(&blk.pp("attn1"), n1, n1, c, c, heads)?.add(h)?;
    let n2 = blk.pp("norm2").layer_norm(h, c, 1e-5)?;
    let h = cross_attention(&blk.pp("attn2"), n2, ctx, c, c_ctx, heads)?.add(h)?;
    let n3 = blk.pp("norm3").layer_norm(h, c, 1e-5)?;
    let proj = blk.pp("ff.net.0.proj").linear(n3, c, 8 * c)?;
    let (a, gate) = (proj.slice(2, 0, 4 * c)?, proj.slice(2, 4 * c, 8 * c)?);
    let ff = a.mul(gate.gelu_erf())?;
    let h = blk.pp("ff.net.2").linear(ff, 4 * c, c)?.add(h)?;
    let h = h.permute(&[0, 2, 1])?.reshape(&[b, c, hh, ww])?;
    vb.pp("proj_out").conv2d(h, c, c, 1, 1)?.add(x)
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
    let y = resblock(&Scope::new(&g, "block."), x, e, c, c, emb)?;
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
    let y = spatial_transformer(&Scope::new(&g, "block."), x, ctx, c, c_ctx, heads)?;
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
    let vb = Scope::new(&g, "");
    let mut h = vb.pp("input_blocks.0.0").conv2d(x, 4, base, 3, 1)?;
    let mut skips = vec![(h, base)];
    let mut c = base;
    let mut size = hw;
    for l in 0..levels {
        let cout = base * (l + 1);
        let down = vb.pp("down").pp(l);
        h = resblock(&down.pp("res"), h, emb, c, cout, emb_dim)?;
        c = cout;
        h = spatial_transformer(&down.pp("attn"), h, ctx, c, 64, 8)?;
        skips.push((h, c));
        if l + 1 < levels {
            h = down.pp("op").conv2d(h, c, c, 3, 2)?;
            size /= 2;
            skips.push((h, c));
        }
    }
    h = resblock(&vb.pp("middle.0"), h, emb, c, c, emb_dim)?;
    h = spatial_transformer(&vb.pp("middle.1"), h, ctx, c, 64, 8)?;
    for l in (0..levels).rev() {
        for j in 0..2 {
            let Some((s, sc)) = skips.pop() else { break };
            let cat = g.concat(&[h, s], 1)?;
            let cout = base * (l + 1);
            let up = vb.pp("up").pp(l).pp(j);
            h = resblock(&up.pp("res"), cat, emb, c + sc, cout, emb_dim)?;
            c = cout;
            h = spatial_transformer(&up.pp("attn"), h, ctx, c, 64, 8)?;
        }
        if l > 0 {
            size *= 2;
            h = h.upsample(crate::tensor::UpsampleMode::Nearest, size, size)?;
            h = vb.pp("up").pp(l).pp("upsample").conv2d(h, c, c, 3, 1)?;
        }
    }
    let h = vb.pp("out.0").group_norm(h, 32, c, 1e-5)?.silu();
    let y = vb.pp("out.2").conv2d(h, c, 4, 3, 1)?;
    Ok(g.finish(&[y]))
}
