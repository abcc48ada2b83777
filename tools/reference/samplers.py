"""Reference outputs for sdkit's schedulers and samplers
(nodes/src/sampling/{discrete,samplers}.rs, nodes/tests/samplers.rs).

Runs ComfyUI's own code: `comfy.samplers.calculate_sigmas` on SD1's
ModelSamplingDiscrete for every scheduler sdkit builds and several step
counts, and k-diffusion's samplers from `comfy/k_diffusion/sampling.py` on
an analytic denoiser: the exact denoiser of Gaussian data N(mu, s2) per
element, D(x, sigma) = mu + s2 / (s2 + sigma^2) * (x - mu). Initial noise
and mu/s2 are stored; ancestral noise is k-diffusion's default noise
sampler for seed 42 (a CPU generator seeded with 42), which the test
reproduces with sdkit's torch-compatible generator.

    COMFY_DIR=/path/to/ComfyUI python tools/reference/samplers.py
"""
import base64
import importlib.util
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCHEDULERS = ["normal", "karras", "simple", "sgm_uniform", "ddim_uniform", "exponential",
              "linear_quadratic", "kl_optimal", "beta"]
STEPS = [1, 2, 3, 5, 10, 20, 33]
SAMPLERS = ["euler", "euler_ancestral", "heun", "dpm_2", "dpm_2_ancestral",
            "dpmpp_2s_ancestral", "dpmpp_2m", "ddpm", "lcm", "ipndm", "lms", "heunpp2",
            "ipndm_v", "res_multistep", "res_multistep_ancestral", "deis", "er_sde",
            "seeds_2", "seeds_3", "sa_solver", "sa_solver_pece"]
# Run on a CFG combination of two analytic denoisers (scale 3), reading the
# unconditional one through ComfyUI's post-CFG hook.
CFG_PP = ["euler_cfg_pp", "euler_ancestral_cfg_pp", "dpmpp_2m_cfg_pp",
          "dpmpp_2s_ancestral_cfg_pp", "res_multistep_cfg_pp", "res_multistep_ancestral_cfg_pp"]
CFG_SCALE = 3.0
SEED = 42


def b64(t):
    import numpy as np
    return base64.b64encode(t.detach().numpy().astype("<f4").tobytes()).decode()


class PairNoise:
    """dpmpp_sde's two queries per step, as sdkit draws them: z_a for
    [sigma_s1, sigma]; for [sigma_next, sigma] the Brownian sum
    (sqrt(w1) z_a + sqrt(w2) z_b) / sqrt(w1 + w2)."""
    def __init__(self, torch, shape):
        self.torch, self.shape = torch, shape
        self.g = torch.Generator().manual_seed(SEED)
        self.pending = None

    def __call__(self, s0, s1):
        if self.pending is None:
            za = self.torch.randn(self.shape, generator=self.g)
            zb = self.torch.randn(self.shape, generator=self.g)
            self.pending = (za, zb, float(s0 - s1), s1)
            return za
        za, zb, w1, s_1 = self.pending
        self.pending = None
        w2 = float(s_1 - s1)
        ka, kb = math.sqrt(w1 / (w1 + w2)), math.sqrt(w2 / (w1 + w2))
        return ka * za + kb * zb


def main():
    path = os.path.join(ROOT, "tools", "reference", "sd1_pipeline.py")
    spec = importlib.util.spec_from_file_location("sd1_pipeline", path)
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    sys.meta_path.insert(0, ref._StubFinder())
    sys.path.insert(0, ref.COMFY)
    sys.argv = [sys.argv[0], "--cpu"]
    import comfy.options
    comfy.options.enable_args_parsing()
    import torch
    torch.set_grad_enabled(False)
    import comfy.model_sampling as ms_mod
    import comfy.samplers
    from comfy.k_diffusion import sampling as kd

    class Discrete(ms_mod.ModelSamplingDiscrete, ms_mod.EPS):
        pass

    ms = Discrete()
    out = {"schedulers": {}, "samplers": {}}
    for name in SCHEDULERS:
        # kl_optimal divides by steps - 1: ComfyUI gives NaN for one step
        # (sdkit gives the largest sigma then 0).
        out["schedulers"][name] = {
            str(n): [float(v) for v in comfy.samplers.calculate_sigmas(ms, name, n).float()]
            for n in STEPS if not (name == "kl_optimal" and n == 1)
        }

    from comfy_extras.nodes_align_your_steps import AlignYourStepsScheduler
    out["ays"] = {}
    for kind in ["SD1", "SDXL", "SVD"]:
        for n in [1, 5, 10, 11, 20, 33]:
            for denoise in [1.0, 0.5, 0.73]:
                s = AlignYourStepsScheduler.execute(kind, n, denoise).result[0]
                out["ays"][f"{kind}/{n}/{denoise}"] = [float(v) for v in s]

    out["schedule_nodes"] = {}
    for n in [1, 4, 13]:
        sn = out["schedule_nodes"]
        sn[f"poly/{n}/1.0"] = [float(v) for v in kd.get_sigmas_polyexponential(n, 0.0291675, 14.614642, 1.0)]
        sn[f"poly/{n}/2.5"] = [float(v) for v in kd.get_sigmas_polyexponential(n, 0.0291675, 14.614642, 2.5)]
        sn[f"vp/{n}"] = [float(v) for v in kd.get_sigmas_vp(n, 19.9, 0.1, 0.001)]
        sn[f"laplace/{n}"] = [float(v) for v in kd.get_sigmas_laplace(n, 0.0291675, 14.614642, 0.0, 0.5)]
        sn[f"beta/{n}/0.4/0.9"] = [float(v) for v in comfy.samplers.beta_scheduler(ms, n, alpha=0.4, beta=0.9)]
    from comfy_extras.nodes_custom_sampler import SDTurboScheduler

    class MS:
        def get_model_object(self, name):
            return ms
    for n, d in [(1, 1.0), (4, 1.0), (3, 0.55), (10, 0.25)]:
        out["schedule_nodes"][f"turbo/{n}/{d}"] = [float(v) for v in SDTurboScheduler().get_sigmas(MS(), n, d)[0]]

    shape = (2, 4, 8, 8)
    count = math.prod(shape)
    mu = torch.tensor([0.5 * math.sin(i * 0.3) for i in range(count)], dtype=torch.float32).reshape(shape)
    s2 = torch.tensor([0.25 + 0.2 * math.cos(i * 0.7) for i in range(count)],
                      dtype=torch.float32).reshape(shape)

    mu_u = torch.tensor([0.4 * math.cos(i * 0.17) for i in range(count)],
                        dtype=torch.float32).reshape(shape)

    class Model:
        """The wrapper chain k-diffusion looks through for model_sampling;
        with `cfg`, a CFG of two analytic denoisers that calls ComfyUI's
        post-CFG functions as `sampling_function` does."""
        def __init__(self, cfg=None):
            self.inner_model = self
            self.model_patcher = self
            self.model_sampling = ms
            self.cfg = cfg

        def get_model_object(self, name):
            return ms

        def __call__(self, x, sigma, model_options=None, **kwargs):
            sigma = sigma.reshape(-1, 1, 1, 1)
            cond = mu + (s2 / (s2 + sigma ** 2)) * (x - mu)
            if self.cfg is None:
                return cond
            uncond = mu_u + (s2 / (s2 + sigma ** 2)) * (x - mu_u)
            out = uncond + (cond - uncond) * self.cfg
            for fn in (model_options or {}).get("sampler_post_cfg_function", []):
                out = fn({"denoised": out, "cond_denoised": cond, "uncond_denoised": uncond,
                          "sigma": sigma, "input": x, "model": None, "model_options": model_options,
                          "cond": None, "uncond": None, "cond_scale": self.cfg})
            return out

    sigmas = comfy.samplers.calculate_sigmas(ms, "karras", 10).float()
    torch.manual_seed(0)
    x0 = torch.randn(shape) * sigmas[0]
    out["x0"] = b64(x0)
    out["mu"] = b64(mu)
    out["s2"] = b64(s2)
    out["sigmas"] = [float(v) for v in sigmas]
    out["mu_u"] = b64(mu_u)
    out["cfg"] = CFG_SCALE
    out["cfg_pp"] = {}
    for name in CFG_PP:
        fn = getattr(kd, "sample_" + name)
        x = fn(Model(CFG_SCALE), x0.clone(), sigmas, extra_args={"seed": SEED}, disable=True)
        out["cfg_pp"][name] = b64(x)
    # SDE samplers with the generator noise sdkit uses instead of torchsde's
    # Brownian tree, handed in as k-diffusion's noise_sampler.
    out["sde"] = {}
    for name in ["dpmpp_2m_sde", "dpmpp_2m_sde_heun", "dpmpp_3m_sde"]:
        g = torch.Generator().manual_seed(SEED)
        ns = lambda s, sn: torch.randn(shape, generator=g)
        fn = getattr(kd, "sample_" + name)
        x = fn(Model(), x0.clone(), sigmas, extra_args={"seed": SEED}, disable=True, noise_sampler=ns)
        out["sde"][name] = b64(x)
    x = kd.sample_dpmpp_sde(Model(), x0.clone(), sigmas, extra_args={"seed": SEED}, disable=True,
                            noise_sampler=PairNoise(torch, shape))
    out["sde"]["dpmpp_sde"] = b64(x)
    for name in ["gradient_estimation"]:
        x = getattr(kd, "sample_" + name)(Model(), x0.clone(), sigmas, extra_args={"seed": SEED},
                                          disable=True)
        out["samplers"][name] = b64(x)
    x = kd.sample_gradient_estimation_cfg_pp(Model(CFG_SCALE), x0.clone(), sigmas,
                                             extra_args={"seed": SEED}, disable=True)
    out["cfg_pp"]["gradient_estimation_cfg_pp"] = b64(x)
    # dpm_fast through ComfyUI's KSAMPLER wrapper (sigma range and step
    # count from the sigmas).
    ks = comfy.samplers.ksampler("dpm_fast")
    x = ks.sampler_function(Model(), x0.clone(), sigmas, extra_args={"seed": SEED}, callback=None,
                            disable=True)
    out["samplers"]["dpm_fast"] = b64(x)
    ks = comfy.samplers.ksampler("dpm_adaptive")
    x = ks.sampler_function(Model(), x0.clone(), sigmas, extra_args={"seed": SEED}, callback=None,
                            disable=True)
    out["samplers"]["dpm_adaptive"] = b64(x)
    from comfy.extra_samplers import uni_pc
    # KSampler drops the penultimate sigma for these; the sampler itself
    # takes the sigmas as given.
    for name, fn in [("uni_pc", uni_pc.sample_unipc), ("uni_pc_bh2", uni_pc.sample_unipc_bh2)]:
        x = fn(Model(), x0.clone(), sigmas.clone(), extra_args={"seed": SEED}, disable=True)
        out["samplers"][name] = b64(x)
    model = Model()
    for name in SAMPLERS:
        fn = getattr(kd, "sample_" + name)
        x = fn(model, x0.clone(), sigmas, extra_args={"seed": SEED}, disable=True)
        out["samplers"][name] = b64(x)
    flow_section(out, torch, ms_mod, comfy, kd, shape, mu, s2, mu_u)
    dst = os.path.join(ROOT, "nodes", "tests", "fixtures", "sampling", "samplers.json")
    with open(dst, "w") as f:
        json.dump(out, f)
        f.write("\n")
    print("wrote", dst)


FLOW_SCHEDULES = {
    # name: (model-sampling base, type, set_parameters kwargs)
    "sd3": ("ModelSamplingDiscreteFlow", "CONST", {"shift": 3.0, "multiplier": 1000}),
    "aura": ("ModelSamplingDiscreteFlow", "CONST", {"shift": 1.73, "multiplier": 1.0}),
    "flux": ("ModelSamplingFlux", "CONST", {"shift": 1.15}),
    "flux_small": ("ModelSamplingFlux", "CONST", {"shift": 0.5 + (1.15 - 0.5) / 3840 * (64 - 256)}),
}


def flow_section(out, torch, ms_mod, comfy, kd, shape, mu, s2, mu_u):
    """Model-sampling kinds beyond SD1's eps: the flow schedules (SD3,
    AuraFlow, Flux), LCM's distilled one and zero-terminal-SNR, with every
    scheduler and percent_to_sigma; then every sampler in flow space on
    the analytic denoiser of x = (1 - s)·x0 + s·n."""
    import comfy_extras.nodes_model_advanced as adv
    kinds = {}
    for key, (base, typ, params) in FLOW_SCHEDULES.items():
        cls = type("MS_" + key, (getattr(ms_mod, base), getattr(ms_mod, typ)), {})
        m = cls()
        m.set_parameters(**params)
        kinds[key] = m
    lcm = type("MS_lcm", (adv.ModelSamplingDiscreteDistilled, adv.LCM), {})()
    kinds["lcm"] = lcm
    zsnr = type("MS_zsnr", (ms_mod.ModelSamplingDiscrete, ms_mod.EPS), {})(zsnr=True)
    kinds["zsnr"] = zsnr
    sched = {}
    for key, m in kinds.items():
        sched[key] = {
            "sigmas_head": [float(v) for v in m.sigmas[:5]],
            "sigmas_tail": [float(v) for v in m.sigmas[-5:]],
            "count": int(len(m.sigmas)),
            "percent": {str(p): float(m.percent_to_sigma(p)) for p in [0.0, 1e-4, 0.2, 0.5, 0.8, 1.0]},
            "timestep": [float(m.timestep(torch.tensor(v))) for v in [0.3, 0.9, float(m.sigmas[7])]],
            "schedulers": {},
        }
        for name in SCHEDULERS:
            sched[key]["schedulers"][name] = {
                str(n): [float(v) for v in comfy.samplers.calculate_sigmas(m, name, n).float()]
                for n in [2, 4, 5, 6, 10, 33] if not (name == "kl_optimal" and n == 1)
            }
    out["model_sampling"] = sched

    ms = kinds["sd3"]
    sigmas = comfy.samplers.calculate_sigmas(ms, "simple", 10).float()
    assert float(sigmas[0]) == 1.0

    class Model:
        """A CONST model: k-diffusion finds its model_sampling through the
        wrapper chain; the denoiser is the exact one for flow noising."""
        def __init__(self, cfg=None):
            self.inner_model = self
            self.model_patcher = self
            self.model_sampling = ms
            self.cfg = cfg

        def get_model_object(self, name):
            return ms

        @staticmethod
        def exact(x, sigma, m):
            a = 1 - sigma
            return m + (a * s2 / (a * a * s2 + sigma * sigma)) * (x - a * m)

        def __call__(self, x, sigma, model_options=None, **kwargs):
            sigma = sigma.reshape(-1, 1, 1, 1)
            cond = self.exact(x, sigma, mu)
            if self.cfg is None:
                return cond
            uncond = self.exact(x, sigma, mu_u)
            o = uncond + (cond - uncond) * self.cfg
            for fn in (model_options or {}).get("sampler_post_cfg_function", []):
                o = fn({"denoised": o, "cond_denoised": cond, "uncond_denoised": uncond,
                        "sigma": sigma, "input": x, "model": None, "model_options": model_options,
                        "cond": None, "uncond": None, "cond_scale": self.cfg})
            return o

    torch.manual_seed(1)
    x0 = torch.randn(shape)
    flow = {"x0": b64(x0), "sigmas": [float(v) for v in sigmas], "samplers": {}, "cfg_pp": {}, "sde": {}}
    skipped = []

    def keep(section, name, x):
        if torch.isfinite(x).all():
            flow[section][name] = b64(x)
        else:
            skipped.append(name)

    for name in SAMPLERS + ["gradient_estimation"]:
        x = getattr(kd, "sample_" + name)(Model(), x0.clone(), sigmas, extra_args={"seed": SEED},
                                          disable=True)
        keep("samplers", name, x)
    for name in ["dpm_fast", "dpm_adaptive"]:
        ks = comfy.samplers.ksampler(name)
        # dpm_fast/adaptive need sigma_min > 0 and take the range only.
        x = ks.sampler_function(Model(), x0.clone(), sigmas, extra_args={"seed": SEED},
                                callback=None, disable=True)
        keep("samplers", name, x)
    from comfy.extra_samplers import uni_pc
    for name, fn in [("uni_pc", uni_pc.sample_unipc), ("uni_pc_bh2", uni_pc.sample_unipc_bh2)]:
        keep("samplers", name, fn(Model(), x0.clone(), sigmas.clone(), extra_args={"seed": SEED},
                                  disable=True))
    for name in CFG_PP + ["gradient_estimation_cfg_pp"]:
        x = getattr(kd, "sample_" + name)(Model(CFG_SCALE), x0.clone(), sigmas,
                                          extra_args={"seed": SEED}, disable=True)
        keep("cfg_pp", name, x)
    for name in ["dpmpp_2m_sde", "dpmpp_2m_sde_heun", "dpmpp_3m_sde"]:
        g = torch.Generator().manual_seed(SEED)
        ns = lambda a, b: torch.randn(shape, generator=g)
        x = getattr(kd, "sample_" + name)(Model(), x0.clone(), sigmas, extra_args={"seed": SEED},
                                          disable=True, noise_sampler=ns)
        keep("sde", name, x)
    keep("sde", "dpmpp_sde", kd.sample_dpmpp_sde(Model(), x0.clone(), sigmas, extra_args={"seed": SEED},
                                                disable=True, noise_sampler=PairNoise(torch, shape)))
    flow["skipped"] = skipped
    out["flow"] = flow


if __name__ == "__main__":
    main()
