//! Euler sampling equals ComfyUI's k-diffusion sample_euler on an analytic
//! denoiser (tools/reference/euler.py).

use sdkit_nodes::sampling::euler::{cfg_combine, sample_euler};

#[test]
fn matches_k_diffusion_euler() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/sampling/euler.json"
    ))
    .expect("fixture");
    let fx: serde_json::Value = serde_json::from_str(&text).expect("json");
    let floats = |k: &str| -> Vec<f32> {
        fx[k]
            .as_array()
            .expect("array")
            .iter()
            .map(|v| v.as_f64().unwrap_or(f64::NAN) as f32)
            .collect()
    };
    let sigmas = floats("sigmas");
    let mut steps = 0;
    let out = sample_euler(
        floats("x0"),
        &sigmas,
        |x, s| Ok::<_, ()>(x.iter().map(|v| v / (1.0 + s * s)).collect()),
        |i, n| {
            steps = i;
            assert!(i <= n);
            Ok(())
        },
    )
    .expect("samples");
    assert_eq!(steps, sigmas.len() - 1);
    let want = floats("out");
    let max = out
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(max <= 1e-6, "max abs diff {max}");
    // The trajectory moved: the result is not the scaled noise.
    assert!(out
        .iter()
        .zip(floats("x0"))
        .any(|(a, b)| (a - b).abs() > 1e-3));
}

#[test]
fn cfg_matches_comfyui_formula() {
    assert_eq!(cfg_combine(&[1.0, 2.0], &[0.5, 0.0], 8.0), vec![4.5, 16.0]);
}
