//! Model loaders (nodes.py).

use super::Finish;
use sdkit_schema::spec::{node, NodeSpec, SocketType as T};

const LORA_DESC: &str = "LoRAs are used to modify diffusion and CLIP models, altering the way in which latents are denoised such as applying styles. Multiple LoRA nodes can be linked together.";

pub(super) fn loaders(v: &mut Vec<NodeSpec>) {
    v.push(
        node("CheckpointLoaderSimple", "loaders")
            .display("Load Checkpoint")
            .description(
                "Loads a diffusion model checkpoint, diffusion models are used to denoise latents.",
            )
            .models("ckpt_name", "checkpoints")
            .tip("The name of the checkpoint (model) to load.")
            .returns(T::Model)
            .returns(T::Clip)
            .returns(T::Vae)
            .build()
            .out_tips(&[
                "The model used for denoising latents.",
                "The CLIP model used for encoding text prompts.",
                "The VAE model used for encoding and decoding images to and from latent space.",
            ]),
    );
    v.push(
        node("CheckpointLoader", "advanced/loaders")
            .display("Load Checkpoint With Config (DEPRECATED)")
            .deprecated()
            .models("config_name", "configs")
            .models("ckpt_name", "checkpoints")
            .returns(T::Model)
            .returns(T::Clip)
            .returns(T::Vae)
            .build(),
    );
    v.push(
        node("unCLIPCheckpointLoader", "loaders")
            .models("ckpt_name", "checkpoints")
            .returns(T::Model)
            .returns(T::Clip)
            .returns(T::Vae)
            .returns(T::ClipVision)
            .build(),
    );
    v.push(
        node("VAELoader", "loaders")
            .display("Load VAE")
            .vaes("vae_name")
            .returns(T::Vae)
            .build(),
    );
    v.push(
        node("LoraLoader", "loaders")
            .display("Load LoRA")
            .description(LORA_DESC)
            .socket("model", T::Model)
            .tip("The diffusion model the LoRA will be applied to.")
            .socket("clip", T::Clip)
            .tip("The CLIP model the LoRA will be applied to.")
            .models("lora_name", "loras")
            .tip("The name of the LoRA.")
            .float("strength_model", 1.0, -100.0, 100.0, 0.01)
            .tip("How strongly to modify the diffusion model. This value can be negative.")
            .float("strength_clip", 1.0, -100.0, 100.0, 0.01)
            .tip("How strongly to modify the CLIP model. This value can be negative.")
            .returns(T::Model)
            .returns(T::Clip)
            .build()
            .out_tips(&["The modified diffusion model.", "The modified CLIP model."]),
    );
    // Inherits LoraLoader's CATEGORY, DESCRIPTION and OUTPUT_TOOLTIPS.
    v.push(
        node("LoraLoaderModelOnly", "loaders")
            .description(LORA_DESC)
            .socket("model", T::Model)
            .models("lora_name", "loras")
            .float("strength_model", 1.0, -100.0, 100.0, 0.01)
            .returns(T::Model)
            .build()
            .out_tips(&["The modified diffusion model."]),
    );
    v.push(node("CLIPLoader", "advanced/loaders").display("Load CLIP")
        .description("[Recipes]\n\nstable_diffusion: clip-l\nstable_cascade: clip-g\nsd3: t5 xxl/ clip-g / clip-l\nstable_audio: t5 base\nmochi: t5 xxl\ncosmos: old t5 xxl\nlumina2: gemma 2 2B\nwan: umt5 xxl\n hidream: llama-3.1 (Recommend) or t5\nomnigen2: qwen vl 2.5 3B")
        .models("clip_name", "text_encoders")
        .combo("type", CLIP_TYPES)
        .combo("device", &["default", "cpu"]).optional()
        .returns(T::Clip).build());
    v.push(node("DualCLIPLoader", "advanced/loaders")
        .description("[Recipes]\n\nsdxl: clip-l, clip-g\nsd3: clip-l, clip-g / clip-l, t5 / clip-g, t5\nflux: clip-l, t5\nhidream: at least one of t5 or llama, recommended t5 and llama\nhunyuan_image: qwen2.5vl 7b and byt5 small")
        .models("clip_name1", "text_encoders")
        .models("clip_name2", "text_encoders")
        .combo("type", DUAL_CLIP_TYPES)
        .combo("device", &["default", "cpu"]).optional()
        .returns(T::Clip).build());
    // ComfyUI-GGUF's custom nodes (city96), as workflows name them.
    const DTYPES: &[&str] = &["default", "target", "float32", "float16", "bfloat16"];
    v.push(
        node("UnetLoaderGGUF", "bootleg")
            .display("Unet Loader (GGUF)")
            .models("unet_name", "unet_gguf")
            .returns(T::Model)
            .build(),
    );
    v.push(
        node("UnetLoaderGGUFAdvanced", "bootleg")
            .display("Unet Loader (GGUF/Advanced)")
            .models("unet_name", "unet_gguf")
            .combo("dequant_dtype", DTYPES)
            .combo("patch_dtype", DTYPES)
            .boolean("patch_on_device", false)
            .returns(T::Model)
            .build(),
    );
    v.push(
        node("CLIPLoaderGGUF", "bootleg")
            .display("CLIPLoader (GGUF)")
            .models("clip_name", "clip_gguf")
            .combo("type", CLIP_TYPES)
            .returns(T::Clip)
            .build(),
    );
    v.push(
        node("DualCLIPLoaderGGUF", "bootleg")
            .display("DualCLIPLoader (GGUF)")
            .models("clip_name1", "clip_gguf")
            .models("clip_name2", "clip_gguf")
            .combo("type", DUAL_CLIP_TYPES)
            .returns(T::Clip)
            .build(),
    );
    v.push(
        node("TripleCLIPLoaderGGUF", "bootleg")
            .display("TripleCLIPLoader (GGUF)")
            .models("clip_name1", "clip_gguf")
            .models("clip_name2", "clip_gguf")
            .models("clip_name3", "clip_gguf")
            .returns(T::Clip)
            .build(),
    );
    v.push(
        node("TripleCLIPLoader", "advanced/loaders")
            .description("[Recipes]\n\nsd3: clip-l, clip-g, t5")
            .models("clip_name1", "text_encoders")
            .models("clip_name2", "text_encoders")
            .models("clip_name3", "text_encoders")
            .returns(T::Clip)
            .build(),
    );
    v.push(
        node("UNETLoader", "advanced/loaders")
            .display("Load Diffusion Model")
            .models("unet_name", "diffusion_models")
            .combo(
                "weight_dtype",
                &["default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"],
            )
            .returns(T::Model)
            .build(),
    );
    v.push(
        node("ControlNetLoader", "loaders")
            .display("Load ControlNet Model")
            .models("control_net_name", "controlnet")
            .returns(T::ControlNet)
            .build(),
    );
    v.push(
        node("DiffControlNetLoader", "loaders")
            .display("Load ControlNet Model (diff)")
            .socket("model", T::Model)
            .models("control_net_name", "controlnet")
            .returns(T::ControlNet)
            .build(),
    );
    v.push(
        node("StyleModelLoader", "loaders")
            .display("Load Style Model")
            .models("style_model_name", "style_models")
            .returns(T::StyleModel)
            .build(),
    );
    v.push(
        node("CLIPVisionLoader", "loaders")
            .display("Load CLIP Vision")
            .models("clip_name", "clip_vision")
            .returns(T::ClipVision)
            .build(),
    );
    v.push(
        node("GLIGENLoader", "loaders")
            .models("gligen_name", "gligen")
            .returns(T::Gligen)
            .build(),
    );
    // comfy_extras/nodes_upscale_model.py and nodes_video_model.py; the
    // front end maps model folders to these loaders at start-up.
    v.push(
        node("UpscaleModelLoader", "loaders")
            .display("Load Upscale Model")
            .models("model_name", "upscale_models")
            .returns(T::UpscaleModel)
            .build(),
    );
    v.push(
        node("ImageUpscaleWithModel", "image/upscaling")
            .display("Upscale Image (using Model)")
            .socket("upscale_model", T::UpscaleModel)
            .socket("image", T::Image)
            .returns(T::Image)
            .build(),
    );
    v.push(
        node("ImageOnlyCheckpointLoader", "loaders/video_models")
            .display("Image Only Checkpoint Loader (img2vid model)")
            .models("ckpt_name", "checkpoints")
            .output("MODEL", T::Model)
            .output("CLIP_VISION", T::ClipVision)
            .output("VAE", T::Vae)
            .build(),
    );
}

/// CLIPLoader's `type` options.
const CLIP_TYPES: &[&str] = &[
    "stable_diffusion",
    "stable_cascade",
    "sd3",
    "stable_audio",
    "mochi",
    "ltxv",
    "pixart",
    "cosmos",
    "lumina2",
    "wan",
    "hidream",
    "chroma",
    "ace",
    "omnigen2",
    "qwen_image",
    "hunyuan_image",
];

/// DualCLIPLoader's `type` options.
const DUAL_CLIP_TYPES: &[&str] = &[
    "sdxl",
    "sd3",
    "flux",
    "hunyuan_video",
    "hidream",
    "hunyuan_image",
];
