//! Schemas (not execution) of ComfyUI's core node types.
//!
//! Transcribed from ComfyUI's `nodes.py` and `comfy_extras/` (`nodes_images`,
//! `nodes_mask`, `nodes_post_processing`, `nodes_custom_sampler`): the same
//! type names, input names and order, defaults, ranges, combo options,
//! outputs, categories and display names, so that ComfyUI workflows validate
//! here exactly as they do there.
//!
//! One submodule per menu group: `sampling` (KSampler, KSamplerAdvanced and
//! the custom-sampling nodes), `loaders`, `conditioning`, `latent`, `image`
//! (image and mask nodes).

use sdkit_schema::spec::{InputKind, NodeSpec};

mod conditioning;
mod image;
mod latent;
mod loaders;
mod sampling;

/// ComfyUI's `MAX_RESOLUTION`.
const MAX_RES: i128 = 16384;

/// `comfy.samplers.KSampler.SAMPLERS` (`KSAMPLER_NAMES` + ddim, uni_pc, uni_pc_bh2).
pub const SAMPLERS: &[&str] = &[
    "euler",
    "euler_cfg_pp",
    "euler_ancestral",
    "euler_ancestral_cfg_pp",
    "heun",
    "heunpp2",
    "dpm_2",
    "dpm_2_ancestral",
    "lms",
    "dpm_fast",
    "dpm_adaptive",
    "dpmpp_2s_ancestral",
    "dpmpp_2s_ancestral_cfg_pp",
    "dpmpp_sde",
    "dpmpp_sde_gpu",
    "dpmpp_2m",
    "dpmpp_2m_cfg_pp",
    "dpmpp_2m_sde",
    "dpmpp_2m_sde_gpu",
    "dpmpp_2m_sde_heun",
    "dpmpp_2m_sde_heun_gpu",
    "dpmpp_3m_sde",
    "dpmpp_3m_sde_gpu",
    "ddpm",
    "lcm",
    "ipndm",
    "ipndm_v",
    "deis",
    "res_multistep",
    "res_multistep_cfg_pp",
    "res_multistep_ancestral",
    "res_multistep_ancestral_cfg_pp",
    "gradient_estimation",
    "gradient_estimation_cfg_pp",
    "er_sde",
    "seeds_2",
    "seeds_3",
    "sa_solver",
    "sa_solver_pece",
    "ddim",
    "uni_pc",
    "uni_pc_bh2",
];

/// `comfy.samplers.KSampler.SCHEDULERS` (`SCHEDULER_NAMES`).
pub const SCHEDULERS: &[&str] = &[
    "simple",
    "sgm_uniform",
    "karras",
    "exponential",
    "ddim_uniform",
    "beta",
    "normal",
    "linear_quadratic",
    "kl_optimal",
];

const CROP: &[&str] = &["disabled", "center"];
const ROTATIONS: &[&str] = &["none", "90 degrees", "180 degrees", "270 degrees"];
const FLIPS: &[&str] = &["x-axis: vertically", "y-axis: horizontally"];

/// What the builder cannot say, applied to a finished spec.
trait Finish {
    /// ComfyUI's OUTPUT_TOOLTIPS, by output index.
    fn out_tips(self, tips: &[&str]) -> NodeSpec;
    /// Turns an upload combo into a plain combo over input-directory files.
    fn no_upload(self, input: &str) -> NodeSpec;
}

impl Finish for NodeSpec {
    fn out_tips(mut self, tips: &[&str]) -> NodeSpec {
        for (out, tip) in self.outputs.iter_mut().zip(tips) {
            out.tooltip = Some((*tip).to_string());
        }
        self
    }

    fn no_upload(mut self, input: &str) -> NodeSpec {
        for i in self.inputs.iter_mut().filter(|i| i.name == input) {
            if let InputKind::Combo { image_upload, .. } = &mut i.kind {
                *image_upload = false;
            }
        }
        self
    }
}

/// Every core node schema, grouped as ComfyUI's menus group them.
pub fn core_specs() -> Vec<NodeSpec> {
    let mut v = Vec::new();
    sampling::sampling(&mut v);
    loaders::loaders(&mut v);
    conditioning::conditioning(&mut v);
    latent::latent(&mut v);
    image::image(&mut v);
    image::mask(&mut v);
    sampling::custom_sampling(&mut v);
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use sdkit_schema::spec::{ComboOptions, Hidden};
    use std::collections::HashSet;

    #[test]
    fn node_and_input_names_are_unique() {
        let specs = core_specs();
        let mut names = HashSet::new();
        for s in &specs {
            assert!(names.insert(s.name.as_str()), "duplicate node {}", s.name);
            let mut inputs = HashSet::new();
            for i in &s.inputs {
                assert!(
                    inputs.insert(i.name.as_str()),
                    "{}: duplicate input {}",
                    s.name,
                    i.name
                );
            }
        }
    }

    #[test]
    fn seeds_are_u64_ranged() {
        let mut seen = 0;
        for s in core_specs() {
            for i in &s.inputs {
                let is_seed_name = i.name == "seed" || i.name == "noise_seed";
                match &i.kind {
                    InputKind::Int {
                        default,
                        min,
                        max,
                        step,
                        control_after_generate,
                    } => {
                        if is_seed_name || *control_after_generate {
                            assert!(
                                *control_after_generate,
                                "{}.{} lacks control",
                                s.name, i.name
                            );
                            assert_eq!((*default, *min, *step), (0, 0, 1), "{}.{}", s.name, i.name);
                            assert_eq!(*max, u64::MAX as i128, "{}.{}", s.name, i.name);
                            seen += 1;
                        }
                    }
                    _ => assert!(!is_seed_name, "{}.{} is not an INT", s.name, i.name),
                }
            }
        }
        // KSampler, KSamplerAdvanced, ImageAddNoise, SamplerCustom, RandomNoise.
        assert_eq!(seen, 5);
    }

    #[test]
    fn ksampler_input_order() {
        let specs = core_specs();
        let ks = specs
            .iter()
            .find(|s| s.name == "KSampler")
            .expect("KSampler");
        let names: Vec<&str> = ks.inputs.iter().map(|i| i.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "model",
                "seed",
                "steps",
                "cfg",
                "sampler_name",
                "scheduler",
                "positive",
                "negative",
                "latent_image",
                "denoise"
            ]
        );
        assert_eq!(ks.output_index("LATENT"), Some(0));
    }

    #[test]
    fn ranges_and_defaults_are_consistent() {
        for s in core_specs() {
            for i in &s.inputs {
                match &i.kind {
                    InputKind::Int {
                        default,
                        min,
                        max,
                        step,
                        ..
                    } => {
                        assert!(
                            min <= default && default <= max && *step > 0,
                            "{}.{}",
                            s.name,
                            i.name
                        );
                    }
                    InputKind::Float {
                        default,
                        min,
                        max,
                        step,
                        ..
                    } => {
                        assert!(
                            min <= default && default <= max && *step > 0.0,
                            "{}.{}",
                            s.name,
                            i.name
                        );
                    }
                    InputKind::Combo {
                        options: ComboOptions::Static(o),
                        default,
                        ..
                    } => {
                        assert!(!o.is_empty(), "{}.{}", s.name, i.name);
                        if let Some(d) = default {
                            assert!(o.contains(d), "{}.{}", s.name, i.name);
                        }
                    }
                    _ => {}
                }
            }
        }
    }

    #[test]
    fn output_nodes_save_with_metadata() {
        let specs = core_specs();
        for name in ["SaveImage", "PreviewImage", "SaveLatent"] {
            let s = specs.iter().find(|s| s.name == name).expect(name);
            assert!(s.output_node && s.outputs.is_empty(), "{name}");
            assert_eq!(s.hidden, [Hidden::Prompt, Hidden::ExtraPngInfo], "{name}");
        }
        let load = specs
            .iter()
            .find(|s| s.name == "LoadImage")
            .expect("LoadImage");
        assert_eq!(load.outputs.len(), 2);
        assert!(matches!(
            load.inputs[0].kind,
            InputKind::Combo {
                options: ComboOptions::InputImages,
                image_upload: true,
                ..
            }
        ));
    }
}
