//! Residency across a whole workflow: the order in which nodes use models
//! (the *use schedule*) and what the device keeps between uses.
//!
//! The executor knows, before a run, every node that will run a model on
//! the device and in which order (it runs them one at a time, in that
//! order): e.g. CLIP once per prompt, the UNet for a sampler's N steps,
//! the VAE once. Each model is named by a *model key*, the cache key of the
//! node output it comes from, so an unchanged loader keeps its key across
//! runs (watch, server) and a changed one gets a new key.
//!
//! Within one use [`super::residency`] decides which weights stay and which
//! stream. Between uses, weights kept from earlier uses share the budget
//! with the current one; when they do not all fit, the ones read again
//! farthest in the future go first, and the ones no later use reads before
//! all others (Belady's rule, with the known future of the schedule).
//! Without a schedule (a library caller), every kept weight counts as
//! unused and the least recently used goes first.
//!
//! For one model used again and again (a sampler, a second sampler on the
//! same model) a larger budget never moves more bytes: each use's plan is
//! monotone and later uses find their resident set in place. Across
//! models it can: with A, B, A, a larger budget lets A keep more, which B
//! then evicts and A reloads (caching with unequal sizes has no monotone
//! online rule); `engine/tests/schedule.rs` tests what does hold.
//!
//! [`DeviceWeights::step`] is the single policy: the wgpu backend applies
//! it on every prepare, and [`plan_workflow`] folds it over a whole
//! schedule to predict the bytes a workflow moves (tests compare the
//! prediction with what the backend measured).

use super::residency::{plan_residency, ModelUse, ResidencyError, ResidencyPlan};
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// One node's use of models on the device.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ScheduledUse {
    /// The node's id in the workflow.
    pub node: String,
    pub class_type: String,
    /// Model keys of the models it runs.
    pub models: Vec<String>,
}

/// Every model use of a run, in the order the executor runs them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct UseSchedule {
    pub uses: Vec<ScheduledUse>,
}

impl UseSchedule {
    /// The first use after `after` that runs `model`.
    pub fn next_use(&self, model: &str, after: usize) -> Option<usize> {
        self.uses
            .iter()
            .enumerate()
            .skip(after + 1)
            .find(|(_, u)| u.models.iter().any(|m| m == model))
            .map(|(i, _)| i)
    }

    /// The position of `node`'s use.
    pub fn position(&self, node: &str) -> Option<usize> {
        self.uses.iter().position(|u| u.node == node)
    }
}

/// A weight kept on the device between uses.
#[derive(Clone, Debug, PartialEq)]
pub struct HeldWeight {
    pub bytes: u64,
    /// Keys of the models whose uses read it.
    pub models: BTreeSet<String>,
    /// The step that last read it.
    pub last_used: u64,
}

/// The weights the device keeps between model uses, by name.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeviceWeights {
    pub held: BTreeMap<String, HeldWeight>,
    tick: u64,
}

/// What one model use does to the device's weights.
#[derive(Clone, Debug, PartialEq)]
pub struct UseStep {
    /// Within the use (None without a budget: everything resident).
    pub plan: Option<ResidencyPlan>,
    /// Weights dropped before the use, in eviction order.
    pub evicted: Vec<String>,
    pub evicted_bytes: u64,
    /// Indices into the use's weights copied to the device to stay (not
    /// already held).
    pub loaded: Vec<usize>,
    pub loaded_bytes: u64,
    /// Weight bytes copied host → device every run (streamed).
    pub streamed_bytes_per_run: u64,
    /// The most device memory in use during the use: its plan plus the
    /// weights other models keep.
    pub device_bytes: u64,
}

impl DeviceWeights {
    pub fn held_bytes(&self) -> u64 {
        self.held.values().map(|h| h.bytes).sum()
    }

    /// Forgets `name` (the backend dropped it: its host data is gone, or a
    /// different tensor now has its name).
    pub fn forget(&mut self, name: &str) {
        self.held.remove(name);
    }

    pub fn clear(&mut self) {
        self.held.clear();
    }

    /// The order in which to evict held weights that the use at `at`
    /// (None: not scheduled) does not read: those no later use reads
    /// first, least recently used first; then the one read again farthest
    /// in the future.
    pub fn eviction_order(
        &self,
        wanted: &BTreeSet<&str>,
        schedule: &UseSchedule,
        at: Option<usize>,
    ) -> Vec<String> {
        let mut next_cache: HashMap<&str, Option<usize>> = HashMap::new();
        let mut order: Vec<(std::cmp::Reverse<usize>, u64, &String)> = Vec::new();
        for (name, h) in &self.held {
            if wanted.contains(name.as_str()) {
                continue;
            }
            let next = at.and_then(|at| {
                h.models
                    .iter()
                    .filter_map(|m| {
                        *next_cache
                            .entry(m.as_str())
                            .or_insert_with(|| schedule.next_use(m, at))
                    })
                    .min()
            });
            // Never read again sorts as the farthest future.
            let distance = next.unwrap_or(usize::MAX);
            order.push((std::cmp::Reverse(distance), h.last_used, name));
        }
        order.sort();
        order.into_iter().map(|(_, _, n)| n.clone()).collect()
    }

    /// Applies one model use: plans it within `budget` (all resident
    /// without one), drops held weights the plan streams (they would be
    /// counted twice), evicts other models' weights in
    /// [`DeviceWeights::eviction_order`] until the plan fits beside what
    /// stays, and records the plan's resident weights as held, read by
    /// `models`. Held weights named in `in_use` (programs still prepared
    /// read them) are never evicted; the use's own such weights should be
    /// marked `keep`.
    #[allow(clippy::too_many_arguments)]
    pub fn step(
        &mut self,
        u: &ModelUse,
        budget: Option<u64>,
        align: u64,
        max_stream: u64,
        schedule: &UseSchedule,
        at: Option<usize>,
        models: &[String],
        in_use: &BTreeSet<String>,
    ) -> Result<UseStep, ResidencyError> {
        let plan = match budget {
            Some(b) => Some(plan_residency(u, b, align, max_stream)?),
            None => None,
        };
        let resident: Vec<usize> = match &plan {
            Some(p) => p.resident.clone(),
            None => (0..u.weights.len()).collect(),
        };
        let wanted: BTreeSet<&str> = u.weights.iter().map(|w| w.name.as_str()).collect();
        let mut evicted = Vec::new();
        let mut evicted_bytes = 0;
        if let Some(p) = &plan {
            let kept: BTreeSet<&str> = p
                .resident
                .iter()
                .map(|&i| u.weights[i].name.as_str())
                .collect();
            for s in &p.streamed {
                let name = &u.weights[s.weight].name;
                if in_use.contains(name) {
                    continue;
                }
                if let Some(h) = self.held.remove(name) {
                    evicted_bytes += h.bytes;
                    evicted.push(name.clone());
                }
            }
            debug_assert!(kept.iter().all(|k| wanted.contains(k)));
        }
        if let (Some(b), Some(p)) = (budget, &plan) {
            let mut others: u64 = self
                .held
                .iter()
                .filter(|(n, _)| !wanted.contains(n.as_str()))
                .map(|(_, h)| h.bytes)
                .sum();
            if p.device_bytes + others > b {
                for name in self.eviction_order(&wanted, schedule, at) {
                    if p.device_bytes + others <= b {
                        break;
                    }
                    if in_use.contains(&name) {
                        continue;
                    }
                    if let Some(h) = self.held.remove(&name) {
                        others -= h.bytes;
                        evicted_bytes += h.bytes;
                        evicted.push(name);
                    }
                }
                if p.device_bytes + others > b {
                    return Err(ResidencyError::InUse {
                        budget: b,
                        needed: p.device_bytes,
                        held: others,
                    });
                }
            }
        }
        self.tick += 1;
        let mut loaded = Vec::new();
        let mut loaded_bytes = 0;
        for i in resident {
            let w = &u.weights[i];
            let h = self.held.entry(w.name.clone()).or_insert_with(|| {
                loaded.push(i);
                loaded_bytes += w.bytes;
                HeldWeight {
                    bytes: w.bytes,
                    models: BTreeSet::new(),
                    last_used: 0,
                }
            });
            h.last_used = self.tick;
            h.models.extend(models.iter().cloned());
        }
        loaded.sort_unstable();
        let others: u64 = self
            .held
            .iter()
            .filter(|(n, _)| !wanted.contains(n.as_str()))
            .map(|(_, h)| h.bytes)
            .sum();
        let (streamed_bytes_per_run, device_bytes) = match &plan {
            Some(p) => (p.streamed_bytes_per_run, p.device_bytes + others),
            None => (
                0,
                u.activation_bytes + u.weights.iter().map(|w| w.bytes).sum::<u64>() + others,
            ),
        };
        Ok(UseStep {
            plan,
            evicted,
            evicted_bytes,
            loaded,
            loaded_bytes,
            streamed_bytes_per_run,
            device_bytes,
        })
    }
}

/// One model use of a workflow, with its program's weights.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkflowUse {
    /// Position in the schedule.
    pub at: usize,
    pub models: Vec<String>,
    /// `runs` is how many times the program runs (a sampler's steps).
    pub model_use: ModelUse,
}

/// The residency plan of a whole workflow.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkflowPlan {
    pub steps: Vec<UseStep>,
    /// Weight bytes copied to the device over the workflow: every load
    /// plus every streamed copy.
    pub bytes_moved: u64,
    /// No policy moves fewer: every distinct weight at least once, and no
    /// run of a use fewer than its plan's lower bound.
    pub lower_bound: u64,
}

impl WorkflowPlan {
    /// Seconds the copies take at `bytes_per_second` host → device.
    pub fn transfer_seconds(&self, bytes_per_second: f64) -> f64 {
        self.bytes_moved as f64 / bytes_per_second.max(1.0)
    }
}

/// Plans every use of `uses` in order from `start` (the device's weights
/// before the workflow: empty, or what a previous run kept).
pub fn plan_workflow(
    start: &DeviceWeights,
    schedule: &UseSchedule,
    uses: &[WorkflowUse],
    budget: Option<u64>,
    align: u64,
    max_stream: u64,
) -> Result<WorkflowPlan, ResidencyError> {
    let mut state = start.clone();
    let mut steps = Vec::new();
    let mut bytes_moved = 0;
    let mut distinct: BTreeMap<&str, u64> = BTreeMap::new();
    let mut per_run_bound = 0;
    for u in uses {
        let step = state.step(
            &u.model_use,
            budget,
            align,
            max_stream,
            schedule,
            Some(u.at),
            &u.models,
            &BTreeSet::new(),
        )?;
        let runs = u.model_use.runs as u64;
        bytes_moved += step.loaded_bytes + step.streamed_bytes_per_run * runs;
        for w in &u.model_use.weights {
            if !start.held.contains_key(&w.name) {
                distinct.insert(&w.name, w.bytes);
            }
        }
        if let Some(p) = &step.plan {
            per_run_bound += p.lower_bound_per_run * runs;
        }
        steps.push(step);
    }
    let distinct_bytes: u64 = distinct.values().sum();
    Ok(WorkflowPlan {
        steps,
        bytes_moved,
        lower_bound: distinct_bytes.max(per_run_bound),
    })
}
