//! Residency across a workflow's model uses: the budget holds at every use,
//! every weight a use keeps is on the device when it runs, the bytes moved
//! respect the lower bound, and the known future beats recency.

use proptest::prelude::*;
use sdkit_compute::plan::residency::{ModelUse, WeightUse};
use sdkit_compute::plan::schedule::{
    plan_workflow, DeviceWeights, ScheduledUse, UseSchedule, WorkflowUse,
};

const ALIGN: u64 = 256;

/// A model: weights read by consecutive kernels, some by two.
fn model_weights(prefix: &str, sizes: &[(u64, bool)]) -> Vec<WeightUse> {
    let mut k = 0;
    sizes
        .iter()
        .enumerate()
        .map(|(i, &(bytes, pair))| {
            let w = WeightUse {
                name: format!("{prefix}.w{i}"),
                bytes: bytes.div_ceil(4) * 4,
                first: k,
                last: k + usize::from(pair),
                keep: false,
            };
            k += 1 + usize::from(pair);
            w
        })
        .collect()
}

fn use_of(weights: Vec<WeightUse>, activation_bytes: u64, runs: usize) -> ModelUse {
    let kernels = weights.iter().map(|w| w.last + 1).max().unwrap_or(0) + 2;
    ModelUse {
        weights,
        kernels,
        activation_bytes,
        runs,
    }
}

fn workflow(
    models: &[(&str, ModelUse)],
    order: &[(usize, usize)],
) -> (UseSchedule, Vec<WorkflowUse>) {
    let schedule = UseSchedule {
        uses: order
            .iter()
            .enumerate()
            .map(|(i, &(m, _))| ScheduledUse {
                node: format!("n{i}"),
                class_type: "Test".into(),
                models: vec![models[m].0.to_string()],
            })
            .collect(),
    };
    let uses = order
        .iter()
        .enumerate()
        .map(|(at, &(m, runs))| WorkflowUse {
            at,
            models: vec![models[m].0.to_string()],
            model_use: ModelUse {
                runs,
                ..models[m].1.clone()
            },
        })
        .collect();
    (schedule, uses)
}

type Case = (Vec<(String, ModelUse)>, Vec<(usize, usize)>, u64, u64);

fn case() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec(
            (
                prop::collection::vec((1u64..20_000, prop::bool::weighted(0.2)), 1..20),
                0u64..30_000,
            ),
            1..4,
        ),
        prop::collection::vec((0usize..3, 1usize..6), 1..9),
        0.0f64..1.2,
        0.0f64..1.2,
    )
        .prop_map(|(ms, order, f1, f2)| {
            let models: Vec<(String, ModelUse)> = ms
                .iter()
                .enumerate()
                .map(|(i, (sizes, act))| {
                    let key = format!("m{i}");
                    (key.clone(), use_of(model_weights(&key, sizes), *act, 1))
                })
                .collect();
            let order: Vec<(usize, usize)> = order
                .into_iter()
                .map(|(m, r)| (m % models.len(), r))
                .collect();
            let all: u64 = models
                .iter()
                .map(|(_, u)| u.activation_bytes + u.weights.iter().map(|w| w.bytes).sum::<u64>())
                .sum();
            let b1 = (all as f64 * f1) as u64;
            let b2 = (all as f64 * f2) as u64;
            (models, order, b1.min(b2), b1.max(b2))
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn workflow_plans_keep_their_guarantees((models, order, small, large) in case()) {
        let named: Vec<(&str, ModelUse)> =
            models.iter().map(|(k, u)| (k.as_str(), u.clone())).collect();
        let (schedule, uses) = workflow(&named, &order);
        for budget in [small, large] {
            let Ok(plan) = plan_workflow(
                &DeviceWeights::default(), &schedule, &uses, Some(budget), ALIGN, u64::MAX,
            ) else {
                continue;
            };
            // Replay step by step to look at the device between uses.
            let mut state = DeviceWeights::default();
            let mut moved = 0;
            for (u, expect) in uses.iter().zip(&plan.steps) {
                let step = state
                    .step(&u.model_use, Some(budget), ALIGN, u64::MAX, &schedule, Some(u.at), &u.models, &Default::default())
                    .expect("replays");
                prop_assert_eq!(&step, expect);
                // Within budget, counting what other models keep.
                prop_assert!(step.device_bytes <= budget, "{} > {budget}", step.device_bytes);
                let p = step.plan.as_ref().expect("a budget gives a plan");
                let others: u64 = state
                    .held
                    .iter()
                    .filter(|(n, _)| !u.model_use.weights.iter().any(|w| &w.name == *n))
                    .map(|(_, h)| h.bytes)
                    .sum();
                prop_assert_eq!(step.device_bytes, p.device_bytes + others);
                // Every weight the plan keeps is on the device; no weight
                // the plan streams is held as well.
                for &i in &p.resident {
                    prop_assert!(state.held.contains_key(&u.model_use.weights[i].name));
                }
                for s in &p.streamed {
                    prop_assert!(!state.held.contains_key(&u.model_use.weights[s.weight].name));
                }
                // What is loaded was not held before.
                prop_assert_eq!(
                    step.loaded_bytes,
                    step.loaded.iter().map(|&i| u.model_use.weights[i].bytes).sum::<u64>()
                );
                moved += step.loaded_bytes + step.streamed_bytes_per_run * u.model_use.runs as u64;
            }
            prop_assert_eq!(moved, plan.bytes_moved);
            prop_assert!(plan.bytes_moved >= plan.lower_bound);
        }
    }

    /// One model used again and again (a sampler, then another with the
    /// same model): the resident set is uploaded once and only the
    /// streamed weights move per run, the cyclic optimum.
    #[test]
    fn repeated_model_moves_resident_once(
        (models, order, small, large) in case(),
    ) {
        let only = &models[..1];
        let named: Vec<(&str, ModelUse)> =
            only.iter().map(|(k, u)| (k.as_str(), u.clone())).collect();
        let order: Vec<(usize, usize)> = order.iter().map(|&(_, r)| (0, r)).collect();
        let (schedule, uses) = workflow(&named, &order);
        let mut moved = Vec::new();
        for budget in [small, large] {
            let Ok(plan) = plan_workflow(
                &DeviceWeights::default(), &schedule, &uses, Some(budget), ALIGN, u64::MAX,
            ) else {
                prop_assert!(moved.is_empty(), "the larger budget failed");
                continue;
            };
            moved.push(plan.bytes_moved);
            let p = plan.steps[0].plan.as_ref().expect("plan");
            let runs: u64 = order.iter().map(|&(_, r)| r as u64).sum();
            prop_assert_eq!(plan.bytes_moved, p.resident_bytes + p.streamed_bytes_per_run * runs);
            for s in &plan.steps[1..] {
                prop_assert_eq!(s.loaded_bytes, 0);
                prop_assert!(s.evicted.is_empty());
            }
        }
        // A larger budget never moves more.
        if let [a, b] = moved[..] {
            prop_assert!(b <= a, "{b} > {a}");
        }
    }
}

/// Hires fix with a second prompt: CLIP, UNet, VAE, CLIP, UNet, VAE on a
/// device that holds the UNet and the CLIP but not the VAE as well. At the
/// VAE, the known future evicts one UNet weight (next read after the
/// second CLIP) and keeps the CLIP; recency evicts the CLIP, then at the
/// second CLIP a UNet weight, then at the UNet the VAE, which it reloads.
#[test]
fn known_future_moves_fewer_bytes_than_recency() {
    let clip = use_of(model_weights("clip", &[(256, false); 4]), 100, 1);
    let unet = use_of(model_weights("unet", &[(1000, false); 8]), 400, 1);
    let vae = use_of(model_weights("vae", &[(200, false); 4]), 600, 1);
    let models = [("clip", clip), ("unet", unet), ("vae", vae)];
    let order = [(0, 1), (1, 20), (2, 1), (0, 1), (1, 10), (2, 1)];
    let (schedule, uses) = workflow(&models, &order);
    let budget = 9500;
    let belady = plan_workflow(
        &DeviceWeights::default(),
        &schedule,
        &uses,
        Some(budget),
        ALIGN,
        u64::MAX,
    )
    .expect("plans");
    // Every use fits wholly, so only loads move bytes.
    assert!(belady.steps.iter().all(|s| s.streamed_bytes_per_run == 0));
    let loads: Vec<u64> = belady.steps.iter().map(|s| s.loaded_bytes).collect();
    assert_eq!(loads, [1024, 8000, 800, 0, 1000, 0]);
    assert_eq!(belady.steps[2].evicted, ["unet.w0"]);
    assert_eq!(belady.lower_bound, 1024 + 8000 + 800);
    // The same uses without a known future: least recently used first.
    let mut state = DeviceWeights::default();
    let mut lru = Vec::new();
    for u in &uses {
        let step = state
            .step(
                &u.model_use,
                Some(budget),
                ALIGN,
                u64::MAX,
                &UseSchedule::default(),
                None,
                &u.models,
                &Default::default(),
            )
            .expect("steps");
        lru.push(step.loaded_bytes);
    }
    assert_eq!(lru, [1024, 8000, 800, 1024, 1000, 800]);
    assert!(belady.bytes_moved < lru.iter().sum::<u64>());
}

/// Weights a previous run left on the device are not uploaded again (an
/// edit that changes only the prompt).
#[test]
fn kept_weights_from_a_previous_run_are_reused() {
    let unet = use_of(model_weights("unet", &[(1000, false); 8]), 400, 1);
    let clip = use_of(model_weights("clip", &[(256, false); 4]), 100, 1);
    let models = [("clip", clip), ("unet", unet)];
    let (schedule, uses) = workflow(&models, &[(0, 1), (1, 20)]);
    let first = plan_workflow(
        &DeviceWeights::default(),
        &schedule,
        &uses,
        None,
        ALIGN,
        u64::MAX,
    )
    .expect("plans");
    assert_eq!(first.bytes_moved, 9024);
    let mut kept = DeviceWeights::default();
    for u in &uses {
        kept.step(
            &u.model_use,
            None,
            ALIGN,
            u64::MAX,
            &schedule,
            Some(u.at),
            &u.models,
            &Default::default(),
        )
        .expect("steps");
    }
    let again = plan_workflow(&kept, &schedule, &uses, None, ALIGN, u64::MAX).expect("plans");
    assert_eq!(again.bytes_moved, 0);
}
