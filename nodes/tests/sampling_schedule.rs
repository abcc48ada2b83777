//! Discrete model sampling and schedulers equal ComfyUI's
//! (tools/reference/sampling_schedule.py runs ComfyUI's own code).

use sdkit_nodes::sampling::discrete::DiscreteSchedule;

fn fixture() -> serde_json::Value {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/sampling/expected.json"
    ))
    .expect("fixture");
    serde_json::from_str(&text).expect("json")
}

fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().unwrap_or(f64::NAN) as f32)
        .collect()
}

/// Differences in units of the last place.
fn ulps(a: f32, b: f32) -> u32 {
    if a == b {
        return 0;
    }
    (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
}

#[test]
fn sigmas_timesteps_and_schedules_match_comfyui() {
    let fx = fixture();
    let s = DiscreteSchedule::sd1();
    // The table itself: exact (f64 maths, then f32 storage).
    assert_eq!(s.sigmas, floats(&fx["sigmas"]));
    assert_eq!(s.log_sigmas, floats(&fx["log_sigmas"]));
    for (k, v) in fx["timestep"].as_object().expect("map") {
        let sigma: f32 = k.parse().expect("sigma");
        assert_eq!(
            s.timestep(sigma),
            v.as_f64().unwrap_or(-1.0) as f32,
            "timestep({sigma})"
        );
    }
    for (k, v) in fx["sigma_of_t"].as_object().expect("map") {
        let t: f32 = k.parse().expect("t");
        let want = v.as_f64().unwrap_or(f64::NAN) as f32;
        assert!(
            ulps(s.sigma(t), want) <= 2,
            "sigma({t}) = {} vs {want}",
            s.sigma(t)
        );
    }
    let mut worst = 0;
    for (k, v) in fx["normal"].as_object().expect("map") {
        let n: usize = k.parse().expect("steps");
        let got = s.normal(n);
        let want = floats(v);
        assert_eq!(got.len(), want.len(), "normal({n})");
        for (g, w) in got.iter().zip(&want) {
            worst = worst.max(ulps(*g, *w));
        }
        eprintln!("normal({n}): worst so far {worst} ulp");
    }
    for (k, v) in fx["karras"].as_object().expect("map") {
        let n: usize = k.parse().expect("steps");
        let got = s.karras(n);
        let want = floats(v);
        assert_eq!(got.len(), want.len(), "karras({n})");
        for (g, w) in got.iter().zip(&want) {
            worst = worst.max(ulps(*g, *w));
        }
    }
    eprintln!("schedulers: worst difference {worst} ulp");
    // torch's vectorised linspace and pow may round differently in the
    // last place.
    assert!(worst <= 4, "worst {worst} ulp");
}
