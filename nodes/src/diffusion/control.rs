//! ControlNets as ComfyUI applies them (comfy/controlnet.py, nodes.py).
//!
//! - **Loading** (ControlNetLoader): a ldm-layout ControlNet, keys under
//!   `control_model.` or at the top level, or a diffusers-format one
//!   renamed to that layout ([`crate::models::controlnet`]). T2I-Adapters,
//!   control-LoRAs and union ControlNets are refused by name.
//! - **Applying**: each conditioning entry carries a chain of [`Control`]s
//!   (the newest last, each pointing at the one it was applied over).
//!   ControlNetApply gives every positive entry its own copy and marks it
//!   for the negative too; the sampler then hands the same object to the
//!   negative entries without an area ([`fill_uncond`], ComfyUI's
//!   `apply_empty_x_to_equal_area`). ControlNetApplyAdvanced shares one
//!   copy per previous chain between positive and negative, which lets
//!   them batch together (entries batch only with the identical chain).
//! - **Running** ([`Runner`]): per batch and step, the chain from the
//!   oldest: a net outside its `(start, end)` sigma range passes the
//!   previous result on; otherwise it runs on `x / c_in`, the timestep,
//!   the batch's context (and ADM vector) and its hint (the image resized
//!   to the latent × 8, nearest-exact with the centre crop, a batch of one
//!   broadcast), its residuals × strength, added to the previous ones
//!   (`prev + own`). The UNet adds them to its skips and middle block.

use super::loaders::{file_fingerprint, model_path, shapes};
use super::{graph_error, input, opaque, run_error, CondEntry, Conditioning, Model, ModelFile};
use crate::imageops::{upscale, Crop, Tensor4, UpscaleMethod};
use crate::models::controlnet::{
    controlnet_config, diffusers_config, diffusers_names, ControlNetConfig,
};
use crate::models::detect::Heads;
use crate::models::t2i::{t2i_adapter, t2i_config, T2iConfig};
use crate::models::unet::skip_shapes;
use sdkit_compute::backend::cpu::Bindings;
use sdkit_compute::plan::plan;
use sdkit_compute::plan::Program;
use sdkit_compute::runtime::Session;
use sdkit_compute::tensor::GraphBuilder;
use sdkit_compute::weights::SafeTensors;
use sdkit_engine::{Inputs, NodeContext, NodeError, NodeImpl, NodeOutput, Tensor};
use sdkit_schema::SocketType;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// A loaded control model file (ComfyUI's CONTROL_NET value).
#[derive(Debug)]
pub struct ControlNetModel {
    pub file: Arc<ModelFile>,
    pub kind: ControlKind,
    pub prefix: String,
    /// SetUnionControlNetType's choice for a union ControlNet (empty:
    /// auto, also what a union net without the node gets).
    pub control_type: Vec<usize>,
}

/// What a control model is.
#[derive(Debug)]
pub enum ControlKind {
    /// A ControlNet: runs every step on x, t and the context.
    Net { cfg: ControlNetConfig, heads: Heads },
    /// A T2I-Adapter: features of the hint alone, computed once.
    T2i(T2iConfig),
    /// Stability's control-LoRA: a ControlNet built at sampling time from
    /// the sampling model's own (patched) weights, the file's full
    /// tensors replacing some and its `up`/`down` pairs added to others
    /// (`W + up·down`). The hint convolutions come from the file.
    Lora {
        hint_convs: Vec<(usize, usize, usize)>,
    },
    /// A Flux ControlNet ([`super::flux_control`]).
    Flux(Arc<super::flux_control::FluxNet>),
    /// Stability's SD3.5 ControlNet ([`super::sd3_control`]): its hint
    /// is a latent the apply node's VAE encodes.
    Sd35 {
        cfg: crate::models::mmdit::Sd35ControlConfig,
        /// The file's `control_type` (0 blur, 1 canny, 2 depth; −1 none).
        control_type: i64,
    },
}

impl ControlNetModel {
    /// Channels of the hint it takes.
    fn hint_channels(&self) -> usize {
        match &self.kind {
            ControlKind::Net { cfg, .. } => cfg.hint_channels(),
            ControlKind::T2i(t) => t.hint_channels(),
            ControlKind::Lora { hint_convs } => hint_convs.first().map_or(3, |c| c.1),
            ControlKind::Flux(f) => f.hint_channels(),
            ControlKind::Sd35 { cfg, .. } => cfg.block.in_channels,
        }
    }

    /// The ControlNet this is for `model`: its own config, or (a
    /// control-LoRA) the model's with the file's hint block.
    pub fn net_config(&self, model: &Model) -> Option<(ControlNetConfig, Heads)> {
        match &self.kind {
            ControlKind::Net { cfg, heads } => Some((cfg.clone(), *heads)),
            ControlKind::Lora { hint_convs } => Some((
                ControlNetConfig {
                    unet: model.unet("a control-LoRA").ok()?.clone(),
                    hint_convs: hint_convs.clone(),
                    union_types: None,
                },
                model.heads,
            )),
            ControlKind::T2i(_) | ControlKind::Flux(_) | ControlKind::Sd35 { .. } => None,
        }
    }

    /// The hint's pixel size for a latent of `h`×`w` (ComfyUI's
    /// compression ratio 8; an adapter rounds up to its unshuffle factor).
    fn hint_size(&self, h: usize, w: usize) -> (usize, usize) {
        match &self.kind {
            ControlKind::Net { .. } | ControlKind::Lora { .. } => (8 * h, 8 * w),
            ControlKind::Flux(f) if f.latent() => (h, w),
            ControlKind::Flux(_) => (8 * h, 8 * w),
            // The encoded hint: latent-sized.
            ControlKind::Sd35 { .. } => (h, w),
            ControlKind::T2i(t) => {
                let r = t.unshuffle();
                ((8 * h).div_ceil(r) * r, (8 * w).div_ceil(r) * r)
            }
        }
    }
}

/// One applied ControlNet: the net, its hint image, strength and range,
/// and the chain it was applied over.
#[derive(Debug)]
pub struct Control {
    pub net: Arc<ControlNetModel>,
    /// IMAGE `[b, H, W, C]`.
    pub hint: Arc<Tensor>,
    pub strength: f32,
    /// `(start_percent, end_percent)`.
    pub range: (f64, f64),
    pub previous: Option<Arc<Control>>,
    /// The apply node's VAE: encodes the hint of a latent-space net.
    pub vae: Option<Arc<super::Vae>>,
}

impl Control {
    /// The chain, oldest first.
    pub(crate) fn chain(self: &Arc<Self>) -> Vec<Arc<Control>> {
        let mut v = vec![Arc::clone(self)];
        while let Some(p) = v.last().and_then(|c| c.previous.clone()) {
            v.push(p);
        }
        v.reverse();
        v
    }
}

/// Whether two entries' chains are the same object (ComfyUI batches
/// entries only then).
pub fn same(a: &Option<Arc<Control>>, b: &Option<Arc<Control>>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => Arc::ptr_eq(a, b),
        _ => false,
    }
}

/// ControlNetLoader.
pub struct ControlNetLoader;

fn load(ctx: &NodeContext, name: &str) -> Result<ControlNetModel, NodeError> {
    let path = model_path(ctx, "controlnet", name)?;
    let mut file = SafeTensors::open(&path).map_err(|e| NodeError::invalid(e.to_string()))?;
    let mut s = shapes(&file);
    if s.contains_key("controlnet_cond_embedding.conv_in.weight") {
        // Diffusers layout: renamed to ldm as ComfyUI does; a union net's
        // own tensors keep their names (`.attn.in_proj_` → `.attn.in_proj.`).
        let cfg = diffusers_config(&s).map_err(|e| NodeError::file(&path, e))?;
        let mut names = diffusers_names(&cfg, &s);
        if s.contains_key("control_add_embedding.linear_1.weight") {
            for k in s.keys() {
                let own = [
                    "task_embedding",
                    "transformer_layes.",
                    "spatial_ch_projs.",
                    "control_add_embedding.",
                ];
                if own.iter().any(|p| k.starts_with(p)) {
                    names.insert(k.clone(), k.replace(".attn.in_proj_", ".attn.in_proj."));
                }
            }
        }
        let dropped = file.rename(&names);
        if !dropped.is_empty() {
            tracing::warn!(
                "{}: {} tensors not used by the ControlNet: {}",
                path.display(),
                dropped.len(),
                dropped
                    .iter()
                    .take(8)
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        s = shapes(&file);
    }
    if super::sd3_control::rename_embedders(&mut file) {
        s = shapes(&file);
    }
    let file = Arc::new(file);
    let has = |k: &str| s.contains_key(k);
    let dit = match super::sd3_control::detect(&path, &file, &s)? {
        Some(kind) => Some(kind),
        None => super::flux_control::detect(&path, &s)?,
    };
    if let Some(kind) = dit {
        return Ok(ControlNetModel {
            file: Arc::new(ModelFile::whole(name, file)),
            kind,
            prefix: String::new(),
            control_type: Vec::new(),
        });
    }
    if has("lora_controlnet") {
        let mut hint_convs = Vec::new();
        for i in (0..32).step_by(2) {
            match s.get(&format!("input_hint_block.{i}.weight")) {
                Some(sh) if sh.len() == 4 => hint_convs.push((i, sh[1], sh[0])),
                _ => break,
            }
        }
        if hint_convs.is_empty() {
            return Err(NodeError::file(
                &path,
                "a control-LoRA without input_hint_block.0.weight",
            ));
        }
        return Ok(ControlNetModel {
            file: Arc::new(ModelFile::whole(name, file)),
            kind: ControlKind::Lora { hint_convs },
            prefix: String::new(),
            control_type: Vec::new(),
        });
    }
    let refuse = |what: &str| {
        Err(NodeError::file(
            &path,
            format!("{what} are not supported yet (sdkit reads ldm-layout ControlNets, control_v11* and their conversions)"),
        ))
    };
    let prefix = if has("control_model.zero_convs.0.0.weight") {
        "control_model."
    } else if has("zero_convs.0.0.weight") {
        ""
    } else {
        // A T2I-Adapter: the full kind is read; the light and style kinds
        // are refused by name.
        if has("body.0.in_conv.weight") {
            return refuse("light T2I-Adapters");
        }
        let Some(t) = t2i_config(&s).map_err(|e| NodeError::file(&path, e))? else {
            return refuse("control models of this layout (not a ControlNet or T2I-Adapter)");
        };
        return Ok(ControlNetModel {
            file: Arc::new(ModelFile::whole(name, file)),
            kind: ControlKind::T2i(t),
            prefix: String::new(),
            control_type: Vec::new(),
        });
    };
    let cfg = controlnet_config(&s, prefix).map_err(|e| NodeError::file(&path, e))?;
    // The family's head rule: SD1's nets have no linear projections, SD2's
    // and SDXL's do (ComfyUI detects the net like a UNet).
    let heads = if cfg.unet.use_linear_in_transformer {
        Heads::Width(64)
    } else {
        Heads::Count(8)
    };
    Ok(ControlNetModel {
        file: Arc::new(ModelFile::whole(name, file)),
        kind: ControlKind::Net { cfg, heads },
        prefix: prefix.to_string(),
        control_type: Vec::new(),
    })
}

impl NodeImpl for ControlNetLoader {
    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let name = inputs.string("control_net_name")?;
        let net = load(ctx, name)?;
        Ok(NodeOutput::values(vec![opaque(
            SocketType::ControlNet,
            Arc::new(net),
        )]))
    }

    fn fingerprint(&self, ctx: &NodeContext, inputs: &Inputs) -> Option<String> {
        file_fingerprint(ctx, "controlnet", inputs.string("control_net_name").ok()?)
    }
}

/// DiffControlNetLoader: ComfyUI adds a "diff" ControlNet's weights to the
/// model's; for a full ControlNet (what people use it with) that is the
/// same as ControlNetLoader.
pub struct DiffControlNetLoader;

impl NodeImpl for DiffControlNetLoader {
    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let _model: Arc<Model> = input(inputs, "model", "MODEL")?;
        ControlNetLoader.execute(ctx, inputs)
    }

    fn fingerprint(&self, ctx: &NodeContext, inputs: &Inputs) -> Option<String> {
        ControlNetLoader.fingerprint(ctx, inputs)
    }
}

/// SetUnionControlNetType: a copy of the ControlNet with the type chosen
/// ("auto" clears it), as ComfyUI's `control_type` extra argument.
pub struct SetUnionControlNetType;

impl NodeImpl for SetUnionControlNetType {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        const TYPES: [&str; 8] = [
            "openpose",
            "depth",
            "hed/pidi/scribble/ted",
            "canny/lineart/anime_lineart/mlsd",
            "normal",
            "segment",
            "tile",
            "repaint",
        ];
        let n = net(inputs)?;
        let ty = inputs.string("type")?;
        let kind = match &n.kind {
            ControlKind::Net { cfg, heads } => ControlKind::Net {
                cfg: cfg.clone(),
                heads: *heads,
            },
            ControlKind::T2i(t) => ControlKind::T2i(t.clone()),
            ControlKind::Lora { hint_convs } => ControlKind::Lora {
                hint_convs: hint_convs.clone(),
            },
            ControlKind::Flux(f) => ControlKind::Flux(Arc::clone(f)),
            ControlKind::Sd35 { cfg, control_type } => ControlKind::Sd35 {
                cfg: cfg.clone(),
                control_type: *control_type,
            },
        };
        let out = ControlNetModel {
            file: Arc::clone(&n.file),
            kind,
            prefix: n.prefix.clone(),
            control_type: TYPES.iter().position(|t| *t == ty).into_iter().collect(),
        };
        Ok(NodeOutput::values(vec![opaque(
            SocketType::ControlNet,
            Arc::new(out),
        )]))
    }
}

fn net(inputs: &Inputs) -> Result<Arc<ControlNetModel>, NodeError> {
    let n: Arc<Arc<ControlNetModel>> = input(inputs, "control_net", "CONTROL_NET")?;
    Ok(Arc::clone(&n))
}

fn strength(inputs: &Inputs) -> Result<f32, NodeError> {
    let s = inputs.float("strength")?;
    if !s.is_finite() {
        return Err(NodeError::invalid("strength must be a finite number"));
    }
    Ok(s as f32)
}

/// ControlNetApply (the old node): positive only, applied to the negative
/// by the sampler.
pub struct ControlNetApply;

impl NodeImpl for ControlNetApply {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let c: Arc<Conditioning> = input(inputs, "conditioning", "CONDITIONING")?;
        let strength = strength(inputs)?;
        if strength == 0.0 {
            return Ok(NodeOutput::values(vec![opaque(
                SocketType::Conditioning,
                (*c).clone(),
            )]));
        }
        let net = net(inputs)?;
        let hint = Arc::clone(inputs.image("image")?);
        let mut out = (*c).clone();
        for e in &mut out.0 {
            e.control = Some(Arc::new(Control {
                net: Arc::clone(&net),
                hint: Arc::clone(&hint),
                strength,
                range: (0.0, 1.0),
                previous: e.control.take(),
                vae: None,
            }));
            e.control_apply_to_uncond = true;
        }
        Ok(NodeOutput::values(vec![opaque(
            SocketType::Conditioning,
            out,
        )]))
    }
}

/// ControlNetApplyAdvanced (and ControlNetApplySD3, the same with the VAE
/// required): one chain object per previous chain, shared by positive and
/// negative. The VAE encodes the hint of a net that works in latent space
/// (SD3.5's); nets that take images leave it unused.
pub struct ControlNetApplyAdvanced;

impl NodeImpl for ControlNetApplyAdvanced {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let pos: Arc<Conditioning> = input(inputs, "positive", "CONDITIONING")?;
        let neg: Arc<Conditioning> = input(inputs, "negative", "CONDITIONING")?;
        let strength = strength(inputs)?;
        if strength == 0.0 {
            return Ok(NodeOutput::values(vec![
                opaque(SocketType::Conditioning, (*pos).clone()),
                opaque(SocketType::Conditioning, (*neg).clone()),
            ]));
        }
        let net = net(inputs)?;
        let hint = Arc::clone(inputs.image("image")?);
        let range = (inputs.float("start_percent")?, inputs.float("end_percent")?);
        let vae: Option<Arc<super::Vae>> = match inputs.get("vae") {
            Some(_) => Some(input(inputs, "vae", "VAE")?),
            None => None,
        };
        // Keyed by the previous chain's identity (None for none).
        let mut made: Vec<(Option<Arc<Control>>, Arc<Control>)> = Vec::new();
        let mut apply = |c: &Conditioning| -> Conditioning {
            let mut out = c.clone();
            for e in &mut out.0 {
                let prev = e.control.take();
                let found = made
                    .iter()
                    .find(|(p, _)| same(p, &prev))
                    .map(|(_, c)| Arc::clone(c));
                let c = found.unwrap_or_else(|| {
                    let c = Arc::new(Control {
                        net: Arc::clone(&net),
                        hint: Arc::clone(&hint),
                        strength,
                        range,
                        previous: prev.clone(),
                        vae: vae.clone(),
                    });
                    made.push((prev, Arc::clone(&c)));
                    c
                });
                e.control = Some(c);
                e.control_apply_to_uncond = false;
            }
            out
        };
        let p = apply(&pos);
        let n = apply(&neg);
        Ok(NodeOutput::values(vec![
            opaque(SocketType::Conditioning, p),
            opaque(SocketType::Conditioning, n),
        ]))
    }
}

/// Whether an entry has an area once resolved (an explicit one, or its
/// mask's bounds).
fn has_area(e: &CondEntry) -> bool {
    e.area.is_some() || e.mask.as_ref().is_some_and(|m| m.set_area_to_bounds)
}

/// `apply_empty_x_to_equal_area` for controls: when no negative entry
/// without an area has a control, the ControlNetApply controls of the
/// positive entries without one go to those negative entries in turn.
pub fn fill_uncond(positive: &Conditioning, negative: &Conditioning) -> Option<Conditioning> {
    let cnets: Vec<&Arc<Control>> = positive
        .0
        .iter()
        .filter(|e| e.control_apply_to_uncond && !has_area(e))
        .filter_map(|e| e.control.as_ref())
        .collect();
    if cnets.is_empty()
        || negative
            .0
            .iter()
            .any(|e| !has_area(e) && e.control.is_some())
    {
        return None;
    }
    let others: Vec<usize> = (0..negative.0.len())
        .filter(|&i| !has_area(&negative.0[i]))
        .collect();
    if others.is_empty() {
        return None;
    }
    let mut out = negative.clone();
    for (x, c) in cnets.iter().enumerate() {
        let i = others[x % others.len()];
        out.0[i].control = Some(Arc::clone(c));
    }
    Some(out)
}

/// Where a chain's residuals enter the UNet program: after input blocks
/// (`ctrl_in.{k}`), on every skip (`ctrl_out.{i}`), after the middle
/// (`ctrl_mid`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Slots {
    pub input: Vec<usize>,
    pub output: bool,
    pub middle: bool,
}

/// One batch's residuals (shared where a net repeats one: a Flux net's
/// lists cycle through its blocks).
#[derive(Debug, Default)]
pub struct Residuals {
    /// By input block (a Flux model's double blocks).
    pub input: BTreeMap<usize, Arc<Vec<f32>>>,
    /// One per skip (a Flux model's single blocks), or none.
    pub output: Vec<Arc<Vec<f32>>>,
    pub middle: Option<Arc<Vec<f32>>>,
}

/// The shapes of a model's residual inputs: per input slot, per output
/// slot, and the middle's.
#[derive(Debug, Clone, Default)]
pub struct SlotShapes {
    pub input: Vec<Vec<usize>>,
    pub output: Vec<Vec<usize>>,
    pub middle: Vec<usize>,
}

/// The residual input shapes of `model`'s program for `rows` latents
/// `h`×`w` (none for models that take no control).
pub fn slot_shapes(model: &Model, rows: usize, h: usize, w: usize) -> SlotShapes {
    match &model.net {
        crate::models::detect::Net::Unet(u) => {
            let (skips, middle) = skip_shapes(u, rows, h, w);
            SlotShapes {
                input: skips.clone(),
                output: skips,
                middle,
            }
        }
        crate::models::detect::Net::Flux(f) => super::flux_control::slot_shapes(f, rows, h, w),
        crate::models::detect::Net::Mmdit(m) => super::sd3_control::slot_shapes(m, rows, h, w),
    }
}

impl Residuals {
    /// The program inputs for `slots`, zeros where this has none.
    pub fn feed(
        &self,
        slots: &Slots,
        shapes: &SlotShapes,
        feed: &mut HashMap<String, Arc<Vec<f32>>>,
    ) {
        let zeros = |s: &[usize]| Arc::new(vec![0f32; s.iter().product()]);
        for &k in &slots.input {
            let v = match self.input.get(&k) {
                Some(v) => Arc::clone(v),
                None => zeros(&shapes.input[k]),
            };
            feed.insert(format!("ctrl_in.{k}"), v);
        }
        if slots.output {
            for (i, s) in shapes.output.iter().enumerate() {
                let v = match self.output.get(i) {
                    Some(v) => Arc::clone(v),
                    None => zeros(s),
                };
                feed.insert(format!("ctrl_out.{i}"), v);
            }
        }
        if slots.middle {
            let v = match &self.middle {
                Some(v) => Arc::clone(v),
                None => zeros(&shapes.middle),
            };
            feed.insert("ctrl_mid".to_string(), v);
        }
    }
}

/// One batch's inputs to a control chain.
pub struct Batch<'a> {
    /// `x / c_in` `[rows, c, h, w]`.
    pub x: &'a [f32],
    pub rows: usize,
    /// Entries in the batch (ComfyUI's `batched_number`).
    pub entries: usize,
    pub hw: (usize, usize),
    pub t: f32,
    pub sigma: f32,
    /// The context, and the ADM inputs where the model takes them.
    pub fixed: &'a HashMap<String, Arc<Vec<f32>>>,
    pub tokens: usize,
    pub dim: usize,
}

/// `(net, rows, h, w, tokens, hint batch)`: one program each.
type Key = (usize, usize, usize, usize, usize, usize);

/// The control programs a sampling needs, planned before it starts, and
/// the hints resized per control and area, and broadcast per batch shape
/// (`(control, rows, entries, h, w)`), so a step copies none.
#[derive(Default)]
pub struct Plans {
    progs: Vec<(Program, Bindings)>,
    index: HashMap<Key, usize>,
    hints: HashMap<(usize, usize, usize), Arc<Vec<f32>>>,
    fed: HashMap<(usize, usize, usize, usize, usize), FedHint>,
    /// SD3.5 ControlNets' sin-cos position tables by (width, rows, cols).
    pos: HashMap<(usize, usize, usize), Arc<Vec<f32>>>,
}

/// A hint as a batch takes it, and its batch size.
type FedHint = (Arc<Vec<f32>>, usize);

/// A batch's shape as [`Plans::add`] needs it.
pub struct Shape {
    pub rows: usize,
    pub entries: usize,
    pub hw: (usize, usize),
    pub tokens: usize,
    pub dim: usize,
}

impl Plans {
    /// Plans every model of `chain` for batches of `shape`; returns the
    /// UNet inputs the chain feeds.
    pub fn add(
        &mut self,
        ctx: &NodeContext,
        model: &Model,
        chain: &Arc<Control>,
        shape: &Shape,
    ) -> Result<Slots, NodeError> {
        let (h, w) = shape.hw;
        let mut slots = Slots::default();
        for c in chain.chain() {
            let (_, hb) = self.hint_for(ctx, model, &c, shape)?;
            let key = key(&c, shape, hb);
            if let ControlKind::Sd35 { cfg, .. } = &c.net.kind {
                slots.output = true;
                let p = cfg.block.patch;
                let (gh, gw) = (h.div_ceil(p), w.div_ceil(p));
                self.pos
                    .entry((cfg.block.hidden, gh, gw))
                    .or_insert_with(|| {
                        Arc::new(crate::models::mmdit::sincos_pos_embed(
                            cfg.block.hidden,
                            gw,
                            gh,
                        ))
                    });
                if !self.index.contains_key(&key) {
                    let prog = super::sd3_control::program(model, &c.net, shape.rows, (h, w), hb)?;
                    let bind = super::sd3_control::bindings(&prog, &c.net, model)?;
                    self.index.insert(key, self.progs.len());
                    self.progs.push((prog, bind));
                }
                continue;
            }
            if let ControlKind::Flux(_) = &c.net.kind {
                let (input, output) = super::flux_control::slots(model, &c.net)?;
                for k in input {
                    if !slots.input.contains(&k) {
                        slots.input.push(k);
                    }
                }
                slots.output |= output;
                if !self.index.contains_key(&key) {
                    let prog = super::flux_control::program(
                        model,
                        &c.net,
                        shape.rows,
                        (h, w),
                        (shape.tokens, shape.dim),
                        hb,
                    )?;
                    let bind = super::flux_control::bindings(&prog, &c.net)?;
                    self.index.insert(key, self.progs.len());
                    self.progs.push((prog, bind));
                }
                continue;
            }
            let (skips, _) = skip_shapes(model.unet("ControlNet")?, shape.rows, h, w);
            match &c.net.kind {
                ControlKind::Net { .. } | ControlKind::Lora { .. } => {
                    slots.output = true;
                    slots.middle = true;
                }
                ControlKind::Flux(_) | ControlKind::Sd35 { .. } => {}
                ControlKind::T2i(t) => {
                    let (blocks, mid) = t.placement();
                    for (_, k) in blocks {
                        if k < skips.len() && !slots.input.contains(&k) {
                            slots.input.push(k);
                        }
                    }
                    slots.middle |= mid.is_some();
                }
            }
            if !self.index.contains_key(&key) {
                let prog = match &c.net.kind {
                    ControlKind::Sd35 { .. } => {
                        super::sd3_control::program(model, &c.net, shape.rows, (h, w), hb)?
                    }
                    ControlKind::Flux(_) => super::flux_control::program(
                        model,
                        &c.net,
                        shape.rows,
                        (h, w),
                        (shape.tokens, shape.dim),
                        hb,
                    )?,
                    ControlKind::Net { .. } | ControlKind::Lora { .. } => model.control_program(
                        &c.net,
                        shape.rows,
                        (h, w),
                        (shape.tokens, shape.dim),
                        hb,
                    )?,
                    ControlKind::T2i(t) => {
                        let (ph, pw) = c.net.hint_size(h, w);
                        adapter_program(&c.net.file.name, t, hb, ph, pw)?
                    }
                };
                let bind = match &c.net.kind {
                    ControlKind::Lora { .. } => {
                        super::control_lora::bindings(&prog, &c.net.file, model)?
                    }
                    _ => c.net.file.bindings(&prog, None, None)?,
                };
                self.index.insert(key, self.progs.len());
                self.progs.push((prog, bind));
            }
        }
        slots.input.sort_unstable();
        Ok(slots)
    }

    /// The control's hint for batches of `shape`, broadcast, and its batch.
    pub(crate) fn hint_for(
        &mut self,
        ctx: &NodeContext,
        model: &Model,
        c: &Arc<Control>,
        shape: &Shape,
    ) -> Result<(Arc<Vec<f32>>, usize), NodeError> {
        let (h, w) = shape.hw;
        let key = (Arc::as_ptr(c) as usize, shape.rows, shape.entries, h, w);
        if let Some((v, hb)) = self.fed.get(&key) {
            return Ok((Arc::clone(v), *hb));
        }
        let hint = self.hint(ctx, model, c, h, w)?;
        let (ph, pw) = c.net.hint_size(h, w);
        let per = c.net.hint_channels() * ph * pw;
        let n = hint.len() / per.max(1);
        let v = if n == shape.rows {
            hint
        } else {
            Arc::new(broadcast(&hint, n, shape.rows, shape.entries))
        };
        let hb = v.len() / per.max(1);
        self.fed.insert(key, (Arc::clone(&v), hb));
        Ok((v, hb))
    }

    /// [`Plans::hint_for`] of a batch shape planned already.
    fn cached_hint(
        &self,
        c: &Arc<Control>,
        shape: &Shape,
    ) -> Result<(Arc<Vec<f32>>, usize), NodeError> {
        let (h, w) = shape.hw;
        let key = (Arc::as_ptr(c) as usize, shape.rows, shape.entries, h, w);
        self.fed
            .get(&key)
            .map(|(v, hb)| (Arc::clone(v), *hb))
            .ok_or_else(|| NodeError::invalid("a control hint was not planned"))
    }

    /// The control's hint for a latent of `h`×`w`, NCHW: resized with the
    /// centre crop (nearest-exact), an adapter's grey hint the channels'
    /// mean.
    fn hint(
        &mut self,
        ctx: &NodeContext,
        model: &Model,
        c: &Arc<Control>,
        h: usize,
        w: usize,
    ) -> Result<Arc<Vec<f32>>, NodeError> {
        let key = (Arc::as_ptr(c) as usize, h, w);
        if let Some(v) = self.hints.get(&key) {
            return Ok(Arc::clone(v));
        }
        let latent = match &c.net.kind {
            ControlKind::Sd35 { control_type, .. } => Some(*control_type),
            // No preprocessing: the image as it is, encoded.
            ControlKind::Flux(f) if f.latent() => Some(-1),
            _ => None,
        };
        if let Some(control_type) = latent {
            let v = Arc::new(encoded_hint(ctx, model, c, control_type, h, w)?);
            self.hints.insert(key, Arc::clone(&v));
            return Ok(v);
        }
        let img = &c.hint;
        let [n, ih, iw, ic] = img.shape[..] else {
            return Err(NodeError::invalid(format!(
                "the control image has shape {:?}; expected [batch, height, width, channels]",
                img.shape
            )));
        };
        let want = c.net.hint_channels();
        let grey = matches!(c.net.kind, ControlKind::T2i(_)) && want == 1 && ic > 1;
        if ic < want {
            return Err(NodeError::invalid(format!(
                "the control image has {ic} channels; this control model takes {want}"
            )));
        }
        let t = Tensor4 {
            b: n,
            h: ih,
            w: iw,
            c: ic,
            data: img.data.clone(),
        };
        let (oh, ow) = c.net.hint_size(h, w);
        let r = upscale(&t, ow, oh, UpscaleMethod::NearestExact, Crop::Center)
            .map_err(|e| NodeError::invalid(format!("resizing the control image: {e}")))?;
        let mut out = Vec::with_capacity(n * want * oh * ow);
        for bi in 0..n {
            for ch in 0..want {
                for y in 0..oh {
                    for x in 0..ow {
                        let px = &r.data[((bi * oh + y) * ow + x) * ic..][..ic];
                        out.push(if grey {
                            px.iter().sum::<f32>() / ic as f32
                        } else {
                            px[ch]
                        });
                    }
                }
            }
        }
        let v = Arc::new(out);
        self.hints.insert(key, Arc::clone(&v));
        Ok(v)
    }
}

/// A T2I-Adapter's program: `hint` in, its four features out.
fn adapter_program(
    name: &str,
    cfg: &T2iConfig,
    hb: usize,
    ph: usize,
    pw: usize,
) -> Result<Program, NodeError> {
    let what = format!("T2I-Adapter {name}");
    let g = GraphBuilder::new();
    let feats = g
        .input("hint", &[hb, cfg.hint_channels(), ph, pw])
        .and_then(|x| t2i_adapter(&g, cfg, x))
        .map_err(|e| graph_error(&what, e))?;
    plan(&g.finish(&feats)).map_err(|e| graph_error(&what, e))
}

fn key(c: &Arc<Control>, shape: &Shape, hb: usize) -> Key {
    let (h, w) = shape.hw;
    let (rows, tokens) = match c.net.kind {
        // An adapter depends on its hint alone.
        ControlKind::T2i(_) => (0, 0),
        ControlKind::Net { .. }
        | ControlKind::Lora { .. }
        | ControlKind::Flux(_)
        | ControlKind::Sd35 { .. } => (shape.rows, shape.tokens),
    };
    (Arc::as_ptr(&c.net) as usize, rows, h, w, tokens, hb)
}

/// An adapter's features for one hint: `(control, h, w, hint batch)`.
type Features = Arc<Vec<Vec<f32>>>;

/// Runs control chains for the sampler on the programs of a [`Plans`],
/// each prepared once; an adapter's features are computed on first use.
pub struct Runner<'p> {
    plans: &'p Plans,
    sessions: Vec<Session<'p>>,
    features: HashMap<(usize, usize, usize, usize), Features>,
}

impl<'p> Runner<'p> {
    /// Prepares every planned program (their weights are bound here).
    pub fn new(ctx: &'p NodeContext, plans: &'p Plans) -> Result<Self, NodeError> {
        let mut sessions = Vec::with_capacity(plans.progs.len());
        for (prog, bind) in &plans.progs {
            sessions.push(
                ctx.runtime
                    .prepare(prog, bind)
                    .map_err(|e| run_error("control model", e))?,
            );
        }
        Ok(Runner {
            plans,
            sessions,
            features: HashMap::new(),
        })
    }

    /// The chain's residuals for a batch, or None when no model in it is
    /// active at this sigma.
    pub fn residuals(
        &mut self,
        model: &Model,
        control: &Arc<Control>,
        b: &Batch<'_>,
    ) -> Result<Option<Residuals>, NodeError> {
        let shape = Shape {
            rows: b.rows,
            entries: b.entries,
            hw: b.hw,
            tokens: b.tokens,
            dim: b.dim,
        };
        let mut acc: Option<Residuals> = None;
        for c in control.chain() {
            // ComfyUI compares the f32 sigma with the range in f32.
            let start = model.schedule.percent_to_sigma(c.range.0) as f32;
            let end = model.schedule.percent_to_sigma(c.range.1) as f32;
            if b.sigma > start || b.sigma < end {
                continue;
            }
            let (hint, hb) = self.plans.cached_hint(&c, &shape)?;
            let key = key(&c, &shape, hb);
            let Some(&i) = self.plans.index.get(&key) else {
                return Err(NodeError::invalid("a control program was not planned"));
            };
            // x *= strength, in f32, as ComfyUI scales in place.
            let scale = |v: &mut Vec<f32>| v.iter_mut().for_each(|x| *x *= c.strength);
            let own = match &c.net.kind {
                ControlKind::Sd35 { cfg, .. } => {
                    let mut feed = HashMap::new();
                    for k in ["pooled"] {
                        if let Some(v) = b.fixed.get(k) {
                            feed.insert(k.to_string(), Arc::clone(v));
                        }
                    }
                    feed.insert("x".to_string(), Arc::new(b.x.to_vec()));
                    feed.insert("t".to_string(), Arc::new(vec![b.t; b.rows]));
                    feed.insert("hint".to_string(), hint);
                    let p = cfg.block.patch;
                    let pos_key = (cfg.block.hidden, b.hw.0.div_ceil(p), b.hw.1.div_ceil(p));
                    if let Some(pos) = self.plans.pos.get(&pos_key) {
                        feed.insert("pos".to_string(), Arc::clone(pos));
                    }
                    let mut outs = outputs(&mut self.sessions[i], feed)?;
                    outs.iter_mut().for_each(scale);
                    super::sd3_control::residuals(&c.net, outs)
                }
                ControlKind::Flux(f) => {
                    let mut feed = b.fixed.clone();
                    feed.insert("x".to_string(), Arc::new(b.x.to_vec()));
                    feed.insert("t".to_string(), Arc::new(vec![b.t; b.rows]));
                    feed.insert("hint".to_string(), hint);
                    f.feed_modes(&c.net.control_type, &mut feed);
                    let mut outs = outputs(&mut self.sessions[i], feed)?;
                    // Each block's residual once, before the lists repeat it.
                    outs.iter_mut().for_each(scale);
                    super::flux_control::residuals(&c.net, outs)
                }
                ControlKind::Net { .. } | ControlKind::Lora { .. } => {
                    let mut feed = b.fixed.clone();
                    feed.insert("x".to_string(), Arc::new(b.x.to_vec()));
                    feed.insert("t".to_string(), Arc::new(vec![b.t; b.rows]));
                    feed.insert("hint".to_string(), hint);
                    if let ControlKind::Net {
                        cfg:
                            ControlNetConfig {
                                union_types: Some(n),
                                ..
                            },
                        ..
                    } = &c.net.kind
                    {
                        // The one-hot of the chosen types (ComfyUI's
                        // `c_type`), embedded in the program.
                        let mut onehot = vec![0f32; *n];
                        for &t in &c.net.control_type {
                            if let Some(v) = onehot.get_mut(t) {
                                *v = 1.0;
                            }
                        }
                        feed.insert("control_type".to_string(), Arc::new(onehot));
                    }
                    let mut outs = self.sessions[i]
                        .run(feed)
                        .map_err(|e| run_error("ControlNet", e))?;
                    let mut middle = outs.pop().map(|o| o.data);
                    let mut output: Vec<Vec<f32>> = outs.into_iter().map(|o| o.data).collect();
                    output.iter_mut().for_each(scale);
                    middle.iter_mut().for_each(scale);
                    Residuals {
                        input: BTreeMap::new(),
                        output: output.into_iter().map(Arc::new).collect(),
                        middle: middle.map(Arc::new),
                    }
                }
                ControlKind::T2i(t) => {
                    let fkey = (Arc::as_ptr(&c) as usize, b.hw.0, b.hw.1, hb);
                    let feats = match self.features.get(&fkey) {
                        Some(f) => Arc::clone(f),
                        None => {
                            let mut feed = HashMap::new();
                            feed.insert("hint".to_string(), hint);
                            let outs = self.sessions[i]
                                .run(feed)
                                .map_err(|e| run_error("T2I-Adapter", e))?;
                            let f = Arc::new(outs.into_iter().map(|o| o.data).collect::<Vec<_>>());
                            self.features.insert(fkey, Arc::clone(&f));
                            f
                        }
                    };
                    // A batch-one feature broadcasts over the batch.
                    let rows = |f: &Vec<f32>| -> Vec<f32> {
                        if hb == b.rows {
                            f.clone()
                        } else {
                            f.repeat(b.rows / hb.max(1))
                        }
                    };
                    let (blocks, mid) = t.placement();
                    let scaled = |v: &Vec<f32>| {
                        let mut v = rows(v);
                        scale(&mut v);
                        Arc::new(v)
                    };
                    Residuals {
                        input: blocks
                            .into_iter()
                            .filter_map(|(f, k)| feats.get(f).map(|v| (k, scaled(v))))
                            .collect(),
                        output: Vec::new(),
                        middle: mid.and_then(|f| feats.get(f)).map(scaled),
                    }
                }
            };
            acc = Some(match acc {
                None => own,
                Some(prev) => merge(prev, own),
            });
        }
        Ok(acc)
    }
}

/// `broadcast_image_to`, which ComfyUI calls when the hint's batch is not
/// the batch's: a batch of one stays (the model broadcasts it); otherwise
/// the first `rows / entries` images, tiled to that, repeated for each
/// entry of the batch.
fn broadcast(hint: &[f32], n: usize, rows: usize, entries: usize) -> Vec<f32> {
    if n <= 1 || n == rows {
        return hint.to_vec();
    }
    let per = hint.len() / n;
    let per_batch = rows / entries.max(1);
    let mut one: Vec<f32> = Vec::with_capacity(per_batch * per);
    for i in 0..per_batch {
        let j = i % n.min(per_batch).max(1);
        one.extend_from_slice(&hint[j * per..(j + 1) * per]);
    }
    if per_batch == rows {
        return one;
    }
    one.repeat(entries)
}

/// `control_merge` with a previous result: `prev + own` where both exist
/// (each pair of shared residuals summed once).
fn merge(prev: Residuals, own: Residuals) -> Residuals {
    // By the (prev, own) pair of shared residuals summed.
    type Sums = HashMap<(usize, usize), Arc<Vec<f32>>>;
    let sums: std::cell::RefCell<Sums> = Default::default();
    let add = |p: Arc<Vec<f32>>, o: Arc<Vec<f32>>| -> Arc<Vec<f32>> {
        if p.len() != o.len() {
            return o;
        }
        let key = (Arc::as_ptr(&p) as usize, Arc::as_ptr(&o) as usize);
        let mut sums = sums.borrow_mut();
        Arc::clone(
            sums.entry(key)
                .or_insert_with(|| Arc::new(p.iter().zip(o.iter()).map(|(a, b)| a + b).collect())),
        )
    };
    let mut input = prev.input;
    for (k, o) in own.input {
        let v = match input.remove(&k) {
            Some(p) => add(p, o),
            None => o,
        };
        input.insert(k, v);
    }
    let mut output = Vec::with_capacity(own.output.len().max(prev.output.len()));
    let mut po = prev.output.into_iter();
    for o in own.output {
        output.push(match po.next() {
            Some(p) => add(p, o),
            None => o,
        });
    }
    output.extend(po);
    let middle = match (prev.middle, own.middle) {
        (Some(p), Some(o)) => Some(add(p, o)),
        (p, o) => o.or(p),
    };
    Residuals {
        input,
        output,
        middle,
    }
}

/// An SD3.5 ControlNet's hint as its program takes it: the image resized
/// to the latent × 8 (nearest-exact, centre crop), preprocessed by the
/// net's `control_type`, encoded by the apply node's VAE and put in the
/// model's latent space (`process_in`): `[n, 16, h, w]`.
fn encoded_hint(
    ctx: &NodeContext,
    model: &Model,
    c: &Arc<Control>,
    control_type: i64,
    h: usize,
    w: usize,
) -> Result<Vec<f32>, NodeError> {
    let vae = c.vae.as_ref().ok_or_else(|| {
        NodeError::invalid(format!(
            "ControlNet {} needs a VAE but none was provided: connect one to the apply node's vae input (ControlNetApplySD3 or ControlNetApplyAdvanced)",
            c.net.file.name
        ))
    })?;
    let img = &c.hint;
    let [n, ih, iw, ic] = img.shape[..] else {
        return Err(NodeError::invalid(format!(
            "the control image has shape {:?}; expected [batch, height, width, channels]",
            img.shape
        )));
    };
    let t = Tensor4 {
        b: n,
        h: ih,
        w: iw,
        c: ic,
        data: img.data.clone(),
    };
    let (oh, ow) = (8 * h, 8 * w);
    let mut r = upscale(&t, ow, oh, UpscaleMethod::NearestExact, Crop::Center)
        .map_err(|e| NodeError::invalid(format!("resizing the control image: {e}")))?;
    r.data
        .iter_mut()
        .for_each(|v| *v = super::sd3_control::preprocess(control_type, *v));
    let pixels = Tensor::new(vec![n, oh, ow, ic], r.data).map_err(NodeError::invalid)?;
    let latent = vae.encode(ctx, &pixels)?;
    Ok(latent
        .data
        .iter()
        .map(|&v| model.latent.process_in(v))
        .collect())
}

/// A control program's outputs' values.
fn outputs(
    session: &mut Session<'_>,
    feed: HashMap<String, Arc<Vec<f32>>>,
) -> Result<Vec<Vec<f32>>, NodeError> {
    Ok(session
        .run(feed)
        .map_err(|e| run_error("ControlNet", e))?
        .into_iter()
        .map(|o| o.data)
        .collect())
}
