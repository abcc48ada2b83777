//! sdkit-nodes: every node type sdkit knows.
//!
//! [`library`] returns the registry of node specs (ComfyUI's core node
//! types, by their ComfyUI names) with the implementations that exist so
//! far. Types without an implementation validate, and running one fails
//! with "not implemented yet".

pub mod adapters;
pub mod clip_tokenizer;
pub mod diffusion;
pub mod image;
pub mod image_stages;
pub mod imagefile;
pub mod imageops;
pub mod io;
pub mod latent;
pub mod models;
pub mod noise;
pub mod sampling;
pub mod specs;
pub mod t5_tokenizer;

use sdkit_engine::NodeLibrary;
use sdkit_schema::Registry;

/// All node specs and implementations.
pub fn library() -> NodeLibrary {
    let mut registry = Registry::new();
    for spec in specs::core_specs() {
        registry.insert(spec);
    }
    let mut lib = NodeLibrary::new(registry);
    lib.implement("LoadImage", io::LoadImage);
    lib.implement("SaveImage", io::SaveImage);
    lib.implement("PreviewImage", io::PreviewImage);
    lib.implement("EmptyLatentImage", latent::EmptyLatentImage);
    lib.implement("SaveLatent", latent::SaveLatent);
    lib.implement("LoadLatent", latent::LoadLatent);
    lib.implement(
        "CheckpointLoaderSimple",
        diffusion::loaders::CheckpointLoaderSimple,
    );
    lib.implement("VAELoader", diffusion::loaders::VaeLoader);
    lib.implement("UNETLoader", diffusion::loaders::UnetLoader);
    lib.implement("LoraLoader", adapters::LoraLoader);
    lib.implement("LoraLoaderModelOnly", adapters::LoraLoaderModelOnly);
    {
        use diffusion::loaders::ClipFilesLoader as C;
        lib.implement("CLIPLoader", C::core(1));
        lib.implement("DualCLIPLoader", C::core(2));
        lib.implement("TripleCLIPLoader", C::core(3));
        lib.implement("CLIPLoaderGGUF", C::gguf(1));
        lib.implement("DualCLIPLoaderGGUF", C::gguf(2));
        lib.implement("TripleCLIPLoaderGGUF", C::gguf(3));
    }
    lib.implement(
        "CLIPSetLastLayer",
        diffusion::conditioning::ClipSetLastLayer,
    );
    lib.implement("CLIPTextEncode", diffusion::conditioning::ClipTextEncode);
    {
        use diffusion::cond_ops::*;
        lib.implement("ConditioningCombine", ConditioningCombine);
        lib.implement("ConditioningAverage", ConditioningAverage);
        lib.implement("ConditioningConcat", ConditioningConcat);
        lib.implement("ConditioningSetArea", ConditioningSetArea);
        lib.implement(
            "ConditioningSetAreaPercentage",
            ConditioningSetAreaPercentage,
        );
        lib.implement("ConditioningSetAreaStrength", ConditioningSetAreaStrength);
        lib.implement("ConditioningSetMask", ConditioningSetMask);
        lib.implement("ConditioningZeroOut", ConditioningZeroOut);
        lib.implement("FluxGuidance", FluxGuidance);
        lib.implement("FluxDisableGuidance", FluxDisableGuidance);
        lib.implement("ReferenceLatent", ReferenceLatent);
        lib.implement(
            "FluxKontextMultiReferenceLatentMethod",
            FluxKontextMultiReferenceLatentMethod,
        );
        lib.implement("ConditioningSetTimestepRange", ConditioningSetTimestepRange);
    }
    lib.implement(
        "CLIPTextEncodeFlux",
        diffusion::conditioning::ClipTextEncodeFlux,
    );
    lib.implement("EmptySD3LatentImage", latent::EmptySd3LatentImage);
    lib.implement(
        "CLIPTextEncodeSD3",
        diffusion::conditioning::ClipTextEncodeSd3,
    );
    lib.implement("UnetLoaderGGUF", diffusion::loaders::UnetLoaderGguf);
    lib.implement("UnetLoaderGGUFAdvanced", diffusion::loaders::UnetLoaderGguf);
    lib.implement(
        "T5TokenizerOptions",
        diffusion::conditioning::T5TokenizerOptions,
    );
    lib.implement(
        "CLIPTextEncodeSDXL",
        diffusion::conditioning::ClipTextEncodeSdxl,
    );
    lib.implement(
        "CLIPTextEncodeSDXLRefiner",
        diffusion::conditioning::ClipTextEncodeSdxlRefiner,
    );
    lib.implement("KSampler", diffusion::ksampler::KSampler);
    lib.implement("KSamplerAdvanced", diffusion::ksampler::KSamplerAdvanced);
    lib.implement(
        "ModelSamplingDiscrete",
        diffusion::ksampler::ModelSamplingDiscrete,
    );
    lib.implement("ModelSamplingSD3", diffusion::ksampler::ModelSamplingSd3);
    lib.implement(
        "ModelSamplingAuraFlow",
        diffusion::ksampler::ModelSamplingAuraFlow,
    );
    lib.implement("ModelSamplingFlux", diffusion::ksampler::ModelSamplingFlux);
    {
        use diffusion::custom::{dpmpp_2m_sde_name, er_sde_name, SamplerPreset, ETA_NOISE};
        let presets: [(&str, SamplerPreset); 8] = [
            (
                "SamplerEulerAncestral",
                SamplerPreset {
                    name: |_| Ok("euler_ancestral"),
                    defaults: ETA_NOISE,
                },
            ),
            (
                "SamplerEulerAncestralCFGPP",
                SamplerPreset {
                    name: |_| Ok("euler_ancestral_cfg_pp"),
                    defaults: ETA_NOISE,
                },
            ),
            (
                "SamplerDPMPP_2S_Ancestral",
                SamplerPreset {
                    name: |_| Ok("dpmpp_2s_ancestral"),
                    defaults: ETA_NOISE,
                },
            ),
            (
                "SamplerDPMPP_2M_SDE",
                SamplerPreset {
                    name: dpmpp_2m_sde_name,
                    defaults: ETA_NOISE,
                },
            ),
            (
                "SamplerDPMPP_3M_SDE",
                SamplerPreset {
                    name: |_| Ok("dpmpp_3m_sde"),
                    defaults: ETA_NOISE,
                },
            ),
            (
                "SamplerDPMPP_SDE",
                SamplerPreset {
                    name: |_| Ok("dpmpp_sde"),
                    defaults: &[("eta", 1.0), ("s_noise", 1.0), ("r", 0.5)],
                },
            ),
            (
                "SamplerLMS",
                SamplerPreset {
                    name: |_| Ok("lms"),
                    defaults: &[("order", 4.0)],
                },
            ),
            (
                "SamplerER_SDE",
                SamplerPreset {
                    name: er_sde_name,
                    defaults: &[("max_stage", 3.0), ("s_noise", 1.0)],
                },
            ),
        ];
        for (name, preset) in presets {
            lib.implement(name, preset);
        }
    }
    {
        use diffusion::vision::*;
        lib.implement("CLIPVisionLoader", ClipVisionLoader);
        lib.implement("CLIPVisionEncode", ClipVisionEncode);
        lib.implement("StyleModelLoader", StyleModelLoader);
        lib.implement("StyleModelApply", StyleModelApply);
    }
    {
        use diffusion::slg::*;
        lib.implement("SkipLayerGuidanceDiT", SkipLayerGuidanceDit);
        lib.implement("SkipLayerGuidanceDiTSimple", SkipLayerGuidanceDitSimple);
        lib.implement("SkipLayerGuidanceSD3", SkipLayerGuidanceSd3);
    }
    lib.implement("KSamplerSelect", diffusion::custom::KSamplerSelect);
    lib.implement("BasicScheduler", diffusion::custom::BasicScheduler);
    lib.implement("KarrasScheduler", diffusion::custom::KarrasScheduler);
    lib.implement(
        "ExponentialScheduler",
        diffusion::custom::ExponentialScheduler,
    );
    lib.implement("SplitSigmas", diffusion::custom::SplitSigmas);
    lib.implement("FlipSigmas", diffusion::custom::FlipSigmas);
    lib.implement("SetFirstSigma", diffusion::custom::SetFirstSigma);
    lib.implement("SamplerCustom", diffusion::custom::SamplerCustom);
    lib.implement(
        "SamplerCustomAdvanced",
        diffusion::custom::SamplerCustomAdvanced,
    );
    lib.implement("CFGGuider", diffusion::custom::CfgGuider);
    lib.implement("BasicGuider", diffusion::custom::BasicGuider);
    lib.implement("RandomNoise", diffusion::custom::RandomNoise);
    lib.implement("DisableNoise", diffusion::custom::DisableNoise);
    lib.implement("SplitSigmasDenoise", diffusion::custom::SplitSigmasDenoise);
    lib.implement(
        "SamplingPercentToSigma",
        diffusion::custom::SamplingPercentToSigma,
    );
    lib.implement(
        "AlignYourStepsScheduler",
        diffusion::custom::AlignYourStepsScheduler,
    );
    lib.implement(
        "PolyexponentialScheduler",
        diffusion::custom::PolyexponentialScheduler,
    );
    lib.implement("LaplaceScheduler", diffusion::custom::LaplaceScheduler);
    lib.implement("VPScheduler", diffusion::custom::VpScheduler);
    lib.implement(
        "BetaSamplingScheduler",
        diffusion::custom::BetaSamplingScheduler,
    );
    lib.implement("SDTurboScheduler", diffusion::custom::SdTurboScheduler);
    lib.implement("VAEDecode", diffusion::vae::VaeDecode);
    lib.implement("VAEEncode", diffusion::vae::VaeEncode);
    lib.implement("ControlNetLoader", diffusion::control::ControlNetLoader);
    lib.implement(
        "DiffControlNetLoader",
        diffusion::control::DiffControlNetLoader,
    );
    lib.implement("ControlNetApply", diffusion::control::ControlNetApply);
    lib.implement(
        "SetUnionControlNetType",
        diffusion::control::SetUnionControlNetType,
    );
    lib.implement(
        "ControlNetApplyAdvanced",
        diffusion::control::ControlNetApplyAdvanced,
    );
    lib.implement(
        "ControlNetApplySD3",
        diffusion::control::ControlNetApplyAdvanced,
    );
    lib.implement(
        "VAEEncodeForInpaint",
        diffusion::inpaint::VaeEncodeForInpaint,
    );
    lib.implement("SetLatentNoiseMask", diffusion::inpaint::SetLatentNoiseMask);
    lib.implement(
        "InpaintModelConditioning",
        diffusion::inpaint::InpaintModelConditioning,
    );
    lib.implement(
        "InstructPixToPixConditioning",
        diffusion::inpaint::InstructPixToPixConditioning,
    );
    lib.implement(
        "DifferentialDiffusion",
        diffusion::inpaint::DifferentialDiffusion,
    );
    lib.implement("VAEDecodeTiled", diffusion::vae::VaeDecodeTiled);
    lib.implement("VAEEncodeTiled", diffusion::vae::VaeEncodeTiled);
    lib.implement("ImageScale", image::ImageScale);
    lib.implement("ImagePadForOutpaint", image::ImagePadForOutpaint);
    lib.implement("ImageScaleToTotalPixels", image::ImageScaleToTotalPixels);
    lib.implement("ImageFlip", image::ImageFlip);
    lib.implement("ImageStitch", image::ImageStitch);
    lib.implement("GetImageSize", image::GetImageSize);
    lib.implement("ImageBlend", image::ImageBlend);
    lib.implement("FeatherMask", image::FeatherMask);
    lib.implement("CropMask", image::CropMask);
    lib.implement("MaskComposite", image::MaskComposite);
    lib.implement("ResizeAndPadImage", image::ResizeAndPadImage);
    lib.implement("ImageRotate", image::ImageRotate);
    lib.implement("ImageCompositeMasked", image::ImageCompositeMasked);
    lib.implement("RepeatImageBatch", image::RepeatImageBatch);
    lib.implement("ImageFromBatch", image::ImageFromBatch);
    lib.implement("ImageColorToMask", image::ImageColorToMask);
    lib.implement("ImageScaleToMaxDimension", image::ImageScaleToMaxDimension);
    {
        use latent::*;
        lib.implement("LatentComposite", LatentComposite);
        lib.implement("LatentCompositeMasked", LatentCompositeMasked);
        lib.implement("LatentBlend", LatentBlend);
        lib.implement("LatentFromBatch", LatentFromBatch);
        lib.implement("RepeatLatentBatch", RepeatLatentBatch);
        lib.implement("LatentCrop", LatentCrop);
        lib.implement("LatentFlip", LatentFlip);
        lib.implement("LatentRotate", LatentRotate);
    }
    lib.implement("GrowMask", image::GrowMask);
    lib.implement("ThresholdMask", image::ThresholdMask);
    lib.implement("LatentUpscale", latent::LatentUpscale);
    lib.implement("LatentUpscaleBy", latent::LatentUpscaleBy);
    lib.implement("FluxKontextImageScale", image::FluxKontextImageScale);
    lib.implement("ImageScaleBy", image::ImageScaleBy);
    lib.implement("ImageInvert", image::ImageInvert);
    lib.implement("Canny", image::Canny);
    lib.implement("ImageCrop", image::ImageCrop);
    lib.implement("ImageBlur", image::ImageBlur);
    lib.implement("ImageSharpen", image::ImageSharpen);
    lib.implement("ImageBatch", image::ImageBatch);
    lib.implement("EmptyImage", image::EmptyImage);
    lib.implement("ImageToMask", image::ImageToMask);
    lib.implement("MaskToImage", image::MaskToImage);
    lib.implement("SolidMask", image::SolidMask);
    lib.implement("InvertMask", image::InvertMask);
    lib
}
