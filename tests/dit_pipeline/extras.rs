//! Guidance nodes, ControlNets and Flux Redux on the transformer families,
//! against ComfyUI's outputs (part of the `dit_pipeline` test binary).

use super::*;

/// Skip-layer guidance and FluxDisableGuidance
/// (tools/reference/dit_guidance.py), on the tiny Flux, SD3 and Chroma
/// files: ComfyUI's latents and images.
fn guidance_matches(graph: &str, device: &str) {
    matches_with_gpu_margin(dit_guidance(), graph, device);
}

/// [`matches_in`], allowing wgpu 2e-5: skip-layer guidance scales the
/// difference of two predictions (by 2.5 here) and a ControlNet adds a
/// second network's residuals, so the GPU's own rounding (~2.5e-6 on a
/// plain Flux run) grows with them.
fn matches_with_gpu_margin(fx: &serde_json::Value, graph: &str, device: &str) {
    let base = setup_with(fx);
    run(base.path(), graph, device);
    let tol = (device == "wgpu").then_some(2e-5);
    check_graph(base.path(), fx, graph, tol);
}

/// SkipLayerGuidanceSD3: a second conditional prediction with joint
/// blocks skipped, added after CFG while the sigma is in range.
#[test]
fn sd3_skip_layer_guidance_matches_comfyui() {
    guidance_matches("tiny_sd3_slg", "cpu");
}

/// SkipLayerGuidanceDiT on Flux: double and single blocks skipped, the
/// result rescaled towards the conditional prediction's spread.
#[test]
fn flux_skip_layer_guidance_matches_comfyui() {
    guidance_matches("tiny_flux_slg", "cpu");
}

#[test]
fn flux_skip_layer_guidance_on_wgpu_matches_comfyui() {
    if !wgpu_here("skip-layer guidance on wgpu") {
        return;
    }
    guidance_matches("tiny_flux_slg", "wgpu");
}

/// FluxDisableGuidance: the dev model without its guidance embedding.
#[test]
fn flux_disable_guidance_matches_comfyui() {
    guidance_matches("tiny_flux_no_guidance", "cpu");
}

/// SkipLayerGuidanceDiTSimple on Chroma: the negative prediction made
/// with blocks skipped while in range.
#[test]
fn chroma_simple_skip_layer_guidance_matches_comfyui() {
    guidance_matches("tiny_chroma_slg_simple", "cpu");
}

/// A Flux ControlNet in XLabs' layout (tools/reference/flux_controlnet.py)
/// through ControlNetLoader and ControlNetApplyAdvanced, with cfg and a
/// range that leaves the last step without it: ComfyUI's image.
#[test]
fn flux_controlnet_matches_comfyui() {
    matches_in(flux_controlnet(), "tiny_flux_controlnet", "cpu");
}

/// Two applications chained (the second on a resized, inverted hint, in a
/// narrower range): their residual lists summed position by position.
#[test]
fn flux_controlnet_chain_matches_comfyui() {
    matches_in(flux_controlnet(), "tiny_flux_controlnet_chain", "cpu");
}

#[test]
fn flux_controlnet_on_wgpu_matches_comfyui() {
    if !wgpu_here("Flux ControlNet on wgpu") {
        return;
    }
    matches_with_gpu_margin(flux_controlnet(), "tiny_flux_controlnet", "wgpu");
}

/// Stability's SD3.5 ControlNet layout (tools/reference/sd3_controlnet.py)
/// through ControlNetApplySD3: the canny preprocessing, the hint encoded
/// by the VAE, the model's `x_embedder` borrowed, the sin-cos positions.
#[test]
fn sd35_canny_controlnet_matches_comfyui() {
    matches_in(sd3_controlnet(), "tiny_sd35_controlnet_canny", "cpu");
}

/// The double-`y`-embedding form (the model's `y_embedder` borrowed, no
/// positions) through ControlNetApplyAdvanced with its VAE, on a resized
/// hint, the first step outside its range.
#[test]
fn sd35_blur_controlnet_matches_comfyui() {
    matches_in(sd3_controlnet(), "tiny_sd35_controlnet_blur", "cpu");
}

#[test]
fn sd35_controlnet_on_wgpu_matches_comfyui() {
    if !wgpu_here("SD3.5 ControlNet on wgpu") {
        return;
    }
    matches_with_gpu_margin(sd3_controlnet(), "tiny_sd35_controlnet_canny", "wgpu");
}

/// Flux Redux (tools/reference/flux_redux.py) as ComfyUI's example runs it:
/// CLIPVisionEncode on a tiny SigLIP (antialiased bicubic resize, centre
/// crop), StyleModelApply's tokens after the text, SamplerCustomAdvanced.
#[test]
fn flux_redux_matches_comfyui() {
    matches_in(flux_redux(), "tiny_flux_redux", "cpu");
}

/// Without the crop, two StyleModelApply chained at other strengths.
#[test]
fn flux_redux_uncropped_chain_matches_comfyui() {
    matches_in(flux_redux(), "tiny_flux_redux_nocrop", "cpu");
}

#[test]
fn flux_redux_on_wgpu_matches_comfyui() {
    if !wgpu_here("Flux Redux on wgpu") {
        return;
    }
    matches_in(flux_redux(), "tiny_flux_redux", "wgpu");
}

/// CLIPVisionEncode's preprocessing (antialiased bicubic up- and
/// downscaling, centre crop or none, the 1/255 quantisation, SigLIP's
/// normalisation) gives ComfyUI's pixel values exactly.
#[test]
fn clip_vision_preprocessing_matches_comfyui() {
    use sdkit_nodes::models::clip_vision::{clip_vision_config, preprocess};
    let dir = tempfile::tempdir().expect("tempdir");
    let path = write_one(flux_redux(), dir.path(), "tiny_sigclip_vision.safetensors");
    let cfg =
        clip_vision_config(&shapes(&SafeTensors::open(&path).expect("opens"))).expect("config");
    assert_eq!((cfg.image_size, cfg.heads, cfg.siglip), (64, 1, true));
    let img = sdkit_nodes::imagefile::decode(&support::root().join("graphs/input/example.png"))
        .expect("decodes");
    let (image, _) = sdkit_nodes::imagefile::image_to_tensors(&img).expect("tensor");
    let shape: [usize; 4] = image.shape[..].try_into().expect("rank 4");
    let runs = flux_redux()["components"]["clip_vision_encode"]
        .as_object()
        .expect("runs");
    let mut checked = 0;
    for nodes in runs.values() {
        for run in nodes.as_object().expect("nodes").values() {
            let data: Vec<f32> = match run["source"].as_str() {
                Some("example.png") => image.data.clone(),
                Some("ImageInvert(example.png)") => image.data.iter().map(|v| 1.0 - v).collect(),
                other => panic!("source {other:?}"),
            };
            let crop = run["crop"] == "center";
            let got = preprocess(&cfg, &data, shape, crop);
            let want = f32s(run["pixel_values"]["f32"].as_str().expect("values"));
            assert_eq!(got.len(), want.len());
            let off = got.iter().zip(&want).filter(|(a, b)| a != b).count();
            assert_eq!(
                off, 0,
                "{} crop {crop}: {off} pixel values differ",
                run["source"]
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 3);
}

/// An InstantX (diffusers-layout) union Flux ControlNet
/// (tools/reference/flux_instantx.py): ComfyUI's names over the file's
/// tensors, the hint encoded by the apply node's VAE, the canny mode
/// token before the text.
#[test]
fn flux_instantx_union_controlnet_matches_comfyui() {
    matches_in(flux_instantx(), "tiny_flux_controlnet_union", "cpu");
}

/// The same net on "auto" (no mode token), a resized hint, the first step
/// outside its range.
#[test]
fn flux_instantx_auto_controlnet_matches_comfyui() {
    matches_in(flux_instantx(), "tiny_flux_controlnet_union_auto", "cpu");
}

#[test]
fn flux_instantx_controlnet_on_wgpu_matches_comfyui() {
    if !wgpu_here("InstantX Flux ControlNet on wgpu") {
        return;
    }
    matches_with_gpu_margin(flux_instantx(), "tiny_flux_controlnet_union", "wgpu");
}
