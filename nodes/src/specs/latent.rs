//! Latent nodes (nodes.py, plus LatentCompositeMasked from nodes_mask.py).

use super::{Finish, CROP, FLIPS, MAX_RES, ROTATIONS};
use sdkit_schema::spec::{node, Hidden, NodeSpec, SocketType as T};

const LATENT_UPSCALE: &[&str] = &["nearest-exact", "bilinear", "area", "bicubic", "bislerp"];

pub(super) fn latent(v: &mut Vec<NodeSpec>) {
    v.push(
        node("VAEDecode", "latent")
            .display("VAE Decode")
            .description("Decodes latent images back into pixel space images.")
            .socket("samples", T::Latent)
            .tip("The latent to be decoded.")
            .socket("vae", T::Vae)
            .tip("The VAE model used for decoding the latent.")
            .returns(T::Image)
            .build()
            .out_tips(&["The decoded image."]),
    );
    v.push(
        node("EmptySD3LatentImage", "latent/sd3")
            .int("width", 1024, 16, MAX_RES, 16)
            .int("height", 1024, 16, MAX_RES, 16)
            .int("batch_size", 1, 1, 4096, 1)
            .returns(T::Latent)
            .build(),
    );
    v.push(
        node("VAEEncode", "latent")
            .display("VAE Encode")
            .socket("pixels", T::Image)
            .socket("vae", T::Vae)
            .returns(T::Latent)
            .build(),
    );
    v.push(
        node("VAEDecodeTiled", "_for_testing")
            .display("VAE Decode (Tiled)")
            .socket("samples", T::Latent)
            .socket("vae", T::Vae)
            .int("tile_size", 512, 64, 4096, 32)
            .int("overlap", 64, 0, 4096, 32)
            .int("temporal_size", 64, 8, 4096, 4)
            .tip("Only used for video VAEs: Amount of frames to decode at a time.")
            .int("temporal_overlap", 8, 4, 4096, 4)
            .tip("Only used for video VAEs: Amount of frames to overlap.")
            .returns(T::Image)
            .build(),
    );
    v.push(
        node("VAEEncodeTiled", "_for_testing")
            .display("VAE Encode (Tiled)")
            .socket("pixels", T::Image)
            .socket("vae", T::Vae)
            .int("tile_size", 512, 64, 4096, 64)
            .int("overlap", 64, 0, 4096, 32)
            .int("temporal_size", 64, 8, 4096, 4)
            .tip("Only used for video VAEs: Amount of frames to encode at a time.")
            .int("temporal_overlap", 8, 4, 4096, 4)
            .tip("Only used for video VAEs: Amount of frames to overlap.")
            .returns(T::Latent)
            .build(),
    );
    v.push(
        node("VAEEncodeForInpaint", "latent/inpaint")
            .display("VAE Encode (for Inpainting)")
            .socket("pixels", T::Image)
            .socket("vae", T::Vae)
            .socket("mask", T::Mask)
            .int("grow_mask_by", 6, 0, 64, 1)
            .returns(T::Latent)
            .build(),
    );
    v.push(
        node("SetLatentNoiseMask", "latent/inpaint")
            .display("Set Latent Noise Mask")
            .socket("samples", T::Latent)
            .socket("mask", T::Mask)
            .returns(T::Latent)
            .build(),
    );
    v.push(
        node("EmptyLatentImage", "latent")
            .display("Empty Latent Image")
            .description("Create a new batch of empty latent images to be denoised via sampling.")
            .int("width", 512, 16, MAX_RES, 8)
            .tip("The width of the latent images in pixels.")
            .int("height", 512, 16, MAX_RES, 8)
            .tip("The height of the latent images in pixels.")
            .int("batch_size", 1, 1, 4096, 1)
            .tip("The number of latent images in the batch.")
            .returns(T::Latent)
            .build()
            .out_tips(&["The empty latent image batch."]),
    );
    v.push(
        node("LatentUpscale", "latent")
            .display("Upscale Latent")
            .socket("samples", T::Latent)
            .combo("upscale_method", LATENT_UPSCALE)
            .int("width", 512, 0, MAX_RES, 8)
            .int("height", 512, 0, MAX_RES, 8)
            .combo("crop", CROP)
            .returns(T::Latent)
            .build(),
    );
    v.push(
        node("LatentUpscaleBy", "latent")
            .display("Upscale Latent By")
            .socket("samples", T::Latent)
            .combo("upscale_method", LATENT_UPSCALE)
            .float("scale_by", 1.5, 0.01, 8.0, 0.01)
            .returns(T::Latent)
            .build(),
    );
    v.push(
        node("LatentFromBatch", "latent/batch")
            .display("Latent From Batch")
            .socket("samples", T::Latent)
            .int("batch_index", 0, 0, 63, 1)
            .int("length", 1, 1, 64, 1)
            .returns(T::Latent)
            .build(),
    );
    v.push(
        node("RepeatLatentBatch", "latent/batch")
            .display("Repeat Latent Batch")
            .socket("samples", T::Latent)
            .int("amount", 1, 1, 64, 1)
            .returns(T::Latent)
            .build(),
    );
    v.push(
        node("LatentRotate", "latent/transform")
            .display("Rotate Latent")
            .socket("samples", T::Latent)
            .combo("rotation", ROTATIONS)
            .returns(T::Latent)
            .build(),
    );
    v.push(
        node("LatentFlip", "latent/transform")
            .display("Flip Latent")
            .socket("samples", T::Latent)
            .combo("flip_method", FLIPS)
            .returns(T::Latent)
            .build(),
    );
    v.push(
        node("LatentCrop", "latent/transform")
            .display("Crop Latent")
            .socket("samples", T::Latent)
            .int("width", 512, 64, MAX_RES, 8)
            .int("height", 512, 64, MAX_RES, 8)
            .int("x", 0, 0, MAX_RES, 8)
            .int("y", 0, 0, MAX_RES, 8)
            .returns(T::Latent)
            .build(),
    );
    v.push(
        node("LatentComposite", "latent")
            .display("Latent Composite")
            .socket("samples_to", T::Latent)
            .socket("samples_from", T::Latent)
            .int("x", 0, 0, MAX_RES, 8)
            .int("y", 0, 0, MAX_RES, 8)
            .int("feather", 0, 0, MAX_RES, 8)
            .returns(T::Latent)
            .build(),
    );
    v.push(
        node("LatentBlend", "_for_testing")
            .display("Latent Blend")
            .socket("samples1", T::Latent)
            .socket("samples2", T::Latent)
            .float("blend_factor", 0.5, 0.0, 1.0, 0.01)
            .returns(T::Latent)
            .build(),
    );
    v.push(
        node("LatentCompositeMasked", "latent")
            .socket("destination", T::Latent)
            .socket("source", T::Latent)
            .int("x", 0, 0, MAX_RES, 8)
            .int("y", 0, 0, MAX_RES, 8)
            .boolean("resize_source", false)
            .optional_socket("mask", T::Mask)
            .returns(T::Latent)
            .build(),
    );
    v.push(
        node("SaveLatent", "_for_testing")
            .output_node()
            .socket("samples", T::Latent)
            .string("filename_prefix", "latents/ComfyUI")
            .hidden(Hidden::Prompt)
            .hidden(Hidden::ExtraPngInfo)
            .build(),
    );
    // ComfyUI lists the input directory's `*.latent` files, without upload.
    // No ComboOptions variant says that; this is the nearest (input files).
    v.push(
        node("LoadLatent", "_for_testing")
            .input_image("latent")
            .returns(T::Latent)
            .build()
            .no_upload("latent"),
    );
}
