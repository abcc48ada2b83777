//! The diffusion pipeline nodes: checkpoint and VAE loading, text encoding,
//! sampling and the VAE, over the model graphs in [`crate::models`].
//!
//! Model-side values travel on links as `Value::Opaque` holding the types
//! here: [`Model`] (MODEL), [`Clip`] (CLIP), [`Vae`] (VAE) and
//! [`Conditioning`] (CONDITIONING). Weights stay in the memory-mapped file
//! in their stored dtype; backends convert them where a kernel or an
//! upload needs them.

pub mod cond_batch;
pub mod cond_ops;
pub mod conditioning;
pub mod control;
pub mod control_lora;
pub mod custom;
pub mod denoiser;
pub mod embeddings;
pub mod flux_control;
pub(crate) mod fused;
pub(crate) mod fused_control;
mod fused_multi;
mod fused_two;
pub mod inpaint;
pub mod ksampler;
pub mod loaders;
pub mod preview;
pub mod sd3_control;
pub mod slg;
pub mod tiling;
pub mod vae;
pub mod vision;

use crate::clip_tokenizer::ClipTokenizer;
use crate::models::detect::{EncoderArch, Family, Heads, Net, UnetConfig, VaeConfig};
use crate::models::family::{LatentFormat, TextRule};
use crate::sampling::discrete::DiscreteSchedule;
use sdkit_compute::backend::cpu::Bindings;
use sdkit_compute::plan::{Command, Program};
use sdkit_compute::weights::{DType, SafeTensors, WeightStore};
use sdkit_engine::{Inputs, NodeError, Tensor, Value};
use sdkit_schema::SocketType;
use std::any::Any;
use std::sync::{Arc, OnceLock};

/// A model file's tensors, shared by every handle made from it. Weights
/// stay in the memory-mapped file in their stored dtype: programs bind
/// `StoredWeight` handles, which the CPU backend converts for the kernels
/// that read them and a GPU backend for its upload.
pub struct ModelFile {
    /// The file name as the workflow gave it (for messages).
    pub name: String,
    pub store: WeightStore,
    /// UNETLoader's fp8 `weight_dtype`: every weight read as if cast to it.
    pub cast: Option<DType>,
    /// Patched tensors of this file by patch list, shared by every patch
    /// set that gives a tensor the same list ([`crate::adapters::Patches`]).
    pub patched: crate::adapters::PatchedCache,
}

impl std::fmt::Debug for ModelFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ModelFile({})", self.name)
    }
}

impl ModelFile {
    pub fn new(name: impl Into<String>, store: WeightStore) -> Self {
        ModelFile {
            name: name.into(),
            store,
            cast: None,
            patched: Default::default(),
        }
    }

    /// One file's tensors under their own names.
    pub fn whole(name: impl Into<String>, file: Arc<SafeTensors>) -> Self {
        let mut store = WeightStore::new();
        store.mount(file, "", "");
        ModelFile::new(name, store)
    }

    fn tensor_error(&self, name: &str, e: impl std::fmt::Display) -> NodeError {
        NodeError::invalid(format!("{}: tensor \"{name}\": {e}", self.name))
    }

    /// One tensor in f32, read now.
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>, NodeError> {
        self.store
            .to_f32(name)
            .map_err(|e| self.tensor_error(name, e))
    }

    /// One tensor in f32 as held in `held_as` (see [`Self::bindings`]).
    pub fn tensor_held(&self, name: &str, held_as: Option<DType>) -> Result<Vec<f32>, NodeError> {
        let w = self
            .store
            .stored(name)
            .map_err(|e| self.tensor_error(name, e))?;
        match held_as {
            Some(d) => w.cast_to(d),
            None => w,
        }
        .to_f32()
        .map_err(|e| self.tensor_error(name, e))
    }

    /// The weights `prog` uploads, as handles on the file; tensors that
    /// `patches` (LoRA) change, patched, in f32. `held_as`: the dtype
    /// ComfyUI holds these weights in on the device, where it rounds them
    /// (its text encoders are f16 weights computed in f32: a bf16 or f32
    /// file, and a LoRA-patched weight, is rounded to f16).
    pub fn bindings(
        &self,
        prog: &Program,
        patches: Option<&crate::adapters::Patches>,
        held_as: Option<DType>,
    ) -> Result<Bindings, NodeError> {
        let mut b = Bindings::default();
        self.bind_into(prog, patches, held_as, &|n| Some(n), &mut b)?;
        Ok(b)
    }

    /// [`ModelFile::bindings`] into `b` of the weights of this file in a
    /// program that holds other files' too: `in_file` gives an upload's
    /// name in this file, None for another file's.
    pub fn bind_into(
        &self,
        prog: &Program,
        patches: Option<&crate::adapters::Patches>,
        held_as: Option<DType>,
        in_file: &dyn Fn(&str) -> Option<&str>,
        b: &mut Bindings,
    ) -> Result<(), NodeError> {
        let cast = self.cast.or(held_as);
        for c in &prog.commands {
            let Command::Upload { name: bound, .. } = c else {
                continue;
            };
            let Some(name) = in_file(bound) else {
                continue;
            };
            if let Some(p) = patches {
                let hold = cast.or_else(|| self.gguf_held(name));
                if let Some(d) = p.patched(self, name, hold)? {
                    b.weights.insert(bound.clone(), d);
                    continue;
                }
            }
            let w = self
                .store
                .stored(name)
                .map_err(|e| self.tensor_error(name, e))?;
            let w = match cast {
                Some(d) => w.cast_to(d),
                None => w,
            };
            b.stored.insert(bound.clone(), w);
        }
        Ok(())
    }

    /// The dtype ComfyUI-GGUF keeps a GGUF file's unquantized f16/bf16
    /// tensor in: a LoRA merged into it is rounded back to that (its
    /// quantized tensors are patched at each use and stay f32).
    fn gguf_held(&self, name: &str) -> Option<DType> {
        let r = self.store.get(name)?;
        (r.file.is_gguf() && matches!(r.info.dtype, DType::F16 | DType::BF16))
            .then_some(r.info.dtype)
    }

    /// Rows `[start, start + count)` of a 2-D tensor `[rows, width]` in
    /// f32, read from the file without converting the rest (token
    /// embedding lookups), rounded as held in `held_as`.
    pub fn rows_f32(
        &self,
        name: &str,
        width: usize,
        (start, count): (usize, usize),
        held_as: Option<DType>,
    ) -> Result<Vec<f32>, NodeError> {
        self.store
            .stored(name)
            .map(|w| match held_as {
                Some(d) => w.cast_to(d),
                None => w,
            })
            .and_then(|w| w.range_f32(start * width, count * width))
            .map_err(|e| self.tensor_error(name, e))
    }
}

/// What a denoiser's output means (ComfyUI's model-sampling type). All
/// but `Flow` take x/sqrt(σ²+1) as input and noise as x₀ + σ·n.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prediction {
    /// The noise (EPS): denoised = x − out·σ.
    Eps,
    /// v (V_PREDICTION): denoised = x/(σ²+1) − out·σ/sqrt(σ²+1).
    V,
    /// LCM's consistency parameterisation over eps: denoised =
    /// c_out·(x − out·σ) + c_skip·x, from the timestep (× 10).
    Lcm,
    /// The clean latent itself (X0): denoised = out.
    X0,
    /// X0 without input scaling (IMG_TO_IMG).
    ImgToImg,
    /// Rectified flow (CONST; SD3, Flux): input x, noise (1 − σ)·x₀ + σ·n,
    /// denoised = x − out·σ.
    Flow,
}

impl Prediction {
    /// The divisor of the model input (ComfyUI's `calculate_input`).
    pub fn input_divisor(self, sigma: f32) -> f32 {
        match self {
            Prediction::Flow | Prediction::ImgToImg => 1.0,
            _ => (sigma * sigma + 1.0).sqrt(),
        }
    }

    /// The denoised estimate of output `out` for input `x` at `sigma`
    /// (timestep `t`): ComfyUI's `calculate_denoised`, in its operation
    /// order.
    pub fn denoised(self, out: &[f32], x: &[f32], sigma: f32, t: f32) -> Vec<f32> {
        let it = out.iter().zip(x);
        match self {
            Prediction::Eps | Prediction::Flow => it.map(|(o, xv)| xv - o * sigma).collect(),
            Prediction::V => {
                let d = sigma * sigma + 1.0;
                let r = d.sqrt();
                it.map(|(o, xv)| xv * 1.0 / d - o * sigma * 1.0 / r)
                    .collect()
            }
            Prediction::Lcm => {
                let ts = t * 10.0;
                let c_skip = 0.25 / (ts * ts + 0.25);
                let c_out = ts / (ts * ts + 0.25).sqrt();
                it.map(|(o, xv)| c_out * (xv - o * sigma) + c_skip * xv)
                    .collect()
            }
            Prediction::X0 | Prediction::ImgToImg => out.to_vec(),
        }
    }
}

/// MODEL: a denoiser (a UNet of SD 1.x, 2.x or XL, or a Flux
/// transformer) and its noise schedule.
#[derive(Debug, Clone)]
pub struct Model {
    pub family: Family,
    pub file: Arc<ModelFile>,
    /// LoRA patches on the model's tensors.
    pub patches: Arc<crate::adapters::Patches>,
    pub prefix: String,
    pub net: Net,
    pub heads: Heads,
    pub schedule: DiscreteSchedule,
    /// The family's latent format (SD1: scale 0.18215, no shift).
    pub latent: &'static LatentFormat,
    pub prediction: Prediction,
    /// DifferentialDiffusion's strength: the sampler thresholds the
    /// denoise mask per step ([`inpaint::Differential`]).
    pub differential: Option<f64>,
    /// Blocks this model's programs skip (a DiT's; set on the copy that
    /// skip-layer guidance runs).
    pub skip_layers: crate::models::SkipLayers,
    /// SkipLayerGuidanceDiT / SD3 / DiTSimple, in the order applied.
    pub slg: Vec<Arc<slg::SkipLayerGuidance>>,
}

impl Model {
    /// The UNet's config, or a clear error naming `what` needs it where
    /// the model is a transformer that sdkit cannot use for it yet.
    pub fn unet(&self, what: &str) -> Result<&UnetConfig, NodeError> {
        match &self.net {
            Net::Unet(u) => Ok(u),
            Net::Flux(_) | Net::Mmdit(_) => Err(NodeError::invalid(format!(
                "{what} with a {} model is not supported yet (sdkit builds it for UNet models)",
                self.family.name()
            ))),
        }
    }

    /// Channels the model takes (the latent's, plus an inpainting
    /// model's mask and masked image).
    pub fn in_channels(&self) -> usize {
        match &self.net {
            Net::Unet(u) => u.in_channels,
            Net::Flux(f) => f.in_channels,
            Net::Mmdit(m) => m.in_channels,
        }
    }

    /// The context width the model attends to (None: a UNet without
    /// cross-attention).
    pub fn context_dim(&self) -> Option<usize> {
        match &self.net {
            Net::Unet(u) => u.context_dim,
            Net::Flux(f) => Some(f.context_in),
            Net::Mmdit(m) => Some(m.context_in),
        }
    }
}

/// One text encoder of a CLIP: where its tensors are, their layout, and
/// how its family runs it.
#[derive(Debug, Clone)]
pub struct TextEncoderModel {
    pub file: Arc<ModelFile>,
    pub prefix: String,
    pub arch: EncoderArch,
    pub rule: TextRule,
    /// LoRA patches on this encoder's tensors.
    pub patches: Arc<crate::adapters::Patches>,
}

/// CLIP: a family's text encoders (SD1: CLIP-L; SD 2.x: OpenCLIP-H;
/// SDXL: CLIP-L and OpenCLIP-G; the refiner: G) and the clip-skip setting.
#[derive(Debug, Clone)]
pub struct Clip {
    pub family: Family,
    pub encoders: Vec<TextEncoderModel>,
    /// ComfyUI's `layer_idx` from CLIPSetLastLayer; None keeps each
    /// encoder's family default.
    pub layer_idx: Option<i64>,
    /// T5TokenizerOptions: `(min_padding, min_length)` for T5 prompts,
    /// replacing the family's minimum length.
    pub t5_options: Option<(usize, usize)>,
}

/// VAE: the KL autoencoder.
#[derive(Debug)]
pub struct Vae {
    pub file: Arc<ModelFile>,
    pub prefix: String,
    pub kind: VaeKind,
}

/// Which autoencoder a VAE is.
#[derive(Debug, Clone)]
pub enum VaeKind {
    /// The KL autoencoder of SD checkpoints and `models/vae` files.
    Kl(VaeConfig),
    /// TAESD (`models/vae_approx`): its encoder and decoder under
    /// `taesd_encoder.` / `taesd_decoder.`, and VAELoader's `vae_scale` /
    /// `vae_shift` (the family's latent scale, no shift).
    Taesd {
        latent_channels: usize,
        scale: f32,
        shift: f32,
    },
}

/// One CONDITIONING entry: the cross-attention context `[1, tokens, dim]`
/// and its options (ComfyUI's `[cond, {options}]` pair).
#[derive(Debug, Clone)]
pub struct CondEntry {
    pub cross_attn: Tensor,
    /// `pooled_output` `[1, width]`: the text encoder's pooled vector
    /// (SD 2.x, SDXL's OpenCLIP-G); SDXL's ADM input starts with it.
    pub pooled: Option<Tensor>,
    /// ComfyUI's `strength` (ConditioningSetAreaStrength); 1 by default.
    pub strength: f32,
    /// SDXL's size conditioning (`width`, `height`, `crop_w`, `crop_h`,
    /// `target_width`, `target_height`); unset ones take ComfyUI's
    /// defaults when the ADM vector is built.
    pub size: SizeCond,
    /// The SDXL refiner's `aesthetic_score`.
    pub aesthetic_score: Option<f64>,
    /// ConditioningSetArea(Percentage): the part of the latent the entry
    /// applies to.
    pub area: Option<CondArea>,
    /// ConditioningSetMask: where (and how strongly) the entry applies.
    pub mask: Option<CondMask>,
    /// ConditioningSetTimestepRange: the fractions of sampling between
    /// which the entry applies.
    pub start_percent: Option<f64>,
    pub end_percent: Option<f64>,
    /// InpaintModelConditioning: the greyed image's latent `[b, c, h, w]`
    /// (unscaled) and the mask `[b, 1, H, W]` an inpainting model gets as
    /// `c_concat` ([`inpaint::concat_cond`]).
    pub concat_latent_image: Option<Arc<Tensor>>,
    pub concat_mask: Option<Arc<Tensor>>,
    /// ControlNetApply(Advanced): the chain of ControlNets, newest last.
    pub control: Option<Arc<control::Control>>,
    /// Set by ControlNetApply: the sampler gives this entry's control to
    /// the negative entries too ([`control::fill_uncond`]).
    pub control_apply_to_uncond: bool,
    /// FluxGuidance / CLIPTextEncodeFlux: the distilled guidance a Flux
    /// dev model is given (ComfyUI's default 3.5 where unset).
    pub guidance: Option<f64>,
    /// FluxDisableGuidance: the model gets no guidance embedding at all.
    pub guidance_disabled: bool,
    /// ReferenceLatent: latents `[b, c, h, w]` (unscaled) an edit model
    /// (Flux Kontext) sees beside the image, in order.
    pub reference_latents: Vec<Arc<Tensor>>,
    /// FluxKontextMultiReferenceLatentMethod (None: "offset").
    pub reference_method: Option<crate::models::flux::RefMethod>,
}

/// An entry's `area`, as ComfyUI stores it: `(height, width, y, x)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CondArea {
    /// In latent cells (pixels / 8, floored: ConditioningSetArea).
    Latent([usize; 4]),
    /// As fractions of the latent (ConditioningSetAreaPercentage),
    /// resolved when sampling starts.
    Percentage([f64; 4]),
}

/// An entry's mask (ConditioningSetMask).
#[derive(Debug, Clone)]
pub struct CondMask {
    /// `[batch, height, width]`, any size (resized to the latent's).
    pub mask: Arc<Tensor>,
    /// `mask_strength`.
    pub strength: f32,
    /// `set_cond_area` "mask bounds": the area becomes the mask's bounding
    /// box.
    pub set_area_to_bounds: bool,
}

impl CondEntry {
    /// An entry with only a context and a pooled vector, as CLIPTextEncode
    /// makes.
    pub fn text(cross_attn: Tensor, pooled: Option<Tensor>) -> Self {
        CondEntry {
            cross_attn,
            pooled,
            strength: 1.0,
            size: SizeCond::default(),
            aesthetic_score: None,
            area: None,
            mask: None,
            start_percent: None,
            end_percent: None,
            concat_latent_image: None,
            concat_mask: None,
            control: None,
            control_apply_to_uncond: false,
            guidance: None,
            guidance_disabled: false,
            reference_latents: Vec::new(),
            reference_method: None,
        }
    }
}

/// The size keys of a conditioning entry (pixels).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SizeCond {
    pub width: Option<f64>,
    pub height: Option<f64>,
    pub crop_w: Option<f64>,
    pub crop_h: Option<f64>,
    pub target_width: Option<f64>,
    pub target_height: Option<f64>,
}

/// CONDITIONING: ComfyUI's list of `[cond, options]` pairs.
#[derive(Debug, Clone, Default)]
pub struct Conditioning(pub Vec<CondEntry>);

/// The SD1 tokenizer, parsed once per process.
pub fn sd1_tokenizer() -> Result<&'static ClipTokenizer, NodeError> {
    static TOKENIZER: OnceLock<Result<ClipTokenizer, String>> = OnceLock::new();
    TOKENIZER
        .get_or_init(|| ClipTokenizer::sd1().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| NodeError::invalid(format!("the bundled CLIP tokenizer data: {e}")))
}

/// Wraps a model-side value for a link.
pub fn opaque<T: Any + Send + Sync>(ty: SocketType, v: T) -> Value {
    Value::Opaque {
        ty,
        value: Arc::new(v),
    }
}

/// Reads a model-side input of type `T`.
pub fn input<T: Any + Send + Sync>(
    inputs: &Inputs,
    name: &str,
    expected: &'static str,
) -> Result<Arc<T>, NodeError> {
    match inputs.require(name)? {
        Value::Opaque { value, .. } => {
            if let Some(m) = value.downcast_ref::<loaders::MissingPart>() {
                return Err(NodeError::invalid(format!(
                    "input \"{name}\": checkpoint {} contains no {} (load one separately)",
                    m.file, m.what
                )));
            }
            Arc::clone(value)
                .downcast::<T>()
                .map_err(|_| NodeError::InputType {
                    name: name.to_string(),
                    expected,
                    found: "another model type".to_string(),
                })
        }
        v => Err(NodeError::InputType {
            name: name.to_string(),
            expected,
            found: v.socket_type().name().to_string(),
        }),
    }
}

/// Binds the model's tensor `rest` (under its prefix) as `name` in `b`:
/// LoRA-patched where the model's patches touch it, else from the file.
/// For programs that borrow a model's weights (a control-LoRA's or an
/// SD3.5 ControlNet's).
pub(crate) fn bind_model_weight(
    model: &Model,
    rest: &str,
    name: &str,
    b: &mut Bindings,
) -> Result<(), NodeError> {
    let full = format!("{}{rest}", model.prefix);
    match model.patches.patched(&model.file, &full, None)? {
        Some(p) => {
            b.weights.insert(name.to_string(), p);
        }
        None => {
            let w = model
                .file
                .store
                .stored(&full)
                .map_err(|e| NodeError::invalid(format!("{}: {e}", model.file.name)))?;
            b.stored.insert(name.to_string(), w);
        }
    }
    Ok(())
}

/// A tensor-graph construction error inside a node: the model's files and
/// the node's inputs do not fit together.
pub(crate) fn graph_error(what: &str, e: impl std::fmt::Display) -> NodeError {
    NodeError::invalid(format!("{what}: {e}"))
}

/// A backend error while running a model's program.
pub(crate) fn run_error(what: &str, e: impl std::fmt::Display) -> NodeError {
    NodeError::invalid(format!("{what} failed on the device: {e}"))
}

/// Runs a model's program once (a text encoder, a VAE), reporting its
/// residency like a sampler's.
pub(crate) fn run_model(
    ctx: &sdkit_engine::NodeContext,
    what: &str,
    model: &str,
    prog: &Program,
    bind: Bindings,
) -> Result<Vec<sdkit_compute::tensor::reference::Array>, NodeError> {
    try_run_model(ctx, model, prog, bind, true).map_err(|e| e.into_node(what))
}

/// Why [`try_run_model`] failed: the node's own error (cancelled), or the
/// device's, which a caller may answer by splitting the work.
pub(crate) enum RunFailure {
    Node(NodeError),
    Device(sdkit_engine::RuntimeError),
}

impl RunFailure {
    pub(crate) fn into_node(self, what: &str) -> NodeError {
        match self {
            RunFailure::Node(e) => e,
            RunFailure::Device(e) => run_error(what, e),
        }
    }
}

/// [`run_model`] keeping the device error; `report` emits the residency
/// event (off for the tiles of a tiled decode).
pub(crate) fn try_run_model(
    ctx: &sdkit_engine::NodeContext,
    model: &str,
    prog: &Program,
    bind: Bindings,
    report: bool,
) -> Result<Vec<sdkit_compute::tensor::reference::Array>, RunFailure> {
    let before = ctx.runtime.bytes_uploaded();
    // One run: no weight packed for the CPU's bf16 products is read twice,
    // so none is kept (the peak stays a layer's worth, not the model's).
    bind.packed.keep_none();
    let mut session = ctx
        .runtime
        .with_tuning_progress(ctx.progress_sink(), || ctx.runtime.prepare(prog, &bind))
        .map_err(RunFailure::Device)?;
    ctx.check_cancel().map_err(RunFailure::Node)?;
    let out = session.run(bind.inputs).map_err(RunFailure::Device)?;
    if report {
        report_residency(ctx, model, &session, 1, before);
    }
    Ok(out)
}

/// Emits a model use's residency event (on a GPU with a budget): what its
/// plan keeps and streams, the lower bound, and the bytes the use
/// actually copied and evicted. `uploaded_before` is the runtime's upload
/// counter before the use's first prepare.
pub(crate) fn report_residency(
    ctx: &sdkit_engine::NodeContext,
    model: &str,
    session: &sdkit_compute::runtime::Session<'_>,
    runs: u64,
    uploaded_before: u64,
) {
    let (Some(budget), Some(plan)) = (session.budget(), session.residency()) else {
        return;
    };
    let step = session.use_step();
    (ctx.events)(&sdkit_engine::Event::Residency {
        prompt_id: ctx.prompt_id.clone(),
        node: ctx.node_id.clone(),
        model: model.to_string(),
        budget,
        weight_bytes: plan.resident_bytes + plan.streamed_bytes_per_run,
        resident_bytes: plan.resident_bytes,
        streamed_bytes_per_run: plan.streamed_bytes_per_run,
        lower_bound_per_run: plan.lower_bound_per_run,
        runs,
        activation_bytes: plan.device_bytes - plan.resident_bytes - plan.stream_arena_bytes,
        loaded_bytes: step.map_or(0, |s| s.loaded_bytes),
        uploaded_bytes: ctx.runtime.bytes_uploaded() - uploaded_before,
        evicted_bytes: step.map_or(0, |s| s.evicted_bytes),
        device_bytes: step.map_or(plan.device_bytes, |s| s.device_bytes),
        out_of_memory_replans: session.replans(),
    });
}
