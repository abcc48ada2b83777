//! Planner tests: dispatch counts for SD blocks, memory placement, and
//! planned execution equal to unfused reference evaluation.

use proptest::prelude::*;
use sdkit_compute::plan::samples::{resblock_graph, transformer_graph, unet_like_graph};
use sdkit_compute::plan::{assign_offsets, lower_bound, plan, Lifetime};

#[test]
fn resblock_is_six_dispatches() {
    let g = resblock_graph(2, 64, 16, 256).expect("builds");
    let p = plan(&g).expect("plans");
    // GN+SiLU, SiLU(emb), emb linear (+bias), conv (+bias, +emb),
    // GN+SiLU, conv (+bias, +skip).
    assert_eq!(p.stats.dispatches, 6, "\n{p}");
    assert_eq!(
        p.kernel_histogram(),
        vec![
            ("conv2d", 2),
            ("elementwise", 1),
            ("group_norm", 2),
            ("matmul", 1)
        ]
    );
    // Every non-view op of the block is computed by exactly one kernel.
    assert_eq!(p.stats.fused_ops, 11);
}

#[test]
fn spatial_transformer_dispatch_count() {
    let g = transformer_graph(1, 64, 8, 77, 96, 8).expect("builds");
    let p = plan(&g).expect("plans");
    // norm, proj_in, ln1, q/k/v, attention, head merge copy, out(+res),
    // ln2, q, k, v, attention, head merge copy, out(+res), ln3,
    // GEGLU proj(+bias), a*gelu(gate), ff out(+res), channels-first copy,
    // proj_out(+res).
    assert_eq!(p.stats.dispatches, 22, "\n{p}");
    let h = p.kernel_histogram();
    assert!(h.contains(&("attention", 2)), "{h:?}");
    assert!(h.contains(&("layer_norm", 3)), "{h:?}");
    assert!(h.contains(&("matmul", 10)), "{h:?}");
}

#[test]
fn unet_peak_is_close_to_the_lower_bound() {
    let g = unet_like_graph(2, 64, 32, 3).expect("builds");
    let p = plan(&g).expect("plans");
    let s = &p.stats;
    let ratio = s.peak_bytes as f64 / s.lower_bound_bytes as f64;
    eprintln!(
        "unet-like: {} dispatches, peak {} B, lower bound {} B, ratio {ratio:.4}",
        s.dispatches, s.peak_bytes, s.lower_bound_bytes
    );
    assert!(s.lower_bound_bytes > 0);
    assert!(ratio <= 1.05, "peak/bound = {ratio}");
    check_no_overlap(&p);
}

fn check_no_overlap(p: &sdkit_compute::plan::Program) {
    use sdkit_compute::plan::BufferKind;
    let nk = p.kernels.len();
    let mut life = vec![(usize::MAX, 0usize); p.buffers.len()];
    for (k, kern) in p.kernels.iter().enumerate() {
        for v in kern.inputs.iter().chain(std::iter::once(&kern.output)) {
            let l = &mut life[v.buffer.0 as usize];
            l.0 = l.0.min(k);
            l.1 = l.1.max(k);
        }
    }
    for o in &p.outputs {
        life[o.buffer.0 as usize].1 = nk;
    }
    let arena: Vec<usize> = (0..p.buffers.len())
        .filter(|&i| p.buffers[i].kind == BufferKind::Arena && life[i].0 != usize::MAX)
        .collect();
    for (x, &i) in arena.iter().enumerate() {
        for &j in &arena[x + 1..] {
            let (a, b) = (&p.buffers[i], &p.buffers[j]);
            let time = life[i].0 <= life[j].1 && life[j].0 <= life[i].1;
            let space = a.offset < b.offset + b.len && b.offset < a.offset + a.len;
            assert!(
                !(time && space),
                "buffers {i} and {j} overlap while both live"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn offsets_never_overlap_live_buffers(
        bufs in proptest::collection::vec((1usize..5000, 0usize..40, 0usize..10), 1..60)
    ) {
        let lts: Vec<Lifetime> = bufs
            .iter()
            .map(|&(size, first, len)| Lifetime { size, first, last: first + len })
            .collect();
        let offs = assign_offsets(&lts);
        let peak = lts.iter().zip(&offs).map(|(l, o)| o + l.size).max().unwrap_or(0);
        prop_assert!(peak >= lts.iter().map(|l| l.size).max().unwrap_or(0));
        // Aligned sizes make the bound an upper estimate of packed sizes.
        prop_assert!(lower_bound(&lts) >= lts.iter().map(|l| l.size).max().unwrap_or(0));
        for i in 0..lts.len() {
            for j in i + 1..lts.len() {
                let (a, b) = (&lts[i], &lts[j]);
                let time = a.first <= b.last && b.first <= a.last;
                let space = offs[i] < offs[j] + b.size && offs[j] < offs[i] + a.size;
                prop_assert!(!(time && space), "{:?}@{} and {:?}@{}", a, offs[i], b, offs[j]);
            }
        }
    }
}

/// An input asked for twice by name is one node (two copies of a model in
/// one graph share each weight's upload); per-run inputs declared under a
/// prefix are the copy's own; a second declaration of another shape is
/// refused.
#[test]
fn inputs_by_name_are_shared_and_prefixes_separate_copies() {
    use sdkit_compute::plan::Command;
    use sdkit_compute::tensor::GraphBuilder;
    let g = GraphBuilder::new();
    let copy = || {
        let x = g.input("x", &[2, 4])?;
        let w = g.weight("w", &[3, 4])?;
        x.linear(w, None)
    };
    let a = copy().expect("first copy");
    g.set_input_prefix("g1.");
    let b = copy().expect("second copy");
    g.set_input_prefix("");
    assert!(
        g.weight("w", &[4, 3]).is_err(),
        "another shape under one name"
    );
    let prog = plan(&g.finish(&[a, b])).expect("plans");
    let mut uploads = Vec::new();
    let mut binds = Vec::new();
    for c in &prog.commands {
        match c {
            Command::Upload { name, .. } => uploads.push(name.clone()),
            Command::Bind { name, .. } => binds.push(name.clone()),
            _ => {}
        }
    }
    assert_eq!(uploads, ["w"]);
    binds.sort();
    assert_eq!(binds, ["g1.x", "x"]);
}
