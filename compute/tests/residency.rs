//! The residency planner's guarantees, on random model uses and on a
//! UNet-shaped program.

use proptest::prelude::*;
use sdkit_compute::plan::residency::{plan_residency, weight_uses, ModelUse, WeightUse};
use sdkit_compute::plan::{plan, samples};

const ALIGN: u64 = 256;

fn model_use() -> impl Strategy<Value = (ModelUse, u64, u64)> {
    (
        prop::collection::vec(
            (
                1u64..20_000,
                0usize..3,
                prop::bool::weighted(0.1),
                prop::bool::weighted(0.05),
            ),
            1..50,
        ),
        0u64..50_000,
        0.0f64..1.3,
        0.0f64..1.3,
    )
        .prop_map(|(ws, act, f1, f2)| {
            let mut weights = Vec::new();
            let mut k = 0;
            for (i, (bytes, span, long, keep)) in ws.iter().enumerate() {
                // Mostly one weight per kernel or two; some read again far
                // later (shared weights).
                let first = k;
                let last = if *long {
                    first + 5
                } else {
                    first + span.min(&1)
                };
                weights.push(WeightUse {
                    name: format!("w{i}"),
                    bytes: bytes.div_ceil(4) * 4,
                    first,
                    last,
                    keep: *keep,
                });
                k += 1 + span;
            }
            let kernels = k + 6;
            let total: u64 = weights.iter().map(|w| w.bytes).sum();
            let b1 = act + (total as f64 * f1) as u64;
            let b2 = act + (total as f64 * f2) as u64;
            (
                ModelUse {
                    weights,
                    kernels,
                    activation_bytes: act,
                    runs: 10,
                },
                b1.min(b2),
                b1.max(b2),
            )
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn plans_keep_their_guarantees((u, small, large) in model_use()) {
        let total: u64 = u.weights.iter().map(|w| w.bytes).sum();
        let a = plan_residency(&u, small, ALIGN, u64::MAX);
        let b = plan_residency(&u, large, ALIGN, u64::MAX);
        if a.is_ok() {
            prop_assert!(b.is_ok(), "a larger budget failed: {:?}", b);
        }
        for (p, budget) in [(a, small), (b, large)] {
            let Ok(p) = p else { continue };
            // Within budget.
            prop_assert!(p.device_bytes <= budget, "{} > {budget}", p.device_bytes);
            prop_assert_eq!(
                p.device_bytes,
                u.activation_bytes + p.resident_bytes + p.stream_arena_bytes
            );
            // Every weight exactly once: resident or streamed.
            let mut seen = vec![0u8; u.weights.len()];
            for &i in &p.resident {
                seen[i] += 1;
            }
            for s in &p.streamed {
                seen[s.weight] += 1;
            }
            prop_assert!(seen.iter().all(|&n| n == 1));
            // Weights marked to keep stay resident.
            for (i, w) in u.weights.iter().enumerate() {
                if w.keep {
                    prop_assert!(p.resident.contains(&i), "{} must stay", w.name);
                }
            }
            // Bytes per run: exactly what is not resident; never below the bound.
            prop_assert_eq!(p.streamed_bytes_per_run, total - p.resident_bytes);
            prop_assert!(p.streamed_bytes_per_run >= p.lower_bound_per_run);
            if u.activation_bytes + total <= budget {
                prop_assert_eq!(p.streamed_bytes_per_run, 0);
            }
            // Slots: inside the arena, uploaded no later than one kernel
            // before the first reader, never overlapping a slot live at the
            // same time.
            for s in &p.streamed {
                let w = &u.weights[s.weight];
                let size = w.bytes.div_ceil(ALIGN) * ALIGN;
                prop_assert!(s.offset + size <= p.stream_arena_bytes);
                prop_assert!(s.upload_before <= w.first);
                prop_assert_eq!(s.offset % ALIGN, 0);
            }
            for (i, s) in p.streamed.iter().enumerate() {
                for t in &p.streamed[i + 1..] {
                    let (ws, wt) = (&u.weights[s.weight], &u.weights[t.weight]);
                    let live = s.upload_before <= wt.last && t.upload_before <= ws.last;
                    let (ss, ts) = (ws.bytes.div_ceil(ALIGN) * ALIGN, wt.bytes.div_ceil(ALIGN) * ALIGN);
                    let overlap = s.offset < t.offset + ts && t.offset < s.offset + ss;
                    prop_assert!(!(live && overlap), "{} and {} share bytes while live", ws.name, wt.name);
                }
            }
        }
        // Monotone: a larger budget never moves more.
        if let (Ok(a), Ok(b)) = (
            plan_residency(&u, small, ALIGN, u64::MAX),
            plan_residency(&u, large, ALIGN, u64::MAX),
        ) {
            prop_assert!(b.streamed_bytes_per_run <= a.streamed_bytes_per_run);
        }
    }
}

/// A UNet-shaped program at budgets of 100%, 50% and 25% of its weights:
/// bytes streamed per run against the lower bound.
#[test]
fn unet_shaped_program_streams_what_does_not_fit() {
    let g = samples::unet_like_graph(2, 64, 16, 3).expect("graph");
    let prog = plan(&g).expect("plans");
    let weights = weight_uses(&prog, 2);
    let total: u64 = weights.iter().map(|w| w.bytes).sum();
    let act = prog.stats.arena_bytes as u64;
    let u = ModelUse {
        weights,
        kernels: prog.stats.dispatches,
        activation_bytes: act,
        runs: 20,
    };
    let mut last = 0;
    for pct in [100u64, 50, 25] {
        let budget = act + total * pct / 100;
        let p = plan_residency(&u, budget, ALIGN, u64::MAX).expect("plans");
        eprintln!(
            "{pct}% of {total} weight bytes: resident {}, streamed/run {}, lower bound {}, stream arena {}",
            p.resident_bytes, p.streamed_bytes_per_run, p.lower_bound_per_run, p.stream_arena_bytes
        );
        assert!(p.device_bytes <= budget);
        assert!(p.streamed_bytes_per_run >= last);
        // Within the stream-arena reservation of the bound.
        assert!(
            p.streamed_bytes_per_run
                <= p.lower_bound_per_run + 2 * p.stream_arena_bytes.max(1) + total / 20
        );
        last = p.streamed_bytes_per_run;
        if pct == 100 {
            assert_eq!(p.streamed_bytes_per_run, 0);
        }
    }
}
