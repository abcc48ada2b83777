//! CLIPTextEncode and CLIPSetLastLayer, with ComfyUI's semantics.

use super::{
    graph_error, input, opaque, sd1_tokenizer, Clip, CondEntry, Conditioning, SizeCond,
    TextEncoderModel,
};
use crate::clip_tokenizer::EMBED_BASE;
use crate::models::clip::{causal_mask, text_encoder_embedded, ClipLayer};
use crate::models::detect::{EncoderArch, Family};
use crate::models::family::{Pooled, TextEncoder};
use crate::models::open_clip::{self, end_token_one_hot};
use crate::models::t5;
use crate::t5_tokenizer::{Padding, T5Tokenizer};
use sdkit_compute::plan::plan;
use sdkit_compute::tensor::GraphBuilder;
use sdkit_compute::weights::DType;
use sdkit_engine::{Inputs, NodeContext, NodeError, NodeImpl, NodeOutput, Tensor};
use sdkit_schema::SocketType;
use std::sync::Arc;

/// ComfyUI's CLIPSetLastLayer: a copy of the CLIP that stops at a layer
/// counted from the end (-1 is the last; clip skip 2 is -2).
pub struct ClipSetLastLayer;

impl NodeImpl for ClipSetLastLayer {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let clip: Arc<Clip> = input(inputs, "clip", "CLIP")?;
        let layer = inputs.int("stop_at_clip_layer")?;
        let mut c = (*clip).clone();
        c.layer_idx = Some(i64::try_from(layer).map_err(|_| {
            NodeError::invalid(format!("stop_at_clip_layer {layer} is out of range"))
        })?);
        Ok(NodeOutput::values(vec![opaque(SocketType::Clip, c)]))
    }
}

/// The dtype ComfyUI holds text-encoder weights in (its default
/// `text_encoder_dtype`, CPU included; computed in f32): weights from a
/// bf16 or f32 file and LoRA-patched weights are rounded to it.
const TEXT_ENCODER_DTYPE: DType = DType::F16;

/// ComfyUI's `set_clip_options` rule: an index beyond the layer count
/// (or none) means the last layer.
fn clip_layer(layer_idx: Option<i64>, layers: usize) -> ClipLayer {
    match layer_idx {
        Some(k) if k < 0 && k.unsigned_abs() <= layers as u64 => {
            ClipLayer::FromEnd(k.unsigned_abs() as usize)
        }
        Some(k) if k > 0 && (k as u64) < layers as u64 => {
            // A positive index counts from the first layer.
            ClipLayer::FromEnd(layers - k as usize)
        }
        _ => ClipLayer::Last,
    }
}

/// A prompt's tokens for one encoder: 77-token chunks of (id, weight),
/// and the embedding vectors that ids from [`EMBED_BASE`] stand for.
#[derive(Clone, Debug, Default)]
pub struct Chunks {
    pub chunks: Vec<Vec<(u32, f32)>>,
    pub embeds: Vec<Vec<f32>>,
}

/// One encoder's output for a prompt: `[1, tokens, width]` and the
/// pooled vector `[1, projection]` where the encoder gives one.
pub(crate) struct Encoded {
    pub hidden: Tensor,
    pub pooled: Option<Tensor>,
}

impl TextEncoderModel {
    fn layers(&self) -> usize {
        self.arch.layers()
    }

    /// Whether the family reads this encoder's pooled output (SD 2.x's H,
    /// SDXL's G, Flux's CLIP-L; OpenCLIP's graph always makes it).
    fn pools(&self) -> bool {
        self.rule.pooled != Pooled::No || matches!(self.arch, EncoderArch::OpenClip(_))
    }

    fn table_name(&self) -> String {
        match &self.arch {
            EncoderArch::Clip(_) => format!("{}embeddings.token_embedding.weight", self.prefix),
            EncoderArch::OpenClip(_) => format!("{}token_embedding.weight", self.prefix),
            EncoderArch::T5(c) => format!("{}{}", self.prefix, c.table),
        }
    }

    /// ComfyUI's `gen_empty_tokens`: start (CLIP), end, then padding;
    /// Chroma's T5 (PixArt's) all padding.
    fn empty_tokens(&self, len: usize, family: Family) -> Vec<u32> {
        let mut empty = match self.arch {
            EncoderArch::T5(_) if family == Family::Chroma => Vec::new(),
            EncoderArch::T5(_) => vec![crate::t5_tokenizer::END],
            _ => vec![crate::clip_tokenizer::BOS, crate::clip_tokenizer::EOS],
        };
        let min = empty.len();
        empty.resize(len.max(min), self.rule.pad);
        empty
    }

    /// Runs the encoder on token rows of equal length; returns the hidden
    /// states `[rows, len, width]` and, where it pools, `[rows, proj]`.
    fn encode_rows(
        &self,
        ctx: &NodeContext,
        rows: &[Vec<u32>],
        embeds_table: &[Vec<f32>],
        layer: ClipLayer,
    ) -> Result<(Vec<f32>, Option<Vec<f32>>), NodeError> {
        let len = rows.first().map_or(0, Vec::len);
        let (vocab, width, positions) = match &self.arch {
            EncoderArch::Clip(c) => (c.vocab, c.width, c.max_positions),
            EncoderArch::OpenClip(c) => (c.vocab, c.width, c.max_positions),
            // Relative positions: any length.
            EncoderArch::T5(c) => (c.vocab, c.width, usize::MAX),
        };
        if len > positions {
            return Err(NodeError::invalid(format!(
                "{len} tokens do not fit the text encoder's {positions} positions"
            )));
        }
        let pools = self.pools();
        let norm = self.rule.norm_hidden;
        let g = GraphBuilder::new();
        let outs = (|| {
            let e = g.input("embeddings", &[rows.len(), len, width])?;
            if let EncoderArch::T5(c) = &self.arch {
                let buckets = g.input("mask", &[len * len])?;
                let h = t5::encoder(&g, c, &self.prefix, e, buckets, None, layer, norm)?;
                return Ok((h, None));
            }
            let m = g.input("mask", &[len, len])?;
            let eot = if pools {
                Some(g.input("eot", &[rows.len(), 1, len])?)
            } else {
                None
            };
            match &self.arch {
                EncoderArch::Clip(c) => {
                    let eot = eot.map(|t| (t, self.rule.pooled != Pooled::Raw));
                    let o = text_encoder_embedded(&g, c, &self.prefix, e, m, eot, layer, norm)?;
                    Ok::<_, sdkit_compute::tensor::ShapeError>((o.hidden, o.pooled))
                }
                EncoderArch::OpenClip(c) => {
                    let eot = match eot {
                        Some(eot) => eot,
                        None => g.input("eot", &[rows.len(), 1, len])?,
                    };
                    let o = open_clip::text_encoder(&g, c, &self.prefix, e, m, eot, layer, norm)?;
                    Ok((o.hidden, Some(o.pooled)))
                }
                EncoderArch::T5(_) => unreachable!("T5 returned above"),
            }
        })()
        .map_err(|e| graph_error("text encoder", e))?;
        let graph = match outs.1 {
            Some(p) => g.finish(&[outs.0, p]),
            None => g.finish(&[outs.0]),
        };
        let prog = plan(&graph).map_err(|e| graph_error("text encoder", e))?;
        let mut bind = self
            .file
            .bindings(&prog, Some(&self.patches), Some(TEXT_ENCODER_DTYPE))?;
        // The token embedding lookup happens here, on the host, one row
        // at a time from the file (the table is the encoder's largest
        // tensor; 77 rows of it need no device and no f32 copy of it).
        let table = self.table_name();
        let mut embeds = Vec::with_capacity(rows.len() * len * width);
        for &id in rows.iter().flatten() {
            if id >= EMBED_BASE {
                // An embedding's vector, as it is (ComfyUI inserts it in
                // f32 beside the looked-up rows).
                let v = embeds_table
                    .get((id - EMBED_BASE) as usize)
                    .ok_or_else(|| NodeError::invalid("an embedding id without its vector"))?;
                embeds.extend_from_slice(v);
                continue;
            }
            if id as usize >= vocab {
                return Err(NodeError::invalid(format!(
                    "token id {id} is outside the text encoder's {vocab}-token vocabulary"
                )));
            }
            embeds.extend(self.file.rows_f32(
                &table,
                width,
                (id as usize, 1),
                Some(TEXT_ENCODER_DTYPE),
            )?);
        }
        bind.inputs.insert("embeddings".into(), Arc::new(embeds));
        // T5's "mask" input is its relative-position buckets.
        let mask = match &self.arch {
            EncoderArch::T5(c) => t5::bucket_ids(len, c),
            _ => causal_mask(len),
        };
        bind.inputs.insert("mask".into(), Arc::new(mask));
        if pools {
            bind.inputs.insert(
                "eot".into(),
                Arc::new(end_token_one_hot(rows, crate::clip_tokenizer::EOS)),
            );
        }
        ctx.check_cancel()?;
        let mut out = super::run_model(ctx, "text encoder", &self.file.name, &prog, bind)?;
        let pooled = if out.len() > 1 {
            Some(out.swap_remove(1).data)
        } else {
            None
        };
        Ok((out.swap_remove(0).data, pooled))
    }

    /// ComfyUI's `encode_token_weights`: encodes each 77-token chunk (plus
    /// an empty prompt when any weight is not 1), moves weighted tokens
    /// away from the empty prompt's encoding by their weight, and joins the
    /// chunks along the token axis: `[1, 77 × chunks, width]`; the pooled
    /// vector is the first chunk's.
    pub(crate) fn encode_weighted(
        &self,
        ctx: &NodeContext,
        tokens: &Chunks,
        layer_idx: Option<i64>,
        family: Family,
    ) -> Result<Encoded, NodeError> {
        let layer = clip_layer(layer_idx.or(self.rule.default_layer), self.layers());
        let width = self.arch.width();
        let chunks = &tokens.chunks;
        let len = chunks.iter().map(Vec::len).max().unwrap_or(0);
        let has_weights = chunks.iter().flatten().any(|&(_, w)| w != 1.0);
        // An embedding of another width is left out and the row padded at
        // its end (ComfyUI warns; the weights keep their positions).
        let fits = |id: u32| {
            id < EMBED_BASE
                || tokens
                    .embeds
                    .get((id - EMBED_BASE) as usize)
                    .is_some_and(|v| v.len() == width)
        };
        let mut rows: Vec<Vec<u32>> = chunks
            .iter()
            .map(|c| {
                let mut r: Vec<u32> = c.iter().map(|&(t, _)| t).filter(|&t| fits(t)).collect();
                r.resize(c.len(), self.rule.pad);
                r
            })
            .collect();
        if chunks.iter().flatten().any(|&(t, _)| !fits(t)) {
            tracing::warn!(
                "node {}: an embedding's vectors are not {width} wide (this text encoder's width); left out",
                ctx.node_id
            );
        }
        if rows.iter().any(|r| r.len() != len) {
            return Err(NodeError::invalid("token chunks differ in length"));
        }
        if has_weights || rows.is_empty() {
            rows.push(self.empty_tokens(len, family));
        }
        let (out, pooled) = self.encode_rows(ctx, &rows, &tokens.embeds, layer)?;
        let pooled = match pooled {
            Some(p) => {
                let w = p.len() / rows.len();
                Some(Tensor::new(vec![1, w], p[..w].to_vec()).map_err(NodeError::invalid)?)
            }
            None => None,
        };
        let row = len * width;
        if chunks.is_empty() {
            // The empty prompt alone (its own length: T5's is `[</s>]`).
            let n = rows[0].len();
            let hidden = Tensor::new(vec![1, n, width], out[..n * width].to_vec())
                .map_err(NodeError::invalid)?;
            return Ok(Encoded { hidden, pooled });
        }
        let mut z = out[..chunks.len() * row].to_vec();
        if has_weights {
            let empty = &out[chunks.len() * row..];
            for (k, chunk) in chunks.iter().enumerate() {
                for (j, &(_, w)) in chunk.iter().enumerate() {
                    if w == 1.0 {
                        continue;
                    }
                    let at = k * row + j * width;
                    for (v, e) in z[at..at + width].iter_mut().zip(&empty[j * width..]) {
                        *v = (*v - e) * w + e;
                    }
                }
            }
        }
        let hidden =
            Tensor::new(vec![1, chunks.len() * len, width], z).map_err(NodeError::invalid)?;
        Ok(Encoded { hidden, pooled })
    }
}

impl Clip {
    /// Each encoder's token chunks for `text` (the same text, each padded
    /// its own way), with `embedding:NAME` resolved from `models/embeddings`
    /// for that encoder.
    pub fn tokenize(&self, ctx: &NodeContext, text: &str) -> Result<Vec<Chunks>, NodeError> {
        let mut out = Vec::with_capacity(self.encoders.len());
        for e in &self.encoders {
            let mut failure = None;
            let mut resolve = |name: &str| match super::embeddings::load(ctx, name, e.rule.encoder)
            {
                Ok(found) => found,
                Err(err) => {
                    failure.get_or_insert(err);
                    None
                }
            };
            let (chunks, embeds) = if e.rule.encoder == TextEncoder::T5Xxl {
                // T5TokenizerOptions replaces the family's minimum.
                let padding = match self.t5_options {
                    Some((min_padding, min_length)) => Padding {
                        min_padding: Some(min_padding),
                        min_length,
                    },
                    None => Padding::min_length(self.family.t5_min_length()),
                };
                T5Tokenizer::shared()
                    .map_err(NodeError::invalid)?
                    .tokenize_with_embeddings(text, padding, &mut resolve)
            } else {
                sd1_tokenizer()?.tokenize_with_embeddings(text, e.rule.pad, &mut resolve)
            };
            if let Some(err) = failure {
                return Err(err);
            }
            out.push(Chunks { chunks, embeds });
        }
        Ok(out)
    }

    /// Encodes per-encoder token chunks and joins the encoders as the
    /// family does: one encoder as it is; SDXL's L and G cut to the
    /// shorter and concatenated along the width, pooled from G.
    pub fn encode_tokens(
        &self,
        ctx: &NodeContext,
        tokens: &[Chunks],
    ) -> Result<CondEntry, NodeError> {
        let mut outs = Vec::with_capacity(self.encoders.len());
        for (e, chunks) in self.encoders.iter().zip(tokens) {
            outs.push(e.encode_weighted(ctx, chunks, self.layer_idx, self.family)?);
        }
        if self.family == Family::Sd3 {
            return self.sd3_conditioning(tokens, outs);
        }
        let pooled = outs.iter().rev().find_map(|o| o.pooled.clone());
        if self.family == Family::Flux {
            // ComfyUI's FluxClipModel: T5's states, CLIP-L's pooled.
            let t5 = self
                .position(TextEncoder::T5Xxl)
                .ok_or_else(|| NodeError::invalid("this Flux CLIP has no T5 text encoder"))?;
            let hidden = outs.swap_remove(t5).hidden;
            return Ok(CondEntry::text(hidden, pooled));
        }
        let cross_attn = match outs.len() {
            0 => return Err(NodeError::invalid("this CLIP has no text encoder")),
            1 => outs.swap_remove(0).hidden,
            _ => {
                let len = outs.iter().map(|o| o.hidden.dim(1)).min().unwrap_or(0);
                let width: usize = outs.iter().map(|o| o.hidden.dim(2)).sum();
                let mut data = Vec::with_capacity(len * width);
                for t in 0..len {
                    for o in &outs {
                        let w = o.hidden.dim(2);
                        data.extend_from_slice(&o.hidden.data[t * w..(t + 1) * w]);
                    }
                }
                Tensor::new(vec![1, len, width], data).map_err(NodeError::invalid)?
            }
        };
        Ok(CondEntry::text(cross_attn, pooled))
    }

    /// ComfyUI's `SD3ClipModel.encode_token_weights`: CLIP-L's and
    /// OpenCLIP-G's states cut to the shorter and joined along the width
    /// (a missing L as zeros on the left), zero-padded to T5's width and
    /// followed by T5's states along the tokens; pooled L ‖ G (zeros for a
    /// missing one). Without T5 the L ‖ G states stay their own width (the
    /// sampler zero-pads them to the model's context width, as ComfyUI
    /// pads them to 4096 here). CLIP-L and G run only where one of them was
    /// given tokens (CLIPTextEncodeSD3 with `empty_padding` "none" may give
    /// none); T5 always runs (no tokens: `[</s>]` alone).
    fn sd3_conditioning(
        &self,
        tokens: &[Chunks],
        outs: Vec<Encoded>,
    ) -> Result<CondEntry, NodeError> {
        // ComfyUI's zero widths for a missing encoder (the real ones').
        const L_WIDTH: usize = 768;
        const G_WIDTH: usize = 1280;
        let lg_given = self.encoders.iter().zip(tokens).any(|(e, t)| {
            matches!(e.rule.encoder, TextEncoder::ClipL | TextEncoder::OpenClipG)
                && !t.chunks.is_empty()
        });
        let (mut l, mut g, mut t5) = (None, None, None);
        for (e, o) in self.encoders.iter().zip(outs) {
            match e.rule.encoder {
                TextEncoder::ClipL => l = Some(o),
                TextEncoder::OpenClipG => g = Some(o),
                TextEncoder::T5Xxl => t5 = Some(o),
                _ => {}
            }
        }
        let any_clip = lg_given && (l.is_some() || g.is_some());
        let zeros = |n: usize| Tensor::new(vec![1, n], vec![0.0; n]).map_err(NodeError::invalid);
        let mut pooled = None;
        let mut lg: Option<Tensor> = None;
        if any_clip {
            let lp = match &l {
                Some(o) => o.pooled.clone().map_or_else(|| zeros(L_WIDTH), Ok)?,
                None => zeros(L_WIDTH)?,
            };
            let gp = match &g {
                Some(o) => o.pooled.clone().map_or_else(|| zeros(G_WIDTH), Ok)?,
                None => zeros(G_WIDTH)?,
            };
            let mut p = lp.data;
            p.extend_from_slice(&gp.data);
            pooled = Some(Tensor::new(vec![1, p.len()], p).map_err(NodeError::invalid)?);
            let (lh, gh) = (l.map(|o| o.hidden), g.map(|o| o.hidden));
            let len = match (&lh, &gh) {
                (Some(a), Some(b)) => a.dim(1).min(b.dim(1)),
                (Some(a), None) => a.dim(1),
                (None, Some(b)) => b.dim(1),
                (None, None) => 0,
            };
            let lw = lh.as_ref().map_or(L_WIDTH, |t| t.dim(2));
            let gw = gh.as_ref().map_or(0, |t| t.dim(2));
            let mut data = Vec::with_capacity(len * (lw + gw));
            for t in 0..len {
                match &lh {
                    Some(a) => data.extend_from_slice(&a.data[t * lw..(t + 1) * lw]),
                    None => data.extend(std::iter::repeat_n(0.0, lw)),
                }
                if let Some(b) = &gh {
                    data.extend_from_slice(&b.data[t * gw..(t + 1) * gw]);
                }
            }
            lg = Some(Tensor::new(vec![1, len, lw + gw], data).map_err(NodeError::invalid)?);
        }
        let cross_attn = match (lg, t5) {
            (Some(lg), Some(t5)) => {
                let tw = t5.hidden.dim(2);
                let w = lg.dim(2);
                if w > tw {
                    return Err(NodeError::invalid(format!(
                        "CLIP-L and OpenCLIP-G give {w}-wide states, wider than T5's {tw}"
                    )));
                }
                let mut data = Vec::with_capacity((lg.dim(1) + t5.hidden.dim(1)) * tw);
                for row in lg.data.chunks(w) {
                    data.extend_from_slice(row);
                    data.extend(std::iter::repeat_n(0.0, tw - w));
                }
                data.extend_from_slice(&t5.hidden.data);
                let n = data.len() / tw;
                Tensor::new(vec![1, n, tw], data).map_err(NodeError::invalid)?
            }
            (Some(lg), _) => lg,
            (None, Some(t5)) => t5.hidden,
            (None, None) => {
                return Err(NodeError::invalid("this SD3 CLIP has no text encoder"));
            }
        };
        // No pooled output (no CLIP prompt): the sampler gives zeros of the
        // model's width, as ComfyUI's zeros here.
        Ok(CondEntry::text(cross_attn, pooled))
    }

    /// The position of the encoder with `role`, if this CLIP has it.
    pub fn position(&self, role: TextEncoder) -> Option<usize> {
        self.encoders.iter().position(|e| e.rule.encoder == role)
    }
}

fn conditioning(entry: CondEntry) -> NodeOutput {
    NodeOutput::values(vec![opaque(
        SocketType::Conditioning,
        Conditioning(vec![entry]),
    )])
}

/// ComfyUI's CLIPTextEncode.
pub struct ClipTextEncode;

impl NodeImpl for ClipTextEncode {
    fn device_inputs(&self) -> &'static [&'static str] {
        &["clip"]
    }

    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let clip: Arc<Clip> = input(inputs, "clip", "CLIP")?;
        let text = inputs.string("text")?;
        let tokens = clip.tokenize(ctx, text)?;
        Ok(conditioning(clip.encode_tokens(ctx, &tokens)?))
    }
}

/// ComfyUI's CLIPTextEncodeSD3: a prompt per encoder; with `empty_padding`
/// "none" an empty prompt gives its encoder no tokens, and L and G are
/// evened out with empty-prompt chunks.
pub struct ClipTextEncodeSd3;

impl NodeImpl for ClipTextEncodeSd3 {
    fn device_inputs(&self) -> &'static [&'static str] {
        &["clip"]
    }

    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let clip: Arc<Clip> = input(inputs, "clip", "CLIP")?;
        let no_padding = inputs.string("empty_padding")? == "none";
        let mut tokens = clip.tokenize(ctx, inputs.string("clip_g")?)?;
        for (role, name) in [
            (TextEncoder::OpenClipG, "clip_g"),
            (TextEncoder::ClipL, "clip_l"),
            (TextEncoder::T5Xxl, "t5xxl"),
        ] {
            let Some(i) = clip.position(role) else {
                continue;
            };
            let text = inputs.string(name)?;
            if text.is_empty() && no_padding {
                tokens[i] = Chunks::default();
            } else if role != TextEncoder::OpenClipG {
                tokens[i] = clip.tokenize(ctx, text)?.swap_remove(i);
            }
        }
        if let (Some(l), Some(g)) = (
            clip.position(TextEncoder::ClipL),
            clip.position(TextEncoder::OpenClipG),
        ) {
            if tokens[l].chunks.len() != tokens[g].chunks.len() {
                let empty = clip.tokenize(ctx, "")?;
                while tokens[l].chunks.len() < tokens[g].chunks.len() {
                    tokens[l].chunks.extend(empty[l].chunks.iter().cloned());
                }
                while tokens[g].chunks.len() < tokens[l].chunks.len() {
                    tokens[g].chunks.extend(empty[g].chunks.iter().cloned());
                }
            }
        }
        Ok(conditioning(clip.encode_tokens(ctx, &tokens)?))
    }
}

/// ComfyUI's T5TokenizerOptions: T5 prompts padded with `min_padding`
/// tokens after the end token, then to `min_length` (replacing the
/// family's minimum).
pub struct T5TokenizerOptions;

impl NodeImpl for T5TokenizerOptions {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let clip: Arc<Clip> = input(inputs, "clip", "CLIP")?;
        let mut c = (*clip).clone();
        c.t5_options = Some((inputs.usize("min_padding")?, inputs.usize("min_length")?));
        Ok(NodeOutput::values(vec![opaque(SocketType::Clip, c)]))
    }
}

/// ComfyUI's CLIPTextEncodeFlux: `clip_l` for CLIP-L, `t5xxl` for T5,
/// and the guidance.
pub struct ClipTextEncodeFlux;

impl NodeImpl for ClipTextEncodeFlux {
    fn device_inputs(&self) -> &'static [&'static str] {
        &["clip"]
    }

    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let clip: Arc<Clip> = input(inputs, "clip", "CLIP")?;
        let Some(t5) = clip.position(TextEncoder::T5Xxl) else {
            return Err(NodeError::invalid(format!(
                "CLIPTextEncodeFlux needs Flux's T5 text encoder; this CLIP is {}'s",
                clip.family.name()
            )));
        };
        let mut tokens = clip.tokenize(ctx, inputs.string("clip_l")?)?;
        tokens[t5] = clip.tokenize(ctx, inputs.string("t5xxl")?)?.swap_remove(t5);
        let mut entry = clip.encode_tokens(ctx, &tokens)?;
        entry.guidance = Some(inputs.float("guidance")?);
        Ok(conditioning(entry))
    }
}

/// A size widget as ComfyUI's conditioning stores it.
fn size(inputs: &Inputs, name: &str) -> Result<Option<f64>, NodeError> {
    Ok(Some(inputs.int(name)? as f64))
}

/// ComfyUI's CLIPTextEncodeSDXL: `text_g` for OpenCLIP-G, `text_l` for
/// CLIP-L (the shorter padded with empty-prompt chunks to the same count),
/// and the size conditioning of SDXL's ADM input.
pub struct ClipTextEncodeSdxl;

impl NodeImpl for ClipTextEncodeSdxl {
    fn device_inputs(&self) -> &'static [&'static str] {
        &["clip"]
    }

    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let clip: Arc<Clip> = input(inputs, "clip", "CLIP")?;
        let (Some(l), Some(gi)) = (
            clip.position(TextEncoder::ClipL),
            clip.position(TextEncoder::OpenClipG),
        ) else {
            return Err(NodeError::invalid(format!(
                "CLIPTextEncodeSDXL needs SDXL's two text encoders (CLIP-L and OpenCLIP-G); this CLIP is {}'s",
                clip.family.name()
            )));
        };
        let mut tokens = clip.tokenize(ctx, inputs.string("text_g")?)?;
        tokens[l] = clip.tokenize(ctx, inputs.string("text_l")?)?.swap_remove(l);
        if tokens[l].chunks.len() != tokens[gi].chunks.len() {
            let empty = clip.tokenize(ctx, "")?;
            while tokens[l].chunks.len() < tokens[gi].chunks.len() {
                tokens[l].chunks.extend(empty[l].chunks.iter().cloned());
            }
            while tokens[gi].chunks.len() < tokens[l].chunks.len() {
                tokens[gi].chunks.extend(empty[gi].chunks.iter().cloned());
            }
        }
        let mut entry = clip.encode_tokens(ctx, &tokens)?;
        entry.size = SizeCond {
            width: size(inputs, "width")?,
            height: size(inputs, "height")?,
            crop_w: size(inputs, "crop_w")?,
            crop_h: size(inputs, "crop_h")?,
            target_width: size(inputs, "target_width")?,
            target_height: size(inputs, "target_height")?,
        };
        Ok(conditioning(entry))
    }
}

/// ComfyUI's CLIPTextEncodeSDXLRefiner: the prompt with the refiner's
/// aesthetic score and size.
pub struct ClipTextEncodeSdxlRefiner;

impl NodeImpl for ClipTextEncodeSdxlRefiner {
    fn device_inputs(&self) -> &'static [&'static str] {
        &["clip"]
    }

    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let clip: Arc<Clip> = input(inputs, "clip", "CLIP")?;
        let tokens = clip.tokenize(ctx, inputs.string("text")?)?;
        let mut entry = clip.encode_tokens(ctx, &tokens)?;
        entry.aesthetic_score = Some(inputs.float("ascore")?);
        entry.size.width = size(inputs, "width")?;
        entry.size.height = size(inputs, "height")?;
        Ok(conditioning(entry))
    }
}
