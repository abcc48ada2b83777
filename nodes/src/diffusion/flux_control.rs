//! Flux ControlNets as ComfyUI runs them (comfy/controlnet.py,
//! comfy/ldm/flux/controlnet.py), loaded by ControlNetLoader and applied by
//! ControlNetApply(Advanced) like any ControlNet:
//! - XLabs' layout (`controlnet_blocks.N` Linears, an image hint through
//!   `input_hint_block`);
//! - InstantX's diffusers layout (Union and Union Pro included): the
//!   tensors read under ComfyUI's names (`convert_diffusers_mmdit`: q, k,
//!   v and a single block's MLP input concatenated into the fused
//!   projections), the hint a latent the apply node's VAE encodes, and a
//!   union net's `controlnet_mode_embedder` token for the
//!   SetUnionControlNetType type put before the text.
//!
//! The net's per-block residuals are repeated to ComfyUI's fixed list
//! lengths (19 double, 38 single: the full model's block counts, whatever
//! the model): cycling through the blocks (XLabs) or each block's in a row
//! (InstantX), and the model adds entry `i` after its block `i`.

use super::control::{ControlKind, ControlNetModel, Residuals};
use super::{graph_error, Model};
use crate::adapters::keys::{FLUX_BASIC, FLUX_DOUBLE};
use crate::models::detect::Shapes;
use crate::models::flux::{flux_config, flux_controlnet, grid, FluxConfig, FluxInputs};
use sdkit_compute::backend::cpu::Bindings;
use sdkit_compute::plan::Command;
use sdkit_compute::plan::{plan, Program};
use sdkit_compute::tensor::{GraphBuilder, ShapeError};
use sdkit_engine::NodeError;
use std::collections::BTreeMap;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

/// ComfyUI's `main_model_double` / `main_model_single`: the lengths of the
/// residual lists a Flux ControlNet returns.
pub const MAIN_DOUBLE: usize = 19;
pub const MAIN_SINGLE: usize = 38;

/// A Flux ControlNet: its config (under ComfyUI's names), its form, and
/// for a diffusers-layout file the file's tensors behind each name.
#[derive(Debug)]
pub struct FluxNet {
    pub cfg: FluxConfig,
    pub form: FluxForm,
    /// ComfyUI name → the file's tensors, concatenated along their rows
    /// (empty: the file uses ComfyUI's names).
    pub names: HashMap<String, Vec<String>>,
}

/// Which Flux ControlNet layout a file is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FluxForm {
    /// An image hint through the hint convolutions; residual lists cycle.
    XLabs,
    /// A latent hint; residuals repeat in a row; `modes` union types.
    InstantX { modes: usize },
}

impl FluxNet {
    /// Whether the hint is a latent (encoded by the apply node's VAE).
    pub fn latent(&self) -> bool {
        matches!(self.form, FluxForm::InstantX { .. })
    }

    /// Channels of the hint the program takes.
    pub fn hint_channels(&self) -> usize {
        if self.latent() {
            self.cfg.in_channels
        } else {
            3
        }
    }

    /// The union mode tokens the net puts before the text for `types`
    /// (SetUnionControlNetType's; none for "auto" or a net without modes).
    fn mode_tokens(&self, types: &[usize]) -> usize {
        match self.form {
            FluxForm::InstantX { modes } if modes > 0 => types.len().min(1),
            _ => 0,
        }
    }

    /// The inputs the union mode needs beside the model's: `control_type`
    /// (the type's row of the embedding) and `pe_control`, the RoPE table
    /// with one more text row (text rows are all position 0).
    pub fn feed_modes(&self, types: &[usize], feed: &mut HashMap<String, Arc<Vec<f32>>>) {
        if self.mode_tokens(types) == 0 {
            return;
        }
        feed.insert(
            "control_type".to_string(),
            Arc::new(types.iter().take(1).map(|&t| t as f32).collect()),
        );
        if let Some(pe) = feed.get("pe").cloned() {
            let row = self.cfg.head_dim / 2 * 4;
            let mut v = Vec::with_capacity(pe.len() + row);
            v.extend_from_slice(&pe[..row.min(pe.len())]);
            v.extend_from_slice(&pe);
            feed.insert("pe_control".to_string(), Arc::new(v));
        }
    }
}

/// The kind of a Flux ControlNet file, or None when it is not one; other
/// Flux and SD3 ControlNet layouts are refused by name.
pub fn detect(path: &Path, s: &Shapes) -> Result<Option<ControlKind>, NodeError> {
    let has = |k: &str| s.contains_key(k);
    let refuse = |what: &str| {
        Err(NodeError::file(
            path,
            format!(
                "{what} are not supported yet (sdkit reads Flux ControlNets in XLabs' and InstantX's layouts)"
            ),
        ))
    };
    if has("controlnet_blocks.0.linear.weight") {
        return refuse("Mistoline Flux ControlNets");
    }
    if has("controlnet_x_embedder.weight") {
        if !has("x_embedder.weight") {
            return refuse("ControlNets of this diffusers layout (not Flux)");
        }
        let (names, comfy) = instantx_names(s);
        let cfg = flux_config(&comfy, "").map_err(|e| NodeError::file(path, e))?;
        let cin = comfy
            .get("pos_embed_input.weight")
            .and_then(|v| v.get(1).copied())
            .unwrap_or(0)
            / 4;
        if cin != cfg.in_channels {
            return refuse("inpainting Flux ControlNets (a 17-channel hint)");
        }
        let modes = s
            .get("controlnet_mode_embedder.weight")
            .and_then(|v| v.first().copied())
            .unwrap_or(0);
        return Ok(Some(ControlKind::Flux(Arc::new(FluxNet {
            cfg,
            form: FluxForm::InstantX { modes },
            names,
        }))));
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
    Ok(Some(ControlKind::Flux(Arc::new(FluxNet {
        cfg,
        form: FluxForm::XLabs,
        names: HashMap::new(),
    }))))
}

/// ComfyUI's `flux_to_diffusers` read backwards for a diffusers-layout
/// Flux ControlNet: each ComfyUI name with the file tensors behind it (in
/// row order), and the shapes under ComfyUI's names; tensors it does not
/// rename (`controlnet_*`) keep theirs.
fn instantx_names(s: &Shapes) -> (HashMap<String, Vec<String>>, Shapes) {
    let mut names: HashMap<String, Vec<String>> = HashMap::new();
    let mut add = |to: String, from: Vec<String>| {
        if from.iter().all(|f| s.contains_key(f)) {
            names.insert(to, from);
        }
    };
    let count = |prefix: &str| {
        (0..)
            .take_while(|i| s.keys().any(|k| k.starts_with(&format!("{prefix}{i}."))))
            .count()
    };
    for end in ["weight", "bias"] {
        for i in 0..count("transformer_blocks.") {
            let (f, t) = (
                format!("transformer_blocks.{i}"),
                format!("double_blocks.{i}"),
            );
            add(
                format!("{t}.img_attn.qkv.{end}"),
                ["to_q", "to_k", "to_v"]
                    .iter()
                    .map(|p| format!("{f}.attn.{p}.{end}"))
                    .collect(),
            );
            add(
                format!("{t}.txt_attn.qkv.{end}"),
                ["add_q_proj", "add_k_proj", "add_v_proj"]
                    .iter()
                    .map(|p| format!("{f}.attn.{p}.{end}"))
                    .collect(),
            );
            for (d, c) in FLUX_DOUBLE {
                add(format!("{t}.{c}.{end}"), vec![format!("{f}.{d}.{end}")]);
            }
        }
        for i in 0..count("single_transformer_blocks.") {
            let (f, t) = (
                format!("single_transformer_blocks.{i}"),
                format!("single_blocks.{i}"),
            );
            add(
                format!("{t}.linear1.{end}"),
                ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"]
                    .iter()
                    .map(|p| format!("{f}.{p}.{end}"))
                    .collect(),
            );
            for (d, c) in [("norm.linear", "modulation.lin"), ("proj_out", "linear2")] {
                add(format!("{t}.{c}.{end}"), vec![format!("{f}.{d}.{end}")]);
            }
        }
        // ComfyUI's basic map (a ControlNet has no `proj_out`), and the
        // hint's projection.
        let hint = [("controlnet_x_embedder", "pos_embed_input")];
        for (d, c) in FLUX_BASIC.into_iter().chain(hint) {
            add(format!("{c}.{end}"), vec![format!("{d}.{end}")]);
        }
    }
    for i in 0..count("transformer_blocks.") {
        let (f, t) = (
            format!("transformer_blocks.{i}"),
            format!("double_blocks.{i}"),
        );
        for (d, c) in [
            ("attn.norm_q", "img_attn.norm.query_norm"),
            ("attn.norm_k", "img_attn.norm.key_norm"),
            ("attn.norm_added_q", "txt_attn.norm.query_norm"),
            ("attn.norm_added_k", "txt_attn.norm.key_norm"),
        ] {
            add(format!("{t}.{c}.scale"), vec![format!("{f}.{d}.weight")]);
        }
    }
    for i in 0..count("single_transformer_blocks.") {
        let (f, t) = (
            format!("single_transformer_blocks.{i}"),
            format!("single_blocks.{i}"),
        );
        for (d, c) in [
            ("attn.norm_q", "norm.query_norm"),
            ("attn.norm_k", "norm.key_norm"),
        ] {
            add(format!("{t}.{c}.scale"), vec![format!("{f}.{d}.weight")]);
        }
    }
    let used: std::collections::HashSet<&String> = names.values().flatten().collect();
    let kept: Vec<String> = s.keys().filter(|k| !used.contains(k)).cloned().collect();
    for k in kept {
        names.insert(k.clone(), vec![k]);
    }
    let shapes = names
        .iter()
        .filter_map(|(to, from)| {
            let first = s.get(&from[0])?.clone();
            let rows: usize = from.iter().filter_map(|f| s.get(f).map(|v| v[0])).sum();
            let mut shape = first;
            if let Some(r) = shape.first_mut() {
                *r = rows;
            }
            Some((to.clone(), shape))
        })
        .collect();
    (names, shapes)
}

/// A Flux ControlNet program's weights: from the file under the names it
/// uses, a fused projection concatenated from the file's parts.
pub fn bindings(prog: &Program, net: &ControlNetModel) -> Result<Bindings, NodeError> {
    let ControlKind::Flux(f) = &net.kind else {
        return net.file.bindings(prog, None, None);
    };
    if f.names.is_empty() {
        return net.file.bindings(prog, None, None);
    }
    let mut b = Bindings::default();
    for c in &prog.commands {
        let Command::Upload { name, .. } = c else {
            continue;
        };
        let from = f.names.get(name).ok_or_else(|| {
            NodeError::invalid(format!("{}: no tensor for {name}", net.file.name))
        })?;
        let stored = |n: &str| {
            net.file
                .store
                .stored(n)
                .map_err(|e| NodeError::invalid(format!("{}: {e}", net.file.name)))
        };
        if let [one] = &from[..] {
            b.stored.insert(name.clone(), stored(one)?);
            continue;
        }
        let mut data = Vec::new();
        for part in from {
            data.extend(
                stored(part)?
                    .to_f32()
                    .map_err(|e| NodeError::invalid(format!("{}: {part}: {e}", net.file.name)))?,
            );
        }
        b.weights.insert(name.clone(), Arc::new(data));
    }
    Ok(b)
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
    let ControlKind::Flux(f) = &net.kind else {
        return Err(NodeError::invalid("not a Flux ControlNet"));
    };
    let cfg = &f.cfg;
    Ok((
        (0..main.depth.min(MAIN_DOUBLE)).collect(),
        cfg.depth_single > 0 && main.depth_single > 0,
    ))
}

/// The ControlNet's program for a batch of `rows` latents `h`×`w`,
/// `tokens` of context `dim` wide, and `hint_batch` hints: inputs `x`,
/// `t`, `context`, `pooled`, `guidance` and `pe` as the model's program
/// takes them (with a union type: `control_type` and `pe_control`, one
/// text row more), and `hint` (`[hint_batch, 3, 8h, 8w]` pixels, or the
/// encoded latent `[hint_batch, channels, h, w]`); outputs the net's
/// double-block residuals, then its single-block ones.
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
    let ControlKind::Flux(f) = &net.kind else {
        return Err(NodeError::invalid(format!(
            "{what} is not a Flux ControlNet"
        )));
    };
    let cfg = &f.cfg;
    if net.control_type.len() > 1 {
        return Err(NodeError::invalid(format!(
            "{what}: one union type at a time (ComfyUI adds one text position for the mode)"
        )));
    }
    let modes = f.mode_tokens(&net.control_type);
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
        let pe = if modes > 0 {
            g.input(
                "pe_control",
                &[1, tokens + modes + gh * gw, cfg.head_dim / 2, 2, 2],
            )?
        } else {
            g.input("pe", &[1, tokens + gh * gw, cfg.head_dim / 2, 2, 2])?
        };
        let inputs = FluxInputs::text(&g, cfg, rows, (tokens, dim), pe)?;
        let hint = if f.latent() {
            g.input("hint", &[hint_batch, cfg.in_channels, h, w])?
        } else {
            g.input("hint", &[hint_batch, 3, 8 * h, 8 * w])?
        };
        let mode = match f.form {
            FluxForm::InstantX { modes: rows } if modes > 0 => {
                Some((g.input("control_type", &[modes])?, rows))
            }
            _ => None,
        };
        let (double, single) = flux_controlnet(&g, cfg, x, inputs, hint, f.latent(), mode)?;
        Ok(double.into_iter().chain(single).collect::<Vec<_>>())
    })()
    .map_err(|e: ShapeError| graph_error(&what, e))?;
    plan(&g.finish(&outs)).map_err(|e| graph_error(&what, e))
}

/// The residual lists of one run's outputs (the net's double-block
/// residuals, then its single-block ones, already × strength), repeated
/// as ComfyUI repeats the tuples: XLabs' `(d0, d1, d0, d1, …)[..19]`,
/// InstantX's `(d0, d0, …, d1, d1, …)[..19]` (each ⌈19 / n⌉ times).
pub fn residuals(net: &ControlNetModel, outs: Vec<Vec<f32>>) -> Residuals {
    let (depth, in_a_row) = match &net.kind {
        ControlKind::Flux(f) => (f.cfg.depth, f.latent()),
        _ => (outs.len(), false),
    };
    let outs: Vec<Arc<Vec<f32>>> = outs.into_iter().map(Arc::new).collect();
    let (double, single) = outs.split_at(depth.min(outs.len()));
    let cycle = |list: &[Arc<Vec<f32>>], n: usize| -> Vec<Arc<Vec<f32>>> {
        if list.is_empty() {
            return Vec::new();
        }
        let repeat = n.div_ceil(list.len());
        (0..n)
            .map(|i| {
                let j = if in_a_row { i / repeat } else { i % list.len() };
                Arc::clone(&list[j])
            })
            .collect()
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
