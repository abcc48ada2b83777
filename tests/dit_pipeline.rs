//! Flux (dev, schnell) end to end gives ComfyUI's latents and images for
//! the same seed, and its parts give ComfyUI's values: tiny models in the
//! real layouts (`flux1-dev` transformer files for UNETLoader, an fp8
//! one, `t5xxl` and `clip_l` text encoder files for DualCLIPLoader type
//! flux, the `ae` VAE without quant convs, and an all-in-one checkpoint as
//! ComfyUI saves it), run by `sdkit run` and compared with ComfyUI's nodes
//! on the same graphs (tools/reference/flux_pipeline.py →
//! tests/reference/flux/expected.json). Covers CLIPTextEncode with
//! weights, FluxGuidance, ConditioningZeroOut, EmptySD3LatentImage,
//! KSampler, SamplerCustomAdvanced with BasicGuider and ModelSamplingFlux,
//! CLIPTextEncodeFlux, img2img on a latent with an odd patch count, a T5
//! prompt longer than 256 tokens, schnell without guidance, fp8 weights.

mod support;
// Guidance nodes, ControlNets and Redux on the transformer families.
#[path = "dit_pipeline/extras.rs"]
mod extras;

use sdkit_compute::backend::cpu;
use sdkit_compute::plan::plan;
use sdkit_compute::tensor::{GraphBuilder, InputKind};
use sdkit_compute::weights::SafeTensors;
use sdkit_nodes::models::flux::{
    chroma_index_table, flux, flux_config, grid, rope_table, FluxInputs, CHROMA_MODULATIONS,
};
use sdkit_nodes::models::mmdit::{mmdit, mmdit_config, MmditInputs};
use sdkit_nodes::models::t5::{bucket_ids, encoder, t5_config};
use sdkit_nodes::t5_tokenizer::{Padding, T5Tokenizer};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use support::{check_graph, copy_input, f32s, rel_diff, run, write_fixture_entry};

/// `fn $name() -> &'static Value`: the fixture at `$path`, read once.
macro_rules! fixtures {
    ($($name:ident => $path:literal),* $(,)?) => {
        $(fn $name() -> &'static serde_json::Value {
            static FX: OnceLock<serde_json::Value> = OnceLock::new();
            FX.get_or_init(|| support::fixture($path))
        })*
    };
}

fixtures! {
    fixture => "flux/expected.json",
    sd3 => "sd3/expected.json",
    scaled_fp8 => "scaled_fp8/expected.json",
    flux_fill => "flux_fill/expected.json",
    kontext => "flux_kontext/expected.json",
    chroma => "chroma/expected.json",
    gguf => "gguf/expected.json",
    gguf_lora => "gguf_lora/expected.json",
    fp8_lora => "fp8_lora/expected.json",
    flux_lora => "flux_lora/expected.json",
    sd3_lora => "sd3_lora/expected.json",
    dit_guidance => "dit_guidance/expected.json",
    flux_controlnet => "flux_controlnet/expected.json",
    sd3_controlnet => "sd3_controlnet/expected.json",
    flux_redux => "flux_redux/expected.json",
    flux_instantx => "flux_instantx/expected.json",
}

/// A base folder with every tiny model file of `fx` and the input image.
fn setup_with(fx: &serde_json::Value) -> tempfile::TempDir {
    let base = tempfile::tempdir().expect("tempdir");
    for f in fx["files"].as_array().expect("files") {
        write_fixture_entry(&base.path().join("models"), f);
    }
    copy_input(base.path());
    base
}

/// One file of `fx` written alone under `dir`; returns its path.
fn write_one(fx: &serde_json::Value, dir: &Path, name: &str) -> std::path::PathBuf {
    let f = fx["files"]
        .as_array()
        .expect("files")
        .iter()
        .find(|f| f["name"] == name)
        .unwrap_or_else(|| panic!("{name} in the fixture"));
    write_fixture_entry(dir, f);
    dir.join(f["folder"].as_str().expect("folder")).join(name)
}

fn shapes(file: &SafeTensors) -> BTreeMap<String, Vec<usize>> {
    file.tensors()
        .map(|t| (t.name.clone(), t.shape.clone()))
        .collect()
}

fn weights(file: &SafeTensors, graph: &sdkit_compute::tensor::TensorGraph) -> cpu::Bindings {
    let mut bind = cpu::Bindings::default();
    for (_, name, _) in graph.inputs(InputKind::Weight) {
        let v = file.to_f32(name).expect("weight");
        bind.weights.insert(name.to_string(), Arc::new(v));
    }
    bind
}

/// Whether a wgpu adapter is here (without one: skipped, or a failure
/// under SDKIT_REQUIRE_WGPU, as CI sets).
fn wgpu_here(what: &str) -> bool {
    match sdkit_compute::backend::wgpu::WgpuBackend::new(None) {
        Ok(_) => true,
        Err(e) => {
            sdkit_compute::backend::wgpu::no_adapter(what, e);
            false
        }
    }
}

fn matches_on(graph: &str, device: &str) {
    matches_in(fixture(), graph, device);
}

fn matches_in(fx: &serde_json::Value, graph: &str, device: &str) {
    let base = setup_with(fx);
    run(base.path(), graph, device);
    check_graph(base.path(), fx, graph, None);
}

/// Runs one case of a `*_forward` component: inputs `x`, `context` (its
/// first `tokens` rows), `y` (where the model takes one), `timestep`,
/// `guidance`; returns the output and the reference's.
fn forward_case(
    cfg: &sdkit_nodes::models::flux::FluxConfig,
    file: &SafeTensors,
    case: &serde_json::Value,
    tokens: Option<usize>,
) -> (Vec<f32>, Vec<f32>) {
    let dims = |k: &str| -> Vec<usize> {
        case[k]
            .as_array()
            .expect("shape")
            .iter()
            .map(|v| v.as_u64().expect("dim") as usize)
            .collect()
    };
    let (xs, mut cs) = (dims("x_shape"), dims("context_shape"));
    cs[1] = tokens.unwrap_or(cs[1]);
    let g = GraphBuilder::new();
    let (gh, gw) = grid(xs[2], xs[3]);
    let x = g.input("x", &xs).expect("input");
    let inputs = FluxInputs {
        t: g.input("t", &[1]).expect("input"),
        context: g.input("context", &cs).expect("input"),
        y: (cfg.vec_in > 0).then(|| g.input("y", &[1, cfg.vec_in]).expect("input")),
        guidance: Some(g.input("guidance", &[1]).expect("input")),
        guidance_on: None,
        pe: g
            .input("pe", &[1, cs[1] + gh * gw, cfg.head_dim / 2, 2, 2])
            .expect("input"),
        chroma_index: cfg.approximator.is_some().then(|| {
            g.input("chroma_index", &[CHROMA_MODULATIONS, 32])
                .expect("input")
        }),
        refs: Vec::new(),
        control: Default::default(),
    };
    let out = flux(&g, cfg, "", x, inputs, &Default::default()).expect("builds");
    assert_eq!(out.shape(), xs);
    let graph = g.finish(&[out]);
    let prog = plan(&graph).expect("plans");
    let mut bind = weights(file, &graph);
    let f = |k: &str| f32s(case[k].as_str().expect("input"));
    bind.inputs.insert("x".into(), Arc::new(f("x_f32")));
    let context = f("context_f32");
    bind.inputs.insert(
        "context".into(),
        Arc::new(context[..cs[1] * cs[2]].to_vec()),
    );
    if cfg.vec_in > 0 {
        bind.inputs.insert("y".into(), Arc::new(f("y_f32")));
    }
    let scalar = |k: &str| Arc::new(vec![case[k].as_f64().expect("scalar") as f32]);
    bind.inputs.insert("t".into(), scalar("timestep"));
    bind.inputs.insert("guidance".into(), scalar("guidance"));
    bind.inputs
        .insert("pe".into(), Arc::new(rope_table(cfg, cs[1], gh, gw)));
    bind.inputs
        .insert("chroma_index".into(), Arc::new(chroma_index_table()));
    let got = cpu::run(&prog, &bind).expect("runs");
    (got[0].data.clone(), f("out_f32"))
}

/// `[[[id, weight], ...], ...]` as (id, weight) batches.
fn batches(v: &serde_json::Value) -> Vec<Vec<(u32, f32)>> {
    v.as_array()
        .expect("batches")
        .iter()
        .map(|b| {
            b.as_array()
                .expect("batch")
                .iter()
                .map(|tw| {
                    (
                        tw[0].as_u64().expect("id") as u32,
                        tw[1].as_f64().expect("w") as f32,
                    )
                })
                .collect()
        })
        .collect()
}

#[test]
fn t5_tokens_match_comfyui() {
    let tok = T5Tokenizer::shared().expect("tokenizer");
    let t = &fixture()["components"]["t5_tokens"];
    for p in t["prompts"].as_array().expect("prompts") {
        let text = p["text"].as_str().expect("text");
        for (family, min) in [("flux", 256), ("sd3", 77)] {
            assert_eq!(t["min_length"][family], min);
            // ComfyUI ran with an empty embedding folder: a missing
            // `embedding:` name is dropped.
            let padding = Padding::min_length(min);
            let (got, _) = tok.tokenize_with_embeddings(text, padding, &mut |_| None);
            assert_eq!(
                got,
                batches(&p[family]),
                "{} ({family}): {text:?}",
                p["label"]
            );
        }
    }
}

#[test]
fn t5_encoder_matches_comfyui() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = SafeTensors::open(&write_one(fixture(), dir.path(), "tiny_t5xxl.safetensors"))
        .expect("opens");
    let cfg = t5_config(&shapes(&file), "")
        .expect("detects")
        .expect("a T5");
    assert_eq!(
        (cfg.width, cfg.layers, cfg.heads, cfg.head_dim),
        (32, 2, 4, 8)
    );
    let tok = T5Tokenizer::shared().expect("tokenizer");
    let table = file.to_f32("shared.weight").expect("table");
    let mut checked = 0;
    for h in fixture()["components"]["t5_hidden"]
        .as_array()
        .expect("t5_hidden")
    {
        let text = h["text"].as_str().expect("text");
        let padding = Padding::min_length(256);
        let (batches, _) = tok.tokenize_with_embeddings(text, padding, &mut |_| None);
        // Weighted prompts also encode the empty prompt (the pipeline
        // tests cover them); the plain ones compare the encoder itself.
        if batches[0].iter().any(|&(_, w)| w != 1.0) {
            continue;
        }
        let ids: Vec<usize> = batches[0].iter().map(|&(t, _)| t as usize).collect();
        let len = ids.len();
        let g = GraphBuilder::new();
        let x = g.input("x", &[1, len, cfg.width]).expect("input");
        let b = g.input("buckets", &[len * len]).expect("input");
        let y = encoder(
            &g,
            &cfg,
            "",
            x,
            b,
            None,
            sdkit_nodes::models::clip::ClipLayer::Last,
            true,
        )
        .expect("builds");
        let graph = g.finish(&[y]);
        let prog = plan(&graph).expect("plans");
        let mut bind = weights(&file, &graph);
        let emb: Vec<f32> = ids
            .iter()
            .flat_map(|&i| table[i * cfg.width..(i + 1) * cfg.width].iter().copied())
            .collect();
        bind.inputs.insert("x".into(), Arc::new(emb));
        bind.inputs
            .insert("buckets".into(), Arc::new(bucket_ids(len, &cfg)));
        let got = cpu::run(&prog, &bind).expect("runs");
        let want = f32s(h["cond_f32"].as_str().expect("cond"));
        let d = rel_diff(&got[0].data, &want);
        eprintln!("t5 {text:?}: rel diff {d:e}");
        assert!(d < 1e-4, "{text:?}: {d}");
        checked += 1;
    }
    assert!(checked > 0, "no unweighted prompt to check");
}

#[test]
fn flux_forward_matches_comfyui() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = write_one(fixture(), dir.path(), "tiny_flux_dev.safetensors");
    let file = SafeTensors::open(&path).expect("opens");
    let cfg = flux_config(&shapes(&file), "").expect("detects");
    assert_eq!(
        (
            cfg.hidden,
            cfg.heads,
            cfg.axes_dim,
            cfg.depth,
            cfg.depth_single,
            cfg.guidance
        ),
        (64, 2, [4, 14, 14], 2, 2, true)
    );
    for case in fixture()["components"]["flux_forward"]
        .as_array()
        .expect("cases")
    {
        let (got, want) = forward_case(&cfg, &file, case, None);
        let d = rel_diff(&got, &want);
        eprintln!("flux forward {}: rel diff {d:e}", case["x_shape"]);
        assert!(d < 1e-4, "{}: {d}", case["x_shape"]);
    }
}

/// Chroma's forward: the approximator's modulation table sliced per block.
/// ComfyUI's masked case (padding tokens masked out of the joint
/// attention) equals the unmasked run on the unpadded context, which is
/// what sdkit runs (ComfyUI passes no mask in its Chroma workflows).
#[test]
fn chroma_forward_matches_comfyui() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = write_one(chroma(), dir.path(), "tiny_chroma.safetensors");
    let file = SafeTensors::open(&path).expect("opens");
    let cfg = flux_config(&shapes(&file), "").expect("detects");
    let a = cfg.approximator.as_ref().expect("an approximator");
    assert_eq!((a.in_dim, a.hidden, a.layers, cfg.vec_in), (64, 48, 2, 0));
    for case in chroma()["components"]["chroma_forward"]
        .as_array()
        .expect("cases")
    {
        let tokens = case
            .get("txt_mask")
            .and_then(|m| m.as_array())
            .map(|m| m.iter().filter(|v| v.as_u64() == Some(1)).count());
        let (got, want) = forward_case(&cfg, &file, case, tokens);
        let d = rel_diff(&got, &want);
        eprintln!(
            "chroma forward {} ({tokens:?} tokens): rel diff {d:e}",
            case["x_shape"]
        );
        assert!(d < 1e-4, "{}: {d}", case["x_shape"]);
    }
}

#[test]
fn chroma_tokens_match_comfyui() {
    let tok = T5Tokenizer::shared().expect("tokenizer");
    let t = &chroma()["components"]["chroma_tokens"];
    let padded = Padding {
        min_padding: Some(1),
        min_length: 0,
    };
    for p in t["prompts"].as_array().expect("prompts") {
        let text = p["text"].as_str().expect("text");
        for (key, padding) in [
            ("default", Padding::min_length(1)),
            ("min_padding_1", padded),
        ] {
            let (got, _) = tok.tokenize_with_embeddings(text, padding, &mut |_| None);
            assert_eq!(got, batches(&p[key]), "{} ({key}): {text:?}", p["label"]);
        }
    }
}

#[test]
fn chroma_txt2img_matches_comfyui() {
    matches_in(chroma(), "tiny_chroma_txt2img", "cpu");
}

#[test]
fn chroma_tokenizer_options_match_comfyui() {
    matches_in(chroma(), "tiny_chroma_t5opts", "cpu");
}

#[test]
fn chroma_long_prompt_on_wgpu_matches_comfyui() {
    if !wgpu_here("Chroma on wgpu") {
        return;
    }
    matches_in(chroma(), "tiny_chroma_long", "wgpu");
}

#[test]
fn txt2img_matches_comfyui() {
    matches_on("tiny_flux_txt2img", "cpu");
}

#[test]
fn custom_sampling_with_clip_text_encode_flux_matches_comfyui() {
    matches_on("tiny_flux_custom", "cpu");
}

#[test]
fn img2img_matches_comfyui() {
    matches_on("tiny_flux_img2img", "cpu");
}

#[test]
fn schnell_matches_comfyui() {
    matches_on("tiny_flux_schnell", "cpu");
}

#[test]
fn long_t5_prompt_matches_comfyui() {
    matches_on("tiny_flux_long_prompt", "cpu");
}

#[test]
fn fp8_file_matches_comfyui() {
    matches_on("tiny_flux_fp8", "cpu");
}

/// ComfyUI's scaled-fp8 files (tools/reference/scaled_fp8.py): a Flux
/// and a T5 whose Linear weights are fp8 times a per-layer scale, their
/// biases held in fp8, through UNETLoader and DualCLIPLoader.
#[test]
fn scaled_fp8_files_match_comfyui() {
    matches_in(scaled_fp8(), "tiny_flux_scaled_fp8", "cpu");
}

/// A LoRA on a scaled-fp8 Flux: ComfyUI patches `stored · scale` and
/// keeps the stochastic rounding of `result / scale` (clamped at ±448).
#[test]
fn scaled_fp8_with_lora_matches_comfyui() {
    matches_in(scaled_fp8(), "tiny_flux_scaled_fp8_lora", "cpu");
}

/// The same on wgpu, which stores weights as f16: a scaled weight (fp8 ×
/// an arbitrary f32 scale) is no longer exact there, so the latent gets
/// the f16 weight rounding's tolerance.
#[test]
fn scaled_fp8_files_on_wgpu_match_comfyui() {
    if !wgpu_here("scaled fp8 on wgpu") {
        return;
    }
    let fx = scaled_fp8();
    let base = setup_with(fx);
    run(base.path(), "tiny_flux_scaled_fp8", "wgpu");
    check_graph(base.path(), fx, "tiny_flux_scaled_fp8", Some(2e-4));
}

/// Flux Fill (96 input channels: the latent, the masked image's latent
/// and the mask folded 8×8) through InpaintModelConditioning and
/// DifferentialDiffusion, on a latent with an odd width
/// (tools/reference/flux_fill.py).
#[test]
fn flux_fill_inpaint_matches_comfyui() {
    high_guidance_matches("tiny_flux_fill", "cpu", HIGH_GUIDANCE_TOL);
}

/// Outpainting with a feathered mask: DifferentialDiffusion at strength
/// 0.6 thresholds the soft mask per step.
#[test]
fn flux_fill_outpaint_matches_comfyui() {
    high_guidance_matches("tiny_flux_fill_outpaint", "cpu", HIGH_GUIDANCE_TOL);
}

/// A Canny/Depth-style Flux (32 input channels) through
/// InstructPixToPixConditioning.
#[test]
fn flux_canny_matches_comfyui() {
    high_guidance_matches("tiny_flux_canny", "cpu", HIGH_GUIDANCE_TOL);
}

/// On wgpu: a model with extra input channels samples on the host loop
/// (the device loop builds the model's input from the latent alone).
#[test]
fn flux_canny_on_wgpu_matches_comfyui() {
    if !wgpu_here("Flux Canny on wgpu") {
        return;
    }
    high_guidance_matches("tiny_flux_canny", "wgpu", 4.0 * HIGH_GUIDANCE_TOL);
}

/// DifferentialDiffusion on a discrete-time model: the threshold follows
/// the UNet's timestep index, not sigma.
#[test]
fn differential_diffusion_on_sd1_matches_comfyui() {
    matches_in(flux_fill(), "tiny_sd1_diffdiff", "cpu");
}

/// The same on wgpu: the device loop uploads the mask of each step.
#[test]
fn differential_diffusion_on_wgpu_matches_comfyui() {
    if !wgpu_here("differential diffusion on wgpu") {
        return;
    }
    matches_in(flux_fill(), "tiny_sd1_diffdiff", "wgpu");
}

#[test]
fn flux_fill_on_wgpu_matches_comfyui() {
    if !wgpu_here("Flux Fill on wgpu") {
        return;
    }
    high_guidance_matches("tiny_flux_fill", "wgpu", 4.0 * HIGH_GUIDANCE_TOL);
}

/// The latent tolerance of the guidance-30 graphs (Flux Fill's and
/// Canny's usual setting). The guidance embedding's arguments reach
/// 30,000 rad there, and torch's f32 `exp` (SLEEF) differs by an ulp from
/// the correctly rounded one on 3 of the 128 frequencies, which moves the
/// embedding by up to 8e-4: latents land 3–5e-6 from ComfyUI's instead of
/// the ~4e-7 of the guidance-3.5 graphs (the same graphs at guidance 3.5
/// meet the default tolerance). Pixels may differ by 1/255 on at most 1%.
const HIGH_GUIDANCE_TOL: f32 = 1e-5;

fn high_guidance_matches(graph: &str, device: &str, tol: f32) {
    let fx = flux_fill();
    let base = setup_with(fx);
    run(base.path(), graph, device);
    check_graph(base.path(), fx, graph, Some(tol));
}

/// Flux Kontext (tools/reference/flux_kontext.py): ReferenceLatent's
/// latent patches after the image's, at RoPE index 1; a negative without
/// a reference (cond and uncond then run apart), a reference unlike the
/// latent in size.
#[test]
fn kontext_matches_comfyui() {
    matches_in(kontext(), "tiny_flux_kontext", "cpu");
}

/// Two references with odd sides, placed by each method of
/// FluxKontextMultiReferenceLatentMethod.
#[test]
fn kontext_reference_methods_match_comfyui() {
    for graph in [
        "tiny_flux_kontext_multi",
        "tiny_flux_kontext_index",
        "tiny_flux_kontext_uxo",
    ] {
        matches_in(kontext(), graph, "cpu");
    }
}

#[test]
fn kontext_on_wgpu_matches_comfyui() {
    if !wgpu_here("Flux Kontext on wgpu") {
        return;
    }
    matches_in(kontext(), "tiny_flux_kontext_multi", "wgpu");
}

/// Where each method puts the references' patches, as ComfyUI gave them
/// to the model: `[index, h_first, w_first, h_last, w_last, tokens]`.
#[test]
fn kontext_reference_positions_match_comfyui() {
    use sdkit_nodes::models::flux::{ref_placements, RefMethod};
    let ids = &kontext()["components"]["ref_ids"];
    // (latent h, w) and the references' (h, w), from the graphs.
    let cases = [
        ("tiny_flux_kontext", (6, 8), vec![(5, 6)], RefMethod::Offset),
        (
            "tiny_flux_kontext_multi",
            (5, 6),
            vec![(5, 6), (7, 4)],
            RefMethod::Offset,
        ),
        (
            "tiny_flux_kontext_index",
            (6, 6),
            vec![(5, 6), (7, 4)],
            RefMethod::Index,
        ),
        (
            "tiny_flux_kontext_uxo",
            (6, 6),
            vec![(5, 6), (7, 4)],
            RefMethod::Uxo,
        ),
    ];
    for (graph, hw, refs, method) in cases {
        let got: Vec<Vec<f64>> = ref_placements(hw, &refs, method)
            .iter()
            .map(|p| {
                vec![
                    p.index,
                    p.h0 as f64,
                    p.w0 as f64,
                    (p.h0 + p.rows - 1) as f64,
                    (p.w0 + p.cols - 1) as f64,
                    (p.rows * p.cols) as f64,
                ]
            })
            .collect();
        let want: Vec<Vec<f64>> = serde_json::from_value(ids[graph].clone()).expect("ids");
        assert_eq!(got, want, "{graph}");
    }
}

/// FluxKontextImageScale: ComfyUI's size table and choice, and its
/// Lanczos output (through 8-bit Pillow) at sampled pixels.
#[test]
fn kontext_image_scale_matches_comfyui() {
    use sdkit_nodes::image::{kontext_size, KONTEXT_RESOLUTIONS};
    use sdkit_nodes::imageops::{scale_to, Crop, Tensor4, UpscaleMethod};
    let c = &kontext()["components"];
    let table: Vec<(usize, usize)> =
        serde_json::from_value(c["kontext_resolutions"].clone()).expect("table");
    assert_eq!(table, KONTEXT_RESOLUTIONS.to_vec());
    let path = support::root().join("graphs/input/example.png");
    let (img, _) = sdkit_nodes::imagefile::load_tensors(&path, &Default::default()).expect("png");
    let s = &img.shape;
    let base = Tensor4::new(s[0], s[1], s[2], s[3], img.data.clone()).expect("image");
    for case in c["kontext_image_scale"].as_array().expect("cases") {
        let input: Vec<usize> = serde_json::from_value(case["input_shape"].clone()).expect("in");
        let src = if input[1..3] == [base.h, base.w] {
            Tensor4::new(base.b, base.h, base.w, base.c, base.data.clone()).expect("image")
        } else {
            scale_to(
                &base,
                UpscaleMethod::Bilinear,
                input[2],
                input[1],
                Crop::Disabled,
            )
            .expect("ImageScale")
        };
        let (w, h) = kontext_size(src.w, src.h);
        let out = scale_to(&src, UpscaleMethod::Lanczos, w, h, Crop::Center).expect("scale");
        let want_shape: Vec<usize> =
            serde_json::from_value(case["output_shape"].clone()).expect("out");
        assert_eq!(
            vec![out.b, out.h, out.w, out.c],
            want_shape,
            "{}",
            case["label"]
        );
        let positions: Vec<[usize; 3]> =
            serde_json::from_value(case["positions"].clone()).expect("positions");
        let want = f32s(case["values_f32"].as_str().expect("values"));
        let mut worst = 0f32;
        for (p, v) in positions.iter().zip(&want) {
            let got = out.data[(p[0] * out.w + p[1]) * out.c + p[2]];
            worst = worst.max((got - v).abs());
        }
        let mean = out.data.iter().map(|&v| f64::from(v)).sum::<f64>() / out.data.len() as f64;
        let want_mean = case["mean"].as_f64().expect("mean");
        eprintln!(
            "{}: worst sampled difference {worst:e}, mean {mean} (ComfyUI {want_mean})",
            case["label"]
        );
        assert!(worst <= 1e-6, "{}: differs by {worst}", case["label"]);
        assert!(
            (mean - want_mean).abs() < 1e-6,
            "{}: mean {mean}",
            case["label"]
        );
    }
}

#[test]
fn all_in_one_checkpoint_matches_comfyui() {
    matches_on("tiny_flux_aio", "cpu");
}

#[test]
fn txt2img_on_wgpu_matches_comfyui() {
    if !wgpu_here("Flux txt2img on wgpu") {
        return;
    }
    matches_on("tiny_flux_txt2img", "wgpu");
}

#[test]
fn custom_sampling_on_wgpu_matches_comfyui() {
    if !wgpu_here("Flux custom sampling on wgpu") {
        return;
    }
    matches_on("tiny_flux_custom", "wgpu");
}

/// The MMDiT of each SD3 layout: SD3 Medium, 3.5 Large's RMS-normed q/k,
/// 3.5 Medium's second image attention; latents with odd patch counts
/// (circular padding, the position table's centre crop).
#[test]
fn mmdit_forward_matches_comfyui() {
    const PREFIX: &str = "model.diffusion_model.";
    let dir = tempfile::tempdir().expect("tempdir");
    let forward = &sd3()["components"]["mmdit_forward"];
    for (name, cases) in forward.as_object().expect("by file") {
        let file = SafeTensors::open(&write_one(sd3(), dir.path(), name)).expect("opens");
        let cfg = mmdit_config(&shapes(&file), PREFIX).expect("detects");
        assert_eq!((cfg.hidden, cfg.heads, cfg.blocks), (128, 2, 2), "{name}");
        for case in cases.as_array().expect("cases") {
            let dims = |k: &str| -> Vec<usize> {
                case[k]
                    .as_array()
                    .expect("shape")
                    .iter()
                    .map(|v| v.as_u64().expect("dim") as usize)
                    .collect()
            };
            let (xs, cs, ys) = (dims("x_shape"), dims("context_shape"), dims("y_shape"));
            let g = GraphBuilder::new();
            let x = g.input("x", &xs).expect("input");
            let t = g.input("t", &[1]).expect("input");
            let c = g.input("context", &cs).expect("input");
            let y = g.input("y", &ys).expect("input");
            let inputs = MmditInputs {
                t,
                context: c,
                y: Some(y),
                control: Vec::new(),
            };
            let out = mmdit(&g, &cfg, PREFIX, x, inputs, &Default::default()).expect("builds");
            assert_eq!(out.shape(), xs);
            let graph = g.finish(&[out]);
            let prog = plan(&graph).expect("plans");
            let mut bind = weights(&file, &graph);
            let f = |k: &str| Arc::new(f32s(case[k].as_str().expect("input")));
            bind.inputs.insert("x".into(), f("x_f32"));
            bind.inputs.insert("context".into(), f("context_f32"));
            bind.inputs.insert("y".into(), f("y_f32"));
            let ts = case["timestep"].as_f64().expect("timestep") as f32;
            bind.inputs.insert("t".into(), Arc::new(vec![ts]));
            let got = cpu::run(&prog, &bind).expect("runs");
            let d = rel_diff(&got[0].data, &f32s(case["out_f32"].as_str().expect("out")));
            eprintln!("mmdit {name} {xs:?}: rel diff {d:e}");
            assert!(d < 1e-4, "{name} {xs:?}: {d}");
        }
    }
}

#[test]
fn sd3_txt2img_matches_comfyui() {
    matches_in(sd3(), "tiny_sd3_txt2img", "cpu");
}

#[test]
fn sd3_triple_clip_loader_matches_comfyui() {
    matches_in(sd3(), "tiny_sd3_triple", "cpu");
}

#[test]
fn sd3_without_t5_matches_comfyui() {
    matches_in(sd3(), "tiny_sd3_no_t5", "cpu");
}

#[test]
fn sd3_img2img_matches_comfyui() {
    matches_in(sd3(), "tiny_sd3_img2img", "cpu");
}

#[test]
fn sd35_large_matches_comfyui() {
    matches_in(sd3(), "tiny_sd35_large_txt2img", "cpu");
}

#[test]
fn sd35_medium_on_wgpu_matches_comfyui() {
    if !wgpu_here("SD3.5 Medium on wgpu") {
        return;
    }
    matches_in(sd3(), "tiny_sd35_medium_txt2img", "wgpu");
}

#[test]
fn sd35_medium_matches_comfyui() {
    matches_in(sd3(), "tiny_sd35_medium_txt2img", "cpu");
}

/// A Q8_0 GGUF Flux, built as ComfyUI-GGUF's files are (the same bytes as
/// the reference script's file, by SHA-256), loaded by
/// UnetLoaderGGUFAdvanced and dequantized as the gguf package does: the
/// same image as ComfyUI's with `dequant_dtype` float32.
#[test]
fn gguf_q8_0_flux_matches_comfyui() {
    gguf_q8_0_flux_on("tiny_flux_gguf_q8_0_dequant_f32", "cpu");
}

/// UnetLoaderGGUF's default: the dequantization in f16 arithmetic, as
/// ComfyUI-GGUF computes it.
#[test]
fn gguf_q8_0_flux_with_f16_dequantization_matches_comfyui() {
    gguf_q8_0_flux_on("tiny_flux_gguf_q8_0", "cpu");
}

#[test]
fn gguf_q8_0_flux_on_wgpu_matches_comfyui() {
    if !wgpu_here("GGUF Flux on wgpu") {
        return;
    }
    gguf_q8_0_flux_on("tiny_flux_gguf_q8_0_dequant_f32", "wgpu");
}

/// A Q4_K GGUF Flux (the K-quant rows where they are whole 256-value
/// blocks, as llama.cpp's converter leaves the rest F16), byte for byte
/// the reference file, through UnetLoaderGGUF: ComfyUI's image.
#[test]
fn gguf_q4_k_flux_matches_comfyui() {
    gguf_flux_on("tiny_flux_q4_k.gguf", 12, "tiny_flux_gguf_q4_k", "cpu");
}

/// On wgpu, where the Q4_K blocks stay quantized on the device.
#[test]
fn gguf_q4_k_flux_on_wgpu_matches_comfyui() {
    if !wgpu_here("GGUF Q4_K Flux on wgpu") {
        return;
    }
    gguf_flux_on("tiny_flux_q4_k.gguf", 12, "tiny_flux_gguf_q4_k", "wgpu");
}

fn gguf_q8_0_flux_on(graph: &str, device: &str) {
    gguf_flux_on("tiny_flux_q8_0.gguf", 8, graph, device);
}

/// Builds the tiny Flux as the reference script's GGUF file `name` (ggml
/// type `target`), checks it is that file byte for byte (SHA-256), and
/// runs `graph` on it.
fn gguf_flux_on(name: &str, target: u32, graph: &str, device: &str) {
    let base = setup_with(fixture());
    write_gguf_flux(base.path(), name, target);
    run(base.path(), graph, device);
    // On wgpu the quantized weights stay in their blocks and the kernels
    // decode them in f32 as the CPU does (the rest of the file holds f16
    // values, which the device's f16 storage keeps exactly), so what
    // remains is the GPU's own summation order and transcendentals: about
    // 2.5e-6, as for the safetensors Flux on wgpu, whose fixture's spread
    // happens to allow it (this one's allows 2.3e-6).
    let tol = (device == "wgpu").then_some(5e-6);
    check_graph(base.path(), gguf(), graph, tol);
}

/// The tiny Flux GGUF file `name` (GGML type `target`) rebuilt byte for
/// byte as the reference script wrote it, under `base`'s `models/unet`.
fn write_gguf_flux(base: &Path, name: &str, target: u32) {
    let dev = fixture()["files"]
        .as_array()
        .expect("files")
        .iter()
        .find(|f| f["name"] == "tiny_flux_dev.safetensors")
        .expect("dev");
    let bytes = support::tiny_flux_gguf(&dev["keys"], target);
    let want = gguf()["gguf_files"]
        .as_array()
        .expect("gguf files")
        .iter()
        .find(|f| f["name"] == name)
        .map(|f| &f["header"])
        .unwrap_or_else(|| panic!("{name} in the fixture"));
    assert_eq!(
        bytes.len() as u64,
        want["file_size"].as_u64().expect("size")
    );
    assert_eq!(
        support::sha256(&bytes),
        want["sha256"].as_str().expect("sha")
    );
    std::fs::write(base.join("models/unet").join(name), bytes).expect("write");
}

/// A LoRA on a GGUF Flux through ComfyUI-GGUF's loader
/// (tools/reference/gguf_lora.py): quantized weights patched in f32 at
/// each use, the file's f16 weights merged and rounded back to f16.
fn gguf_lora_matches(name: &str, target: u32, graph: &str) {
    let base = setup_with(fixture());
    write_gguf_flux(base.path(), name, target);
    for f in gguf_lora()["files"].as_array().expect("files") {
        write_fixture_entry(&base.path().join("models"), f);
    }
    run(base.path(), graph, "cpu");
    check_graph(base.path(), gguf_lora(), graph, None);
}

/// ComfyUI's stochastic rounding of LoRA-patched fp8 weights, bit for
/// bit (tools/reference/fp8_lora.py): its seeds, torch's f16 draws, and
/// the rounded codes of weight-like, mixed, tiny, huge and signed-zero
/// inputs in both fp8 formats.
#[test]
fn stochastic_fp8_rounding_matches_comfyui() {
    use sdkit_compute::weights::{
        f16_to_f32, f32_to_f16_bits, f8_e4m3_to_f32, f8_e5m2_to_f32, DType,
    };
    use sdkit_nodes::adapters::stochastic::{rand_f16, stochastic_round, string_to_seed};
    let c = &fp8_lora()["components"];
    for e in c["string_to_seed"].as_array().expect("seeds") {
        let key = e["key"].as_str().expect("key");
        assert_eq!(
            string_to_seed(key),
            e["seed"].as_u64().expect("seed"),
            "{key}"
        );
    }
    let r = &c["torch_rand_f16"];
    let mut gen = sdkit_nodes::noise::Mt19937::new(r["seed"].as_u64().expect("seed"));
    let bits: Vec<u16> = support::b64(r["f16_bits"].as_str().expect("bits"))
        .chunks(2)
        .map(|b| u16::from_le_bytes([b[0], b[1]]))
        .collect();
    for (i, &want) in bits.iter().enumerate() {
        let got = rand_f16(&mut gen);
        assert_eq!(
            f32_to_f16_bits(got),
            want,
            "draw {i}: {got} vs {}",
            f16_to_f32(want)
        );
    }
    let sr = &c["stochastic_rounding"];
    let mut checked = 0;
    for case in sr["cases"].as_array().expect("cases") {
        let input = &sr["inputs"][case["input"].as_str().expect("input")];
        let mut v = f32s(input["f32"].as_str().expect("f32"));
        let (dtype, decode): (DType, fn(u8) -> f32) = match case["dtype"].as_str() {
            Some("float8_e4m3fn") => (DType::F8E4M3, f8_e4m3_to_f32),
            _ => (DType::F8E5M2, f8_e5m2_to_f32),
        };
        stochastic_round(&mut v, dtype, case["seed"].as_u64().expect("seed"));
        let want = support::b64(case["fp8"].as_str().expect("fp8"));
        assert_eq!(want.len(), v.len());
        for (i, (&g, &code)) in v.iter().zip(&want).enumerate() {
            let w = decode(code);
            let same = (g.is_nan() && w.is_nan()) || g.to_bits() == w.to_bits();
            assert!(
                same,
                "{} {:?} element {i}: {g} vs {w}",
                case["input"], case["dtype"]
            );
        }
        checked += v.len();
    }
    eprintln!("stochastic rounding: {checked} values bit for bit");
}

/// UNETLoader's fp8 weight_dtype with a LoRA: the patched weights
/// rounded back to fp8 stochastically, as ComfyUI on the CPU.
#[test]
fn fp8_weight_dtype_with_lora_matches_comfyui() {
    for graph in ["tiny_flux_fp8_lora", "tiny_flux_fp8_e5m2_lora"] {
        let base = setup_with(fixture());
        for f in fp8_lora()["files"].as_array().expect("files") {
            write_fixture_entry(&base.path().join("models"), f);
        }
        run(base.path(), graph, "cpu");
        check_graph(base.path(), fp8_lora(), graph, None);
    }
}

#[test]
fn gguf_q8_0_flux_with_a_kohya_lora_matches_comfyui() {
    gguf_lora_matches("tiny_flux_q8_0.gguf", 8, "tiny_flux_gguf_lora");
}

/// Q4_K, where most patched weights are the file's f16 ones.
#[test]
fn gguf_q4_k_flux_with_a_diffusers_lora_matches_comfyui() {
    gguf_lora_matches("tiny_flux_q4_k.gguf", 12, "tiny_flux_gguf_q4_k_lora");
}

/// A T5 in GGUF with llama.cpp's tensor names (`token_embd`,
/// `enc.blk.N.attn_q`, `ffn_gate`, ...), stored F16 with the values of the
/// `t5xxl` safetensors file, loaded by DualCLIPLoaderGGUF: the same
/// conditioning, so the Flux txt2img reference holds.
#[test]
fn gguf_t5_in_llama_names_matches_the_safetensors_t5() {
    let base = setup_with(fixture());
    let t5 = fixture()["files"]
        .as_array()
        .expect("files")
        .iter()
        .find(|f| f["name"] == "tiny_t5xxl.safetensors")
        .expect("t5");
    let mut tensors = Vec::new();
    for k in t5["keys"].as_array().expect("keys") {
        let name = k[0].as_str().expect("name");
        let shape: Vec<usize> = k[1]
            .as_array()
            .expect("shape")
            .iter()
            .map(|d| d.as_u64().expect("dim") as usize)
            .collect();
        let llama = name
            .replace("encoder.block.", "enc.blk.")
            .replace(
                "layer.0.SelfAttention.relative_attention_bias",
                "attn_rel_b",
            )
            .replace("layer.0.SelfAttention.", "attn_")
            .replace("layer.0.layer_norm", "attn_norm")
            .replace("layer.1.layer_norm", "ffn_norm")
            .replace("layer.1.DenseReluDense.wi_0", "ffn_gate")
            .replace("layer.1.DenseReluDense.wi_1", "ffn_up")
            .replace("layer.1.DenseReluDense.wo", "ffn_down")
            .replace("encoder.final_layer_norm", "enc.output_norm")
            .replace("shared", "token_embd");
        let bits: Vec<u8> = support::values(name, &shape)
            .into_iter()
            .flat_map(|v| sdkit_compute::backend::wgpu::f32_to_f16_bits(v).to_le_bytes())
            .collect();
        tensors.push((llama, shape, 1u32, bits));
    }
    tensors.sort();
    let bytes = support::gguf_bytes("t5encoder", 1, &tensors);
    std::fs::write(base.path().join("models/clip/tiny_t5xxl.gguf"), bytes).expect("write");
    let graph = "tiny_flux_gguf_t5";
    run(base.path(), graph, "cpu");
    // The reference is the safetensors T5's run of the same graph.
    let mut fx = fixture().clone();
    let reference = fx["workflows"]["tiny_flux_txt2img"].clone();
    fx["workflows"][graph] = reference;
    check_graph(base.path(), &fx, graph, None);
}

/// A workflow of `loras` (a LoRA fixture: tools/reference/flux_lora.py,
/// sd3_lora.py) with its LoRA files beside the models of `models`.
fn lora_matches(models: &serde_json::Value, loras: &serde_json::Value, graph: &str) {
    let base = setup_with(models);
    for f in loras["files"].as_array().expect("files") {
        write_fixture_entry(&base.path().join("models"), f);
    }
    run(base.path(), graph, "cpu");
    check_graph(base.path(), loras, graph, None);
}

fn flux_lora_matches(graph: &str) {
    lora_matches(fixture(), flux_lora(), graph);
}

/// Kohya names (`lora_unet_double_blocks_0_img_attn_qkv`, …) with alphas,
/// on every kind of Flux layer, embedders and final layer included.
#[test]
fn flux_kohya_lora_matches_comfyui() {
    flux_lora_matches("tiny_flux_lora_kohya");
}

/// Diffusers/PEFT names (ai-toolkit): q, k and v as rows of the fused
/// projections, a single block's `proj_mlp` as linear1's last rows,
/// `norm_out` with its halves swapped.
#[test]
fn flux_diffusers_lora_matches_comfyui() {
    flux_lora_matches("tiny_flux_lora_diffusers");
}

/// LoraLoader with a CLIP-L part (`lora_te1_`) on the Flux CLIP, then a
/// LoraLoaderModelOnly at a negative strength.
#[test]
fn flux_lora_stack_with_clip_matches_comfyui() {
    flux_lora_matches("tiny_flux_lora_stack");
}

/// ComfyUI's own names (`diffusion_model.…`, `linear1_qkv`, `.diff_b`).
#[test]
fn flux_comfyui_lora_matches_comfyui() {
    flux_lora_matches("tiny_flux_lora_comfy");
}

fn sd3_lora_matches(graph: &str) {
    lora_matches(sd3(), sd3_lora(), graph);
}

/// Diffusers names: q, k, v as rows of the fused projections (image and
/// context sides), the last block's pre-only `norm1_context` and
/// `norm_out` with their halves swapped, the embedders.
#[test]
fn sd3_diffusers_lora_matches_comfyui() {
    sd3_lora_matches("tiny_sd3_lora_diffusers");
}

/// Kohya and `diffusion_model.` names mixed, with `.diff_b` biases.
#[test]
fn sd3_kohya_lora_matches_comfyui() {
    sd3_lora_matches("tiny_sd3_lora_kohya");
}

/// LoraLoader with CLIP-L (`lora_te1_`) and CLIP-G (`lora_te2_`) layers
/// and both text projections.
#[test]
fn sd3_clip_lora_matches_comfyui() {
    sd3_lora_matches("tiny_sd3_lora_clip");
}
