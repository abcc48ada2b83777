//! ControlNets in the sampling loop on the device: where every entry
//! shares one chain of SD ControlNets, the UNet's fused program runs the
//! nets active at its σ itself on the same model input, timestep, context
//! and ADM vector, scales each net's residuals by its strength and adds
//! them up (`prev + own`, oldest first), as `control::Runner` does on the
//! host. Each set of nets active together (their start and end percent)
//! is a program of its own ([`FusedControl::active`]). The residuals never
//! leave the device: on the host loop each step downloads every net's
//! twelve skips and middle (about 54 MB a step for SD1 at 512², four
//! times that for SDXL at 1024²) and uploads their sum to the UNet.
//!
//! Each net's weights are named `ctl{i}/` + its own names in the program
//! and bound from its file ([`FusedControl::bind`]); its hint (and a
//! union net's control types) are fixed inputs under `ctl{i}.`.

use super::cond_batch::Item;
use super::control::{self, Control, ControlKind};
use super::denoiser::ModelGroup;
use super::Model;
use crate::models::controlnet::{controlnet, ControlNetConfig};
use crate::models::detect::{Heads, Net};
use crate::models::unet::ControlResiduals;
use sdkit_compute::backend::cpu::Bindings;
use sdkit_compute::plan::Program;
use sdkit_compute::tensor::{GraphBuilder, ShapeError, T};
use sdkit_engine::{NodeContext, NodeError};
use std::collections::HashMap;
use std::sync::Arc;

/// What the device loop can do with the sampled entries' ControlNets.
pub(crate) enum Chain {
    /// No entry has one.
    None,
    /// Every entry shares this chain (oldest first) and the program can
    /// run it.
    Fused(Vec<Arc<Control>>),
    /// Only the host loop runs them.
    Host,
}

/// The chain of `items`' ControlNets as [`Chain`] says: the program runs
/// plain SD ControlNets (no control-LoRA, T2I-Adapter, Flux or SD3.5 net)
/// on a UNet.
pub(crate) fn chain_of(model: &Model, items: &[Item<'_>]) -> Chain {
    let Some(first) = items.first() else {
        return Chain::None;
    };
    if !items
        .iter()
        .all(|it| control::same(&it.control, &first.control))
    {
        return Chain::Host;
    }
    let Some(head) = &first.control else {
        return Chain::None;
    };
    let chain = head.chain();
    let runs = matches!(model.net, Net::Unet(_))
        && chain.len() <= 64
        && chain
            .iter()
            .all(|c| matches!(c.net.kind, ControlKind::Net { .. }));
    if runs {
        Chain::Fused(chain)
    } else {
        Chain::Host
    }
}

/// A chain the fused program runs, with what each net needs; or the part
/// of one active at some σ ([`FusedControl::active`]).
#[derive(Clone, Debug)]
pub(crate) struct FusedControl {
    chain: Vec<Arc<Control>>,
    /// Each net's place in the whole chain: its weights and inputs are
    /// named by it, the same in every program of the sampling.
    ids: Vec<usize>,
    /// Each net's σ range, `(start, end)`: it runs while `end ≤ σ ≤
    /// start`, compared in f32 as ComfyUI does.
    ranges: Vec<(f32, f32)>,
    /// Per net, its config for this model.
    nets: Vec<(ControlNetConfig, Heads)>,
    /// Per group, per net: its hint as the group's rows take it, and the
    /// hint's batch.
    hints: Vec<Vec<(Arc<Vec<f32>>, usize)>>,
}

/// The prefix of net `i`'s weights in the program.
fn weight_prefix(i: usize) -> String {
    format!("ctl{i}/")
}

impl FusedControl {
    /// Checks each net fits the model and prepares its hint for each
    /// group (`(rows, entries)` of `h`×`w` latents, `dim`-wide context).
    pub(crate) fn new(
        ctx: &NodeContext,
        model: &Model,
        chain: Vec<Arc<Control>>,
        groups: &[(usize, usize, usize)],
        (h, w): (usize, usize),
        dim: usize,
    ) -> Result<Self, NodeError> {
        let mut plans = control::Plans::default();
        let ranges = chain
            .iter()
            .map(|c| {
                let s = model.schedule.percent_to_sigma(c.range.0) as f32;
                let e = model.schedule.percent_to_sigma(c.range.1) as f32;
                (s, e)
            })
            .collect();
        let mut nets = Vec::with_capacity(chain.len());
        for c in &chain {
            let rows = groups.first().map_or(1, |g| g.0);
            nets.push(model.control_fit(&c.net, rows, (h, w), dim)?);
        }
        let mut hints = Vec::with_capacity(groups.len());
        for &(rows, entries, tokens) in groups {
            let shape = control::Shape {
                rows,
                entries,
                hw: (h, w),
                tokens,
                dim,
            };
            hints.push(
                chain
                    .iter()
                    .map(|c| plans.hint_for(ctx, model, c, &shape))
                    .collect::<Result<Vec<_>, _>>()?,
            );
        }
        Ok(FusedControl {
            ids: (0..chain.len()).collect(),
            chain,
            ranges,
            nets,
            hints,
        })
    }

    /// The nets active at `sigma`, as a bit mask over the whole chain.
    pub(crate) fn mask_at(&self, sigma: f32) -> u64 {
        self.ids
            .iter()
            .zip(&self.ranges)
            .filter(|(_, &(start, end))| !(sigma > start || sigma < end))
            .fold(0, |m, (&i, _)| m | 1 << i)
    }

    /// The nets of `mask`; None when it has none.
    pub(crate) fn active(&self, mask: u64) -> Option<FusedControl> {
        let keep: Vec<usize> = (0..self.ids.len())
            .filter(|&k| mask & (1 << self.ids[k]) != 0)
            .collect();
        if keep.is_empty() {
            return None;
        }
        Some(FusedControl {
            chain: keep.iter().map(|&k| Arc::clone(&self.chain[k])).collect(),
            ids: keep.iter().map(|&k| self.ids[k]).collect(),
            ranges: keep.iter().map(|&k| self.ranges[k]).collect(),
            nets: keep.iter().map(|&k| self.nets[k].clone()).collect(),
            hints: self
                .hints
                .iter()
                .map(|g| keep.iter().filter_map(|&k| g.get(k).cloned()).collect())
                .collect(),
        })
    }

    /// The summed residuals of the chain for group `k` (`prefix` its
    /// inputs' prefix) over the model input `x`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn residuals<'a>(
        &self,
        g: &'a GraphBuilder,
        model: &Model,
        (k, prefix): (usize, &str),
        grp: &ModelGroup,
        (h, w): (usize, usize),
        dim: usize,
        x: T<'a>,
    ) -> Result<ControlResiduals<'a>, ShapeError> {
        let rows = grp.rows;
        // The UNet's own inputs (the same nodes: inputs are shared by name).
        let t = g.input("t", &[rows])?;
        let context = g.input("context", &[rows, grp.tokens, dim])?;
        let y = model.adm_vector(g, rows)?;
        let mut sum: Option<(Vec<T<'a>>, T<'a>)> = None;
        for (n, (c, (cfg, heads))) in self.chain.iter().zip(&self.nets).enumerate() {
            let hb = self.hints.get(k).and_then(|v| v.get(n)).map_or(1, |h| h.1);
            let i = self.ids[n];
            // The net's own inputs (hint, control types) under its prefix.
            g.set_input_prefix(&format!("{prefix}ctl{i}."));
            let built = (|| {
                let hint = g.input("hint", &[hb, cfg.hint_channels(), 8 * h, 8 * w])?;
                controlnet(
                    g,
                    cfg,
                    *heads,
                    &format!("{}{}", weight_prefix(i), c.net.prefix),
                    x,
                    t,
                    context,
                    y,
                    hint,
                    Some(&c.net.control_type),
                )
            })();
            g.set_input_prefix(prefix);
            let (outs, mid) = built?;
            // × strength, then added to the earlier nets' (prev + own).
            let s = c.strength;
            let outs: Vec<T<'a>> = outs.into_iter().map(|o| o.mul_scalar(s)).collect();
            let mid = mid.mul_scalar(s);
            sum = Some(match sum {
                None => (outs, mid),
                Some((prev, pm)) => (
                    prev.iter()
                        .zip(&outs)
                        .map(|(p, o)| p.add(*o))
                        .collect::<Result<_, _>>()?,
                    pm.add(mid)?,
                ),
            });
        }
        let (output, middle) = sum.ok_or_else(|| ShapeError {
            op: "ControlNet",
            message: "an empty chain".into(),
            shapes: Vec::new(),
        })?;
        Ok(ControlResiduals {
            input: vec![None; output.len()],
            output,
            middle: Some(middle),
        })
    }

    /// Group `k`'s fixed inputs (`prefix` its prefix): each net's hint and
    /// a union net's one-hot control types.
    pub(crate) fn feeds(&self, k: usize, prefix: &str, into: &mut HashMap<String, Arc<Vec<f32>>>) {
        for (n, (c, (cfg, _))) in self.chain.iter().zip(&self.nets).enumerate() {
            let i = self.ids[n];
            if let Some((hint, _)) = self.hints.get(k).and_then(|v| v.get(n)) {
                into.insert(format!("{prefix}ctl{i}.hint"), Arc::clone(hint));
            }
            if let Some(n) = cfg.union_types {
                let mut onehot = vec![0f32; n];
                for &t in &c.net.control_type {
                    if let Some(v) = onehot.get_mut(t) {
                        *v = 1.0;
                    }
                }
                into.insert(format!("{prefix}ctl{i}.control_type"), Arc::new(onehot));
            }
        }
    }

    /// Binds the nets' weights `prog` uploads (`ctl{i}/…`) from their
    /// files into `b`.
    pub(crate) fn bind(&self, prog: &Program, b: &mut Bindings) -> Result<(), NodeError> {
        for (c, &id) in self.chain.iter().zip(&self.ids) {
            c.net.file.bind_into(
                prog,
                None,
                None,
                &|n| Self::owner(n).and_then(|(i, name)| (i == id).then_some(name)),
                b,
            )?;
        }
        Ok(())
    }

    /// The net a weight name belongs to and its name in the net's file.
    pub(crate) fn owner(name: &str) -> Option<(usize, &str)> {
        let rest = name.strip_prefix("ctl")?;
        let (i, own) = rest.split_once('/')?;
        Some((i.parse().ok()?, own))
    }
}
