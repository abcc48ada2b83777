//! Flux ControlNets as ComfyUI runs them (comfy/controlnet.py,
//! comfy/ldm/flux/controlnet.py): the XLabs layout (`controlnet_blocks.N`
//! Linears, an image hint through `input_hint_block`), loaded by
//! ControlNetLoader and applied by ControlNetApply(Advanced) like any
//! ControlNet. The net's per-block residuals are repeated to ComfyUI's
//! fixed list lengths (19 double, 38 single: the full model's block
//! counts, whatever the model), cycling through the net's blocks, and
//! the model adds entry `i` after its block `i`.

use super::control::{ControlKind, ControlNetModel, Residuals};
use super::{graph_error, Model};
use crate::models::detect::Shapes;
use crate::models::flux::{flux_config, flux_controlnet, grid, FluxConfig, FluxInputs};
use sdkit_compute::plan::{plan, Program};
use sdkit_compute::tensor::{GraphBuilder, ShapeError};
use sdkit_engine::NodeError;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

/// ComfyUI's `main_model_double` / `main_model_single`: the lengths of the
/// residual lists a Flux ControlNet returns.
pub const MAIN_DOUBLE: usize = 19;
pub const MAIN_SINGLE: usize = 38;

/// The kind of a Flux ControlNet file, or None when it is not one; other
/// Flux and SD3 ControlNet layouts are refused by name.
pub fn detect(path: &Path, s: &Shapes) -> Result<Option<ControlKind>, NodeError> {
    let has = |k: &str| s.contains_key(k);
    let refuse = |what: &str| {
        Err(NodeError::file(
            path,
            format!("{what} are not supported yet (sdkit reads XLabs-layout Flux ControlNets)"),
        ))
    };
    if has("controlnet_blocks.0.linear.weight") {
        return refuse("Mistoline Flux ControlNets");
    }
    if has("controlnet_x_embedder.weight") {
        return refuse("InstantX (diffusers-layout) Flux ControlNets");
    }
    if !has("controlnet_blocks.0.weight") {
        return Ok(None);
    }
    if has("pos_embed_input.proj.weight") {
        return refuse("SD3 ControlNets in the diffusers layout");
    }
    if !has("double_blocks.0.img_attn.norm.key_norm.scale") {
        return Ok(None);
    }
    let cfg = flux_config(s, "").map_err(|e| NodeError::file(path, e))?;
    if cfg.approximator.is_some() {
        return refuse("Chroma ControlNets");
    }
    Ok(Some(ControlKind::Flux { cfg }))
}

/// The main model's config, or a clear error naming the net.
fn main_config<'m>(model: &'m Model, net: &ControlNetModel) -> Result<&'m FluxConfig, NodeError> {
    match &model.net {
        crate::models::detect::Net::Flux(f) if f.approximator.is_none() => Ok(f),
        _ => Err(NodeError::invalid(format!(
            "ControlNet {} is a Flux ControlNet; the model is {}",
            net.file.name,
            model.family.name()
        ))),
    }
}

/// The double-block indices the model takes residuals at, and whether it
/// takes single-block ones (a net without single blocks gives none).
pub fn slots(model: &Model, net: &ControlNetModel) -> Result<(Vec<usize>, bool), NodeError> {
    let main = main_config(model, net)?;
    let ControlKind::Flux { cfg } = &net.kind else {
        return Err(NodeError::invalid("not a Flux ControlNet"));
    };
    Ok((
        (0..main.depth.min(MAIN_DOUBLE)).collect(),
        cfg.depth_single > 0 && main.depth_single > 0,
    ))
}

/// The ControlNet's program for a batch of `rows` latents `h`×`w` (even
/// sides), `tokens` of context `dim` wide, and `hint_batch` hints: inputs
/// `x`, `t`, `context`, `pooled`, `guidance` and `pe` as the model's
/// program takes them, and `hint` `[hint_batch, 3, 8h, 8w]`; outputs the
/// net's double-block residuals, then its single-block ones.
pub fn program(
    model: &Model,
    net: &ControlNetModel,
    rows: usize,
    (h, w): (usize, usize),
    (tokens, dim): (usize, usize),
    hint_batch: usize,
) -> Result<Program, NodeError> {
    let what = format!("ControlNet {}", net.file.name);
    let main = main_config(model, net)?;
    let ControlKind::Flux { cfg } = &net.kind else {
        return Err(NodeError::invalid(format!(
            "{what} is not a Flux ControlNet"
        )));
    };
    if (
        cfg.hidden,
        cfg.head_dim,
        cfg.context_in,
        cfg.vec_in,
        cfg.in_channels,
    ) != (
        main.hidden,
        main.head_dim,
        main.context_in,
        main.vec_in,
        main.in_channels,
    ) {
        return Err(NodeError::invalid(format!(
            "{what} does not fit this Flux model: its widths (hidden {}, head {}, context {}, \
             vector {}, channels {}) differ from the model's ({}, {}, {}, {}, {})",
            cfg.hidden,
            cfg.head_dim,
            cfg.context_in,
            cfg.vec_in,
            cfg.in_channels,
            main.hidden,
            main.head_dim,
            main.context_in,
            main.vec_in,
            main.in_channels
        )));
    }
    let (gh, gw) = grid(h, w);
    let g = GraphBuilder::new();
    let outs = (|| {
        let x = g.input("x", &[rows, cfg.in_channels, h, w])?;
        let inputs = FluxInputs {
            t: g.input("t", &[rows])?,
            context: g.input("context", &[rows, tokens, dim])?,
            y: if cfg.vec_in > 0 {
                Some(g.input("pooled", &[rows, cfg.vec_in])?)
            } else {
                None
            },
            guidance: if cfg.guidance {
                Some(g.input("guidance", &[rows])?)
            } else {
                None
            },
            guidance_on: None,
            pe: g.input("pe", &[1, tokens + gh * gw, cfg.head_dim / 2, 2, 2])?,
            chroma_index: None,
            refs: Vec::new(),
            control: Default::default(),
        };
        let hint = g.input("hint", &[hint_batch, 3, 8 * h, 8 * w])?;
        let (double, single) = flux_controlnet(&g, cfg, "", x, inputs, hint)?;
        Ok(double.into_iter().chain(single).collect::<Vec<_>>())
    })()
    .map_err(|e: ShapeError| graph_error(&what, e))?;
    plan(&g.finish(&outs)).map_err(|e| graph_error(&what, e))
}

/// The residual lists of one run's outputs (the net's double-block
/// residuals, then its single-block ones, already × strength), repeated
/// as ComfyUI repeats the tuples: `(d0, d1, d0, d1, …)[..19]`.
pub fn residuals(net: &ControlNetModel, outs: Vec<Vec<f32>>) -> Residuals {
    let depth = match &net.kind {
        ControlKind::Flux { cfg } => cfg.depth,
        _ => outs.len(),
    };
    let outs: Vec<Arc<Vec<f32>>> = outs.into_iter().map(Arc::new).collect();
    let (double, single) = outs.split_at(depth.min(outs.len()));
    let cycle = |list: &[Arc<Vec<f32>>], n: usize| -> Vec<Arc<Vec<f32>>> {
        if list.is_empty() {
            return Vec::new();
        }
        (0..n).map(|i| Arc::clone(&list[i % list.len()])).collect()
    };
    Residuals {
        input: cycle(double, MAIN_DOUBLE)
            .into_iter()
            .enumerate()
            .collect::<BTreeMap<_, _>>(),
        output: cycle(single, MAIN_SINGLE),
        middle: None,
    }
}

/// The shapes of the model's residual inputs for `rows` latents `h`×`w`:
/// one `[rows, image tokens, hidden]` per double and per single block.
pub fn slot_shapes(
    cfg: &FluxConfig,
    rows: usize,
    h: usize,
    w: usize,
) -> super::control::SlotShapes {
    let (gh, gw) = grid(h, w);
    let one = vec![rows, gh * gw, cfg.hidden];
    super::control::SlotShapes {
        input: vec![one.clone(); cfg.depth.min(MAIN_DOUBLE)],
        output: vec![one; cfg.depth_single.min(MAIN_SINGLE)],
        middle: Vec::new(),
    }
}
