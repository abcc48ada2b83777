//! The denoiser: what every sampler calls. It turns a model and the
//! conditioning entries of one batch into the model program's inputs, as
//! ComfyUI's `BaseModel.extra_conds` / `apply_model` do: the latent, the
//! timestep, the cross-attention context, and the ADM vector `y` of
//! families that take one (SDXL: the pooled text vector and size
//! embeddings; the refiner: the aesthetic score instead of the target
//! size). Inpainting's `c_concat`, ControlNet residuals and Flux's
//! guidance join here as further inputs of the same program.

use super::control::{ControlNetModel, Slots};
use super::flux_control;
use super::fused::Fused;
use super::{graph_error, CondEntry, Model};
use crate::models::controlnet::{controlnet, ControlNetConfig};
use crate::models::detect::{Family, Heads, Net, UnetConfig, ADM_EMBED};
use crate::models::flux::{
    chroma_index_table, flux, grid, ref_placements, rope_table_with, FluxConfig, FluxControl,
    FluxInputs, CHROMA_MODULATIONS,
};
use crate::models::mmdit::{mmdit, MmditInputs};
use crate::models::unet::{skip_shapes, timestep_embedding, ControlResiduals};
use sdkit_compute::plan::{plan, Program};
use sdkit_compute::tensor::{GraphBuilder, ShapeError, T};
use sdkit_engine::NodeError;
use std::collections::HashMap;
use std::sync::Arc;

/// How a model builds its ADM vector from a conditioning entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Adm {
    /// SDXL base: pooled ‖ emb(height, width, crop_h, crop_w,
    /// target_height, target_width).
    Sdxl,
    /// SDXL refiner: pooled ‖ emb(height, width, crop_h, crop_w,
    /// aesthetic_score).
    SdxlRefiner,
}

impl Adm {
    /// How many size values are embedded.
    pub fn values(self) -> usize {
        match self {
            Adm::Sdxl => 6,
            Adm::SdxlRefiner => 5,
        }
    }
}

impl Model {
    /// The model's ADM rule, if its UNet takes one.
    pub fn adm(&self) -> Option<Adm> {
        let Net::Unet(u) = &self.net else {
            return None;
        };
        u.adm_in_channels?;
        match self.family {
            Family::SdxlRefiner => Some(Adm::SdxlRefiner),
            _ => Some(Adm::Sdxl),
        }
    }

    /// The pooled width the ADM input expects.
    fn pooled_width(&self, adm: Adm) -> usize {
        let Net::Unet(u) = &self.net else {
            return 0;
        };
        u.adm_in_channels
            .unwrap_or(0)
            .saturating_sub(adm.values() * ADM_EMBED)
    }

    /// The denoiser program for `batch` rows of `[in, h, w]` latents and
    /// a `[batch, tokens, dim]` context. With `control`, it also takes
    /// control residuals as inputs: `ctrl_in.{k}` after input block `k`,
    /// `ctrl_out.{i}` on every skip, `ctrl_mid` after the middle block.
    /// `refs`: the `(h, w)` of each reference latent (Flux Kontext), which
    /// it takes as inputs `ref.{i}`.
    #[allow(clippy::too_many_arguments)]
    pub fn program(
        &self,
        batch: usize,
        h: usize,
        w: usize,
        tokens: usize,
        dim: usize,
        control: Option<&Slots>,
        refs: &[(usize, usize)],
    ) -> Result<Program, NodeError> {
        self.program_fused(batch, (h, w), (tokens, dim), control, refs, None)
    }

    /// [`Model::program`], with `fused`: the model's input built from the
    /// carried latent and the CFG combination and sampler step after its
    /// output ([`Fused`]), for one group of rows.
    pub(crate) fn program_fused(
        &self,
        batch: usize,
        (h, w): (usize, usize),
        (tokens, dim): (usize, usize),
        control: Option<&Slots>,
        refs: &[(usize, usize)],
        fused: Option<&Fused>,
    ) -> Result<Program, NodeError> {
        let group = ModelGroup {
            rows: batch,
            tokens,
            refs: refs.to_vec(),
        };
        self.program_groups(&[group], (h, w), dim, control, fused)
    }

    /// The program running the model once per group (a fused sampling
    /// step may batch its conditionings in two groups of different
    /// context lengths): each group after the first takes its per-run
    /// inputs under the prefix `Fused::prefix` gives it; the weights are
    /// shared.
    pub(crate) fn program_groups(
        &self,
        groups: &[ModelGroup],
        (h, w): (usize, usize),
        dim: usize,
        control: Option<&Slots>,
        fused: Option<&Fused>,
    ) -> Result<Program, NodeError> {
        if groups.iter().any(|g| !g.refs.is_empty()) && !matches!(self.net, Net::Flux(_)) {
            return Err(NodeError::invalid(format!(
                "reference latents (ReferenceLatent) with a {} model are not supported (sdkit uses them with Flux Kontext)",
                self.family.name()
            )));
        }
        let what = match self.net {
            Net::Unet(_) => "UNet",
            Net::Flux(_) => "Flux",
            Net::Mmdit(_) => "MMDiT",
        };
        let in_channels = match &self.net {
            Net::Unet(u) => u.in_channels,
            Net::Flux(f) => f.in_channels,
            Net::Mmdit(m) => m.in_channels,
        };
        let g = GraphBuilder::new();
        let out = (|| match fused {
            None => {
                let mut outs = Vec::new();
                for grp in groups {
                    let x = g.input("x", &[grp.rows, in_channels, h, w])?;
                    outs.push(self.model_graph(&g, grp, (h, w), dim, control, x, None)?);
                }
                Ok(outs)
            }
            Some(f) => {
                let head = f.head(&g)?;
                let mut outs = Vec::new();
                for (k, grp) in groups.iter().enumerate() {
                    g.set_input_prefix(&f.prefix(k));
                    let x = f.model_input(&head, k, &[grp.rows, in_channels, h, w])?;
                    // A ControlNet chain the program runs itself.
                    let given = f.control_residuals(&g, self, k, grp, (h, w), dim, x)?;
                    outs.push(self.model_graph(&g, grp, (h, w), dim, control, x, given)?);
                }
                g.set_input_prefix("");
                f.outputs(&g, head, &outs)
            }
        })()
        .map_err(|e| graph_error(what, e))?;
        plan(&g.finish(&out)).map_err(|e| graph_error(what, e))
    }

    /// The model over `x` ([rows, in, h, w]) for one group: its inputs
    /// `t`, `context` and the family's others, ControlNet residual slots
    /// where `control` has them, or the residuals `given` (a UNet's,
    /// computed in the same graph).
    #[allow(clippy::too_many_arguments)]
    fn model_graph<'a>(
        &self,
        g: &'a GraphBuilder,
        grp: &ModelGroup,
        (h, w): (usize, usize),
        dim: usize,
        control: Option<&Slots>,
        x: T<'a>,
        given: Option<ControlResiduals<'a>>,
    ) -> Result<T<'a>, ShapeError> {
        let (batch, tokens) = (grp.rows, grp.tokens);
        match &self.net {
            Net::Flux(cfg) => self.flux_graph(g, cfg, grp, (h, w), dim, control, x),
            Net::Mmdit(m) => {
                let t = g.input("t", &[batch])?;
                let c = g.input("context", &[batch, tokens, dim])?;
                let y = match m.adm_in {
                    Some(a) => Some(g.input("pooled", &[batch, a])?),
                    None => None,
                };
                let (gh, gw) = (h.div_ceil(m.patch), w.div_ceil(m.patch));
                let control = match control.filter(|s| s.output) {
                    Some(_) => (0..m.blocks)
                        .map(|i| {
                            g.input(&format!("ctrl_out.{i}"), &[batch, gh * gw, m.hidden])
                                .map(Some)
                        })
                        .collect::<Result<_, _>>()?,
                    None => Vec::new(),
                };
                let inputs = MmditInputs {
                    t,
                    context: c,
                    y,
                    control,
                };
                mmdit(g, m, &self.prefix, x, inputs, &self.skip_layers)
            }
            Net::Unet(unet) => {
                let t = g.input("t", &[batch])?;
                let c = g.input("context", &[batch, tokens, dim])?;
                let y = self.adm_vector(g, batch)?;
                let residuals = match (given, control) {
                    (Some(r), _) => Some(r),
                    (None, Some(slots)) => {
                        let (skips, mid) = skip_shapes(unet, batch, h, w);
                        let mut r = ControlResiduals {
                            input: vec![None; skips.len()],
                            ..Default::default()
                        };
                        for &k in &slots.input {
                            r.input[k] = Some(g.input(&format!("ctrl_in.{k}"), &skips[k])?);
                        }
                        if slots.output {
                            for (i, s) in skips.iter().enumerate() {
                                r.output.push(g.input(&format!("ctrl_out.{i}"), s)?);
                            }
                        }
                        if slots.middle {
                            r.middle = Some(g.input("ctrl_mid", &mid)?);
                        }
                        Some(r)
                    }
                    (None, None) => None,
                };
                crate::models::unet::unet(g, unet, self.heads, &self.prefix, x, t, c, y, residuals)
            }
        }
    }

    /// The Flux model: inputs `t` (σ), `context`, `pooled` `[batch,
    /// vec_in]`, `guidance` `[batch]` (dev models), `pe` (the RoPE table
    /// of [`rope_table_with`] for these token and patch counts) and
    /// `ref.{i}` `[batch, out_channels, h, w]` per reference latent.
    #[allow(clippy::too_many_arguments)]
    fn flux_graph<'a>(
        &self,
        g: &'a GraphBuilder,
        cfg: &FluxConfig,
        grp: &ModelGroup,
        (h, w): (usize, usize),
        dim: usize,
        control: Option<&Slots>,
        x: T<'a>,
    ) -> Result<T<'a>, ShapeError> {
        let (batch, tokens, refs) = (grp.rows, grp.tokens, &grp.refs);
        let (gh, gw) = grid(h, w);
        let residual = |name: String| g.input(&name, &[batch, gh * gw, cfg.hidden]);
        let ref_patches: usize = refs
            .iter()
            .map(|&(rh, rw)| {
                let (r, c) = grid(rh, rw);
                r * c
            })
            .sum();
        let pe = g.input(
            "pe",
            &[1, tokens + gh * gw + ref_patches, cfg.head_dim / 2, 2, 2],
        )?;
        let mut inputs = FluxInputs::text(g, cfg, batch, (tokens, dim), pe)?;
        inputs.guidance_on = if cfg.guidance && cfg.approximator.is_none() {
            Some(g.input("guidance_on", &[batch])?)
        } else {
            None
        };
        inputs.chroma_index = if cfg.approximator.is_some() {
            Some(g.input("chroma_index", &[CHROMA_MODULATIONS, 32])?)
        } else {
            None
        };
        inputs.refs = refs
            .iter()
            .enumerate()
            .map(|(i, &(rh, rw))| g.input(&format!("ref.{i}"), &[batch, cfg.out_channels, rh, rw]))
            .collect::<Result<_, _>>()?;
        inputs.control = match control {
            Some(slots) => FluxControl {
                double: (0..cfg.depth)
                    .map(|i| {
                        slots
                            .input
                            .contains(&i)
                            .then(|| residual(format!("ctrl_in.{i}")))
                            .transpose()
                    })
                    .collect::<Result<_, _>>()?,
                single: if slots.output {
                    (0..cfg.depth_single.min(flux_control::MAIN_SINGLE))
                        .map(|i| residual(format!("ctrl_out.{i}")).map(Some))
                        .collect::<Result<_, _>>()?
                } else {
                    Vec::new()
                },
            },
            None => FluxControl::default(),
        };
        flux(g, cfg, &self.prefix, x, inputs, &self.skip_layers)
    }

    /// The ADM vector `y`, built in the graph from the inputs `pooled` and
    /// `adm_values` (each size value's `Timestep(256)` embedding).
    pub(crate) fn adm_vector<'a>(
        &self,
        g: &'a GraphBuilder,
        batch: usize,
    ) -> Result<Option<T<'a>>, ShapeError> {
        let Some(adm) = self.adm() else {
            return Ok(None);
        };
        let pooled = g.input("pooled", &[batch, self.pooled_width(adm)])?;
        let n = adm.values();
        let values = g.input("adm_values", &[batch * n])?;
        let emb = timestep_embedding(g, values, ADM_EMBED)?.reshape(&[batch, n * ADM_EMBED])?;
        Ok(Some(g.concat(&[pooled, emb], 1)?))
    }

    /// A ControlNet's program for the same batch as [`Model::program`]:
    /// inputs `x` (the latent channels, already divided by c_in), `t`,
    /// `context`, the ADM inputs, and `hint` `[1 or batch, channels, 8h,
    /// 8w]`; outputs the residuals, input blocks first, the middle last.
    pub fn control_program(
        &self,
        net: &ControlNetModel,
        batch: usize,
        (h, w): (usize, usize),
        (tokens, dim): (usize, usize),
        hint_batch: usize,
    ) -> Result<Program, NodeError> {
        let what = format!("ControlNet {}", net.file.name);
        let (cfg, heads) = self.control_fit(net, batch, (h, w), dim)?;
        let (cfg, heads) = (&cfg, &heads);
        let g = GraphBuilder::new();
        let outs = (|| {
            let x = g.input("x", &[batch, cfg.unet.in_channels, h, w])?;
            let t = g.input("t", &[batch])?;
            let c = g.input("context", &[batch, tokens, dim])?;
            let y = self.adm_vector(&g, batch)?;
            let hint = g.input("hint", &[hint_batch, cfg.hint_channels(), 8 * h, 8 * w])?;
            let (mut outs, mid) = controlnet(
                &g,
                cfg,
                *heads,
                &net.prefix,
                x,
                t,
                c,
                y,
                hint,
                Some(&net.control_type),
            )?;
            outs.push(mid);
            Ok(outs)
        })()
        .map_err(|e: ShapeError| graph_error(&what, e))?;
        plan(&g.finish(&outs)).map_err(|e| graph_error(&what, e))
    }

    /// The ControlNet `net` is for this model, refused by name where it
    /// does not fit batches of `batch` latents `h`×`w` with `dim`-wide
    /// context (another family's net, an unknown union control type).
    pub(crate) fn control_fit(
        &self,
        net: &ControlNetModel,
        batch: usize,
        (h, w): (usize, usize),
        dim: usize,
    ) -> Result<(ControlNetConfig, Heads), NodeError> {
        let what = format!("ControlNet {}", net.file.name);
        let unet: &UnetConfig = self.unet(&what)?;
        let Some((cfg, heads)) = net.net_config(self) else {
            return Err(NodeError::invalid(format!("{what} is not a ControlNet")));
        };
        if let (Some(n), Some(&t)) = (cfg.union_types, net.control_type.iter().max()) {
            if t >= n {
                return Err(NodeError::invalid(format!(
                    "{what}: control type {t} is out of range for its {n} control types \
                     (the ProMax union ControlNet has all 8)"
                )));
            }
        }
        if cfg.unet.adm_in_channels != unet.adm_in_channels
            || cfg.unet.context_dim.is_some_and(|d| d != dim)
            || skip_shapes(&cfg.unet, batch, h, w) != skip_shapes(unet, batch, h, w)
        {
            return Err(NodeError::invalid(format!(
                "{what} does not fit this model: its blocks ({} channels × {:?}, context {:?}, \
                 ADM {:?}) differ from the model's ({} × {:?}, context {:?}, ADM {:?}); use a \
                 ControlNet made for this model family",
                cfg.unet.model_channels,
                cfg.unet.channel_mult,
                cfg.unet.context_dim,
                cfg.unet.adm_in_channels,
                unet.model_channels,
                unet.channel_mult,
                unet.context_dim,
                unet.adm_in_channels,
            )));
        }
        Ok((cfg, heads))
    }

    /// The per-row model inputs other than `x` and `t` for the entries of
    /// one batch, each repeated `per_entry` times (the latent batch):
    /// `pooled` and `adm_values` where the model takes an ADM vector.
    /// `negative[i]` says whether entry `i` is negative conditioning (the
    /// refiner's default aesthetic score is 2.5 there, 6 otherwise);
    /// `(height, width)` is the latent's size in pixels (8 × latent), the
    /// default for unset sizes as ComfyUI's `encode_model_conds` sets it.
    pub fn cond_inputs(
        &self,
        entries: &[(&CondEntry, bool)],
        per_entry: usize,
        (height, width): (f64, f64),
        (tokens, ah, aw): (usize, usize, usize),
    ) -> Result<HashMap<String, Arc<Vec<f32>>>, NodeError> {
        let mut out = HashMap::new();
        match &self.net {
            Net::Flux(cfg) => return flux_inputs(self, cfg, entries, per_entry, (tokens, ah, aw)),
            Net::Mmdit(m) => {
                return Ok(pooled_rows(m.adm_in, entries, per_entry)?
                    .into_iter()
                    .collect())
            }
            Net::Unet(_) => {}
        }
        let Some(adm) = self.adm() else {
            return Ok(out);
        };
        let want = self.pooled_width(adm);
        let mut pooled = Vec::with_capacity(entries.len() * per_entry * want);
        let mut values = Vec::with_capacity(entries.len() * per_entry * adm.values());
        for &(e, negative) in entries {
            let p = e.pooled.as_ref().ok_or_else(|| {
                NodeError::invalid(format!(
                    "this {} model needs the text encoder's pooled output in its conditioning (encode the prompt with the checkpoint's own CLIP)",
                    self.family.name()
                ))
            })?;
            if p.numel() != want {
                return Err(NodeError::invalid(format!(
                    "the conditioning's pooled output is {} wide; this model's ADM input takes {want} (text encoder and model do not belong together)",
                    p.numel()
                )));
            }
            // ComfyUI's encode_adm defaults: width/height of the latent,
            // no crop, target = size; refiner aesthetic 6 (2.5 negative).
            let s = &e.size;
            let w = s.width.unwrap_or(width);
            let h = s.height.unwrap_or(height);
            let row: Vec<f64> = match adm {
                Adm::Sdxl => vec![
                    h,
                    w,
                    s.crop_h.unwrap_or(0.0),
                    s.crop_w.unwrap_or(0.0),
                    s.target_height.unwrap_or(h),
                    s.target_width.unwrap_or(w),
                ],
                Adm::SdxlRefiner => vec![
                    h,
                    w,
                    s.crop_h.unwrap_or(0.0),
                    s.crop_w.unwrap_or(0.0),
                    e.aesthetic_score
                        .unwrap_or(if negative { 2.5 } else { 6.0 }),
                ],
            };
            for _ in 0..per_entry {
                pooled.extend_from_slice(&p.data);
                // torch.Tensor([v]): float32.
                values.extend(row.iter().map(|&v| v as f32));
            }
        }
        out.insert("pooled".to_string(), Arc::new(pooled));
        out.insert("adm_values".to_string(), Arc::new(values));
        Ok(out)
    }
}

/// Flux's per-row inputs: the pooled CLIP-L vector (zeros where an entry
/// has none, as ComfyUI's `y = None`; Chroma takes none), the guidance
/// (the entry's, else ComfyUI's default: 3.5 for Flux, 0 for Chroma; dev
/// models and Chroma only), the reference latents in model space (each
/// entry's, repeated to the latent batch; a batch's entries have the same
/// shapes and method) and the RoPE table, references included.
fn flux_inputs(
    model: &Model,
    cfg: &FluxConfig,
    entries: &[(&CondEntry, bool)],
    per_entry: usize,
    (tokens, ah, aw): (usize, usize, usize),
) -> Result<HashMap<String, Arc<Vec<f32>>>, NodeError> {
    let mut pooled = Vec::with_capacity(entries.len() * per_entry * cfg.vec_in);
    let mut guidance = Vec::with_capacity(entries.len() * per_entry);
    let mut guidance_on = Vec::with_capacity(entries.len() * per_entry);
    let default_guidance = if cfg.approximator.is_some() { 0.0 } else { 3.5 };
    for &(e, _) in entries {
        if e.guidance_disabled && cfg.approximator.is_some() {
            // ComfyUI's Chroma fails on it too: its modulation approximator
            // embeds the guidance value.
            return Err(NodeError::invalid(
                "FluxDisableGuidance: a Chroma model needs a guidance value (its modulation embeds it)",
            ));
        }
        let row = match &e.pooled {
            _ if cfg.vec_in == 0 => Vec::new(),
            Some(p) if p.numel() == cfg.vec_in => p.data.clone(),
            Some(p) => {
                return Err(NodeError::invalid(format!(
                    "the conditioning's pooled output is {} wide; this Flux model's vector input takes {} (text encoder and model do not belong together)",
                    p.numel(),
                    cfg.vec_in
                )))
            }
            None => vec![0.0; cfg.vec_in],
        };
        for _ in 0..per_entry {
            pooled.extend_from_slice(&row);
            // torch.FloatTensor([guidance]).
            guidance.push(e.guidance.unwrap_or(default_guidance) as f32);
            guidance_on.push(if e.guidance_disabled { 0.0 } else { 1.0 });
        }
    }
    let (gh, gw) = grid(ah, aw);
    let mut out = HashMap::new();
    if cfg.vec_in > 0 {
        out.insert("pooled".to_string(), Arc::new(pooled));
    }
    // Schnell takes no guidance, but ComfyUI's conditioning carries one
    // all the same, and a ControlNet with a guidance embedding reads it.
    out.insert("guidance".to_string(), Arc::new(guidance));
    if cfg.guidance && cfg.approximator.is_none() {
        out.insert("guidance_on".to_string(), Arc::new(guidance_on));
    }
    if cfg.approximator.is_some() {
        out.insert("chroma_index".to_string(), Arc::new(chroma_index_table()));
    }
    let first = entries.first().map(|(e, _)| *e);
    let shapes = first.map(ref_shapes).unwrap_or_default();
    for (i, &(rh, rw)) in shapes.iter().enumerate() {
        let per = cfg.out_channels * rh * rw;
        let mut data = Vec::with_capacity(entries.len() * per_entry * per);
        for &(e, _) in entries {
            let r = &e.reference_latents[i];
            if r.numel() == 0 || r.shape[1] != cfg.out_channels || r.numel() % per != 0 {
                return Err(NodeError::invalid(format!(
                    "reference latent {i} has shape {:?}; this Flux model takes {}-channel latents",
                    r.shape, cfg.out_channels
                )));
            }
            // repeat_to_batch_size: the first items, tiled as needed.
            let n = r.numel() / per;
            for k in 0..per_entry {
                let item = &r.data[(k % n) * per..(k % n + 1) * per];
                data.extend(item.iter().map(|&v| model.latent.process_in(v)));
            }
        }
        out.insert(format!("ref.{i}"), Arc::new(data));
    }
    let method = first.and_then(|e| e.reference_method).unwrap_or_default();
    let placements = ref_placements((ah, aw), &shapes, method);
    out.insert(
        "pe".to_string(),
        Arc::new(rope_table_with(cfg, tokens, gh, gw, &placements)),
    );
    Ok(out)
}

/// The `(h, w)` of an entry's reference latents.
pub(crate) fn ref_shapes(e: &CondEntry) -> Vec<(usize, usize)> {
    e.reference_latents
        .iter()
        .map(|r| match r.shape[..] {
            [_, _, h, w] => (h, w),
            _ => (0, 0),
        })
        .collect()
}

/// SD3's `pooled` input `[rows, width]`: each entry's pooled vector (L ‖
/// G), zeros where it has none (ComfyUI's `encode_adm`).
fn pooled_rows(
    width: Option<usize>,
    entries: &[(&CondEntry, bool)],
    per_entry: usize,
) -> Result<HashMap<String, Arc<Vec<f32>>>, NodeError> {
    let mut out = HashMap::new();
    let Some(width) = width else {
        return Ok(out);
    };
    let mut pooled = Vec::with_capacity(entries.len() * per_entry * width);
    for &(e, _) in entries {
        let row = match &e.pooled {
            Some(p) if p.numel() == width => p.data.clone(),
            Some(p) => {
                return Err(NodeError::invalid(format!(
                    "the conditioning's pooled output is {} wide; this model's vector input takes {width} (text encoder and model do not belong together)",
                    p.numel()
                )))
            }
            None => vec![0.0; width],
        };
        for _ in 0..per_entry {
            pooled.extend_from_slice(&row);
        }
    }
    out.insert("pooled".to_string(), Arc::new(pooled));
    Ok(out)
}

/// One group of a model program's rows: how many, their context length
/// and reference latents.
#[derive(Clone, Debug)]
pub(crate) struct ModelGroup {
    pub rows: usize,
    pub tokens: usize,
    pub refs: Vec<(usize, usize)>,
}
