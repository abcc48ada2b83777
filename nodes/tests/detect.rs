//! Detection on key/shape maps laid out exactly as the original
//! checkpoints are (ldm names), at real and at tiny sizes.

use sdkit_nodes::models::detect::{
    detect_checkpoint, DetectError, EncoderArch, Family, Heads, Shapes,
};

struct Gen {
    s: Shapes,
}

impl Gen {
    fn put(&mut self, name: String, shape: &[usize]) {
        self.s.insert(name, shape.to_vec());
    }

    fn res(&mut self, p: &str, cin: usize, cout: usize, emb: usize) {
        self.put(format!("{p}in_layers.0.weight"), &[cin]);
        self.put(format!("{p}in_layers.0.bias"), &[cin]);
        self.put(format!("{p}in_layers.2.weight"), &[cout, cin, 3, 3]);
        self.put(format!("{p}in_layers.2.bias"), &[cout]);
        self.put(format!("{p}emb_layers.1.weight"), &[cout, emb]);
        self.put(format!("{p}emb_layers.1.bias"), &[cout]);
        self.put(format!("{p}out_layers.0.weight"), &[cout]);
        self.put(format!("{p}out_layers.0.bias"), &[cout]);
        self.put(format!("{p}out_layers.3.weight"), &[cout, cout, 3, 3]);
        self.put(format!("{p}out_layers.3.bias"), &[cout]);
        if cin != cout {
            self.put(format!("{p}skip_connection.weight"), &[cout, cin, 1, 1]);
            self.put(format!("{p}skip_connection.bias"), &[cout]);
        }
    }

    fn st(&mut self, p: &str, c: usize, ctx: usize, linear: bool, depth: usize) {
        self.put(format!("{p}norm.weight"), &[c]);
        self.put(format!("{p}norm.bias"), &[c]);
        let proj: Vec<usize> = if linear { vec![c, c] } else { vec![c, c, 1, 1] };
        self.put(format!("{p}proj_in.weight"), &proj);
        self.put(format!("{p}proj_out.weight"), &proj);
        for d in 0..depth {
            let b = format!("{p}transformer_blocks.{d}.");
            for a in ["attn1", "attn2"] {
                let kv = if a == "attn1" { c } else { ctx };
                self.put(format!("{b}{a}.to_q.weight"), &[c, c]);
                self.put(format!("{b}{a}.to_k.weight"), &[c, kv]);
                self.put(format!("{b}{a}.to_v.weight"), &[c, kv]);
                self.put(format!("{b}{a}.to_out.0.weight"), &[c, c]);
                self.put(format!("{b}{a}.to_out.0.bias"), &[c]);
            }
            for n in ["norm1", "norm2", "norm3"] {
                self.put(format!("{b}{n}.weight"), &[c]);
            }
            self.put(format!("{b}ff.net.0.proj.weight"), &[8 * c, c]);
            self.put(format!("{b}ff.net.2.weight"), &[c, 4 * c]);
        }
    }
}

/// An SD1/SD2-style checkpoint's key layout at width `mc`.
fn sd_unet(
    mc: usize,
    mult: &[usize],
    attn: &[bool],
    ctx: usize,
    linear: bool,
    depth: usize,
) -> Shapes {
    let mut g = Gen { s: Shapes::new() };
    let p = "model.diffusion_model.";
    let emb = 4 * mc;
    g.put(format!("{p}time_embed.0.weight"), &[emb, mc]);
    g.put(format!("{p}input_blocks.0.0.weight"), &[mc, 4, 3, 3]);
    let mut skips = vec![mc];
    let mut c = mc;
    let mut block = 1;
    for (l, &m) in mult.iter().enumerate() {
        for _ in 0..2 {
            let cout = mc * m;
            g.res(&format!("{p}input_blocks.{block}.0."), c, cout, emb);
            c = cout;
            if attn[l] {
                g.st(
                    &format!("{p}input_blocks.{block}.1."),
                    c,
                    ctx,
                    linear,
                    depth,
                );
            }
            skips.push(c);
            block += 1;
        }
        if l + 1 < mult.len() {
            g.put(
                format!("{p}input_blocks.{block}.0.op.weight"),
                &[c, c, 3, 3],
            );
            skips.push(c);
            block += 1;
        }
    }
    g.res(&format!("{p}middle_block.0."), c, c, emb);
    g.st(&format!("{p}middle_block.1."), c, ctx, linear, depth);
    g.res(&format!("{p}middle_block.2."), c, c, emb);
    let mut ob = 0;
    for (l, &m) in mult.iter().enumerate().rev() {
        for r in 0..3 {
            let skip = skips.pop().unwrap_or(mc);
            let cout = mc * m;
            g.res(&format!("{p}output_blocks.{ob}.0."), c + skip, cout, emb);
            c = cout;
            let mut sub = 1;
            if attn[l] {
                g.st(&format!("{p}output_blocks.{ob}.1."), c, ctx, linear, depth);
                sub = 2;
            }
            if l > 0 && r == 2 {
                g.put(
                    format!("{p}output_blocks.{ob}.{sub}.conv.weight"),
                    &[c, c, 3, 3],
                );
            }
            ob += 1;
        }
    }
    g.put(format!("{p}out.0.weight"), &[c]);
    g.put(format!("{p}out.2.weight"), &[4, c, 3, 3]);
    g.s
}

fn add_clip_vae(s: &mut Shapes, width: usize, layers: usize, vae_ch: usize) {
    let t = "cond_stage_model.transformer.text_model.";
    s.insert(
        format!("{t}embeddings.token_embedding.weight"),
        vec![49408, width],
    );
    s.insert(
        format!("{t}embeddings.position_embedding.weight"),
        vec![77, width],
    );
    for l in 0..layers {
        s.insert(
            format!("{t}encoder.layers.{l}.mlp.fc1.weight"),
            vec![4 * width, width],
        );
    }
    let v = "first_stage_model.";
    s.insert(format!("{v}encoder.conv_in.weight"), vec![vae_ch, 3, 3, 3]);
    for (l, m) in [1usize, 2, 4, 4].iter().enumerate() {
        for b in 0..2 {
            s.insert(
                format!("{v}encoder.down.{l}.block.{b}.conv2.weight"),
                vec![vae_ch * m, vae_ch * m, 3, 3],
            );
        }
    }
    s.insert(
        format!("{v}decoder.conv_in.weight"),
        vec![vae_ch * 4, 4, 3, 3],
    );
}

#[test]
fn sd15_full_size() {
    let mut s = sd_unet(
        320,
        &[1, 2, 4, 4],
        &[true, true, true, false],
        768,
        false,
        1,
    );
    add_clip_vae(&mut s, 768, 12, 128);
    let d = detect_checkpoint(&s).expect("detects");
    assert_eq!(d.family, Family::Sd1);
    let u = d.net.unet().expect("a UNet");
    assert_eq!(u.model_channels, 320);
    assert_eq!(u.channel_mult, [1, 2, 4, 4]);
    assert_eq!(u.num_res_blocks, [2, 2, 2, 2]);
    assert_eq!(u.transformer_depth, [1, 1, 1, 1, 1, 1, 0, 0]);
    assert_eq!(
        u.transformer_depth_output,
        [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0]
    );
    assert_eq!(u.transformer_depth_middle, Some(1));
    assert_eq!(u.context_dim, Some(768));
    assert!(!u.use_linear_in_transformer);
    assert_eq!((u.in_channels, u.out_channels), (4, 4));
    assert_eq!(d.text.len(), 1);
    let EncoderArch::Clip(c) = &d.text[0].arch else {
        panic!("SD1's CLIP is in the HF layout")
    };
    assert_eq!(
        (c.width, c.layers, c.heads, c.intermediate, c.vocab),
        (768, 12, 12, 3072, 49408)
    );
    let v = d.vae.expect("vae");
    assert_eq!(
        (v.ch, v.ch_mult.clone(), v.num_res_blocks, v.z_channels),
        (128, vec![1, 2, 4, 4], 2, 4)
    );
}

#[test]
fn tiny_sd1_infers_every_size_from_shapes() {
    // A distilled/tiny layout: two levels, attention only on the first.
    let mut s = sd_unet(32, &[1, 2], &[true, false], 768, false, 2);
    add_clip_vae(&mut s, 768, 2, 8);
    let d = detect_checkpoint(&s).expect("detects");
    let u = d.net.unet().expect("a UNet");
    assert_eq!(u.model_channels, 32);
    assert_eq!(u.channel_mult, [1, 2]);
    assert_eq!(u.num_res_blocks, [2, 2]);
    assert_eq!(u.transformer_depth, [2, 2, 0, 0]);
    assert_eq!(u.transformer_depth_output, [2, 2, 2, 0, 0, 0]);
    assert_eq!(d.text.first().map(|p| p.arch.layers()), Some(2));
}

#[test]
fn unet_families_by_structure_at_any_width() {
    // SD 2.x: linear projections, no ADM; 64-channel heads.
    for (mc, ctx) in [(320, 1024), (64, 128)] {
        let sd2 = sd_unet(mc, &[1, 2, 4, 4], &[true, true, true, false], ctx, true, 1);
        let d = detect_checkpoint(&sd2).expect("SD2 detects");
        assert_eq!(d.family, Family::Sd2);
        assert_eq!(d.heads, Heads::Width(64));
        assert!(d.text.is_empty());
    }
    // SDXL base: ADM = pooled + 6×256; the refiner's = context + 5×256.
    for (mc, ctx, adm, family) in [
        (320, 2048, 2816, Family::Sdxl),
        (64, 192, 128 + 1536, Family::Sdxl),
        (384, 1280, 2560, Family::SdxlRefiner),
        (64, 128, 128 + 1280, Family::SdxlRefiner),
    ] {
        let mut xl = sd_unet(mc, &[1, 2, 4], &[false, true, true], ctx, true, 2);
        xl.insert(
            "model.diffusion_model.label_emb.0.0.weight".into(),
            vec![4 * mc, adm],
        );
        let d = detect_checkpoint(&xl).expect("SDXL detects");
        assert_eq!(
            (d.family, d.net.unet().expect("a UNet").adm_in_channels),
            (family, Some(adm))
        );
    }
    // An ADM input of neither form (SD 2.x unCLIP) is not guessed.
    let mut unclip = sd_unet(
        320,
        &[1, 2, 4, 4],
        &[true, true, true, false],
        1024,
        true,
        1,
    );
    unclip.insert(
        "model.diffusion_model.label_emb.0.0.weight".into(),
        vec![1280, 1536],
    );
    assert!(matches!(
        detect_checkpoint(&unclip),
        Err(DetectError::UnknownUnet { .. })
    ));
}

#[test]
fn transformer_files_missing_keys_name_them() {
    let mut flux = Shapes::new();
    flux.insert(
        "model.diffusion_model.double_blocks.0.img_attn.norm.key_norm.scale".into(),
        vec![128],
    );
    flux.insert("model.diffusion_model.img_in.weight".into(), vec![3072, 64]);
    // Flux is built: a file missing its keys names the one it lacks.
    assert_eq!(
        detect_checkpoint(&flux).map(|d| d.family),
        Err(DetectError::Missing {
            name: "model.diffusion_model.double_blocks.0.img_attn.norm.query_norm.scale".into()
        })
    );
    flux.insert(
        "model.diffusion_model.distilled_guidance_layer.in_proj.weight".into(),
        vec![5120, 64],
    );
    assert_eq!(
        detect_checkpoint(&flux).map(|d| d.family),
        Err(DetectError::Missing {
            name: "model.diffusion_model.double_blocks.0.img_attn.norm.query_norm.scale".into()
        })
    );

    let mut sd3 = Shapes::new();
    sd3.insert(
        "model.diffusion_model.joint_blocks.0.context_block.attn.qkv.weight".into(),
        vec![4608, 1536],
    );
    assert_eq!(
        detect_checkpoint(&sd3).map(|d| d.family),
        Err(DetectError::Missing {
            name: "model.diffusion_model.x_embedder.proj.weight".into()
        })
    );
    let msg = DetectError::Unsupported(Family::Sd3).to_string();
    assert!(
        msg.contains("Stable Diffusion 3") && msg.contains("not support"),
        "{msg}"
    );

    assert!(matches!(
        detect_checkpoint(&Shapes::new()),
        Err(DetectError::NoModel { .. })
    ));
}

#[test]
fn truncated_checkpoint_names_the_missing_tensor() {
    let mut s = sd_unet(32, &[1, 2], &[true, false], 768, false, 1);
    s.remove("model.diffusion_model.input_blocks.1.0.out_layers.3.weight");
    match detect_checkpoint(&s) {
        Err(DetectError::Missing { name }) => assert!(name.ends_with("out_layers.3.weight")),
        other => panic!("{other:?}"),
    }
}

#[test]
fn heads_by_count_or_by_width() {
    assert_eq!(Heads::Count(8).at(320), 8);
    assert_eq!(Heads::Count(8).at(1280), 8);
    // SDXL: 64-channel heads, 5 at 320 channels and 20 at 1280.
    assert_eq!(Heads::Width(64).at(320), 5);
    assert_eq!(Heads::Width(64).at(1280), 20);
    // A tiny model narrower than one head still has one.
    assert_eq!(Heads::Width(64).at(32), 1);
}

/// flux1-dev's and flux1-schnell's real shapes give their real config:
/// every size from shapes, the RoPE axes from the head width.
#[test]
fn flux_sizes_from_shapes() {
    use sdkit_nodes::models::detect::{detect_unet, Net};
    let mut s = Shapes::new();
    let mut put = |k: String, v: &[usize]| {
        s.insert(k, v.to_vec());
    };
    put("img_in.weight".into(), &[3072, 64]);
    put("txt_in.weight".into(), &[3072, 4096]);
    put("vector_in.in_layer.weight".into(), &[3072, 768]);
    put("guidance_in.in_layer.weight".into(), &[3072, 256]);
    put("final_layer.linear.weight".into(), &[64, 3072]);
    for i in 0..19 {
        let p = format!("double_blocks.{i}.");
        put(format!("{p}img_attn.norm.query_norm.scale"), &[128]);
        put(format!("{p}img_attn.norm.key_norm.scale"), &[128]);
        put(format!("{p}img_attn.qkv.weight"), &[9216, 3072]);
        put(format!("{p}img_attn.qkv.bias"), &[9216]);
        put(format!("{p}img_mlp.0.weight"), &[12288, 3072]);
    }
    for i in 0..38 {
        put(format!("single_blocks.{i}.linear1.weight"), &[21504, 3072]);
    }
    let (family, net, _, prefix) = detect_unet(&s).expect("detects");
    assert_eq!((family, prefix), (Family::Flux, ""));
    let Net::Flux(f) = net else {
        panic!("not a Flux config")
    };
    assert_eq!(
        (
            f.hidden,
            f.heads,
            f.head_dim,
            f.mlp,
            f.depth,
            f.depth_single
        ),
        (3072, 24, 128, 12288, 19, 38)
    );
    assert_eq!(
        (f.in_channels, f.out_channels, f.vec_in, f.context_in),
        (16, 16, 768, 4096)
    );
    assert_eq!(f.axes_dim, [16, 56, 56]);
    assert!(f.guidance && f.qkv_bias);
    s.remove("guidance_in.in_layer.weight");
    let (_, net, _, _) = detect_unet(&s).expect("detects schnell");
    assert!(matches!(net, Net::Flux(f) if !f.guidance));
}

/// "Scaled fp8" files (weights × a per-layer `scale_weight`, a
/// `scaled_fp8` marker) are detected as their unscaled layout: the scales
/// are applied where the file is read, not by detection.
#[test]
fn scaled_fp8_files_detect_as_their_layout() {
    use sdkit_nodes::models::detect::detect_text_encoder;
    let mut t5 = Shapes::new();
    for (k, s) in [
        ("shared.weight", vec![32128, 32]),
        ("encoder.final_layer_norm.weight", vec![32]),
        (
            "encoder.block.0.layer.0.SelfAttention.q.weight",
            vec![32, 32],
        ),
        (
            "encoder.block.0.layer.0.SelfAttention.q.scale_weight",
            vec![],
        ),
        (
            "encoder.block.0.layer.0.SelfAttention.k.weight",
            vec![32, 32],
        ),
        (
            "encoder.block.0.layer.0.SelfAttention.v.weight",
            vec![32, 32],
        ),
        (
            "encoder.block.0.layer.0.SelfAttention.o.weight",
            vec![32, 32],
        ),
        (
            "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
            vec![32, 4],
        ),
        ("encoder.block.0.layer.0.layer_norm.weight", vec![32]),
        ("encoder.block.0.layer.1.layer_norm.weight", vec![32]),
        (
            "encoder.block.0.layer.1.DenseReluDense.wi_0.weight",
            vec![64, 32],
        ),
        (
            "encoder.block.0.layer.1.DenseReluDense.wi_1.weight",
            vec![64, 32],
        ),
        (
            "encoder.block.0.layer.1.DenseReluDense.wo.weight",
            vec![32, 64],
        ),
        ("scaled_fp8", vec![0]),
    ] {
        t5.insert(k.into(), s);
    }
    let part = detect_text_encoder(&t5)
        .expect("a scaled T5 is detected")
        .expect("an encoder");
    assert_eq!(part.role, sdkit_nodes::models::family::TextEncoder::T5Xxl);
}
