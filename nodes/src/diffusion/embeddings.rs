//! Textual-inversion embeddings (`embedding:NAME` in a prompt), found and
//! read as ComfyUI's `load_embed` does: `models/embeddings/NAME`, else
//! NAME with `.safetensors`, `.pt` or `.bin` appended; the tensor under the
//! encoder's key (`clip_l`, `clip_g`, `clip_h`: SDXL files carry one per
//! encoder), else the file's first tensor (`emb_params` of SD1/SD2
//! files); one vector per row. A1111's `.pt` files are read by the
//! restricted pickle reader (nothing in them runs).

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

/// ComfyUI's choice of tensor: A1111's `string_to_param`, else the
/// encoder's key, else a LoRA-bundled embedding, else the first tensor
/// (names are sorted).
fn choose(names: &[&str], key: &str) -> Option<String> {
    let pick = names
        .iter()
        .find(|n| n.starts_with("string_to_param."))
        .or_else(|| names.iter().find(|n| **n == key))
        .or_else(|| {
            names.iter().find(|n| {
                n.starts_with("bundle_emb.")
                    && (n.ends_with(".string_to_param.*") || n.ends_with(&format!(".{key}")))
            })
        })
        .or_else(|| names.first());
    pick.map(|n| n.to_string())
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
    // `.pt`/`.bin` files go through the restricted pickle reader, which
    // flattens A1111's {"string_to_param": {"*": tensor}} to dotted names.
    let file = SafeTensors::open(&path).map_err(|e| NodeError::invalid(e.to_string()))?;
    let names: Vec<&str> = file.tensors().map(|t| t.name.as_str()).collect();
    let Some(chosen) = choose(&names, key(role)) else {
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
