//! Stability's SD3.5 ControlNets (blur, canny, depth) as ComfyUI runs
//! them (comfy/controlnet.py `load_controlnet_sd35`, `ControlNetSD35`,
//! comfy/cldm/dit_embedder.py): the hint image, resized to the latent ×
//! 8, preprocessed by the file's `control_type` (canny `a·255·0.5 + 0.5`,
//! depth `1 − a`), encoded by the VAE the apply node was given and put in
//! the SD3 latent space; the net borrows the main model's `x_embedder` (or,
//! with a double `y` embedding, its `y_embedder`), and its per-block
//! residuals, each repeated ⌈depth / blocks⌉ times in a row, are added to
//! the image stream after the MMDiT's joint blocks.

use super::control::{ControlKind, ControlNetModel, Residuals, SlotShapes};
use super::{graph_error, Model};
use crate::models::detect::{Net, Shapes};
use crate::models::mmdit::{sd35_control_config, sd35_controlnet, MmditConfig};
use sdkit_compute::backend::cpu::Bindings;
use sdkit_compute::plan::{plan, Command, Program};
use sdkit_compute::tensor::{GraphBuilder, ShapeError};
use sdkit_compute::weights::SafeTensors;
use sdkit_engine::NodeError;
use std::path::Path;
use std::sync::Arc;

/// Where the program names the main model's tensors it borrows.
const MAIN: &str = "main.";

/// The kind of an SD3.5 ControlNet file, or None when it is not one.
pub fn detect(
    path: &Path,
    file: &SafeTensors,
    s: &Shapes,
) -> Result<Option<ControlKind>, NodeError> {
    let has = |k: &str| s.contains_key(k);
    if !(has("controlnet_blocks.0.weight")
        && has("pos_embed_input.proj.weight")
        && has("transformer_blocks.0.adaLN_modulation.1.bias"))
    {
        return Ok(None);
    }
    let cfg = sd35_control_config(s).map_err(|e| NodeError::file(path, e))?;
    // ComfyUI pops the type: 0 blur, 1 canny, 2 depth; none: −1.
    let control_type = if has("control_type") {
        let v = file
            .to_f32("control_type")
            .map_err(|e| NodeError::file(path, e))?;
        v.first().map_or(-1, |x| x.round() as i64)
    } else {
        -1
    };
    Ok(Some(ControlKind::Sd35 { cfg, control_type }))
}

/// ComfyUI's names for the embedders of an SD3.5 ControlNet file, where it
/// uses diffusers' (`MMDIT_MAP_BASIC`: `time_text_embed.*`, `pos_embed.proj`).
const EMBEDDER_NAMES: [(&str, &str); 6] = [
    (
        "time_text_embed.timestep_embedder.linear_1",
        "t_embedder.mlp.0",
    ),
    (
        "time_text_embed.timestep_embedder.linear_2",
        "t_embedder.mlp.2",
    ),
    ("time_text_embed.text_embedder.linear_1", "y_embedder.mlp.0"),
    ("time_text_embed.text_embedder.linear_2", "y_embedder.mlp.2"),
    ("pos_embed.proj", "x_embedder.proj"),
    ("context_embedder", "context_embedder"),
];

/// Gives an SD3.5 ControlNet file's diffusers-named embedders ComfyUI's
/// names (the rest keep theirs); true when the file is one.
pub fn rename_embedders(file: &mut SafeTensors) -> bool {
    let is = ["controlnet_blocks.0.weight", "pos_embed_input.proj.weight"]
        .iter()
        .all(|k| file.get(k).is_some())
        && file
            .get("transformer_blocks.0.adaLN_modulation.1.bias")
            .is_some();
    if !is {
        return false;
    }
    let map: std::collections::HashMap<String, String> = file
        .tensors()
        .map(|t| {
            let new = EMBEDDER_NAMES
                .iter()
                .find_map(|(from, to)| {
                    t.name
                        .strip_prefix(from)
                        .filter(|rest| rest.starts_with('.'))
                        .map(|rest| format!("{to}{rest}"))
                })
                .unwrap_or_else(|| t.name.clone());
            (t.name.clone(), new)
        })
        .collect();
    file.rename(&map);
    true
}

/// The hint preprocessing of `control_type`, on 0..1 pixels.
pub fn preprocess(control_type: i64, v: f32) -> f32 {
    match control_type {
        1 => v * 255.0 * 0.5 + 0.5,
        2 => 1.0 - v,
        _ => v,
    }
}

fn main_config<'m>(model: &'m Model, net: &ControlNetModel) -> Result<&'m MmditConfig, NodeError> {
    match &model.net {
        Net::Mmdit(m) => Ok(m),
        _ => Err(NodeError::invalid(format!(
            "ControlNet {} is an SD3.5 ControlNet; the model is {}",
            net.file.name,
            model.family.name()
        ))),
    }
}

/// The net's program for `rows` latents `h`×`w` and `hint_batch` encoded
/// hints: inputs `x`, `t`, `pooled`, `hint` `[hint_batch, 16, h, w]` and
/// `pos` (the sin-cos table); one residual per block out. Its weights:
/// the file's, and the main model's borrowed ones under `main.`.
pub fn program(
    model: &Model,
    net: &ControlNetModel,
    rows: usize,
    (h, w): (usize, usize),
    hint_batch: usize,
) -> Result<Program, NodeError> {
    let what = format!("ControlNet {}", net.file.name);
    let main = main_config(model, net)?;
    let ControlKind::Sd35 { cfg, .. } = &net.kind else {
        return Err(NodeError::invalid(format!(
            "{what} is not an SD3.5 ControlNet"
        )));
    };
    let bc = &cfg.block;
    if (bc.hidden, bc.in_channels, bc.patch) != (main.hidden, main.in_channels, main.patch)
        || (!cfg.double_y_emb && main.adm_in != bc.adm_in)
    {
        return Err(NodeError::invalid(format!(
            "{what} does not fit this SD3 model: its width {}, channels {}, patch {} and \
             pooled width {:?} differ from the model's ({}, {}, {}, {:?})",
            bc.hidden,
            bc.in_channels,
            bc.patch,
            bc.adm_in,
            main.hidden,
            main.in_channels,
            main.patch,
            main.adm_in
        )));
    }
    let adm = main.adm_in.ok_or_else(|| {
        NodeError::invalid(format!(
            "{what} needs the model's pooled input (y_embedder)"
        ))
    })?;
    let (gh, gw) = (h.div_ceil(bc.patch), w.div_ceil(bc.patch));
    let g = GraphBuilder::new();
    let outs = (|| {
        let x = g.input("x", &[rows, bc.in_channels, h, w])?;
        let t = g.input("t", &[rows])?;
        let y = g.input("pooled", &[rows, adm])?;
        let hint = g.input("hint", &[hint_batch, bc.in_channels, h, w])?;
        let pos = if cfg.double_y_emb {
            None
        } else {
            Some(g.input("pos", &[1, gh * gw, bc.hidden])?)
        };
        sd35_controlnet(&g, cfg, MAIN, x, t, y, hint, pos)
    })()
    .map_err(|e: ShapeError| graph_error(&what, e))?;
    plan(&g.finish(&outs)).map_err(|e| graph_error(&what, e))
}

/// The program's weights: the file's own, and the main model's (patched
/// as the model samples with them) for the names under `main.`.
pub fn bindings(
    prog: &Program,
    net: &ControlNetModel,
    model: &Model,
) -> Result<Bindings, NodeError> {
    let mut b = Bindings::default();
    for c in &prog.commands {
        let Command::Upload { name, .. } = c else {
            continue;
        };
        match name.strip_prefix(MAIN) {
            Some(rest) => super::bind_model_weight(model, rest, name, &mut b)?,
            None => {
                let w = net
                    .file
                    .store
                    .stored(name)
                    .map_err(|e| NodeError::invalid(format!("{}: {e}", net.file.name)))?;
                b.stored.insert(name.clone(), w);
            }
        }
    }
    Ok(b)
}

/// The residual list of one run's outputs (one per block, already ×
/// strength): each repeated ⌈depth / blocks⌉ times in a row.
pub fn residuals(net: &ControlNetModel, outs: Vec<Vec<f32>>) -> Residuals {
    let depth = match &net.kind {
        ControlKind::Sd35 { cfg, .. } => cfg.main_double,
        _ => outs.len(),
    };
    let repeat = depth.div_ceil(outs.len().max(1));
    let mut output = Vec::with_capacity(outs.len() * repeat);
    for o in outs {
        let o = Arc::new(o);
        output.extend(std::iter::repeat_n(o, repeat));
    }
    Residuals {
        output,
        ..Residuals::default()
    }
}

/// The shapes of an MMDiT's residual inputs: one `[rows, patches,
/// hidden]` after each joint block.
pub fn slot_shapes(cfg: &MmditConfig, rows: usize, h: usize, w: usize) -> SlotShapes {
    let (gh, gw) = (h.div_ceil(cfg.patch), w.div_ceil(cfg.patch));
    SlotShapes {
        input: Vec::new(),
        output: vec![vec![rows, gh * gw, cfg.hidden]; cfg.blocks],
        middle: Vec::new(),
    }
}
