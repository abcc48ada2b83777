//! Image and mask nodes: nodes.py, comfy_extras/nodes_images.py,
//! nodes_post_processing.py and nodes_mask.py.

use super::{CROP, FLIPS, MAX_RES, ROTATIONS};
use sdkit_schema::spec::{node, Hidden, NodeSpec, SocketType as T};

const IMAGE_UPSCALE: &[&str] = &["nearest-exact", "bilinear", "area", "bicubic", "lanczos"];

const PREFIX_TIP: &str = "The prefix for the file to save. This may include formatting information such as %date:yyyy-MM-dd% or %Empty Latent Image.width% to include values from nodes.";
/// SaveImage's DESCRIPTION, inherited by PreviewImage and MaskPreview.
const SAVE_DESC: &str = "Saves the input images to your ComfyUI output directory.";

pub(super) fn image(v: &mut Vec<NodeSpec>) {
    v.push(
        node("SaveImage", "image")
            .display("Save Image")
            .description(SAVE_DESC)
            .output_node()
            .socket("images", T::Image)
            .tip("The images to save.")
            .string("filename_prefix", "ComfyUI")
            .tip(PREFIX_TIP)
            .hidden(Hidden::Prompt)
            .hidden(Hidden::ExtraPngInfo)
            .build(),
    );
    v.push(
        node("PreviewImage", "image")
            .display("Preview Image")
            .description(SAVE_DESC)
            .output_node()
            .socket("images", T::Image)
            .hidden(Hidden::Prompt)
            .hidden(Hidden::ExtraPngInfo)
            .build(),
    );
    v.push(
        node("LoadImage", "image")
            .display("Load Image")
            .input_image("image")
            .returns(T::Image)
            .returns(T::Mask)
            .build(),
    );
    v.push(
        node("LoadImageMask", "mask")
            .display("Load Image (as Mask)")
            .input_image("image")
            .combo("channel", &["alpha", "red", "green", "blue"])
            .returns(T::Mask)
            .build(),
    );
    v.push(
        node("ImageScale", "image/upscaling")
            .display("Upscale Image")
            .socket("image", T::Image)
            .combo("upscale_method", IMAGE_UPSCALE)
            .int("width", 512, 0, MAX_RES, 1)
            .int("height", 512, 0, MAX_RES, 1)
            .combo("crop", CROP)
            .returns(T::Image)
            .build(),
    );
    v.push(
        node("ImageScaleBy", "image/upscaling")
            .display("Upscale Image By")
            .socket("image", T::Image)
            .combo("upscale_method", IMAGE_UPSCALE)
            .float("scale_by", 1.0, 0.01, 8.0, 0.01)
            .returns(T::Image)
            .build(),
    );
    v.push(
        node("Canny", "image/preprocessors")
            .socket("image", T::Image)
            .float("low_threshold", 0.4, 0.01, 0.99, 0.01)
            .float("high_threshold", 0.8, 0.01, 0.99, 0.01)
            .returns(T::Image)
            .build(),
    );
    v.push(
        node("ImageInvert", "image")
            .display("Invert Image")
            .socket("image", T::Image)
            .returns(T::Image)
            .build(),
    );
    v.push(
        node("ImageBatch", "image")
            .display("Batch Images")
            .socket("image1", T::Image)
            .socket("image2", T::Image)
            .returns(T::Image)
            .build(),
    );
    v.push(
        node("ImagePadForOutpaint", "image")
            .display("Pad Image for Outpainting")
            .socket("image", T::Image)
            .int("left", 0, 0, MAX_RES, 8)
            .int("top", 0, 0, MAX_RES, 8)
            .int("right", 0, 0, MAX_RES, 8)
            .int("bottom", 0, 0, MAX_RES, 8)
            .int("feathering", 40, 0, MAX_RES, 1)
            .returns(T::Image)
            .returns(T::Mask)
            .build(),
    );
    // "color" is shown as a colour picker (display: "color") in ComfyUI.
    v.push(
        node("EmptyImage", "image")
            .int("width", 512, 1, MAX_RES, 1)
            .int("height", 512, 1, MAX_RES, 1)
            .int("batch_size", 1, 1, 4096, 1)
            .int("color", 0, 0, 0xFFFFFF, 1)
            .returns(T::Image)
            .build(),
    );

    // comfy_extras/nodes_images.py
    v.push(
        node("ImageCrop", "image/transform")
            .display("Image Crop")
            .socket("image", T::Image)
            .int("width", 512, 1, MAX_RES, 1)
            .int("height", 512, 1, MAX_RES, 1)
            .int("x", 0, 0, MAX_RES, 1)
            .int("y", 0, 0, MAX_RES, 1)
            .returns(T::Image)
            .build(),
    );
    v.push(
        node("RepeatImageBatch", "image/batch")
            .socket("image", T::Image)
            .int("amount", 1, 1, 4096, 1)
            .returns(T::Image)
            .build(),
    );
    v.push(
        node("ImageFromBatch", "image/batch")
            .socket("image", T::Image)
            .int("batch_index", 0, 0, 4095, 1)
            .int("length", 1, 1, 4096, 1)
            .returns(T::Image)
            .build(),
    );
    v.push(
        node("ImageAddNoise", "image")
            .socket("image", T::Image)
            .seed("seed")
            .tip("The random seed used for creating the noise.")
            .float("strength", 0.5, 0.0, 1.0, 0.01)
            .returns(T::Image)
            .build(),
    );
    v.push(
        node("SaveAnimatedWEBP", "image/animation")
            .output_node()
            .socket("images", T::Image)
            .string("filename_prefix", "ComfyUI")
            .float("fps", 6.0, 0.01, 1000.0, 0.01)
            .boolean("lossless", true)
            .int("quality", 80, 0, 100, 1)
            .combo("method", &["default", "fastest", "slowest"])
            .hidden(Hidden::Prompt)
            .hidden(Hidden::ExtraPngInfo)
            .build(),
    );
    v.push(
        node("SaveAnimatedPNG", "image/animation")
            .output_node()
            .socket("images", T::Image)
            .string("filename_prefix", "ComfyUI")
            .float("fps", 6.0, 0.01, 1000.0, 0.01)
            .int("compress_level", 4, 0, 9, 1)
            .hidden(Hidden::Prompt)
            .hidden(Hidden::ExtraPngInfo)
            .build(),
    );
    v.push(node("ImageStitch", "image/transform").display("Image Stitch")
        .description("\nStitches image2 to image1 in the specified direction.\nIf image2 is not provided, returns image1 unchanged.\nOptional spacing can be added between images.\n")
        .socket("image1", T::Image)
        .combo("direction", &["right", "down", "left", "up"]).combo_default("right")
        .boolean("match_image_size", true)
        .int("spacing_width", 0, 0, 1024, 2)
        .combo("spacing_color", &["white", "black", "red", "green", "blue"]).combo_default("white")
        .optional_socket("image2", T::Image)
        .returns(T::Image).build());
    v.push(
        node("ResizeAndPadImage", "image/transform")
            .socket("image", T::Image)
            .int("target_width", 512, 1, MAX_RES, 1)
            .int("target_height", 512, 1, MAX_RES, 1)
            .combo("padding_color", &["white", "black"])
            .combo(
                "interpolation",
                &["area", "bicubic", "nearest-exact", "bilinear", "lanczos"],
            )
            .returns(T::Image)
            .build(),
    );
    v.push(
        node("GetImageSize", "image")
            .display("Get Image Size")
            .description("Returns width and height of the image, and passes it through unchanged.")
            .socket("image", T::Image)
            .hidden(Hidden::UniqueId)
            .output("width", T::Int)
            .output("height", T::Int)
            .output("batch_size", T::Int)
            .build(),
    );
    v.push(
        node("ImageRotate", "image/transform")
            .socket("image", T::Image)
            .combo("rotation", ROTATIONS)
            .returns(T::Image)
            .build(),
    );
    v.push(
        node("ImageFlip", "image/transform")
            .socket("image", T::Image)
            .combo("flip_method", FLIPS)
            .returns(T::Image)
            .build(),
    );
    // ComfyUI's list really does name "bilinear" twice.
    v.push(
        node("ImageScaleToMaxDimension", "image/upscaling")
            .socket("image", T::Image)
            .combo(
                "upscale_method",
                &[
                    "area",
                    "lanczos",
                    "bilinear",
                    "nearest-exact",
                    "bilinear",
                    "bicubic",
                ],
            )
            .int("largest_size", 512, 0, MAX_RES, 1)
            .returns(T::Image)
            .build(),
    );

    // comfy_extras/nodes_post_processing.py (io.Schema nodes; their display
    // names come from nodes.py's NODE_DISPLAY_NAME_MAPPINGS)
    v.push(
        node("ImageBlend", "image/postprocessing")
            .display("Image Blend")
            .socket("image1", T::Image)
            .socket("image2", T::Image)
            .float("blend_factor", 0.5, 0.0, 1.0, 0.01)
            .combo(
                "blend_mode",
                &[
                    "normal",
                    "multiply",
                    "screen",
                    "overlay",
                    "soft_light",
                    "difference",
                ],
            )
            .returns(T::Image)
            .build(),
    );
    v.push(
        node("ImageBlur", "image/postprocessing")
            .display("Image Blur")
            .socket("image", T::Image)
            .int("blur_radius", 1, 1, 31, 1)
            .float("sigma", 1.0, 0.1, 10.0, 0.1)
            .returns(T::Image)
            .build(),
    );
    v.push(
        node("ImageQuantize", "image/postprocessing")
            .display("Image Quantize")
            .socket("image", T::Image)
            .int("colors", 256, 1, 256, 1)
            .combo(
                "dither",
                &[
                    "none",
                    "floyd-steinberg",
                    "bayer-2",
                    "bayer-4",
                    "bayer-8",
                    "bayer-16",
                ],
            )
            .returns(T::Image)
            .build(),
    );
    v.push(
        node("ImageSharpen", "image/postprocessing")
            .display("Image Sharpen")
            .socket("image", T::Image)
            .int("sharpen_radius", 1, 1, 31, 1)
            .float("sigma", 1.0, 0.1, 10.0, 0.01)
            .float("alpha", 1.0, 0.0, 5.0, 0.01)
            .returns(T::Image)
            .build(),
    );
    v.push(
        node("ImageScaleToTotalPixels", "image/upscaling")
            .display("Scale Image to Total Pixels")
            .socket("image", T::Image)
            .combo("upscale_method", IMAGE_UPSCALE)
            .float("megapixels", 1.0, 0.01, 16.0, 0.01)
            .returns(T::Image)
            .build(),
    );
}

// -------------------------------------------------------------------- mask

pub(super) fn mask(v: &mut Vec<NodeSpec>) {
    v.push(
        node("ImageCompositeMasked", "image")
            .socket("destination", T::Image)
            .socket("source", T::Image)
            .int("x", 0, 0, MAX_RES, 1)
            .int("y", 0, 0, MAX_RES, 1)
            .boolean("resize_source", false)
            .optional_socket("mask", T::Mask)
            .returns(T::Image)
            .build(),
    );
    v.push(
        node("MaskToImage", "mask")
            .display("Convert Mask to Image")
            .socket("mask", T::Mask)
            .returns(T::Image)
            .build(),
    );
    v.push(
        node("ImageToMask", "mask")
            .display("Convert Image to Mask")
            .socket("image", T::Image)
            .combo("channel", &["red", "green", "blue", "alpha"])
            .returns(T::Mask)
            .build(),
    );
    v.push(
        node("ImageColorToMask", "mask")
            .socket("image", T::Image)
            .int("color", 0, 0, 0xFFFFFF, 1)
            .returns(T::Mask)
            .build(),
    );
    v.push(
        node("SolidMask", "mask")
            .float("value", 1.0, 0.0, 1.0, 0.01)
            .int("width", 512, 1, MAX_RES, 1)
            .int("height", 512, 1, MAX_RES, 1)
            .returns(T::Mask)
            .build(),
    );
    v.push(
        node("InvertMask", "mask")
            .socket("mask", T::Mask)
            .returns(T::Mask)
            .build(),
    );
    v.push(
        node("CropMask", "mask")
            .socket("mask", T::Mask)
            .int("x", 0, 0, MAX_RES, 1)
            .int("y", 0, 0, MAX_RES, 1)
            .int("width", 512, 1, MAX_RES, 1)
            .int("height", 512, 1, MAX_RES, 1)
            .returns(T::Mask)
            .build(),
    );
    v.push(
        node("MaskComposite", "mask")
            .socket("destination", T::Mask)
            .socket("source", T::Mask)
            .int("x", 0, 0, MAX_RES, 1)
            .int("y", 0, 0, MAX_RES, 1)
            .combo(
                "operation",
                &["multiply", "add", "subtract", "and", "or", "xor"],
            )
            .returns(T::Mask)
            .build(),
    );
    v.push(
        node("FeatherMask", "mask")
            .socket("mask", T::Mask)
            .int("left", 0, 0, MAX_RES, 1)
            .int("top", 0, 0, MAX_RES, 1)
            .int("right", 0, 0, MAX_RES, 1)
            .int("bottom", 0, 0, MAX_RES, 1)
            .returns(T::Mask)
            .build(),
    );
    v.push(
        node("GrowMask", "mask")
            .socket("mask", T::Mask)
            .int("expand", 0, -MAX_RES, MAX_RES, 1)
            .boolean("tapered_corners", true)
            .returns(T::Mask)
            .build(),
    );
    v.push(
        node("ThresholdMask", "mask")
            .socket("mask", T::Mask)
            .float("value", 0.5, 0.0, 1.0, 0.01)
            .returns(T::Mask)
            .build(),
    );
    // A SaveImage subclass: inherits OUTPUT_NODE and DESCRIPTION.
    v.push(
        node("MaskPreview", "mask")
            .description(SAVE_DESC)
            .output_node()
            .socket("mask", T::Mask)
            .hidden(Hidden::Prompt)
            .hidden(Hidden::ExtraPngInfo)
            .build(),
    );
}
