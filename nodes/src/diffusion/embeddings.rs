//! Textual-inversion embeddings (`embedding:NAME` in a prompt), found and
//! read as ComfyUI's `load_embed` does: `models/embeddings/NAME`, else
//! NAME with `.safetensors`, `.pt` or `.bin` appended; the tensor under the
//! encoder's key (`clip_l`, `clip_g`, `clip_h`: SDXL files carry one per
//! encoder), else the file's first tensor (`emb_params` of SD1/SD2
//! files); one vector per row.

use crate::models::family::TextEncoder;
use sdkit_compute::weights::SafeTensors;
use sdkit_engine::{NodeContext, NodeError};

/// The key of an encoder's vectors in an SDXL-style embedding file.
fn key(role: TextEncoder) -> &'static str {
    match role {
        TextEncoder::ClipL => "clip_l",
        TextEncoder::OpenClipG => "clip_g",
        TextEncoder::OpenClipH => "clip_h",
        TextEncoder::T5Xxl => "t5xxl",
    }
}

/// The vectors of embedding `name` for the encoder `role`; None (with
/// ComfyUI's warning) when there is no such file.
pub fn load(
    ctx: &NodeContext,
    name: &str,
    role: TextEncoder,
) -> Result<Option<Vec<Vec<f32>>>, NodeError> {
    let Some(path) = ["", ".safetensors", ".pt", ".bin"]
        .iter()
        .filter_map(|ext| ctx.paths.model("embeddings", &format!("{name}{ext}")))
        .find(|p| p.is_file())
    else {
        tracing::warn!(
            "node {} ({}): embedding:{name} does not exist in models/embeddings, ignoring",
            ctx.node_id,
            ctx.class_type
        );
        return Ok(None);
    };
    let is_safetensors = path
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("safetensors"));
    if !is_safetensors {
        return Err(NodeError::file(
            &path,
            "embedding files in pickle form (.pt, .bin) are not supported yet; use the .safetensors version",
        ));
    }
    let file = SafeTensors::open(&path).map_err(|e| NodeError::invalid(e.to_string()))?;
    let mut names: Vec<&str> = file.tensors().map(|t| t.name.as_str()).collect();
    names.sort_unstable();
    let Some(chosen) = names
        .iter()
        .find(|n| **n == key(role))
        .or_else(|| names.first())
        .map(|n| n.to_string())
    else {
        return Err(NodeError::file(&path, "the embedding file holds no tensor"));
    };
    let info = file
        .get(&chosen)
        .ok_or_else(|| NodeError::file(&path, format!("no tensor {chosen}")))?;
    let shape = info.shape.clone();
    let data = file
        .to_f32(&chosen)
        .map_err(|e| NodeError::invalid(e.to_string()))?;
    let width = shape.last().copied().unwrap_or(0);
    if width == 0 || data.is_empty() {
        return Err(NodeError::file(
            &path,
            format!("embedding tensor {chosen} has shape {shape:?}"),
        ));
    }
    Ok(Some(data.chunks(width).map(<[f32]>::to_vec).collect()))
}
