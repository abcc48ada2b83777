//! Workflow templates: sdkit's own example workflows (`graphs/`), served
//! where ComfyUI's front end looks for its core templates, so its first
//! screen ("Get Started with a Template") offers workflows this server can
//! run.
//!
//! The front end reads `/templates/index.json` (a list of categories, each
//! `{moduleName, title, type, templates: [{name, title, description,
//! mediaType, mediaSubtype}]}`; ComfyUI serves the
//! `comfyui-workflow-templates` package there), loads `/templates/NAME.json`
//! (UI form) and shows `/templates/NAME-1.png` as the thumbnail. The
//! workflows are compiled into the binary, so the server needs no checkout;
//! the index lists only those that validate against this server's node
//! types and folders (a model workflow appears once its checkpoint is in
//! place). The example image the image workflows load is bundled too, and
//! copied into the input folder when such a template is opened.

use super::routes::status;
use super::Server;
use axum::extract::{Path as UrlPath, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json as JsonBody, Router};
use sdkit_engine::validate;
use sdkit_schema::export::ComboSource;
use sdkit_schema::spec::ComboOptions;
use sdkit_schema::workflow::{self, Workflow};
use serde_json::{json, Value as Json};
use std::sync::Arc;

struct Template {
    name: &'static str,
    title: &'static str,
    description: &'static str,
    source: &'static str,
}

macro_rules! template {
    ($name:literal, $file:literal, $title:literal, $description:literal) => {
        Template {
            name: $name,
            title: $title,
            description: $description,
            source: include_str!(concat!("../../graphs/", $file)),
        }
    };
}

/// One row per example workflow; the image pipeline's other three forms
/// (tests/formats.rs) would only repeat it.
const TEMPLATES: &[Template] = &[
    template!(
        "sdkit_image_pipeline",
        "comfy_ui_image_pipeline.json",
        "Scale and invert an image",
        "Loads the example image, scales it to 128 px wide, inverts it and saves it. Image nodes only: runs without models."
    ),
    template!(
        "sdkit_mask_ops",
        "mask_ops.ron",
        "Masks, blur, sharpen and crop",
        "The example image's alpha mask inverted and blurred, a sharpened crop, and a solid canvas batch. Runs without models."
    ),
    template!(
        "sdkit_sd15_txt2img",
        "sd15_txt2img.json",
        "Text to image (SD 1.5)",
        "ComfyUI's default workflow. Needs v1-5-pruned-emaonly.safetensors in models/checkpoints."
    ),
    template!(
        "sdkit_sdxl_txt2img",
        "sdxl_txt2img.json",
        "Text to image (SDXL base + refiner)",
        "ComfyUI's SDXL example: 20 of 25 steps on the base, the rest on the refiner. Needs sd_xl_base_1.0.safetensors and sd_xl_refiner_1.0.safetensors in models/checkpoints."
    ),
    template!(
        "sdkit_flux_dev_txt2img",
        "flux_dev_txt2img.json",
        "Text to image (Flux dev)",
        "ComfyUI's Flux dev example: SamplerCustomAdvanced with FluxGuidance and ModelSamplingFlux. Needs flux1-dev.safetensors in models/diffusion_models, clip_l.safetensors and t5xxl_fp16.safetensors in models/text_encoders, ae.safetensors in models/vae."
    ),
    template!(
        "sdkit_flux_kontext_dev",
        "flux_kontext_dev.json",
        "Image edit (Flux Kontext dev)",
        "ComfyUI's Kontext example: the input image scaled by FluxKontextImageScale, encoded and given as a ReferenceLatent. Needs flux1-kontext-dev.safetensors in models/diffusion_models, clip_l.safetensors and t5xxl_fp8_e4m3fn_scaled.safetensors in models/text_encoders, ae.safetensors in models/vae."
    ),
    template!(
        "sdkit_sd35_large_txt2img",
        "sd35_large_txt2img.json",
        "Text to image (SD 3.5 Large)",
        "ComfyUI's SD3.5 example: TripleCLIPLoader, ModelSamplingSD3 and a negative zeroed after the first tenth. Needs sd3.5_large.safetensors in models/checkpoints, clip_l, clip_g and t5xxl_fp8_e4m3fn_scaled in models/text_encoders."
    ),
    template!(
        "sdkit_chroma_txt2img",
        "chroma_txt2img.json",
        "Text to image (Chroma)",
        "Chroma with real CFG and a negative prompt, T5 unpadded. Needs chroma.safetensors in models/diffusion_models, t5xxl_fp16.safetensors in models/text_encoders, ae.safetensors in models/vae."
    ),
    template!("sdkit_tiny_sd1_txt2img", "tiny_sd1_txt2img.json", "Tiny SD1: text to image", "KSampler on the tiny test checkpoint (tiny_sd1.safetensors)."),
    template!("sdkit_tiny_sd1_img2img", "tiny_sd1_img2img.json", "Tiny SD1: image to image", "VAEEncode and a partial denoise on the tiny test checkpoint."),
    template!("sdkit_tiny_sd1_hires", "tiny_sd1_hires.json", "Tiny SD1: hires fix", "Two samplers with a latent upscale between, on the tiny test checkpoint."),
    template!("sdkit_tiny_sd1_advanced", "tiny_sd1_advanced.json", "Tiny SD1: KSamplerAdvanced", "Start and end steps split over two samplers, on the tiny test checkpoint."),
    template!("sdkit_tiny_sd1_ancestral", "tiny_sd1_ancestral.json", "Tiny SD1: ancestral sampler", "An ancestral sampler with its own seeded noise, on the tiny test checkpoint."),
    template!("sdkit_tiny_sd1_cfgpp", "tiny_sd1_cfgpp.json", "Tiny SD1: CFG++ sampler", "A CFG++ sampler on the tiny test checkpoint."),
    template!("sdkit_tiny_sd1_custom", "tiny_sd1_custom.json", "Tiny SD1: custom sampling", "SamplerCustom with a scheduler and sampler as nodes, on the tiny test checkpoint."),
    template!("sdkit_tiny_sd1_guiders", "tiny_sd1_guiders.json", "Tiny SD1: guiders", "SamplerCustomAdvanced with guider, noise and sigma nodes, on the tiny test checkpoint."),
    template!("sdkit_tiny_sd1_tiled", "tiny_sd1_tiled.json", "Tiny SD1: tiled VAE", "Tiled VAE decoding on the tiny test checkpoint."),
    template!("sdkit_tiny_sd1_lcm", "tiny_sd1_lcm.json", "Tiny SD1: LCM sampling", "ModelSamplingDiscrete set to LCM, on the tiny test checkpoint."),
    template!("sdkit_tiny_sd1_vpred", "tiny_sd1_vpred.json", "Tiny SD1: v-prediction", "ModelSamplingDiscrete set to v-prediction, on the tiny test checkpoint."),
    template!("sdkit_tiny_sd1_zsnr", "tiny_sd1_zsnr.json", "Tiny SD1: zero terminal SNR", "Zero terminal SNR sampling on the tiny test checkpoint."),
    template!("sdkit_tiny_sd1_flow", "tiny_sd1_flow.json", "Tiny SD1: flow sampling", "ModelSamplingSD3 (flow) on the tiny test checkpoint."),
    template!("sdkit_tiny_sd1_flux", "tiny_sd1_flux.json", "Tiny SD1: Flux sampling schedule", "ModelSamplingFlux on the tiny test checkpoint."),
];

/// The image the example workflows load, written into the input folder
/// when a template that loads it is opened and no file of its name is there.
const EXAMPLE_IMAGE: (&str, &[u8]) = (
    "example.png",
    include_bytes!("../../graphs/input/example.png"),
);

/// The template routes, merged into the server's router.
pub fn router() -> Router<Arc<Server>> {
    Router::new().route("/templates/{file}", get(template_file))
}

/// `index.json`, `NAME.json` or a thumbnail `NAME-N.png`.
async fn template_file(
    State(server): State<Arc<Server>>,
    UrlPath(file): UrlPath<String>,
) -> Response {
    if file == "index.json" {
        let server = Arc::clone(&server);
        return match tokio::task::spawn_blocking(move || index(&server)).await {
            Ok(v) => JsonBody(v).into_response(),
            Err(_) => status(StatusCode::INTERNAL_SERVER_ERROR),
        };
    }
    if let Some(t) = file.strip_suffix(".json").and_then(find) {
        let server = Arc::clone(&server);
        return match tokio::task::spawn_blocking(move || ui_workflow(&server, t)).await {
            Ok(Some(v)) => JsonBody(v).into_response(),
            _ => status(StatusCode::INTERNAL_SERVER_ERROR),
        };
    }
    let thumbnail = file
        .strip_suffix(".png")
        .and_then(|stem| stem.rsplit_once('-'))
        .is_some_and(|(name, n)| find(name).is_some() && n.bytes().all(|b| b.is_ascii_digit()));
    if thumbnail {
        return ([(header::CONTENT_TYPE, "image/png")], EXAMPLE_IMAGE.1).into_response();
    }
    status(StatusCode::NOT_FOUND)
}

fn find(name: &str) -> Option<&'static Template> {
    TEMPLATES.iter().find(|t| t.name == name)
}

/// The front end's template index: one category of the templates this
/// server can run now.
fn index(server: &Server) -> Json {
    let templates: Vec<Json> = TEMPLATES
        .iter()
        .filter(|t| runnable(server, t))
        .map(|t| {
            json!({
                "name": t.name,
                "title": t.title,
                "description": t.description,
                "mediaType": "image",
                "mediaSubtype": "png",
            })
        })
        .collect();
    json!([{
        "moduleName": "default",
        "title": "sdkit examples",
        "type": "image",
        "templates": templates,
    }])
}

fn load(server: &Server, t: &Template) -> Option<Workflow> {
    workflow::load(t.source, &server.lib.registry).ok()
}

/// Whether the template validates here, counting the bundled example
/// image as present (it is written when the template is opened).
fn runnable(server: &Server, t: &Template) -> bool {
    let combos = WithExample(&server.combos());
    load(server, t).is_some_and(|wf| validate(&wf, &server.lib.registry, &combos).is_ok())
}

/// The template in UI form, after putting the example image in place.
fn ui_workflow(server: &Server, t: &Template) -> Option<Json> {
    let wf = load(server, t)?;
    let (name, bytes) = EXAMPLE_IMAGE;
    let loads_example = t.source.contains(name);
    let dest = server.paths.input.join(name);
    if loads_example && !dest.exists() {
        let written = std::fs::create_dir_all(&server.paths.input)
            .and_then(|()| sdkit_compute::atomic::write_atomic(&dest, bytes));
        if let Err(e) = written {
            tracing::warn!("cannot write {}: {e}", dest.display());
        }
    }
    Some(sdkit_schema::ui::to_ui_json(&wf, &server.lib.registry))
}

/// The server's folders, plus the bundled example image in the input
/// folder's list.
struct WithExample<'a>(&'a dyn ComboSource);

impl ComboSource for WithExample<'_> {
    fn options(&self, options: &ComboOptions) -> Vec<String> {
        let mut list = self.0.options(options);
        if *options == ComboOptions::InputImages && !list.iter().any(|o| o == EXAMPLE_IMAGE.0) {
            list.push(EXAMPLE_IMAGE.0.to_string());
        }
        list
    }

    fn contains(&self, options: &ComboOptions, value: &str) -> bool {
        (*options == ComboOptions::InputImages && value == EXAMPLE_IMAGE.0)
            || self.0.contains(options, value)
    }
}
