//! Conditioning nodes (nodes.py).

use super::{Finish, MAX_RES};
use sdkit_schema::spec::{node, NodeSpec, SocketType as T};

pub(super) fn conditioning(v: &mut Vec<NodeSpec>) {
    v.push(node("CLIPTextEncode", "conditioning").display("CLIP Text Encode (Prompt)")
        .description("Encodes a text prompt using a CLIP model into an embedding that can be used to guide the diffusion model towards generating specific images.")
        .text("text").tip("The text to be encoded.")
        .socket("clip", T::Clip).tip("The CLIP model used for encoding the text.")
        .returns(T::Conditioning).build()
        .out_tips(&["A conditioning containing the embedded text used to guide the diffusion model."]));
    v.push(
        node("CLIPTextEncodeFlux", "advanced/conditioning/flux")
            .socket("clip", T::Clip)
            .text("clip_l")
            .text("t5xxl")
            .float("guidance", 3.5, 0.0, 100.0, 0.1)
            .returns(T::Conditioning)
            .build(),
    );
    v.push(
        node("CLIPTextEncodeSD3", "advanced/conditioning")
            .socket("clip", T::Clip)
            .text("clip_l")
            .text("clip_g")
            .text("t5xxl")
            .combo("empty_padding", &["none", "empty_prompt"])
            .returns(T::Conditioning)
            .build(),
    );
    v.push(
        node("T5TokenizerOptions", "_for_testing/conditioning")
            .socket("clip", T::Clip)
            .int("min_padding", 0, 0, 10000, 1)
            .int("min_length", 0, 0, 10000, 1)
            .returns(T::Clip)
            .experimental()
            .build(),
    );
    v.push(
        node("ReferenceLatent", "advanced/conditioning/edit_models")
            .description("This node sets the guiding latent for an edit model. If the model supports it you can chain multiple to set multiple reference images.")
            .socket("conditioning", T::Conditioning)
            .optional_socket("latent", T::Latent)
            .returns(T::Conditioning)
            .build(),
    );
    v.push(
        node(
            "FluxKontextMultiReferenceLatentMethod",
            "advanced/conditioning/flux",
        )
        .experimental()
        .socket("conditioning", T::Conditioning)
        .combo("reference_latents_method", &["offset", "index", "uxo/uno"])
        .returns(T::Conditioning)
        .build(),
    );
    v.push(
        node("FluxKontextImageScale", "advanced/conditioning/flux")
            .description(
                "This node resizes the image to one that is more optimal for flux kontext.",
            )
            .socket("image", T::Image)
            .returns(T::Image)
            .build(),
    );
    v.push(
        node("FluxDisableGuidance", "advanced/conditioning/flux")
            .description(
                "This node completely disables the guidance embed on Flux and Flux like models",
            )
            .socket("conditioning", T::Conditioning)
            .returns(T::Conditioning)
            .build(),
    );
    v.push(
        node("FluxGuidance", "advanced/conditioning/flux")
            .socket("conditioning", T::Conditioning)
            .float("guidance", 3.5, 0.0, 100.0, 0.1)
            .returns(T::Conditioning)
            .build(),
    );
    v.push(
        node("CLIPSetLastLayer", "conditioning")
            .display("CLIP Set Last Layer")
            .socket("clip", T::Clip)
            .int("stop_at_clip_layer", -1, -24, -1, 1)
            .returns(T::Clip)
            .build(),
    );
    v.push(
        node("CLIPTextEncodeSDXLRefiner", "advanced/conditioning")
            .float("ascore", 6.0, 0.0, 1000.0, 0.01)
            .int("width", 1024, 0, MAX_RES, 1)
            .int("height", 1024, 0, MAX_RES, 1)
            .text("text")
            .socket("clip", T::Clip)
            .returns(T::Conditioning)
            .build(),
    );
    v.push(
        node("CLIPTextEncodeSDXL", "advanced/conditioning")
            .socket("clip", T::Clip)
            .int("width", 1024, 0, MAX_RES, 1)
            .int("height", 1024, 0, MAX_RES, 1)
            .int("crop_w", 0, 0, MAX_RES, 1)
            .int("crop_h", 0, 0, MAX_RES, 1)
            .int("target_width", 1024, 0, MAX_RES, 1)
            .int("target_height", 1024, 0, MAX_RES, 1)
            .text("text_g")
            .text("text_l")
            .returns(T::Conditioning)
            .build(),
    );
    v.push(
        node("ConditioningCombine", "conditioning")
            .display("Conditioning (Combine)")
            .socket("conditioning_1", T::Conditioning)
            .socket("conditioning_2", T::Conditioning)
            .returns(T::Conditioning)
            .build(),
    );
    // nodes.py maps "ConditioningAverage " (trailing space), so ComfyUI shows
    // the bare class name.
    v.push(
        node("ConditioningAverage", "conditioning")
            .socket("conditioning_to", T::Conditioning)
            .socket("conditioning_from", T::Conditioning)
            .float("conditioning_to_strength", 1.0, 0.0, 1.0, 0.01)
            .returns(T::Conditioning)
            .build(),
    );
    v.push(
        node("ConditioningConcat", "conditioning")
            .display("Conditioning (Concat)")
            .socket("conditioning_to", T::Conditioning)
            .socket("conditioning_from", T::Conditioning)
            .returns(T::Conditioning)
            .build(),
    );
    v.push(
        node("ConditioningSetArea", "conditioning")
            .display("Conditioning (Set Area)")
            .socket("conditioning", T::Conditioning)
            .int("width", 64, 64, MAX_RES, 8)
            .int("height", 64, 64, MAX_RES, 8)
            .int("x", 0, 0, MAX_RES, 8)
            .int("y", 0, 0, MAX_RES, 8)
            .float("strength", 1.0, 0.0, 10.0, 0.01)
            .returns(T::Conditioning)
            .build(),
    );
    v.push(
        node("ConditioningSetAreaPercentage", "conditioning")
            .display("Conditioning (Set Area with Percentage)")
            .socket("conditioning", T::Conditioning)
            .float("width", 1.0, 0.0, 1.0, 0.01)
            .float("height", 1.0, 0.0, 1.0, 0.01)
            .float("x", 0.0, 0.0, 1.0, 0.01)
            .float("y", 0.0, 0.0, 1.0, 0.01)
            .float("strength", 1.0, 0.0, 10.0, 0.01)
            .returns(T::Conditioning)
            .build(),
    );
    v.push(
        node("ConditioningSetAreaStrength", "conditioning")
            .socket("conditioning", T::Conditioning)
            .float("strength", 1.0, 0.0, 10.0, 0.01)
            .returns(T::Conditioning)
            .build(),
    );
    v.push(
        node("ConditioningSetMask", "conditioning")
            .display("Conditioning (Set Mask)")
            .socket("conditioning", T::Conditioning)
            .socket("mask", T::Mask)
            .float("strength", 1.0, 0.0, 10.0, 0.01)
            .combo("set_cond_area", &["default", "mask bounds"])
            .returns(T::Conditioning)
            .build(),
    );
    v.push(
        node("ConditioningZeroOut", "advanced/conditioning")
            .socket("conditioning", T::Conditioning)
            .returns(T::Conditioning)
            .build(),
    );
    v.push(
        node("ConditioningSetTimestepRange", "advanced/conditioning")
            .socket("conditioning", T::Conditioning)
            .float("start", 0.0, 0.0, 1.0, 0.001)
            .float("end", 1.0, 0.0, 1.0, 0.001)
            .returns(T::Conditioning)
            .build(),
    );
    v.push(
        node("ControlNetApply", "conditioning/controlnet")
            .display("Apply ControlNet (OLD)")
            .deprecated()
            .socket("conditioning", T::Conditioning)
            .socket("control_net", T::ControlNet)
            .socket("image", T::Image)
            .float("strength", 1.0, 0.0, 10.0, 0.01)
            .returns(T::Conditioning)
            .build(),
    );
    v.push(
        node("SetUnionControlNetType", "conditioning/controlnet")
            .socket("control_net", T::ControlNet)
            .combo(
                "type",
                &[
                    "auto",
                    "openpose",
                    "depth",
                    "hed/pidi/scribble/ted",
                    "canny/lineart/anime_lineart/mlsd",
                    "normal",
                    "segment",
                    "tile",
                    "repaint",
                ],
            )
            .returns(T::ControlNet)
            .build(),
    );
    v.push(
        node("ControlNetApplyAdvanced", "conditioning/controlnet")
            .display("Apply ControlNet")
            .socket("positive", T::Conditioning)
            .socket("negative", T::Conditioning)
            .socket("control_net", T::ControlNet)
            .socket("image", T::Image)
            .float("strength", 1.0, 0.0, 10.0, 0.01)
            .float("start_percent", 0.0, 0.0, 1.0, 0.001)
            .float("end_percent", 1.0, 0.0, 1.0, 0.001)
            .optional_socket("vae", T::Vae)
            .output("positive", T::Conditioning)
            .output("negative", T::Conditioning)
            .build(),
    );
    // comfy_extras/nodes_sd3.py
    v.push(
        node("ControlNetApplySD3", "conditioning/controlnet")
            .display("Apply Controlnet with VAE")
            .deprecated()
            .socket("positive", T::Conditioning)
            .socket("negative", T::Conditioning)
            .socket("control_net", T::ControlNet)
            .socket("vae", T::Vae)
            .socket("image", T::Image)
            .float("strength", 1.0, 0.0, 10.0, 0.01)
            .float("start_percent", 0.0, 0.0, 1.0, 0.001)
            .float("end_percent", 1.0, 0.0, 1.0, 0.001)
            .output("positive", T::Conditioning)
            .output("negative", T::Conditioning)
            .build(),
    );
    v.push(
        node("CLIPVisionEncode", "conditioning")
            .display("CLIP Vision Encode")
            .socket("clip_vision", T::ClipVision)
            .socket("image", T::Image)
            .combo("crop", &["center", "none"])
            .returns(T::ClipVisionOutput)
            .build(),
    );
    v.push(
        node("StyleModelApply", "conditioning/style_model")
            .display("Apply Style Model")
            .socket("conditioning", T::Conditioning)
            .socket("style_model", T::StyleModel)
            .socket("clip_vision_output", T::ClipVisionOutput)
            .float("strength", 1.0, 0.0, 10.0, 0.001)
            .combo("strength_type", &["multiply", "attn_bias"])
            .returns(T::Conditioning)
            .build(),
    );
    v.push(
        node("unCLIPConditioning", "conditioning")
            .socket("conditioning", T::Conditioning)
            .socket("clip_vision_output", T::ClipVisionOutput)
            .float("strength", 1.0, -10.0, 10.0, 0.01)
            .float("noise_augmentation", 0.0, 0.0, 1.0, 0.01)
            .returns(T::Conditioning)
            .build(),
    );
    v.push(
        node("GLIGENTextBoxApply", "conditioning/gligen")
            .socket("conditioning_to", T::Conditioning)
            .socket("clip", T::Clip)
            .socket("gligen_textbox_model", T::Gligen)
            .text("text")
            .int("width", 64, 8, MAX_RES, 8)
            .int("height", 64, 8, MAX_RES, 8)
            .int("x", 0, 0, MAX_RES, 8)
            .int("y", 0, 0, MAX_RES, 8)
            .returns(T::Conditioning)
            .build(),
    );
    v.push(node("InpaintModelConditioning", "conditioning/inpaint")
        .socket("positive", T::Conditioning)
        .socket("negative", T::Conditioning)
        .socket("vae", T::Vae)
        .socket("pixels", T::Image)
        .socket("mask", T::Mask)
        .boolean("noise_mask", true).tip("Add a noise mask to the latent so sampling will only happen within the mask. Might improve results or completely break things depending on the model.")
        .output("positive", T::Conditioning).output("negative", T::Conditioning)
        .output("latent", T::Latent).build());
    v.push(
        node(
            "InstructPixToPixConditioning",
            "conditioning/instructpix2pix",
        )
        .socket("positive", T::Conditioning)
        .socket("negative", T::Conditioning)
        .socket("vae", T::Vae)
        .socket("pixels", T::Image)
        .output("positive", T::Conditioning)
        .output("negative", T::Conditioning)
        .output("latent", T::Latent)
        .build(),
    );
}
