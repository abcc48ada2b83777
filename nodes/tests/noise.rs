//! The torch RNG port draws torch.randn's values (tools/reference/noise.py).

use sdkit_nodes::noise::Mt19937;

#[test]
fn matches_torch_randn() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/noise/expected.json"
    ))
    .expect("fixture");
    let fx: serde_json::Value = serde_json::from_str(&text).expect("json");
    let mut exact = 0;
    let mut total = 0;
    for case in fx["cases"].as_array().expect("cases") {
        let seed: u64 = case["seed"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .expect("seed");
        let n = case["n"].as_u64().expect("n") as usize;
        let want: Vec<f32> = case["values"]
            .as_array()
            .expect("values")
            .iter()
            .map(|v| v.as_f64().unwrap_or(f64::NAN) as f32)
            .collect();
        let got = Mt19937::new(seed).randn(n);
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            // Same draw, same transform; libm vs SLEEF may differ by ulps.
            let tol = 4.0 * f32::EPSILON * w.abs().max(1.0);
            assert!((g - w).abs() <= tol, "seed {seed} n {n} [{i}]: {g} vs {w}");
            exact += usize::from(g == w);
            total += 1;
        }
    }
    eprintln!("{exact} of {total} values bit-identical to torch");
    assert!(exact * 10 >= total * 7, "only {exact}/{total} exact");
}
