//! Every generated kernel form is valid WGSL for each capability set the
//! backend may pick, checked by naga (WGSL front end, validator, SPIR-V
//! back end) without an adapter. The cooperative-matrix kernels need the
//! adapter feature; this proves they compile, and the conformance suite
//! checks their numbers on adapters that have it (and on emulated
//! fragments everywhere else).

use sdkit_compute::backend::wgpu::codegen::{
    conv_taps_first, generate, tilings, Caps, Coop, Operand,
};
use sdkit_compute::backend::wgpu::keep_loops;
use sdkit_compute::plan::{plan, BufferKind, Command, Kernel, KernelKind, Program};
use sdkit_compute::tensor::{Conv2dParams, GraphBuilder, TensorGraph, UpsampleMode};

fn graphs() -> Vec<(&'static str, TensorGraph)> {
    let mut v = Vec::new();
    let g = GraphBuilder::new();
    let y = g
        .input("a", &[2, 200, 72])
        .and_then(|a| a.linear(g.weight("w", &[130, 72])?, Some(g.weight("b", &[130])?)))
        .map(|y| y.gelu());
    v.push(("linear+gelu", g.finish(&[y.expect("linear")])));
    let g = GraphBuilder::new();
    let y = g
        .input("a", &[3, 40, 33])
        .and_then(|a| a.transpose(1, 2)?.matmul(g.input("b", &[3, 40, 17])?));
    v.push(("matmul, transposed A", g.finish(&[y.expect("matmul")])));
    let g = GraphBuilder::new();
    let p = Conv2dParams {
        stride: [1; 2],
        padding: [1; 2],
        dilation: [1; 2],
        groups: 1,
    };
    let y = g.input("x", &[2, 8, 20, 20]).and_then(|x| {
        let c = x.conv2d(
            g.weight("w", &[16, 8, 3, 3])?,
            Some(g.weight("b", &[16])?),
            p,
        )?;
        let s = c.shape();
        c.add(g.input("res", &s)?)
    });
    v.push(("conv+residual", g.finish(&[y.expect("conv")])));
    // Depths that are whole fragments: f16 weights are read directly.
    let g = GraphBuilder::new();
    let y = g
        .input("a", &[2, 100, 64])
        .and_then(|a| a.linear(g.weight("w", &[48, 64])?, None));
    v.push(("linear, k 64", g.finish(&[y.expect("linear")])));
    let g = GraphBuilder::new();
    let y = g
        .input("x", &[1, 16, 12, 12])
        .and_then(|x| x.conv2d(g.weight("w", &[32, 16, 3, 3])?, None, p));
    v.push(("conv, k 144", g.finish(&[y.expect("conv")])));
    let g = GraphBuilder::new();
    let y = g.input("q", &[2, 3, 70, 40]).and_then(|q| {
        q.attention(
            g.input("k", &[2, 3, 90, 40])?,
            g.input("v", &[2, 3, 90, 40])?,
            Some(g.input("mask", &[70, 90])?),
            0.15,
        )
    });
    v.push(("attention", g.finish(&[y.expect("attention")])));
    // Deep-level shapes: few output tiles over a long depth, so the
    // cooperative forms split the depth (split-K).
    let g = GraphBuilder::new();
    let y = g.input("x", &[2, 64, 4, 4]).and_then(|x| {
        let c = x.conv2d(
            g.weight("w", &[64, 64, 3, 3])?,
            Some(g.weight("b", &[64])?),
            p,
        )?;
        let s = c.shape();
        c.add(g.input("res", &s)?)
    });
    v.push(("deep conv, split-K", g.finish(&[y.expect("conv")])));
    let g = GraphBuilder::new();
    let y = g
        .input("a", &[1, 16, 2048])
        .and_then(|a| a.linear(g.weight("w", &[64, 2048])?, Some(g.weight("b", &[64])?)));
    v.push(("long linear, split-K", g.finish(&[y.expect("linear")])));
    // Two groups of 18,432 elements: each row's statistics in chunks.
    let g = GraphBuilder::new();
    let y = g.input("x", &[1, 4, 96, 96]).and_then(|x| {
        let n = x.group_norm(
            2,
            Some(g.weight("w", &[4])?),
            Some(g.weight("b", &[4])?),
            1e-5,
        )?;
        Ok(n.silu())
    });
    v.push((
        "group norm, long rows, split",
        g.finish(&[y.expect("group norm")]),
    ));
    // The other row-wise kernels: an unsplit group norm, layer and RMS
    // norms (with and without affine terms, one on a transposed view) and
    // a softmax along a middle axis.
    let g = GraphBuilder::new();
    let y = g.input("x", &[2, 8, 6, 6]).and_then(|x| {
        let a = x.group_norm(
            4,
            Some(g.weight("gw", &[8])?),
            Some(g.weight("gb", &[8])?),
            1e-6,
        )?;
        let t = x.reshape(&[2, 8, 36])?.transpose(1, 2)?;
        let l = t.layer_norm(
            Some(g.weight("lw", &[8])?),
            Some(g.weight("lb", &[8])?),
            1e-5,
        )?;
        let r = t.rms_norm(Some(g.weight("rw", &[8])?), 1e-6)?;
        let p = x.layer_norm(None, None, 1e-5)?.rms_norm(None, 1e-6)?;
        let s = x.softmax(1)?;
        Ok(vec![a, l, r, p, s])
    });
    v.push(("row-wise", g.finish(&y.expect("row-wise"))));
    // The remaining kinds: reductions over views, a gather, both
    // upsampling modes, a concat, a pad and RoPE's fused rotation.
    let g = GraphBuilder::new();
    let y = g.input("x", &[2, 8, 6, 6]).and_then(|x| {
        let t = x.transpose(2, 3)?;
        let r = vec![
            t.sum(&[1], false)?,
            t.mean(&[2, 3], true)?,
            x.max(&[3], false)?,
            t.var(&[1, 3], false)?,
        ];
        let ids = g.input("ids", &[3, 5])?;
        let e = g.weight("table", &[40, 12])?.gather(ids)?;
        let near = x.upsample(UpsampleMode::Nearest, 12, 9)?;
        let bil = x.upsample(
            UpsampleMode::Bilinear {
                align_corners: false,
            },
            11,
            13,
        )?;
        let cat = g.concat(&[x, t, x.mul_scalar(2.0)], 1)?;
        let pad = x.pad(&[(0, 0), (1, 2), (3, 0), (0, 1)], -1.0)?;
        let reflect = x.pad_reflect(&[(0, 0), (1, 2), (3, 0), (0, 1)])?;
        let q = g.input("q", &[2, 3, 7, 8])?;
        let rope = q.rope(g.input("pe", &[1, 7, 4, 2, 2])?)?;
        let mut out = r;
        out.extend([e, near, bil, cat, pad, reflect, rope]);
        Ok(out)
    });
    v.push(("other kinds", g.finish(&y.expect("other kinds"))));
    v
}

fn validate(name: &str, src: &str) {
    let module = naga::front::wgsl::parse_str(src)
        .unwrap_or_else(|e| panic!("{name}: {}\n{src}", e.emit_to_string(src)));
    let info = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    )
    .validate(&module)
    .unwrap_or_else(|e| panic!("{name}: {}\n{src}", e.emit_to_string(src)));
    let opts = naga::back::spv::Options {
        lang_version: (1, 3),
        ..Default::default()
    };
    naga::back::spv::write_vec(&module, &info, &opts, None)
        .unwrap_or_else(|e| panic!("{name}: SPIR-V: {e}\n{src}"));
}

/// Every capability set the backend may pick, by name.
/// The first kernel of `prog` named `name`.
fn kernel<'p>(prog: &'p Program, name: &str) -> &'p Kernel {
    prog.kernels
        .iter()
        .find(|k| k.kind.name() == name)
        .unwrap_or_else(|| panic!("a {name} kernel"))
}

/// Kernel `k`'s operands, each as long as its buffer (so products stage
/// whole-unit views in 16-byte units), conv weights as the backend
/// stores them for `cap`, inputs outside the arena read-only as the
/// backend binds them.
fn whole_operands(prog: &Program, k: &Kernel, f16: bool, cap: &Caps) -> Vec<Operand> {
    let mut ops: Vec<Operand> = k
        .inputs
        .iter()
        .map(|v| (v, prog.buffer(v.buffer).kind != BufferKind::Arena))
        .chain([(&k.output, false)])
        .map(|(v, read_only)| {
            Operand::whole(f16)
                .with_len(prog.buffer(v.buffer).len)
                .reading(read_only)
        })
        .collect();
    if let KernelKind::Conv2d { kh, kw, .. } = &k.kind {
        ops[1].taps_first = conv_taps_first(cap.coop.is_some(), kh * kw);
    }
    ops
}

fn all_caps() -> Vec<(&'static str, Caps)> {
    let coop16 = Some(Coop {
        tile: 16,
        subgroup: 32,
        emulated: false,
    });
    let coop8 = Some(Coop {
        tile: 8,
        subgroup: 32,
        emulated: false,
    });
    let caps = [
        ("plain", Caps::plain()),
        (
            "subgroups",
            Caps {
                subgroups: true,
                ..Caps::plain()
            },
        ),
        (
            "coop16",
            Caps {
                subgroups: true,
                coop: coop16,
                workgroup_memory: 49152,
                gemm_tiles: None,
                two_pass_attention: false,
                attention_tiles: 1,
                split_k: true,
                prefetch: false,
                double_buffer: false,
                vector_staging: true,
                channels_last: true,
                raster: true,
            },
        ),
        (
            "coop8",
            Caps {
                subgroups: true,
                coop: coop8,
                workgroup_memory: 32768,
                gemm_tiles: None,
                two_pass_attention: false,
                attention_tiles: 1,
                split_k: true,
                prefetch: false,
                double_buffer: false,
                vector_staging: true,
                channels_last: true,
                raster: true,
            },
        ),
    ];
    // Every tiling the benchmarks compare, on the 16×16 fragments.
    let mut caps = caps.to_vec();
    for tiles in tilings() {
        caps.push((
            "coop16, fixed tiles",
            Caps {
                gemm_tiles: Some(tiles),
                ..caps[2].1
            },
        ));
    }
    caps.push((
        "coop16, two-pass attention",
        Caps {
            two_pass_attention: true,
            ..caps[2].1
        },
    ));
    caps.push((
        "coop16, wave64",
        Caps {
            coop: Some(Coop {
                tile: 16,
                subgroup: 64,
                emulated: false,
            }),
            ..caps[2].1
        },
    ));
    // Staged tilings with register prefetch.
    for tiles in tilings().into_iter().filter(|t| !t.direct) {
        caps.push((
            "coop16, staged, prefetch",
            Caps {
                gemm_tiles: Some(tiles),
                prefetch: true,
                ..caps[2].1
            },
        ));
    }
    // Staged tilings with two workgroup stages.
    for tiles in tilings().into_iter().filter(|t| !t.direct) {
        caps.push((
            "coop16, staged, two stages",
            Caps {
                gemm_tiles: Some(tiles),
                double_buffer: true,
                ..caps[2].1
            },
        ));
    }
    // Convs reading their NCHW input element by element.
    caps.push((
        "coop16, NCHW convs",
        Caps {
            channels_last: false,
            ..caps[2].1
        },
    ));
    // Staged tilings reading element by element (the comparison rows).
    for tiles in tilings().into_iter().filter(|t| !t.direct) {
        caps.push((
            "coop16, staged, element loads",
            Caps {
                gemm_tiles: Some(tiles),
                vector_staging: false,
                ..caps[2].1
            },
        ));
    }
    // Two-pass attention with its key blocks prefetched (the staged
    // tilings above prefetch the single-pass form).
    caps.push((
        "coop16, two-pass attention, prefetch",
        Caps {
            two_pass_attention: true,
            prefetch: true,
            ..caps[2].1
        },
    ));
    // Single-pass attention with two query tiles a subgroup: 32 rows on
    // 32 lanes, 16 rows on 32 lanes (two lanes a row), 32 rows on 64.
    for (tile, subgroup) in [(16, 32), (8, 32), (16, 64)] {
        caps.push((
            "two query tiles",
            Caps {
                coop: Some(Coop {
                    tile,
                    subgroup,
                    emulated: false,
                }),
                attention_tiles: 2,
                ..caps[2].1
            },
        ));
    }
    // The emulated fragments CI runs on lavapipe (8 lanes), both forms,
    // each with and without prefetch, and two query tiles (two rows a
    // lane).
    for (two_pass_attention, attention_tiles) in [(false, 1), (true, 1), (false, 2)] {
        for prefetch in [false, true] {
            caps.push((
                "coop8 emulated",
                Caps {
                    coop: Some(Coop {
                        tile: 8,
                        subgroup: 8,
                        emulated: true,
                    }),
                    two_pass_attention,
                    attention_tiles,
                    prefetch,
                    ..caps[3].1
                },
            ));
        }
    }
    caps
}

/// The program of one unmasked self-attention over 300 tokens, 2×8
/// heads of width `d`.
fn self_attention(d: usize) -> Program {
    let g = GraphBuilder::new();
    let y = g.input("q", &[2, 8, 300, d]).and_then(|q| {
        q.attention(
            g.input("k", &[2, 8, 300, d])?,
            g.input("v", &[2, 8, 300, d])?,
            None,
            0.1,
        )
    });
    plan(&g.finish(&[y.expect("attention")])).expect("plan")
}

#[test]
fn attention_prefetches_key_blocks_of_whole_units() {
    // SD's head widths are whole 16-byte units in f16 and in f32: with
    // prefetch on, both cooperative forms load the next block's K and V
    // into registers (`pKQ`, `pVs`); off, or for a width that is not
    // whole units (20 halves), they stage each block in turn.
    for (d, f16, units) in [
        (40, true, true),
        (64, true, true),
        (80, false, true),
        (160, true, true),
        (20, true, false),
    ] {
        let prog = self_attention(d);
        let k = kernel(&prog, "attention");
        for two_pass_attention in [false, true] {
            for prefetch in [false, true] {
                let cap = Caps {
                    two_pass_attention,
                    prefetch,
                    ..all_caps()[2].1
                };
                let ops = whole_operands(&prog, k, f16, &cap);
                let src = generate(k, &ops, &cap).expect("generates").source;
                let name = format!("d {d}, f16 {f16}, two-pass {two_pass_attention}");
                assert_eq!(src.contains("pKQ[se] = v;"), prefetch && units, "{name}");
                assert_eq!(src.contains("pVs[se] = v;"), prefetch && units, "{name}");
                validate(&name, &src);
            }
        }
    }
}

#[test]
fn every_kernel_form_compiles_for_every_capability_set() {
    let caps = all_caps();
    let mut checked = 0;
    for (gname, g) in graphs() {
        let prog = plan(&g).expect("plan");
        for c in &prog.commands {
            let Command::Dispatch { kernel } = c else {
                continue;
            };
            let k = &prog.kernels[kernel.0 as usize];
            for (cname, cap) in &caps {
                for f16 in [false, true] {
                    let ops = whole_operands(&prog, k, f16, cap);
                    let sh =
                        generate(k, &ops, cap).unwrap_or_else(|e| panic!("{gname} {cname}: {e}"));
                    if let Some(c) = cap
                        .coop
                        .filter(|_| matches!(k.kind.name(), "matmul" | "conv2d" | "attention"))
                    {
                        // Emulated fragments multiply in `cmma`.
                        let mma = if c.emulated {
                            "cmma("
                        } else {
                            "coopMultiplyAdd"
                        };
                        assert!(sh.source.contains(mma), "{gname} {cname}: no coop");
                    }
                    let split = (cap.coop.is_some()
                        && cap.gemm_tiles.is_none()
                        && gname.ends_with("split-K"))
                        || gname.ends_with(", split");
                    if split && cap.split_k {
                        assert!(sh.finish.is_some(), "{gname} {cname}: not split");
                    }
                    let name = format!("{gname} [{cname}, f16 {f16}]");
                    // SDKIT_SHADER_DUMP=substring prints matching shaders
                    // (an empty one prints all: diff two dumps to prove a
                    // generator refactor changes no shader).
                    let dump = std::env::var("SDKIT_SHADER_DUMP").is_ok_and(|d| name.contains(&d));
                    for (which, f) in [("first", &sh.pre), ("second", &sh.finish)] {
                        let Some(f) = f else { continue };
                        let pass = format!("{gname} [{cname}, f16 {f16}, {which} pass]");
                        if dump {
                            eprintln!("// {pass} {:?}\n{}", f.groups, f.source);
                        }
                        validate(&pass, &f.source);
                    }
                    if dump {
                        eprintln!("// {name} {:?}\n{}", sh.groups, sh.source);
                    }
                    validate(&name, &sh.source);
                    // The form software adapters compile (counted loops
                    // kept), for the capability sets they can have.
                    if cap.coop.is_none_or(|c| c.emulated) {
                        let kept = keep_loops(&sh.source).unwrap_or_else(|e| panic!("{name}: {e}"));
                        validate(&format!("{name}, loops kept"), &kept);
                    }
                    checked += 1;
                }
            }
        }
    }
    eprintln!("{checked} shaders validated");
    assert!(checked >= 100);
}

#[test]
fn staged_views_load_whole_units() {
    // A linear with depth 64 on staged tiles: the activations (A, along
    // the depth) and the weight (B, depth-contiguous) are whole units,
    // read as `vec4<u32>` (f16) or `vec4<f32>`; element loads only when
    // asked.
    let g = GraphBuilder::new();
    let y = g
        .input("a", &[2, 100, 64])
        .and_then(|a| a.linear(g.weight("w", &[48, 64])?, None));
    let prog = plan(&g.finish(&[y.expect("linear")])).expect("plan");
    let k = kernel(&prog, "matmul");
    let staged = tilings().into_iter().find(|t| !t.direct);
    let caps = all_caps()[2].1;
    for (f16, unit) in [(true, "vec4<u32>"), (false, "vec4<f32>")] {
        let ops = whole_operands(&prog, k, f16, &Caps::plain());
        for vector_staging in [true, false] {
            let cap = Caps {
                gemm_tiles: staged,
                vector_staging,
                ..caps
            };
            let src = generate(k, &ops, &cap).expect("generates").source;
            for j in 0..2 {
                let declared = format!("in{j}_0: array<{unit}>");
                assert_eq!(
                    src.contains(&declared),
                    vector_staging,
                    "f16 {f16}: {declared}"
                );
                assert_eq!(src.contains(&format!("vld{j}(")), vector_staging);
            }
        }
        // A tensor of a partial unit is staged element by element.
        let mut short = ops.clone();
        short[0] = short[0].with_len(100 * 64 * 2 + 1);
        let cap = Caps {
            gemm_tiles: staged,
            ..caps
        };
        let src = generate(k, &short, &cap).expect("generates").source;
        assert!(!src.contains("vld0(") && src.contains("vld1("), "f16 {f16}");
    }
    // A conv's weights of one group (A, [out][C·9]) are whole units where
    // C·9 is: 16 channels are, 3 are not (27), on the portable kernel and
    // on staged tiles; grouped weights stay element by element.
    for (c, groups, units) in [(16, 1, true), (3, 1, false), (16, 2, false)] {
        let g = GraphBuilder::new();
        let p = Conv2dParams {
            stride: [1; 2],
            padding: [1; 2],
            dilation: [1; 2],
            groups,
        };
        let y = g
            .input("x", &[2, c, 12, 12])
            .and_then(|x| x.conv2d(g.weight("w", &[24, c / groups, 3, 3])?, None, p));
        let prog = plan(&g.finish(&[y.expect("conv")])).expect("plan");
        let k = kernel(&prog, "conv2d");
        let w = k
            .inputs
            .iter()
            .position(|v| prog.buffer(v.buffer).len == 24 * (c / groups) * 9)
            .expect("the weights");
        for (name, caps) in [("plain", Caps::plain()), ("staged", all_caps()[2].1)] {
            let caps = Caps {
                gemm_tiles: tilings().into_iter().find(|t| !t.direct),
                ..caps
            };
            for f16 in [true, false] {
                let ops = whole_operands(&prog, k, f16, &caps);
                let src = generate(k, &ops, &caps).expect("generates").source;
                assert_eq!(
                    src.contains(&format!("vld{w}(")),
                    units,
                    "{name}, f16 {f16}, {c} channels, {groups} groups"
                );
            }
        }
    }
}

#[test]
fn split_k_fills_a_large_gpu_at_sd_deep_levels() {
    // SD1.5's 1280-channel 3×3 convs, batch 2, on 16×16 fragments: at 8²
    // and 16² the output tiles alone are 20 and 80 workgroups, so the
    // depth (11,520) is split until about 256 run; at 32² (640 channels,
    // 160 workgroups) it is not. Split or not, each copies its input
    // channels-last first; a split one keeps its partial sums after the
    // copy in the same scratch.
    let caps = Caps {
        subgroups: true,
        coop: Some(Coop {
            tile: 16,
            subgroup: 32,
            emulated: false,
        }),
        workgroup_memory: 49152,
        gemm_tiles: None,
        two_pass_attention: false,
        attention_tiles: 1,
        split_k: true,
        prefetch: false,
        double_buffer: false,
        vector_staging: true,
        channels_last: true,
        raster: true,
    };
    let p = Conv2dParams {
        stride: [1; 2],
        padding: [1; 2],
        dilation: [1; 2],
        groups: 1,
    };
    for (ch, size, splits) in [(1280, 8, Some(13)), (1280, 16, Some(4)), (640, 32, None)] {
        let g = GraphBuilder::new();
        let y = g
            .input("x", &[2, ch, size, size])
            .and_then(|x| x.conv2d(g.weight("w", &[ch, ch, 3, 3])?, None, p));
        let prog = plan(&g.finish(&[y.expect("conv")])).expect("plan");
        let k = kernel(&prog, "conv2d");
        let ops = whole_operands(&prog, k, true, &caps);
        let sh = generate(k, &ops, &caps).expect("generates");
        let outputs = 2 * ch * size * size;
        let copy = sh.pre.as_ref().map(|p| p.scratch_elems);
        assert_eq!(
            copy,
            Some(outputs / 2),
            "{ch} channels at {size}²: f16 copy"
        );
        let got = sh
            .finish
            .as_ref()
            .map(|f| (f.scratch_elems - outputs / 2) / outputs);
        assert_eq!(got, splits, "{ch} channels at {size}²");
        assert_eq!(sh.source.contains("part_st("), splits.is_some());
        assert!(sh.source.contains("part[((z * "), "staged from the copy");
        let workgroups: u32 = sh.groups.iter().product();
        eprintln!("{ch}@{size}²: {workgroups} workgroups, splits {got:?}");
        if splits.is_some() {
            assert!((200..=400).contains(&workgroups), "{workgroups}");
        }
    }
}

/// A GGUF weight kept in its quant blocks compiles into every kernel that
/// reads weights (products, with and without the cooperative paths, and
/// gathers), for every block type and dequantization arithmetic.
#[test]
fn quantized_weight_readers_compile() {
    use sdkit_compute::backend::wgpu::codegen::Quant;
    use sdkit_compute::plan::BufferKind;
    use sdkit_compute::weights::{DType, Dequant};
    let mut graphs = Vec::new();
    let g = GraphBuilder::new();
    let y = g
        .input("a", &[2, 40, 512])
        .and_then(|a| a.linear(g.weight("w", &[96, 512])?, Some(g.weight("b", &[96])?)));
    graphs.push(("linear", g.finish(&[y.expect("linear")])));
    let g = GraphBuilder::new();
    let y = g
        .input("a", &[1, 16, 4096])
        .and_then(|a| a.linear(g.weight("w", &[64, 4096])?, None));
    graphs.push(("long linear, split-K", g.finish(&[y.expect("linear")])));
    let g = GraphBuilder::new();
    let y = g
        .weight("table", &[300, 256])
        .and_then(|t| t.gather(g.input("ids", &[7])?));
    graphs.push(("gather", g.finish(&[y.expect("gather")])));
    let types = [
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q2K,
        DType::Q3K,
        DType::Q4K,
        DType::Q5K,
        DType::Q6K,
    ];
    let caps = all_caps();
    let mut checked = 0;
    for (gname, g) in &graphs {
        let prog = plan(g).expect("plan");
        for k in &prog.kernels {
            let weight = k.inputs.iter().position(
                |v| matches!(&prog.buffer(v.buffer).kind, BufferKind::Weight(n) if n != "b"),
            );
            let Some(weight) = weight else { continue };
            for dtype in types {
                for dequant in [Dequant::F32, Dequant::F16, Dequant::Bf16] {
                    let q = Quant::of(dtype, dequant).expect("a block type");
                    for (cname, cap) in &caps {
                        let mut ops = vec![Operand::whole(true); k.inputs.len() + 1];
                        ops[weight] = Operand::quantized(q);
                        let name = format!("{gname} [{cname}, {} {dequant:?}]", dtype.name());
                        let sh = generate(k, &ops, cap).unwrap_or_else(|e| panic!("{name}: {e}"));
                        assert!(sh.source.contains("array<u32>"), "{name}: not quantized");
                        validate(&name, &sh.source);
                        checked += 1;
                    }
                }
            }
        }
    }
    eprintln!("{checked} quantized shaders validated");
    assert!(checked >= 3 * 10 * 3, "{checked}");
}

#[test]
fn single_pass_attention_takes_two_query_tiles_where_they_fit() {
    // On 16×16 fragments with 48 KiB: heads of 40, 64 and 80 take two
    // query tiles a subgroup (a second probability fragment `pa1`, each
    // V fragment loaded once for both); 160 needs more score rows than
    // fit and keeps one, still in one pass.
    for (d, two) in [(40, true), (64, true), (80, true), (160, false)] {
        let prog = self_attention(d);
        let k = kernel(&prog, "attention");
        let cap = Caps {
            attention_tiles: 2,
            ..all_caps()[2].1
        };
        let ops = whole_operands(&prog, k, true, &cap);
        let sh = generate(k, &ops, &cap).expect("generates");
        assert_eq!(sh.source.contains("let pa1 = "), two, "d {d}");
        assert!(
            sh.source.contains("atomicOr(&rescale"),
            "d {d}: single pass"
        );
        // 128 queries a workgroup against 64: half the workgroups.
        let one = generate(k, &ops, &all_caps()[2].1).expect("generates");
        let blocks = |s: &sdkit_compute::backend::wgpu::codegen::Shader| s.groups[0];
        let want = if two { 16 * 3 } else { 16 * 5 };
        assert_eq!((blocks(&sh), blocks(&one)), (want, 16 * 5), "d {d}");
        validate(&format!("d {d}"), &sh.source);
    }
}

#[test]
fn inputs_outside_the_arena_bind_read_only() {
    // A linear over a per-run input and a weight: both are declared
    // `read`; the arena's intermediate (the linear's output, read by the
    // GELU after it) and every output stay read-write.
    let g = GraphBuilder::new();
    let y = g.input("a", &[2, 16, 24]).and_then(|a| {
        a.linear(g.weight("w", &[8, 24])?, None)?
            .exp()
            .sum(&[2], false)
    });
    let prog = plan(&g.finish(&[y.expect("graph")])).expect("plan");
    let caps = all_caps()[2].1;
    let mut seen = 0;
    for k in &prog.kernels {
        let ops = whole_operands(&prog, k, true, &caps);
        let src = generate(k, &ops, &caps).expect("generates").source;
        for (j, v) in k.inputs.iter().enumerate() {
            let arena = prog.buffer(v.buffer).kind == BufferKind::Arena;
            let access = if arena { "read_write" } else { "read" };
            let decl = format!("var<storage, {access}> in{j}_0");
            assert!(src.contains(&decl), "{}: no {decl}", k.kind.name());
            seen += usize::from(!arena);
        }
        assert!(src.contains("var<storage, read_write> dst_0"));
        validate(k.kind.name(), &src);
    }
    assert_eq!(seen, 2, "the input and the weight:\n{prog}");
}
