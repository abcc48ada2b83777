//! Replays `nodes/tests/fixtures/latentops` (`tools/reference/image_ops.py
//! latentops`: ComfyUI's latent and image-batch nodes): LATENT inputs and
//! outputs as objects of `samples`, `noise_mask` and `batch_index`.

use super::*;
use sdkit_nodes::imageops::LatentParts;

fn latent(fx: &Fixtures, v: &Value) -> LatentParts {
    let f32s = |name: &str| match fx.array(name) {
        Array::F32(s, d) => (s, d),
        Array::U8(..) => panic!("{name} is not f32"),
    };
    let (s, samples) = f32s(v["samples"].as_str().expect("samples"));
    LatentParts {
        shape: s[..].try_into().expect("a 4-D latent"),
        samples,
        noise_mask: v.get("noise_mask").map(|n| f32s(n.as_str().expect("mask"))),
        batch_index: v.get("batch_index").map(|b| {
            b.as_array()
                .expect("list")
                .iter()
                .map(|x| x.as_i64().expect("int"))
                .collect()
        }),
    }
}

fn run(fx: &Fixtures, c: &Value) -> Result<Result<LatentParts, Got>, ImageOpError> {
    let op = c["op"].as_str().expect("op");
    let lat = |i: usize| latent(fx, &c["inputs"][i]);
    Ok(match op {
        "latent_composite" => Ok(latent_composite(
            &lat(0),
            &lat(1),
            p_usize(c, "x"),
            p_usize(c, "y"),
            p_usize(c, "feather"),
        )?),
        "latent_composite_masked" => {
            let mask = c["inputs"]
                .get(2)
                .map(|m| fx.mask(m.as_str().expect("mask")));
            Ok(latent_composite_masked(
                &lat(0),
                &lat(1),
                p_usize(c, "x"),
                p_usize(c, "y"),
                c["params"]["resize_source"].as_bool().expect("bool"),
                mask.as_ref(),
            )?)
        }
        "latent_blend" => Ok(latent_blend(&lat(0), &lat(1), p_f64(c, "blend_factor"))?),
        "latent_from_batch" => Ok(latent_from_batch(
            &lat(0),
            p_usize(c, "batch_index"),
            p_usize(c, "length"),
        )?),
        "repeat_latent_batch" => Ok(repeat_latent_batch(&lat(0), p_usize(c, "amount"))),
        "latent_crop" => Ok(latent_crop(
            &lat(0),
            p_usize(c, "width"),
            p_usize(c, "height"),
            p_usize(c, "x"),
            p_usize(c, "y"),
        )),
        "latent_flip" => Ok(latent_flip(
            &lat(0),
            p_str(c, "flip_method").starts_with('x'),
        )),
        "latent_rotate" => {
            let k = match p_str(c, "rotation") {
                r if r.starts_with("90") => 1,
                r if r.starts_with("180") => 2,
                r if r.starts_with("270") => 3,
                _ => 0,
            };
            Ok(latent_rotate(&lat(0), k))
        }
        "repeat_image_batch" => Err(image_out(repeat_image_batch(
            &fx.image(input(c, 0)),
            p_usize(c, "amount"),
        )?)),
        "image_from_batch" => Err(image_out(image_from_batch(
            &fx.image(input(c, 0)),
            p_usize(c, "batch_index"),
            p_usize(c, "length"),
        )?)),
        "image_color_to_mask" => Err(mask_out(image_color_to_mask(
            &fx.image(input(c, 0)),
            c["params"]["color"].as_i64().expect("color"),
        )?)),
        "image_scale_to_max_dimension" => {
            let method: UpscaleMethod = p_str(c, "upscale_method").parse()?;
            let out =
                scale_to_max_dimension(&fx.image(input(c, 0)), method, p_usize(c, "largest_size"))?;
            Err(if method == UpscaleMethod::Lanczos {
                Got::U8(out.shape().to_vec(), to_u8(&out))
            } else {
                image_out(out)
            })
        }
        other => panic!("unknown op {other}"),
    })
}

/// ComfyUI's latent and image-batch nodes, case by case: every output
/// value exact (NaN for NaN), a LATENT's noise mask and batch index as
/// ComfyUI's dict has them, and an error wherever ComfyUI raised.
#[test]
fn latent_reference_fixtures() {
    let fx = Fixtures::load("latentops");
    let mut failures = Vec::new();
    let mut checked = 0;
    for c in fx.cases() {
        let name = c["name"].as_str().expect("name");
        let got = run(&fx, c);
        if c.get("error").is_some() {
            if got.is_ok() {
                failures.push(format!("{name}: ComfyUI raised, sdkit gave a result"));
            }
            continue;
        }
        let got = match got {
            Ok(g) => g,
            // "area" at a zero side: ComfyUI gives an empty image, sdkit refuses.
            Err(ImageOpError::ZeroSize { .. }) => continue,
            Err(e) => {
                failures.push(format!("{name}: unexpected error {e}"));
                continue;
            }
        };
        let out = &c["output"];
        let check = |got: &Got, want: &str, what: &str, failures: &mut Vec<String>| match compare(
            got,
            &fx.array(want),
        ) {
            Ok(0.0) => {}
            Ok(d) => failures.push(format!("{name}: {what} differs by {d:e}")),
            Err(e) => failures.push(format!("{name}: {what}: {e}")),
        };
        match got {
            Ok(l) => {
                let samples = Got::F32(l.shape.to_vec(), l.samples);
                check(
                    &samples,
                    out["samples"].as_str().expect("samples"),
                    "samples",
                    &mut failures,
                );
                match (&l.noise_mask, out.get("noise_mask")) {
                    (Some((s, d)), Some(w)) => check(
                        &Got::F32(s.clone(), d.clone()),
                        w.as_str().expect("mask"),
                        "noise_mask",
                        &mut failures,
                    ),
                    (None, None) => {}
                    (g, w) => failures.push(format!(
                        "{name}: noise_mask present {} vs ComfyUI {}",
                        g.is_some(),
                        w.is_some()
                    )),
                }
                let want_bi: Option<Vec<i64>> = out.get("batch_index").map(|b| {
                    b.as_array()
                        .expect("list")
                        .iter()
                        .map(|x| x.as_i64().expect("int"))
                        .collect()
                });
                if l.batch_index != want_bi {
                    failures.push(format!(
                        "{name}: batch_index {:?} vs ComfyUI {want_bi:?}",
                        l.batch_index
                    ));
                }
            }
            Err(g) => check(&g, out.as_str().expect("output"), "output", &mut failures),
        }
        checked += 1;
    }
    assert!(checked > 800, "{checked} cases checked");
    assert!(
        failures.is_empty(),
        "{} of {} failures:\n{}",
        failures.len(),
        fx.cases().len(),
        failures
            .iter()
            .take(40)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}
