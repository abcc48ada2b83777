//! KSampler nodes (nodes.py) and comfy_extras/nodes_custom_sampler.py.

use super::{Finish, SAMPLERS, SCHEDULERS};
use sdkit_schema::spec::{node, NodeSpec, SocketType as T};

const NOISE_DEVICE: &[&str] = &["gpu", "cpu"];

pub(super) fn sampling(v: &mut Vec<NodeSpec>) {
    v.push(node("KSampler", "sampling")
        .description("Uses the provided model, positive and negative conditioning to denoise the latent image.")
        .socket("model", T::Model).tip("The model used for denoising the input latent.")
        .seed("seed").tip("The random seed used for creating the noise.")
        .int("steps", 20, 1, 10000, 1).tip("The number of steps used in the denoising process.")
        .float("cfg", 8.0, 0.0, 100.0, 0.1).round(0.01).tip("The Classifier-Free Guidance scale balances creativity and adherence to the prompt. Higher values result in images more closely matching the prompt however too high values will negatively impact quality.")
        .combo("sampler_name", SAMPLERS).tip("The algorithm used when sampling, this can affect the quality, speed, and style of the generated output.")
        .combo("scheduler", SCHEDULERS).tip("The scheduler controls how noise is gradually removed to form the image.")
        .socket("positive", T::Conditioning).tip("The conditioning describing the attributes you want to include in the image.")
        .socket("negative", T::Conditioning).tip("The conditioning describing the attributes you want to exclude from the image.")
        .socket("latent_image", T::Latent).tip("The latent image to denoise.")
        .float("denoise", 1.0, 0.0, 1.0, 0.01).tip("The amount of denoising applied, lower values will maintain the structure of the initial image allowing for image to image sampling.")
        .returns(T::Latent).build().out_tips(&["The denoised latent."]));
    v.push(
        node("KSamplerAdvanced", "sampling")
            .display("KSampler (Advanced)")
            .socket("model", T::Model)
            .combo("add_noise", &["enable", "disable"])
            .seed("noise_seed")
            .int("steps", 20, 1, 10000, 1)
            .float("cfg", 8.0, 0.0, 100.0, 0.1)
            .round(0.01)
            .combo("sampler_name", SAMPLERS)
            .combo("scheduler", SCHEDULERS)
            .socket("positive", T::Conditioning)
            .socket("negative", T::Conditioning)
            .socket("latent_image", T::Latent)
            .int("start_at_step", 0, 0, 10000, 1)
            .int("end_at_step", 10000, 0, 10000, 1)
            .combo("return_with_leftover_noise", &["disable", "enable"])
            .returns(T::Latent)
            .build(),
    );
    // comfy_extras/nodes_model_advanced.py
    v.push(
        node("ModelSamplingDiscrete", "advanced/model")
            .socket("model", T::Model)
            .combo(
                "sampling",
                &["eps", "v_prediction", "lcm", "x0", "img_to_img"],
            )
            .boolean("zsnr", false)
            .returns(T::Model)
            .build(),
    );
    v.push(
        node("ModelSamplingSD3", "advanced/model")
            .socket("model", T::Model)
            .float("shift", 3.0, 0.0, 100.0, 0.01)
            .returns(T::Model)
            .build(),
    );
    v.push(
        node("ModelSamplingAuraFlow", "advanced/model")
            .socket("model", T::Model)
            .float("shift", 1.73, 0.0, 100.0, 0.01)
            .returns(T::Model)
            .build(),
    );
    v.push(
        node("DifferentialDiffusion", "_for_testing")
            .display("Differential Diffusion")
            .experimental()
            .socket("model", T::Model)
            .float("strength", 1.0, 0.0, 1.0, 0.01)
            .optional()
            .returns(T::Model)
            .build(),
    );
    // comfy_extras/nodes_slg.py and nodes_sd3.py
    let slg = "Generic version of SkipLayerGuidance node that can be used on every DiT model.";
    v.push(
        node("SkipLayerGuidanceDiT", "advanced/guidance")
            .description(slg)
            .experimental()
            .socket("model", T::Model)
            .string("double_layers", "7, 8, 9")
            .string("single_layers", "7, 8, 9")
            .float("scale", 3.0, 0.0, 10.0, 0.1)
            .float("start_percent", 0.01, 0.0, 1.0, 0.001)
            .float("end_percent", 0.15, 0.0, 1.0, 0.001)
            .float("rescaling_scale", 0.0, 0.0, 10.0, 0.01)
            .returns(T::Model)
            .build(),
    );
    v.push(
        node("SkipLayerGuidanceDiTSimple", "advanced/guidance")
            .description("Simple version of the SkipLayerGuidanceDiT node that only modifies the uncond pass.")
            .experimental()
            .socket("model", T::Model)
            .string("double_layers", "7, 8, 9")
            .string("single_layers", "7, 8, 9")
            .float("start_percent", 0.0, 0.0, 1.0, 0.001)
            .float("end_percent", 1.0, 0.0, 1.0, 0.001)
            .returns(T::Model)
            .build(),
    );
    v.push(
        node("SkipLayerGuidanceSD3", "advanced/guidance")
            .description(slg)
            .experimental()
            .socket("model", T::Model)
            .string("layers", "7, 8, 9")
            .float("scale", 3.0, 0.0, 10.0, 0.1)
            .float("start_percent", 0.01, 0.0, 1.0, 0.001)
            .float("end_percent", 0.15, 0.0, 1.0, 0.001)
            .returns(T::Model)
            .build(),
    );
    v.push(
        node("ModelSamplingFlux", "advanced/model")
            .socket("model", T::Model)
            .float("max_shift", 1.15, 0.0, 100.0, 0.01)
            .float("base_shift", 0.5, 0.0, 100.0, 0.01)
            .int("width", 1024, 16, 16384, 8)
            .int("height", 1024, 16, 16384, 8)
            .returns(T::Model)
            .build(),
    );
}

// --------------------------------------------------------- custom sampling

pub(super) fn custom_sampling(v: &mut Vec<NodeSpec>) {
    const CS: &str = "sampling/custom_sampling";
    const SCHED: &str = "sampling/custom_sampling/schedulers";
    const SIGMAS: &str = "sampling/custom_sampling/sigmas";
    const SAMP: &str = "sampling/custom_sampling/samplers";
    const GUIDERS: &str = "sampling/custom_sampling/guiders";
    const NOISE: &str = "sampling/custom_sampling/noise";

    v.push(
        node("SamplerCustom", CS)
            .socket("model", T::Model)
            .boolean("add_noise", true)
            .seed("noise_seed")
            .float("cfg", 8.0, 0.0, 100.0, 0.1)
            .round(0.01)
            .socket("positive", T::Conditioning)
            .socket("negative", T::Conditioning)
            .socket("sampler", T::Sampler)
            .socket("sigmas", T::Sigmas)
            .socket("latent_image", T::Latent)
            .output("output", T::Latent)
            .output("denoised_output", T::Latent)
            .build(),
    );
    v.push(
        node("SamplerCustomAdvanced", CS)
            .socket("noise", T::Noise)
            .socket("guider", T::Guider)
            .socket("sampler", T::Sampler)
            .socket("sigmas", T::Sigmas)
            .socket("latent_image", T::Latent)
            .output("output", T::Latent)
            .output("denoised_output", T::Latent)
            .build(),
    );

    // Schedulers. The sigma FLOATs have `"round": False`.
    v.push(
        node("BasicScheduler", SCHED)
            .socket("model", T::Model)
            .combo("scheduler", SCHEDULERS)
            .int("steps", 20, 1, 10000, 1)
            .float("denoise", 1.0, 0.0, 1.0, 0.01)
            .returns(T::Sigmas)
            .build(),
    );
    v.push(
        node("KarrasScheduler", SCHED)
            .int("steps", 20, 1, 10000, 1)
            .float("sigma_max", 14.614642, 0.0, 5000.0, 0.01)
            .float("sigma_min", 0.0291675, 0.0, 5000.0, 0.01)
            .float("rho", 7.0, 0.0, 100.0, 0.01)
            .returns(T::Sigmas)
            .build(),
    );
    v.push(
        node("ExponentialScheduler", SCHED)
            .int("steps", 20, 1, 10000, 1)
            .float("sigma_max", 14.614642, 0.0, 5000.0, 0.01)
            .float("sigma_min", 0.0291675, 0.0, 5000.0, 0.01)
            .returns(T::Sigmas)
            .build(),
    );
    v.push(
        node("PolyexponentialScheduler", SCHED)
            .int("steps", 20, 1, 10000, 1)
            .float("sigma_max", 14.614642, 0.0, 5000.0, 0.01)
            .float("sigma_min", 0.0291675, 0.0, 5000.0, 0.01)
            .float("rho", 1.0, 0.0, 100.0, 0.01)
            .returns(T::Sigmas)
            .build(),
    );
    v.push(
        node("LaplaceScheduler", SCHED)
            .int("steps", 20, 1, 10000, 1)
            .float("sigma_max", 14.614642, 0.0, 5000.0, 0.01)
            .float("sigma_min", 0.0291675, 0.0, 5000.0, 0.01)
            .float("mu", 0.0, -10.0, 10.0, 0.1)
            .float("beta", 0.5, 0.0, 10.0, 0.1)
            .returns(T::Sigmas)
            .build(),
    );
    v.push(
        node("VPScheduler", SCHED)
            .int("steps", 20, 1, 10000, 1)
            .float("beta_d", 19.9, 0.0, 5000.0, 0.01)
            .float("beta_min", 0.1, 0.0, 5000.0, 0.01)
            .float("eps_s", 0.001, 0.0, 1.0, 0.0001)
            .returns(T::Sigmas)
            .build(),
    );
    v.push(
        node("BetaSamplingScheduler", SCHED)
            .socket("model", T::Model)
            .int("steps", 20, 1, 10000, 1)
            .float("alpha", 0.6, 0.0, 50.0, 0.01)
            .float("beta", 0.6, 0.0, 50.0, 0.01)
            .returns(T::Sigmas)
            .build(),
    );
    // comfy_extras/nodes_align_your_steps.py
    v.push(
        node("AlignYourStepsScheduler", SCHED)
            .combo("model_type", &["SD1", "SDXL", "SVD"])
            .int("steps", 10, 1, 10000, 1)
            .float("denoise", 1.0, 0.0, 1.0, 0.01)
            .returns(T::Sigmas)
            .build(),
    );
    v.push(
        node("SDTurboScheduler", SCHED)
            .socket("model", T::Model)
            .int("steps", 1, 1, 10, 1)
            .float("denoise", 1.0, 0.0, 1.0, 0.01)
            .returns(T::Sigmas)
            .build(),
    );

    // Sigma tools.
    v.push(
        node("SplitSigmas", SIGMAS)
            .socket("sigmas", T::Sigmas)
            .int("step", 0, 0, 10000, 1)
            .output("high_sigmas", T::Sigmas)
            .output("low_sigmas", T::Sigmas)
            .build(),
    );
    v.push(
        node("SplitSigmasDenoise", SIGMAS)
            .socket("sigmas", T::Sigmas)
            .float("denoise", 1.0, 0.0, 1.0, 0.01)
            .output("high_sigmas", T::Sigmas)
            .output("low_sigmas", T::Sigmas)
            .build(),
    );
    v.push(
        node("FlipSigmas", SIGMAS)
            .socket("sigmas", T::Sigmas)
            .returns(T::Sigmas)
            .build(),
    );
    v.push(
        node("SetFirstSigma", SIGMAS)
            .socket("sigmas", T::Sigmas)
            .float("sigma", 136.0, 0.0, 20000.0, 0.001)
            .returns(T::Sigmas)
            .build(),
    );
    v.push(
        node("ExtendIntermediateSigmas", SIGMAS)
            .socket("sigmas", T::Sigmas)
            .int("steps", 2, 1, 100, 1)
            .float("start_at_sigma", -1.0, -1.0, 20000.0, 0.01)
            .float("end_at_sigma", 12.0, 0.0, 20000.0, 0.01)
            .combo("spacing", &["linear", "cosine", "sine"])
            .returns(T::Sigmas)
            .build(),
    );
    v.push(node("SamplingPercentToSigma", SIGMAS)
        .socket("model", T::Model)
        .float("sampling_percent", 0.0, 0.0, 1.0, 0.0001)
        .boolean("return_actual_sigma", false).tip("Return the actual sigma value instead of the value used for interval checks.\nThis only affects results at 0.0 and 1.0.")
        .output("sigma_value", T::Float).build());

    // Samplers. Their eta/s_noise/... FLOATs have `"round": False`.
    v.push(
        node("KSamplerSelect", SAMP)
            .combo("sampler_name", SAMPLERS)
            .returns(T::Sampler)
            .build(),
    );
    v.push(
        node("SamplerEulerAncestral", SAMP)
            .float("eta", 1.0, 0.0, 100.0, 0.01)
            .float("s_noise", 1.0, 0.0, 100.0, 0.01)
            .returns(T::Sampler)
            .build(),
    );
    v.push(
        node("SamplerEulerAncestralCFGPP", SAMP)
            .display("SamplerEulerAncestralCFG++")
            .float("eta", 1.0, 0.0, 1.0, 0.01)
            .float("s_noise", 1.0, 0.0, 10.0, 0.01)
            .returns(T::Sampler)
            .build(),
    );
    v.push(
        node("SamplerLMS", SAMP)
            .int("order", 4, 1, 100, 1)
            .returns(T::Sampler)
            .build(),
    );
    v.push(
        node("SamplerDPMPP_3M_SDE", SAMP)
            .float("eta", 1.0, 0.0, 100.0, 0.01)
            .float("s_noise", 1.0, 0.0, 100.0, 0.01)
            .combo("noise_device", NOISE_DEVICE)
            .returns(T::Sampler)
            .build(),
    );
    v.push(
        node("SamplerDPMPP_2M_SDE", SAMP)
            .combo("solver_type", &["midpoint", "heun"])
            .float("eta", 1.0, 0.0, 100.0, 0.01)
            .float("s_noise", 1.0, 0.0, 100.0, 0.01)
            .combo("noise_device", NOISE_DEVICE)
            .returns(T::Sampler)
            .build(),
    );
    v.push(
        node("SamplerDPMPP_SDE", SAMP)
            .float("eta", 1.0, 0.0, 100.0, 0.01)
            .float("s_noise", 1.0, 0.0, 100.0, 0.01)
            .float("r", 0.5, 0.0, 100.0, 0.01)
            .combo("noise_device", NOISE_DEVICE)
            .returns(T::Sampler)
            .build(),
    );
    v.push(
        node("SamplerDPMPP_2S_Ancestral", SAMP)
            .float("eta", 1.0, 0.0, 100.0, 0.01)
            .float("s_noise", 1.0, 0.0, 100.0, 0.01)
            .returns(T::Sampler)
            .build(),
    );
    v.push(
        node("SamplerDPMAdaptative", SAMP)
            .int("order", 3, 2, 3, 1)
            .float("rtol", 0.05, 0.0, 100.0, 0.01)
            .float("atol", 0.0078, 0.0, 100.0, 0.01)
            .float("h_init", 0.05, 0.0, 100.0, 0.01)
            .float("pcoeff", 0.0, 0.0, 100.0, 0.01)
            .float("icoeff", 1.0, 0.0, 100.0, 0.01)
            .float("dcoeff", 0.0, 0.0, 100.0, 0.01)
            .float("accept_safety", 0.81, 0.0, 100.0, 0.01)
            .float("eta", 0.0, 0.0, 100.0, 0.01)
            .float("s_noise", 1.0, 0.0, 100.0, 0.01)
            .returns(T::Sampler)
            .build(),
    );
    v.push(node("SamplerER_SDE", SAMP)
        .combo("solver_type", &["ER-SDE", "Reverse-time SDE", "ODE"])
        .int("max_stage", 3, 1, 3, 1)
        .float("eta", 1.0, 0.0, 100.0, 0.01).tip("Stochastic strength of reverse-time SDE.\nWhen eta=0, it reduces to deterministic ODE. This setting doesn't apply to ER-SDE solver type.")
        .float("s_noise", 1.0, 0.0, 100.0, 0.01)
        .returns(T::Sampler).build());
    v.push(
        node("SamplerSASolver", SAMP)
            .socket("model", T::Model)
            .float("eta", 1.0, 0.0, 10.0, 0.01)
            .float("sde_start_percent", 0.2, 0.0, 1.0, 0.001)
            .float("sde_end_percent", 0.8, 0.0, 1.0, 0.001)
            .float("s_noise", 1.0, 0.0, 100.0, 0.01)
            .int("predictor_order", 3, 1, 6, 1)
            .int("corrector_order", 4, 0, 6, 1)
            .boolean("use_pece", false)
            .boolean("simple_order_2", false)
            .returns(T::Sampler)
            .build(),
    );

    // Guiders and noise.
    v.push(
        node("BasicGuider", GUIDERS)
            .socket("model", T::Model)
            .socket("conditioning", T::Conditioning)
            .returns(T::Guider)
            .build(),
    );
    v.push(
        node("CFGGuider", GUIDERS)
            .socket("model", T::Model)
            .socket("positive", T::Conditioning)
            .socket("negative", T::Conditioning)
            .float("cfg", 8.0, 0.0, 100.0, 0.1)
            .round(0.01)
            .returns(T::Guider)
            .build(),
    );
    v.push(
        node("DualCFGGuider", GUIDERS)
            .socket("model", T::Model)
            .socket("cond1", T::Conditioning)
            .socket("cond2", T::Conditioning)
            .socket("negative", T::Conditioning)
            .float("cfg_conds", 8.0, 0.0, 100.0, 0.1)
            .round(0.01)
            .float("cfg_cond2_negative", 8.0, 0.0, 100.0, 0.1)
            .round(0.01)
            .combo("style", &["regular", "nested"])
            .returns(T::Guider)
            .build(),
    );
    v.push(
        node("RandomNoise", NOISE)
            .seed("noise_seed")
            .returns(T::Noise)
            .build(),
    );
    v.push(node("DisableNoise", NOISE).returns(T::Noise).build());
    v.push(
        node("AddNoise", "_for_testing/custom_sampling/noise")
            .socket("model", T::Model)
            .socket("noise", T::Noise)
            .socket("sigmas", T::Sigmas)
            .socket("latent_image", T::Latent)
            .returns(T::Latent)
            .build(),
    );
}
