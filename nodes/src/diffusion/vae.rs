//! VAEDecode and VAEEncode.

use super::tiling::{tile_count, tiled_scale};
use super::{graph_error, input, try_run_model, RunFailure, Vae, VaeKind};
use crate::models::taesd;
use crate::models::vae::{decode_raw, encode_pixels};
use sdkit_compute::plan::{plan, Program};
use sdkit_compute::tensor::{GraphBuilder, ShapeError, T};

type R<'a> = Result<T<'a>, ShapeError>;

use sdkit_engine::{
    ImageStage, Inputs, Latent, NodeContext, NodeError, NodeImpl, NodeOutput, Tensor, Value,
};
use std::sync::Arc;

impl Vae {
    /// The spatial factor between image and latent (8 for SD's VAE).
    pub fn downscale(&self) -> usize {
        match &self.kind {
            VaeKind::Kl(cfg) => 1 << cfg.ch_mult.len().saturating_sub(1),
            VaeKind::Taesd { .. } => 8,
        }
    }

    /// Latent channels.
    pub fn z_channels(&self) -> usize {
        match &self.kind {
            VaeKind::Kl(cfg) => cfg.z_channels,
            VaeKind::Taesd {
                latent_channels, ..
            } => *latent_channels,
        }
    }

    /// The decoder's output `[b, 3, H, W]` before ComfyUI's
    /// `process_output` (about −1..1). TAESD: `decoder((z − shift) ·
    /// scale)`, then `(x − 0.5) · 2`.
    fn raw_decode<'a>(&self, g: &'a GraphBuilder, z: T<'a>) -> R<'a> {
        match &self.kind {
            VaeKind::Kl(cfg) => decode_raw(g, cfg, &self.prefix, z),
            VaeKind::Taesd {
                latent_channels,
                scale,
                shift,
            } => {
                let z = z.add_scalar(-shift).mul_scalar(*scale);
                let x = taesd::decoder(g, "taesd_decoder.", z, *latent_channels)?;
                Ok(x.add_scalar(-0.5).mul_scalar(2.0))
            }
        }
    }

    /// The latent for pixels `[b, 3, H, W]` in 0..1. TAESD: the encoder of
    /// `(p · 2 − 1) · 0.5 + 0.5` (ComfyUI's round trip, which rounds),
    /// divided by the scale, plus the shift.
    fn raw_encode<'a>(&self, g: &'a GraphBuilder, pixels: T<'a>) -> R<'a> {
        match &self.kind {
            VaeKind::Kl(cfg) => encode_pixels(g, cfg, &self.prefix, pixels),
            VaeKind::Taesd {
                latent_channels,
                scale,
                shift,
            } => {
                let x = pixels
                    .mul_scalar(2.0)
                    .add_scalar(-1.0)
                    .mul_scalar(0.5)
                    .add_scalar(0.5);
                let z = taesd::encoder(g, "taesd_encoder.", x, *latent_channels)?;
                Ok(z.div(g.constant(*scale))?.add_scalar(*shift))
            }
        }
    }

    /// The IMAGE `[b, 8h, 8w, 3]` in 0..1 (`process_output`) of `z`.
    fn image<'a>(&self, g: &'a GraphBuilder, z: T<'a>) -> R<'a> {
        self.raw_decode(g, z)?
            .add_scalar(1.0)
            .mul_scalar(0.5)
            .clamp(0.0, 1.0)
            .permute(&[0, 2, 3, 1])
    }

    /// [`Vae::decode`] with image stages after it, in one program (a fused
    /// chain: the image is read back once, in its last form). `None`: not
    /// this way (the stages do not apply to this image, or the device
    /// lacks the memory); the executor then decodes as usual, in tiles if
    /// need be, and runs the stages' nodes on the host.
    pub fn decode_fused(
        &self,
        ctx: &NodeContext,
        latent: &Tensor,
        stages: &[ImageStage],
    ) -> Result<Option<Tensor>, NodeError> {
        self.check_latent(latent)?;
        let g = GraphBuilder::new();
        let out = g.input("latent", &latent.shape).and_then(|z| {
            let image = self.image(&g, z)?;
            ImageStage::apply_all(stages, &g, image)
        });
        let Ok(out) = out else {
            return Ok(None);
        };
        let graph = g.finish(&[out]);
        let data = ImageStage::bindings(stages);
        match self.run_with(ctx, graph, "latent", latent, data, "VAE decoder") {
            Err(RunFailure::Device(e)) if e.needs_less_memory() => Ok(None),
            r => r.map(Some).map_err(|e| e.into_node("VAE decoder")),
        }
    }

    /// An unscaled latent `[b, z, h, w]` → IMAGE `[b, 8h, 8w, 3]` in 0..1.
    pub fn decode(&self, ctx: &NodeContext, latent: &Tensor) -> Result<Tensor, NodeError> {
        self.check_latent(latent)?;
        let g = GraphBuilder::new();
        let out = g
            .input("latent", &latent.shape)
            .and_then(|z| self.image(&g, z))
            .map_err(|e| graph_error("VAE decoder", e))?;
        match self.run(ctx, g.finish(&[out]), "latent", latent, "VAE decoder") {
            // As ComfyUI: out of device memory, decode in tiles instead.
            Err(RunFailure::Device(e)) if e.needs_less_memory() => {
                tracing::warn!("VAE decoding does not fit the device ({e}); decoding in tiles");
                self.decode_tiled(ctx, latent, 64, 64, 16)
            }
            r => r.map_err(|e| e.into_node("VAE decoder")),
        }
    }

    /// ComfyUI's `decode_tiled_`: the mean of three tiled passes (tiles of
    /// `tile_x/2 × 2·tile_y`, `2·tile_x × tile_y/2` and `tile_x × tile_y`
    /// latent pixels, overlapping by `overlap`), then `process_output`.
    pub fn decode_tiled(
        &self,
        ctx: &NodeContext,
        latent: &Tensor,
        tile_x: usize,
        tile_y: usize,
        overlap: usize,
    ) -> Result<Tensor, NodeError> {
        self.check_latent(latent)?;
        let passes = [
            (tile_x / 2, tile_y * 2),
            (tile_x * 2, tile_y / 2),
            (tile_x, tile_y),
        ];
        let f = self.downscale();
        let raw = self.tiled_passes(
            ctx,
            latent,
            &passes,
            overlap,
            f as f64,
            3,
            "VAE decoder",
            &|g, x| self.raw_decode(g, x),
        )?;
        // process_output, then IMAGE layout.
        let [b, c, h, w] = raw.shape[..] else {
            return Err(NodeError::invalid("tiled decode lost its shape"));
        };
        let mut px = vec![0f32; raw.data.len()];
        for bi in 0..b {
            for ci in 0..c {
                for y in 0..h {
                    for x in 0..w {
                        let v = raw.data[((bi * c + ci) * h + y) * w + x];
                        px[((bi * h + y) * w + x) * c + ci] = ((v + 1.0) / 2.0).clamp(0.0, 1.0);
                    }
                }
            }
        }
        Tensor::new(vec![b, h, w, c], px).map_err(NodeError::invalid)
    }

    /// ComfyUI's `encode_tiled_` (after its crop to the VAE's cell): the
    /// mean of tiled passes of `tile_x × tile_y`, `2·tile_x × tile_y/2` and
    /// `tile_x/2 × 2·tile_y` pixels overlapping by `overlap`.
    pub fn encode_tiled(
        &self,
        ctx: &NodeContext,
        image: &Tensor,
        tile_x: usize,
        tile_y: usize,
        overlap: usize,
    ) -> Result<Tensor, NodeError> {
        let pixels = self.crop_pixels(image)?;
        let [b, h, w, c] = pixels.shape[..] else {
            return Err(NodeError::invalid("cropped pixels lost their shape"));
        };
        let mut nchw = vec![0f32; pixels.data.len()];
        for bi in 0..b {
            for y in 0..h {
                for x in 0..w {
                    for ci in 0..c {
                        nchw[((bi * c + ci) * h + y) * w + x] =
                            pixels.data[((bi * h + y) * w + x) * c + ci];
                    }
                }
            }
        }
        let nchw = Tensor::new(vec![b, c, h, w], nchw).map_err(NodeError::invalid)?;
        let passes = [
            (tile_x, tile_y),
            (tile_x * 2, tile_y / 2),
            (tile_x / 2, tile_y * 2),
        ];
        self.tiled_passes(
            ctx,
            &nchw,
            &passes,
            overlap,
            1.0 / self.downscale() as f64,
            self.z_channels(),
            "VAE encoder",
            &|g, x| self.raw_encode(g, x),
        )
    }

    /// Runs `build` on tiles of `x` for each `(tile_x, tile_y)` pass and
    /// returns the passes' mean (summed in pass order, then divided by 3,
    /// as ComfyUI). One Program per tile shape; progress counts tiles.
    #[allow(clippy::too_many_arguments)]
    fn tiled_passes(
        &self,
        ctx: &NodeContext,
        x: &Tensor,
        passes: &[(usize, usize); 3],
        overlap: usize,
        scale: f64,
        out_channels: usize,
        what: &str,
        build: &dyn for<'a> Fn(
            &'a GraphBuilder,
            sdkit_compute::tensor::T<'a>,
        ) -> Result<
            sdkit_compute::tensor::T<'a>,
            sdkit_compute::tensor::ShapeError,
        >,
    ) -> Result<Tensor, NodeError> {
        let (b, h, w) = (x.shape[0], x.shape[2], x.shape[3]);
        for &(tx, ty) in passes {
            if tx <= overlap || ty <= overlap {
                return Err(NodeError::invalid(format!(
                    "{what}: tiles of {tx}x{ty} cannot overlap by {overlap} (make the tile larger than twice the overlap, or the overlap smaller)"
                )));
            }
        }
        let total: usize = passes
            .iter()
            .map(|&(tx, ty)| b * tile_count(h, w, ty, tx, overlap))
            .sum();
        let mut programs: std::collections::HashMap<Vec<usize>, Program> = Default::default();
        let mut done = 0u64;
        let mut sum: Option<Vec<f32>> = None;
        let mut shape = Vec::new();
        for &(tx, ty) in passes {
            let mut run_tile = |t: &Tensor| -> Result<Tensor, NodeError> {
                if !programs.contains_key(&t.shape) {
                    let g = GraphBuilder::new();
                    let out = g
                        .input("x", &t.shape)
                        .and_then(|x| build(&g, x))
                        .map_err(|e| graph_error(what, e))?;
                    let prog = plan(&g.finish(&[out])).map_err(|e| graph_error(what, e))?;
                    programs.insert(t.shape.clone(), prog);
                }
                let prog = &programs[&t.shape];
                let mut bind = self.file.bindings(prog, None, None)?;
                bind.inputs.insert("x".into(), Arc::new(t.data.clone()));
                let out = try_run_model(ctx, &self.file.name, prog, bind, false)
                    .map_err(|e| e.into_node(what))?
                    .swap_remove(0);
                Tensor::new(out.shape, out.data).map_err(NodeError::invalid)
            };
            let mut tick = || -> Result<(), NodeError> {
                done += 1;
                ctx.progress(done, total as u64)
            };
            let pass = tiled_scale(
                x,
                ty,
                tx,
                overlap,
                scale,
                out_channels,
                &mut run_tile,
                &mut tick,
                &|m| NodeError::invalid(format!("{what}: {m}")),
            )?;
            shape = pass.shape;
            match &mut sum {
                None => sum = Some(pass.data),
                Some(s) => {
                    for (a, v) in s.iter_mut().zip(&pass.data) {
                        *a += v;
                    }
                }
            }
        }
        let data = sum
            .unwrap_or_default()
            .into_iter()
            .map(|v| v / 3.0)
            .collect();
        Tensor::new(shape, data).map_err(NodeError::invalid)
    }

    /// An IMAGE `[b, H, W, C≥3]` → unscaled latent, after ComfyUI's crop to
    /// a multiple of the downscale factor (centred) and using the first
    /// three channels.
    pub fn encode(&self, ctx: &NodeContext, image: &Tensor) -> Result<Tensor, NodeError> {
        let pixels = self.crop_pixels(image)?;
        let g = GraphBuilder::new();
        let out = g
            .input("pixels", &pixels.shape)
            .and_then(|x| self.raw_encode(&g, x.permute(&[0, 3, 1, 2])?))
            .map_err(|e| graph_error("VAE encoder", e))?;
        match self.run(ctx, g.finish(&[out]), "pixels", &pixels, "VAE encoder") {
            // As ComfyUI: out of device memory, encode in tiles instead.
            Err(RunFailure::Device(e)) if e.needs_less_memory() => {
                tracing::warn!("VAE encoding does not fit the device ({e}); encoding in tiles");
                self.encode_tiled(ctx, image, 512, 512, 64)
            }
            r => r.map_err(|e| e.into_node("VAE encoder")),
        }
    }

    fn check_latent(&self, latent: &Tensor) -> Result<(), NodeError> {
        if latent.shape.len() != 4 || latent.shape[1] != self.z_channels() {
            return Err(NodeError::invalid(format!(
                "latent of shape {:?} does not fit this VAE ([batch, {}, height, width])",
                latent.shape,
                self.z_channels()
            )));
        }
        Ok(())
    }

    /// ComfyUI's `vae_encode_crop_pixels`: the first three channels,
    /// cropped (centred) to a multiple of the downscale factor.
    fn crop_pixels(&self, image: &Tensor) -> Result<Tensor, NodeError> {
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
        Tensor::new(vec![b, h2, w2, 3], px).map_err(NodeError::invalid)
    }

    fn run(
        &self,
        ctx: &NodeContext,
        graph: sdkit_compute::tensor::TensorGraph,
        input: &str,
        value: &Tensor,
        what: &str,
    ) -> Result<Tensor, RunFailure> {
        self.run_with(ctx, graph, input, value, Vec::new(), what)
    }

    /// [`Vae::run`] with more per-run inputs (fused image stages' data).
    fn run_with(
        &self,
        ctx: &NodeContext,
        graph: sdkit_compute::tensor::TensorGraph,
        input: &str,
        value: &Tensor,
        more: Vec<(String, Arc<Vec<f32>>)>,
        what: &str,
    ) -> Result<Tensor, RunFailure> {
        let prog = plan(&graph).map_err(|e| RunFailure::Node(graph_error(what, e)))?;
        let mut bind = self
            .file
            .bindings(&prog, None, None)
            .map_err(RunFailure::Node)?;
        bind.inputs
            .insert(input.to_string(), Arc::new(value.data.clone()));
        bind.inputs.extend(more);
        ctx.check_cancel().map_err(RunFailure::Node)?;
        let out = try_run_model(ctx, &self.file.name, &prog, bind, true)?.swap_remove(0);
        Tensor::new(out.shape, out.data).map_err(|e| RunFailure::Node(NodeError::invalid(e)))
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
        ctx.warn_non_finite("the decoded image", &image.data);
        Ok(NodeOutput::values(vec![Value::image(image)]))
    }

    fn takes_image_tail(&self) -> bool {
        true
    }

    fn execute_with_tail(
        &self,
        ctx: &NodeContext,
        inputs: &Inputs,
        tail: &[ImageStage],
    ) -> Option<Result<NodeOutput, NodeError>> {
        let run = || -> Result<Option<NodeOutput>, NodeError> {
            let vae: Arc<Vae> = input(inputs, "vae", "VAE")?;
            let latent = inputs.latent("samples")?;
            let Some(image) = vae.decode_fused(ctx, &latent.samples, tail)? else {
                return Ok(None);
            };
            ctx.warn_non_finite("the image", &image.data);
            Ok(Some(NodeOutput::values(vec![Value::image(image)])))
        };
        run().transpose()
    }

    /// The image on the host, twice (read back, then laid out as IMAGE).
    fn estimate_bytes(&self, _ctx: &NodeContext, inputs: &Inputs) -> Option<u64> {
        let vae: Arc<Vae> = input(inputs, "vae", "VAE").ok()?;
        let shape = &inputs.latent("samples").ok()?.samples.shape;
        let f = vae.downscale();
        let &[b, _, h, w] = shape.as_slice() else {
            return None;
        };
        let image = sdkit_engine::memory::f32_bytes(&[b, h * f, w * f, 3]);
        Some(image.saturating_mul(2))
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

/// ComfyUI's VAEDecodeTiled: tile size and overlap in pixels (overlap at
/// most a quarter of the tile); the temporal inputs only matter for video
/// VAEs.
pub struct VaeDecodeTiled;

impl NodeImpl for VaeDecodeTiled {
    fn device_inputs(&self) -> &'static [&'static str] {
        &["vae"]
    }

    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let vae: Arc<Vae> = input(inputs, "vae", "VAE")?;
        let latent = inputs.latent("samples")?;
        let tile = inputs.int("tile_size")?.max(0) as usize;
        let mut overlap = inputs.int("overlap")?.max(0) as usize;
        if tile < overlap * 4 {
            overlap = tile / 4;
        }
        let f = vae.downscale();
        let image = vae.decode_tiled(ctx, &latent.samples, tile / f, tile / f, overlap / f)?;
        ctx.warn_non_finite("the decoded image", &image.data);
        Ok(NodeOutput::values(vec![Value::image(image)]))
    }
}

/// ComfyUI's VAEEncodeTiled: tile size and overlap in pixels.
pub struct VaeEncodeTiled;

impl NodeImpl for VaeEncodeTiled {
    fn device_inputs(&self) -> &'static [&'static str] {
        &["vae"]
    }

    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let vae: Arc<Vae> = input(inputs, "vae", "VAE")?;
        let pixels = inputs.image("pixels")?;
        let tile = inputs.int("tile_size")?.max(0) as usize;
        let overlap = inputs.int("overlap")?.max(0) as usize;
        let samples = vae.encode_tiled(ctx, pixels, tile, tile, overlap)?;
        Ok(NodeOutput::values(vec![Value::Latent(Arc::new(Latent {
            samples,
            batch_index: None,
            noise_mask: None,
        }))]))
    }
}
