//! Schedulers and samplers against ComfyUI's own code
//! (tools/reference/samplers.py → fixtures/sampling/samplers.json), and
//! each sampler's convergence order on the analytic denoiser.

use sdkit_nodes::noise::Mt19937;
use sdkit_nodes::sampling::discrete::{DiscreteSchedule, BUILT_SCHEDULERS};
use sdkit_nodes::sampling::samplers::{Sampler, Space};

fn fixture() -> serde_json::Value {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/sampling/samplers.json"
    ))
    .expect("fixture");
    serde_json::from_str(&text).expect("json")
}

fn b64(s: &str) -> Vec<f32> {
    let val = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            _ => 63,
        }
    };
    let bytes: Vec<u8> = s.bytes().filter(|&c| c != b'=').collect();
    let mut out = Vec::new();
    for chunk in bytes.chunks(4) {
        let mut acc = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            acc |= val(c) << (18 - 6 * i);
        }
        for i in 0..chunk.len() * 6 / 8 {
            out.push((acc >> (16 - 8 * i)) as u8);
        }
    }
    out.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().expect("number") as f32)
        .collect()
}

#[test]
fn schedulers_match_comfyui() {
    let fx = fixture();
    let s = DiscreteSchedule::sd1();
    let mut worst = 0f32;
    for name in BUILT_SCHEDULERS {
        let cases = fx["schedulers"][*name].as_object().expect(name);
        for (steps, want) in cases {
            let n: usize = steps.parse().expect("steps");
            let got = s.schedule(name, n).expect("built");
            let want = floats(want);
            assert_eq!(got.len(), want.len(), "{name} {n}: {got:?} vs {want:?}");
            for (g, w) in got.iter().zip(&want) {
                let rel = (g - w).abs() / w.abs().max(1e-6);
                worst = worst.max(rel);
                assert!(rel < 2e-6, "{name} {n}: {got:?} vs {want:?}");
            }
        }
    }
    eprintln!("schedulers: worst relative difference {worst:e}");
}

/// The analytic denoiser the reference uses, in its order of operations.
fn denoiser<'a>(
    mu: &'a [f32],
    s2: &'a [f32],
) -> impl FnMut(&[f32], f32) -> Result<Vec<f32>, ()> + 'a {
    move |x: &[f32], sigma: f32| {
        Ok(x.iter()
            .zip(mu)
            .zip(s2)
            .map(|((x, m), v)| m + (v / (v + sigma * sigma)) * (x - m))
            .collect())
    }
}

/// Within a few float32 ulps of the reference's largest value.
fn assert_close(name: &str, got: &[f32], want: &[f32]) {
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    eprintln!("{name:<32} max abs diff {diff:e} (values up to {scale:.3})");
    assert!(diff <= 2e-6 * scale.max(1.0), "{name}: {diff}");
}

/// Runs every sampler of fixture section `section` on the analytic
/// denoiser with the reference's noise stream (seed 42) and compares.
fn check_section(section: &str) {
    let fx = fixture();
    let x0 = b64(fx["x0"].as_str().expect("x0"));
    let mu = b64(fx["mu"].as_str().expect("mu"));
    let s2 = b64(fx["s2"].as_str().expect("s2"));
    let sigmas = floats(&fx["sigmas"]);
    for (name, want) in fx[section].as_object().expect(section) {
        let sampler = Sampler::from_name(name).expect("built");
        let want = b64(want.as_str().expect("b64"));
        let mut gen = Mt19937::new(42);
        let n = x0.len();
        let got = sampler
            .run(
                x0.clone(),
                &sigmas,
                denoiser(&mu, &s2),
                || gen.randn(n),
                |_, _| Ok(()),
            )
            .expect("runs");
        assert_close(name, &got, &want);
    }
}

#[test]
fn samplers_match_comfyui() {
    check_section("samplers");
}

/// Error against the exact probability-flow ODE solution falls at each
/// deterministic sampler's order when the step count doubles.
#[test]
fn deterministic_samplers_converge_at_their_order() {
    // One element, data N(0.3, 0.5); from sigma 10 to 0.5 (no final 0).
    let (mu, s2) = (vec![0.3f32], vec![0.5f32]);
    let exact = |x0: f32, s0: f32, s1: f32| -> f64 {
        let (m, v) = (f64::from(mu[0]), f64::from(s2[0]));
        m + (v + f64::from(s1).powi(2)).sqrt() / (v + f64::from(s0).powi(2)).sqrt()
            * (f64::from(x0) - m)
    };
    let karras = |n: usize| -> Vec<f32> {
        let mut s = sdkit_nodes::sampling::discrete::karras(n, 0.5, 10.0, 7.0);
        s.pop();
        s
    };
    for (name, order) in [
        ("euler", 1.0),
        ("heun", 2.0),
        ("dpm_2", 2.0),
        ("dpmpp_2m", 2.0),
    ] {
        let sampler = Sampler::from_name(name).expect("built");
        let err = |n: usize| -> f64 {
            let s = karras(n + 1);
            let x = sampler
                .run(
                    vec![8.0],
                    &s,
                    denoiser(&mu, &s2),
                    || vec![0.0],
                    |_, _| Ok(()),
                )
                .expect("runs");
            (f64::from(x[0]) - exact(8.0, s[0], *s.last().expect("sigma"))).abs()
        };
        let (e1, e2) = (err(8), err(16));
        let rate = (e1 / e2).log2();
        eprintln!("{name:<10} error {e1:.2e} → {e2:.2e}: order {rate:.2}");
        assert!(
            rate > order - 0.35,
            "{name}: observed order {rate}, expected {order}"
        );
    }
}

/// CFG++ samplers on a CFG of two analytic denoisers, reading the
/// unconditional prediction as ComfyUI's post-CFG hook hands it over.
#[test]
fn cfg_pp_samplers_match_comfyui() {
    let fx = fixture();
    let x0 = b64(fx["x0"].as_str().expect("x0"));
    let mu = b64(fx["mu"].as_str().expect("mu"));
    let mu_u = b64(fx["mu_u"].as_str().expect("mu_u"));
    let s2 = b64(fx["s2"].as_str().expect("s2"));
    let cfg = fx["cfg"].as_f64().expect("cfg") as f32;
    let sigmas = floats(&fx["sigmas"]);
    for (name, want) in fx["cfg_pp"].as_object().expect("cfg_pp") {
        let sampler = Sampler::from_name(name).expect("built");
        assert!(sampler.needs_uncond());
        let want = b64(want.as_str().expect("b64"));
        let last_uncond = std::cell::RefCell::new(None);
        let mut cond = denoiser(&mu, &s2);
        let mut uncond = denoiser(&mu_u, &s2);
        let combined = |x: &[f32], sigma: f32| -> Result<Vec<f32>, ()> {
            let c = cond(x, sigma)?;
            let u = uncond(x, sigma)?;
            let out = u.iter().zip(&c).map(|(u, c)| u + (c - u) * cfg).collect();
            *last_uncond.borrow_mut() = Some(u);
            Ok(out)
        };
        let mut gen = Mt19937::new(42);
        let n = x0.len();
        let got = sampler
            .run_with_uncond(
                Space::default(),
                x0.clone(),
                &sigmas,
                combined,
                || last_uncond.borrow().clone(),
                || gen.randn(n),
                |_, _| Ok(()),
            )
            .expect("runs");
        assert_close(name, &got, &want);
    }
}

/// SDE samplers, with the reference given the same generator noise sdkit
/// uses in place of torchsde's Brownian tree.
#[test]
fn sde_samplers_match_comfyui_given_the_same_noise() {
    let fx = fixture();
    for name in fx["sde"].as_object().expect("sde").keys() {
        assert!(
            Sampler::from_name(name).expect("built").brownian(),
            "{name}"
        );
    }
    check_section("sde");
}

#[test]
fn align_your_steps_matches_comfyui() {
    let fx = fixture();
    for (key, want) in fx["ays"].as_object().expect("ays") {
        let parts: Vec<&str> = key.split('/').collect();
        let (kind, n, denoise) = (
            parts[0],
            parts[1].parse::<usize>().expect("steps"),
            parts[2].parse::<f64>().expect("denoise"),
        );
        let got =
            sdkit_nodes::diffusion::custom::align_your_steps(kind, n, denoise).expect("known");
        let want = floats(want);
        assert_eq!(got.len(), want.len(), "{key}: {got:?} vs {want:?}");
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (g - w).abs() <= 2e-7 * w.abs().max(1.0),
                "{key}: {got:?} vs {want:?}"
            );
        }
    }
}

#[test]
fn scheduler_nodes_match_comfyui() {
    use sdkit_nodes::sampling::discrete::{laplace, polyexponential, vp};
    let fx = fixture();
    let s = DiscreteSchedule::sd1();
    for (key, want) in fx["schedule_nodes"].as_object().expect("schedule_nodes") {
        let p: Vec<&str> = key.split('/').collect();
        let n: usize = p[1].parse().expect("steps");
        let num = |i: usize| p[i].parse::<f64>().expect("number");
        let got = match p[0] {
            "poly" => polyexponential(n, 0.0291675, 14.614642, num(2)),
            "vp" => vp(n, 19.9, 0.1, 0.001),
            "laplace" => laplace(n, 0.0291675, 14.614642, 0.0, 0.5),
            "beta" => s.beta_with(n, num(2), num(3)),
            "turbo" => s.sd_turbo(n, num(2)),
            other => panic!("unknown case {other}"),
        };
        let want = floats(want);
        assert_eq!(got.len(), want.len(), "{key}: {got:?} vs {want:?}");
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (g - w).abs() <= 4e-7 * w.abs().max(1.0),
                "{key}: {got:?} vs {want:?}"
            );
        }
    }
}

/// The model-sampling kinds of fixture section `model_sampling`, built as
/// the matching nodes build them.
fn model_sampling_kind(key: &str) -> DiscreteSchedule {
    match key {
        "sd3" => DiscreteSchedule::flow(3.0, 1000.0),
        "aura" => DiscreteSchedule::flow(1.73, 1.0),
        "flux" => DiscreteSchedule::flux(1.15),
        "flux_small" => DiscreteSchedule::flux(0.5 + (1.15 - 0.5) / 3840.0 * (64.0 - 256.0)),
        "lcm" => DiscreteSchedule::distilled(&DiscreteSchedule::sd1()),
        "zsnr" => DiscreteSchedule::sd1_zsnr(),
        other => panic!("unknown model sampling {other}"),
    }
}

#[test]
fn model_sampling_kinds_match_comfyui() {
    let fx = fixture();
    let close = |what: &str, g: f64, w: f64, tol: f64| {
        assert!(
            (g - w).abs() <= tol * w.abs().max(1e-6),
            "{what}: {g} vs {w}"
        );
    };
    let mut worst = 0f64;
    for (key, case) in fx["model_sampling"].as_object().expect("model_sampling") {
        let s = model_sampling_kind(key);
        assert_eq!(
            s.sigmas.len() as u64,
            case["count"].as_u64().expect("count"),
            "{key}"
        );
        let (head, tail) = (floats(&case["sigmas_head"]), floats(&case["sigmas_tail"]));
        assert_eq!(&s.sigmas[..5], &head[..], "{key} head");
        assert_eq!(&s.sigmas[s.sigmas.len() - 5..], &tail[..], "{key} tail");
        for (p, want) in case["percent"].as_object().expect("percent") {
            let p: f64 = p.parse().expect("percent");
            let w = want.as_f64().expect("sigma");
            close(
                &format!("{key} percent {p}"),
                s.percent_to_sigma(p),
                w,
                1e-12,
            );
        }
        let sigmas_for_t = [0.3f32, 0.9, s.sigmas[7]];
        for (sig, want) in sigmas_for_t.iter().zip(floats(&case["timestep"])) {
            assert_eq!(s.timestep(*sig), want, "{key} timestep({sig})");
        }
        for name in BUILT_SCHEDULERS {
            for (steps, want) in case["schedulers"][*name].as_object().expect(name) {
                let n: usize = steps.parse().expect("steps");
                let got = s.schedule(name, n).expect("built");
                let want = floats(want);
                assert_eq!(
                    got.len(),
                    want.len(),
                    "{key} {name} {n}: {got:?} vs {want:?}"
                );
                for (g, w) in got.iter().zip(&want) {
                    let rel = f64::from((g - w).abs() / w.abs().max(1e-6));
                    worst = worst.max(rel);
                    assert!(rel < 2e-6, "{key} {name} {n}: {got:?} vs {want:?}");
                }
            }
        }
    }
    eprintln!("model-sampling schedules: worst relative difference {worst:e}");
}

/// Every sampler in rectified-flow space (SD3's shift-3 schedule from
/// σ = 1) on the exact denoiser of x = (1 − σ)·x₀ + σ·n, against ComfyUI's
/// CONST code paths (RF ancestral samplers, logit half-logSNR, the first
/// sigma offset, flow noise scaling).
#[test]
fn samplers_in_flow_space_match_comfyui() {
    let fx = fixture();
    let flow = &fx["flow"];
    assert_eq!(flow["skipped"].as_array().map(Vec::len), Some(0));
    let x0 = b64(flow["x0"].as_str().expect("x0"));
    let mu = b64(fx["mu"].as_str().expect("mu"));
    let mu_u = b64(fx["mu_u"].as_str().expect("mu_u"));
    let s2 = b64(fx["s2"].as_str().expect("s2"));
    let cfg = fx["cfg"].as_f64().expect("cfg") as f32;
    let sigmas = floats(&flow["sigmas"]);
    let space = Space::of(&DiscreteSchedule::flow(3.0, 1000.0));
    assert!(space.flow);
    let exact = |x: &[f32], sigma: f32, m: &[f32]| -> Vec<f32> {
        let a = 1.0 - sigma;
        x.iter()
            .zip(m)
            .zip(&s2)
            .map(|((x, m), v)| m + (a * v / (a * a * v + sigma * sigma)) * (x - a * m))
            .collect()
    };
    let mut count = 0;
    for section in ["samplers", "cfg_pp", "sde"] {
        for (name, want) in flow[section].as_object().expect(section) {
            let sampler = Sampler::from_name(name).expect("built");
            let want = b64(want.as_str().expect("b64"));
            let last_uncond = std::cell::RefCell::new(None);
            let model = |x: &[f32], sigma: f32| -> Result<Vec<f32>, ()> {
                let c = exact(x, sigma, &mu);
                if section != "cfg_pp" {
                    return Ok(c);
                }
                let u = exact(x, sigma, &mu_u);
                let out = u.iter().zip(&c).map(|(u, c)| u + (c - u) * cfg).collect();
                *last_uncond.borrow_mut() = Some(u);
                Ok(out)
            };
            let mut gen = Mt19937::new(42);
            let n = x0.len();
            let got = sampler
                .run_with_uncond(
                    space,
                    x0.clone(),
                    &sigmas,
                    model,
                    || last_uncond.borrow().clone(),
                    || gen.randn(n),
                    |_, _| Ok(()),
                )
                .expect("runs");
            assert_close(&format!("flow {name}"), &got, &want);
            count += 1;
        }
    }
    assert!(count >= 36, "only {count} samplers in the flow fixture");
}
