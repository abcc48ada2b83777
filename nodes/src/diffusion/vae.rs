//! VAEDecode and VAEEncode.

use super::{graph_error, input, Vae};
use crate::models::vae::{decode_image, encode_image};
use sdkit_engine::plan::plan;
use sdkit_engine::tensor::GraphBuilder;
use sdkit_engine::{Inputs, Latent, NodeContext, NodeError, NodeImpl, NodeOutput, Tensor, Value};
use std::sync::Arc;

impl Vae {
    /// The spatial factor between image and latent (8 for SD's VAE).
    pub fn downscale(&self) -> usize {
        1 << self.cfg.ch_mult.len().saturating_sub(1)
    }

    /// An unscaled latent `[b, z, h, w]` → IMAGE `[b, 8h, 8w, 3]` in 0..1.
    pub fn decode(&self, ctx: &NodeContext, latent: &Tensor) -> Result<Tensor, NodeError> {
        if latent.shape.len() != 4 || latent.shape[1] != self.cfg.z_channels {
            return Err(NodeError::invalid(format!(
                "latent of shape {:?} does not fit this VAE ([batch, {}, height, width])",
                latent.shape, self.cfg.z_channels
            )));
        }
        let g = GraphBuilder::new();
        let out = g
            .input("latent", &latent.shape)
            .and_then(|z| decode_image(&g, &self.cfg, &self.prefix, z))
            .map_err(|e| graph_error("VAE decoder", e))?;
        self.run(ctx, g.finish(&[out]), "latent", latent, "VAE decoder")
    }

    /// An IMAGE `[b, H, W, C≥3]` → unscaled latent, after ComfyUI's crop to
    /// a multiple of the downscale factor (centred) and using the first
    /// three channels.
    pub fn encode(&self, ctx: &NodeContext, image: &Tensor) -> Result<Tensor, NodeError> {
        let s = &image.shape;
        let f = self.downscale();
        if s.len() != 4 || s[3] < 3 {
            return Err(NodeError::invalid(format!(
                "pixels of shape {s:?}: expected an RGB image batch [batch, height, width, 3]"
            )));
        }
        let (b, h, w, c) = (s[0], s[1], s[2], s[3]);
        let (h2, w2) = ((h / f) * f, (w / f) * f);
        if h2 == 0 || w2 == 0 {
            return Err(NodeError::invalid(format!(
                "a {w}x{h} image is smaller than the VAE's {f}-pixel cell"
            )));
        }
        let (y0, x0) = ((h % f) / 2, (w % f) / 2);
        let mut px = Vec::with_capacity(b * h2 * w2 * 3);
        for bi in 0..b {
            for y in y0..y0 + h2 {
                let row = (bi * h + y) * w;
                for x in x0..x0 + w2 {
                    let at = (row + x) * c;
                    px.extend_from_slice(&image.data[at..at + 3]);
                }
            }
        }
        let pixels = Tensor::new(vec![b, h2, w2, 3], px).map_err(NodeError::invalid)?;
        let g = GraphBuilder::new();
        let out = g
            .input("pixels", &pixels.shape)
            .and_then(|x| encode_image(&g, &self.cfg, &self.prefix, x))
            .map_err(|e| graph_error("VAE encoder", e))?;
        self.run(ctx, g.finish(&[out]), "pixels", &pixels, "VAE encoder")
    }

    fn run(
        &self,
        ctx: &NodeContext,
        graph: sdkit_engine::tensor::TensorGraph,
        input: &str,
        value: &Tensor,
        what: &str,
    ) -> Result<Tensor, NodeError> {
        let prog = plan(&graph).map_err(|e| graph_error(what, e))?;
        let mut bind = self.file.bindings(&prog)?;
        bind.inputs
            .insert(input.to_string(), Arc::new(value.data.clone()));
        ctx.check_cancel()?;
        let out = super::run_model(ctx, what, &self.file.name, &prog, bind)?.swap_remove(0);
        Tensor::new(out.shape, out.data).map_err(NodeError::invalid)
    }
}

/// ComfyUI's VAEDecode.
pub struct VaeDecode;

impl NodeImpl for VaeDecode {
    fn device_inputs(&self) -> &'static [&'static str] {
        &["vae"]
    }

    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let vae: Arc<Vae> = input(inputs, "vae", "VAE")?;
        let latent = inputs.latent("samples")?;
        let image = vae.decode(ctx, &latent.samples)?;
        Ok(NodeOutput::values(vec![Value::image(image)]))
    }
}

/// ComfyUI's VAEEncode.
pub struct VaeEncode;

impl NodeImpl for VaeEncode {
    fn device_inputs(&self) -> &'static [&'static str] {
        &["vae"]
    }

    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let vae: Arc<Vae> = input(inputs, "vae", "VAE")?;
        let pixels = inputs.image("pixels")?;
        let samples = vae.encode(ctx, pixels)?;
        Ok(NodeOutput::values(vec![Value::Latent(Arc::new(Latent {
            samples,
            batch_index: None,
            noise_mask: None,
        }))]))
    }
}
