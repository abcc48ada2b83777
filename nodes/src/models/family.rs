//! Model families as data: one row per family with what the rest of the
//! engine needs to know about it — its latent format, its default model
//! sampling, its text encoders and its native resolution — as ComfyUI's
//! `supported_models.py` and `latent_formats.py` hold them. How a family
//! is recognised from keys and shapes is [`super::detect`]'s job; what it
//! *is* lives here, so adding a family is a module plus a row.

use super::detect::{Family, Heads};

/// A latent space: how a VAE's latent maps into the model's space, and
/// the linear latent → RGB map of ComfyUI's default previewer.
#[derive(Debug, PartialEq)]
pub struct LatentFormat {
    pub name: &'static str,
    pub channels: usize,
    /// `process_in`: `(latent − shift) × scale`; `process_out` inverts it.
    pub scale: f32,
    pub shift: f32,
    /// One `[r, g, b]` row per latent channel.
    pub rgb_factors: &'static [[f32; 3]],
    pub rgb_bias: [f32; 3],
    /// The stem of its TAESD files in `models/vae_approx`
    /// (`{stem}_decoder.*`), where one exists.
    pub taesd: Option<&'static str>,
}

impl LatentFormat {
    /// A VAE latent value in the model's space.
    pub fn process_in(&self, v: f32) -> f32 {
        // Without a shift the product alone, so SD formats round exactly
        // as they always have.
        if self.shift == 0.0 {
            v * self.scale
        } else {
            (v - self.shift) * self.scale
        }
    }

    /// A model-space value back in the VAE's latent space.
    pub fn process_out(&self, v: f32) -> f32 {
        if self.shift == 0.0 {
            v / self.scale
        } else {
            v / self.scale + self.shift
        }
    }
}

/// SD 1.x and 2.x (ComfyUI's `SD15`).
pub static SD15: LatentFormat = LatentFormat {
    name: "SD15",
    taesd: Some("taesd"),
    channels: 4,
    scale: 0.18215,
    shift: 0.0,
    rgb_factors: &[
        [0.3512, 0.2297, 0.3227],
        [0.3250, 0.4974, 0.2350],
        [-0.2829, 0.1762, 0.2721],
        [-0.2120, -0.2616, -0.7177],
    ],
    rgb_bias: [0.0; 3],
};

/// SDXL and its refiner (`SDXL`).
pub static SDXL: LatentFormat = LatentFormat {
    name: "SDXL",
    taesd: Some("taesdxl"),
    channels: 4,
    scale: 0.13025,
    shift: 0.0,
    rgb_factors: &[
        [0.3651, 0.4232, 0.4341],
        [-0.2533, -0.0042, 0.1068],
        [0.1076, 0.1111, -0.0362],
        [-0.3165, -0.2492, -0.2188],
    ],
    rgb_bias: [0.1084, -0.0175, -0.0011],
};

/// SD3 / 3.5 (`SD3`): 16 channels with a shift.
pub static SD3: LatentFormat = LatentFormat {
    name: "SD3",
    taesd: Some("taesd3"),
    channels: 16,
    scale: 1.5305,
    shift: 0.0609,
    rgb_factors: &[
        [-0.0922, -0.0175, 0.0749],
        [0.0311, 0.0633, 0.0954],
        [0.1994, 0.0927, 0.0458],
        [0.0856, 0.0339, 0.0902],
        [0.0587, 0.0272, -0.0496],
        [-0.0006, 0.1104, 0.0309],
        [0.0978, 0.0306, 0.0427],
        [-0.0042, 0.1038, 0.1358],
        [-0.0194, 0.0020, 0.0669],
        [-0.0488, 0.0130, -0.0268],
        [0.0922, 0.0988, 0.0951],
        [-0.0278, 0.0524, -0.0542],
        [0.0332, 0.0456, 0.0895],
        [-0.0069, -0.0030, -0.0810],
        [-0.0596, -0.0465, -0.0293],
        [-0.1448, -0.1463, -0.1189],
    ],
    rgb_bias: [0.2394, 0.2135, 0.1925],
};

/// Flux and Chroma (`Flux`): 16 channels with a shift.
pub static FLUX: LatentFormat = LatentFormat {
    name: "Flux",
    taesd: Some("taef1"),
    channels: 16,
    scale: 0.3611,
    shift: 0.1159,
    rgb_factors: &[
        [-0.0346, 0.0244, 0.0681],
        [0.0034, 0.0210, 0.0687],
        [0.0275, -0.0668, -0.0433],
        [-0.0174, 0.0160, 0.0617],
        [0.0859, 0.0721, 0.0329],
        [0.0004, 0.0383, 0.0115],
        [0.0405, 0.0861, 0.0915],
        [-0.0236, -0.0185, -0.0259],
        [-0.0245, 0.0250, 0.1180],
        [0.1008, 0.0755, -0.0421],
        [-0.0515, 0.0201, 0.0011],
        [0.0428, -0.0012, -0.0036],
        [0.0817, 0.0765, 0.0749],
        [-0.1264, -0.0522, -0.1103],
        [-0.0280, -0.0881, -0.0499],
        [-0.1262, -0.0982, -0.0778],
    ],
    rgb_bias: [-0.0329, -0.0718, -0.0851],
};

/// The model sampling a family's checkpoints get without a
/// ModelSampling* node (ComfyUI's `sampling_settings` and model type).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DefaultSampling {
    /// Discrete ε-prediction on SD's linear β schedule (0.00085–0.012).
    Eps,
    /// ε or v, decided per file (SD 2.x: ComfyUI's weight-statistics rule).
    EpsOrV,
    /// Rectified flow with a time shift (`ModelSamplingDiscreteFlow`).
    Flow { shift: f64, multiplier: f64 },
    /// Flux's resolution-dependent shift (`ModelSamplingFlux`); `shift`
    /// is the base value for the default resolution. (Flux schnell, told
    /// apart by having no guidance embedding, samples as `Flow` with shift
    /// and multiplier 1, as ComfyUI's `FluxSchnell` row says.)
    FluxShift { shift: f64 },
}

/// The text encoders a family conditions on, in ComfyUI's order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TextEncoder {
    /// OpenAI CLIP ViT-L/14's text tower.
    ClipL,
    /// OpenCLIP ViT-H/14 (SD 2.x).
    OpenClipH,
    /// OpenCLIP ViT-bigG/14 (SDXL, SD3).
    OpenClipG,
    T5Xxl,
}

/// How a family runs one of its text encoders (ComfyUI's per-family
/// `SDClipModel` arguments).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TextRule {
    pub encoder: TextEncoder,
    /// The layer read without CLIPSetLastLayer: None for the last layer
    /// (final-normed), or ComfyUI's negative `layer_idx` (-2 is the
    /// penultimate).
    pub default_layer: Option<i64>,
    /// Whether an earlier layer's state still goes through the final
    /// LayerNorm (`layer_norm_hidden_state`).
    pub norm_hidden: bool,
    /// The padding token (`pad_with_end`: the end token 49407, else 0).
    pub pad: u32,
    /// Whether the family reads this encoder's pooled output, and how.
    pub pooled: Pooled,
}

/// How a family reads an encoder's pooled output (the final-normed state
/// at the end token).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pooled {
    /// Unused (SD1's and SDXL's CLIP-L, T5).
    No,
    /// Through the encoder's text projection (OpenCLIP-G/H).
    Projected,
    /// As it is (Flux's CLIP-L: `return_projected_pooled=False`).
    Raw,
}

const END: u32 = 49407;

const fn rule(
    encoder: TextEncoder,
    default_layer: Option<i64>,
    norm_hidden: bool,
    pad: u32,
    pooled: Pooled,
) -> TextRule {
    TextRule {
        encoder,
        default_layer,
        norm_hidden,
        pad,
        pooled,
    }
}

/// SD1's CLIP-L: the last layer, final-normed; padded with the end token.
const SD1_L: TextRule = rule(TextEncoder::ClipL, None, true, END, Pooled::No);
/// SD 2.x's OpenCLIP-H: the penultimate layer, final-normed; padded with 0.
const SD2_H: TextRule = rule(TextEncoder::OpenClipH, Some(-2), true, 0, Pooled::Projected);
/// SDXL's CLIP-L and OpenCLIP-G (also SD3's): the penultimate layer as it
/// is, no final norm; L pads with the end token, G with 0.
const XL_L: TextRule = rule(TextEncoder::ClipL, Some(-2), false, END, Pooled::No);
const XL_G: TextRule = rule(
    TextEncoder::OpenClipG,
    Some(-2),
    false,
    0,
    Pooled::Projected,
);
/// SD3's CLIP-L: as SDXL's, its unprojected pooled output read too.
const SD3_L: TextRule = rule(TextEncoder::ClipL, Some(-2), false, END, Pooled::Raw);
/// Flux's CLIP-L (pooled only) and T5 (last layer; its pad is T5's own).
const FLUX_L: TextRule = rule(TextEncoder::ClipL, None, true, END, Pooled::Raw);
const T5: TextRule = rule(TextEncoder::T5Xxl, None, true, 0, Pooled::No);

/// One family's row.
#[derive(Debug)]
pub struct FamilySpec {
    pub family: Family,
    pub name: &'static str,
    pub latent: &'static LatentFormat,
    pub sampling: DefaultSampling,
    pub text_encoders: &'static [TextRule],
    /// The side of a square image at the family's native resolution.
    pub default_size: u32,
    /// How its UNet splits attention heads (a constant shapes do not
    /// show; unused by DiT families).
    pub heads: Heads,
    /// Whether sdkit can build its models today.
    pub supported: bool,
}

/// Every family sdkit recognises.
pub static FAMILIES: [FamilySpec; 7] = [
    FamilySpec {
        family: Family::Sd1,
        name: "Stable Diffusion 1.x",
        latent: &SD15,
        sampling: DefaultSampling::Eps,
        text_encoders: &[SD1_L],
        default_size: 512,
        heads: Heads::Count(8),
        supported: true,
    },
    FamilySpec {
        family: Family::Sd2,
        name: "Stable Diffusion 2.x",
        latent: &SD15,
        sampling: DefaultSampling::EpsOrV,
        text_encoders: &[SD2_H],
        default_size: 768,
        heads: Heads::Width(64),
        supported: true,
    },
    FamilySpec {
        family: Family::Sdxl,
        name: "Stable Diffusion XL",
        latent: &SDXL,
        sampling: DefaultSampling::Eps,
        text_encoders: &[XL_L, XL_G],
        default_size: 1024,
        heads: Heads::Width(64),
        supported: true,
    },
    FamilySpec {
        family: Family::SdxlRefiner,
        name: "Stable Diffusion XL refiner",
        latent: &SDXL,
        sampling: DefaultSampling::Eps,
        text_encoders: &[XL_G],
        default_size: 1024,
        heads: Heads::Width(64),
        supported: true,
    },
    FamilySpec {
        family: Family::Sd3,
        name: "Stable Diffusion 3",
        latent: &SD3,
        sampling: DefaultSampling::Flow {
            shift: 3.0,
            multiplier: 1000.0,
        },
        text_encoders: &[SD3_L, XL_G, T5],
        default_size: 1024,
        heads: Heads::Width(64),
        supported: true,
    },
    FamilySpec {
        family: Family::Flux,
        name: "Flux",
        latent: &FLUX,
        sampling: DefaultSampling::FluxShift { shift: 1.15 },
        text_encoders: &[FLUX_L, T5],
        default_size: 1024,
        heads: Heads::Width(64),
        supported: true,
    },
    FamilySpec {
        family: Family::Chroma,
        name: "Chroma",
        latent: &FLUX,
        // ComfyUI's model type FLUX: ModelSamplingFlux's default shift
        // (its `multiplier` setting is unused by that sampling).
        sampling: DefaultSampling::FluxShift { shift: 1.15 },
        text_encoders: &[T5],
        default_size: 1024,
        heads: Heads::Width(64),
        supported: true,
    },
];

impl FamilySpec {
    /// The rule for one of this family's text encoders.
    pub fn text_rule(&self, encoder: TextEncoder) -> Option<TextRule> {
        self.text_encoders
            .iter()
            .copied()
            .find(|r| r.encoder == encoder)
    }
}

impl Family {
    /// The length T5 prompts are padded to (ComfyUI's `min_length` of the
    /// family's T5 tokenizer: Flux 256, SD3 77, Chroma 1).
    pub fn t5_min_length(self) -> usize {
        match self {
            Family::Flux => 256,
            Family::Chroma => 1,
            _ => 77,
        }
    }

    /// This family's row of [`FAMILIES`].
    pub fn spec(self) -> &'static FamilySpec {
        // Every variant has exactly one row (checked by a test), so the
        // fallback is never taken.
        FAMILIES
            .iter()
            .find(|s| s.family == self)
            .unwrap_or(&FAMILIES[0])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_has_one_consistent_row() {
        for f in [
            Family::Sd1,
            Family::Sd2,
            Family::Sdxl,
            Family::SdxlRefiner,
            Family::Sd3,
            Family::Flux,
            Family::Chroma,
        ] {
            let rows = FAMILIES.iter().filter(|s| s.family == f).count();
            assert_eq!(rows, 1, "{f:?}");
            let s = f.spec();
            assert_eq!(s.family, f);
            assert_eq!(s.latent.rgb_factors.len(), s.latent.channels, "{f:?}");
            assert!(!s.text_encoders.is_empty());
        }
    }

    #[test]
    fn latent_maps_round_trip() {
        for fmt in [&SD15, &SDXL, &SD3, &FLUX] {
            for v in [-2.5f32, 0.0, 0.7, 3.0] {
                let back = fmt.process_out(fmt.process_in(v));
                assert!((back - v).abs() < 1e-5, "{} {v} → {back}", fmt.name);
            }
        }
        // SD formats: exactly the plain product and quotient.
        assert_eq!(SD15.process_in(1.5), 1.5 * 0.18215);
        assert_eq!(SD15.process_out(1.5), 1.5 / 0.18215);
        assert_eq!(FLUX.process_in(1.0), (1.0 - 0.1159) * 0.3611);
    }
}
