//! CLIPTextEncode and CLIPSetLastLayer, with ComfyUI's semantics.

use super::{graph_error, input, opaque, sd1_tokenizer, Clip, CondEntry, Conditioning};
use crate::models::clip::{causal_mask, text_encoder_embedded, ClipLayer};
use sdkit_engine::plan::plan;
use sdkit_engine::tensor::GraphBuilder;
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

impl Clip {
    /// The layer to read, by ComfyUI's rule (`SDClipModel.set_clip_options`):
    /// an index beyond the layer count means the last layer.
    pub fn layer(&self) -> ClipLayer {
        match self.layer_idx {
            Some(k) if k < 0 && k.unsigned_abs() <= self.cfg.layers as u64 => {
                ClipLayer::FromEnd(k.unsigned_abs() as usize)
            }
            Some(k) if k > 0 && (k as u64) < self.cfg.layers as u64 => {
                // A positive index counts from the first layer.
                ClipLayer::FromEnd(self.cfg.layers - k as usize)
            }
            _ => ClipLayer::Last,
        }
    }

    /// Runs the text encoder on token rows of equal length; returns
    /// `[rows, len, width]` (row-major).
    pub fn encode_rows(&self, ctx: &NodeContext, rows: &[Vec<u32>]) -> Result<Vec<f32>, NodeError> {
        let len = rows.first().map_or(0, Vec::len);
        if len > self.cfg.max_positions {
            return Err(NodeError::invalid(format!(
                "{} tokens do not fit the text encoder's {} positions",
                len, self.cfg.max_positions
            )));
        }
        let width = self.cfg.width;
        let g = GraphBuilder::new();
        let out = (|| {
            let e = g.input("embeddings", &[rows.len(), len, width])?;
            let m = g.input("mask", &[len, len])?;
            text_encoder_embedded(&g, &self.cfg, &self.prefix, e, m, self.layer())
        })()
        .map_err(|e| graph_error("CLIP text encoder", e))?;
        let graph = g.finish(&[out]);
        let prog = plan(&graph).map_err(|e| graph_error("CLIP text encoder", e))?;
        let mut bind = self.file.bindings(&prog)?;
        // The token embedding lookup happens here, on the host.
        let table = self
            .file
            .tensor_f32(&format!("{}embeddings.token_embedding.weight", self.prefix))?;
        let mut embeds = Vec::with_capacity(rows.len() * len * width);
        for &id in rows.iter().flatten() {
            let at = id as usize * width;
            let row = table.get(at..at + width).ok_or_else(|| {
                NodeError::invalid(format!(
                    "token id {id} is outside the text encoder's {}-token vocabulary",
                    self.cfg.vocab
                ))
            })?;
            embeds.extend_from_slice(row);
        }
        bind.inputs.insert("embeddings".into(), Arc::new(embeds));
        bind.inputs
            .insert("mask".into(), Arc::new(causal_mask(len)));
        ctx.check_cancel()?;
        let mut out = super::run_model(ctx, "CLIP text encoder", &self.file.name, &prog, bind)?;
        Ok(out.swap_remove(0).data)
    }

    /// ComfyUI's `encode_token_weights`: encodes each 77-token chunk (plus
    /// an empty prompt when any weight is not 1), moves weighted tokens
    /// away from the empty prompt's encoding by their weight, and joins the
    /// chunks along the token axis: `[1, 77 × chunks, width]`.
    pub fn encode_weighted(
        &self,
        ctx: &NodeContext,
        chunks: &[Vec<(u32, f32)>],
    ) -> Result<Tensor, NodeError> {
        let width = self.cfg.width;
        let len = chunks.iter().map(Vec::len).max().unwrap_or(0);
        let has_weights = chunks.iter().flatten().any(|&(_, w)| w != 1.0);
        let mut rows: Vec<Vec<u32>> = chunks
            .iter()
            .map(|c| c.iter().map(|&(t, _)| t).collect())
            .collect();
        if rows.iter().any(|r| r.len() != len) {
            return Err(NodeError::invalid("token chunks differ in length"));
        }
        if has_weights || rows.is_empty() {
            let (start, end) = (crate::clip_tokenizer::BOS, crate::clip_tokenizer::EOS);
            let mut empty = vec![start, end];
            empty.resize(len.max(2), end);
            rows.push(empty);
        }
        let out = self.encode_rows(ctx, &rows)?;
        let row = len * width;
        if chunks.is_empty() {
            return Tensor::new(vec![1, len, width], out[..row].to_vec())
                .map_err(NodeError::invalid);
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
        Tensor::new(vec![1, chunks.len() * len, width], z).map_err(NodeError::invalid)
    }
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
        let chunks = sd1_tokenizer()?.tokenize_with_weights(text);
        let cross_attn = clip.encode_weighted(ctx, &chunks)?;
        Ok(NodeOutput::values(vec![opaque(
            SocketType::Conditioning,
            Conditioning(vec![CondEntry {
                cross_attn,
                strength: 1.0,
            }]),
        )]))
    }
}
