//! How conditioning entries become denoiser calls, as ComfyUI's
//! `process_conds` and `calc_cond_batch` do it:
//! - before sampling: percentage areas become latent cells, masks are
//!   resized to the latent (bilinear) and, with "mask bounds", give the
//!   area; timestep ranges become sigmas; every area gets an entry of the
//!   same area in the other list (`create_cond_with_same_area_if_none`,
//!   with the model inputs of the smallest entry there that contains it);
//! - each step: entries outside their sigma range sit out; each runs on
//!   its area's crop of the latent; `denoised × mult` is added into its
//!   area and `mult` into the counts, where `mult` is the mask × its
//!   strength, or the strength with an 8-cell feather on the inner edges
//!   of an area; the prediction is sums / counts.
//!
//! Entries run in groups with one program each: the same area size and
//! sigma range, and contexts that ComfyUI's `CONDCrossAttn.can_concat`
//! lets share a batch (lengths within 4× of the group's first, repeated to
//! their least common multiple).

use super::{CondArea, CondEntry, Conditioning, Model};
use crate::imageops::{common_upscale, Crop, SourceLayout, Tensor4, UpscaleMethod};
use sdkit_engine::NodeError;

/// One entry as the sampler runs it.
pub(crate) struct Item<'a> {
    /// 0 positive, 1 negative.
    pub cond: usize,
    /// Where the model inputs (context, pooled, sizes) come from, and
    /// whether that entry is negative conditioning (the refiner's default
    /// aesthetic score).
    pub model: &'a CondEntry,
    pub model_negative: bool,
    /// `(height, width, y, x)` in latent cells, clipped to the latent.
    pub area: [usize; 4],
    /// `[batch, channels, height, width]` of the area, or one factor.
    pub mult: Mult,
    /// Runs while `end ≤ σ ≤ start`.
    pub sigma_start: Option<f32>,
    pub sigma_end: Option<f32>,
    /// The entry's ControlNet chain.
    pub control: Option<std::sync::Arc<super::control::Control>>,
}

pub(crate) enum Mult {
    Scalar(f32),
    Map(Vec<f32>),
}

impl Item<'_> {
    /// Whether the entry takes part at `sigma` (`get_area_and_mult`).
    pub fn active(&self, sigma: f32) -> bool {
        !(self.sigma_start.is_some_and(|s| sigma > s) || self.sigma_end.is_some_and(|e| sigma < e))
    }
}

/// An entry with its area and mask resolved for the latent.
struct Resolved<'a> {
    entry: &'a CondEntry,
    /// The model inputs' entry (differs for an opposite-area copy).
    model: &'a CondEntry,
    model_negative: bool,
    area: Option<[usize; 4]>,
    /// `[mask batch, h, w]` at the latent size, times nothing yet.
    mask: Option<(usize, Vec<f32>)>,
}

/// Python's `round` (half to even).
fn round(v: f64) -> usize {
    v.round_ties_even().max(0.0) as usize
}

fn resolve<'a>(
    e: &'a CondEntry,
    negative: bool,
    h: usize,
    w: usize,
) -> Result<Resolved<'a>, NodeError> {
    let mut area = match e.area {
        None => None,
        Some(CondArea::Latent(a)) => Some(a),
        Some(CondArea::Percentage([ph, pw, py, px])) => Some([
            round(ph * h as f64).max(1),
            round(pw * w as f64).max(1),
            round(py * h as f64),
            round(px * w as f64),
        ]),
    };
    let mask = match &e.mask {
        None => None,
        Some(m) => {
            let s = &m.mask.shape;
            let (mb, mh, mw) = (s[0], s[1], s[2]);
            let data = if (mh, mw) == (h, w) {
                m.mask.data.clone()
            } else {
                let t = Tensor4 {
                    b: mb,
                    h: mh,
                    w: mw,
                    c: 1,
                    data: m.mask.data.clone(),
                };
                common_upscale(
                    &t,
                    w,
                    h,
                    UpscaleMethod::Bilinear,
                    Crop::Disabled,
                    SourceLayout::ContiguousNchw,
                )
                .map_err(|e| NodeError::invalid(format!("resizing a conditioning mask: {e}")))?
                .data
            };
            if m.set_area_to_bounds {
                area = Some(mask_bounds(&data, mb, h, w));
            }
            Some((mb, data))
        }
    };
    Ok(Resolved {
        entry: e,
        model: e,
        model_negative: negative,
        area,
        mask,
    })
}

/// `get_mask_aabb` of the batch's max |mask|: `(h, w, y, x)`, at least
/// 8 cells each way; (8, 8, 0, 0) for an empty mask.
fn mask_bounds(mask: &[f32], b: usize, h: usize, w: usize) -> [usize; 4] {
    let (mut y0, mut y1, mut x0, mut x1) = (usize::MAX, 0, usize::MAX, 0);
    for y in 0..h {
        for x in 0..w {
            if (0..b).any(|i| mask[(i * h + y) * w + x] != 0.0) {
                y0 = y0.min(y);
                y1 = y1.max(y);
                x0 = x0.min(x);
                x1 = x1.max(x);
            }
        }
    }
    if y0 == usize::MAX {
        return [8, 8, 0, 0];
    }
    [(y1 - y0 + 1).max(8), (x1 - x0 + 1).max(8), y0, x0]
}

/// Whether area `a` lies inside `outer` (`area_inside`).
fn inside(a: [usize; 4], outer: [usize; 4]) -> bool {
    a[2] >= outer[2]
        && a[3] >= outer[3]
        && a[0] + a[2] <= outer[0] + outer[2]
        && a[1] + a[3] <= outer[1] + outer[3]
}

/// `create_cond_with_same_area_if_none`: `c`'s options with the model
/// inputs of the smallest entry of `other` that contains its area (or the
/// first without one), unless that entry has the very same area.
fn opposite<'a>(c: &Resolved<'a>, other: &[Resolved<'a>]) -> Option<Resolved<'a>> {
    let area = c.area?;
    let mut smallest: Option<&Resolved<'a>> = None;
    for x in other {
        match (x.area, smallest.and_then(|s| s.area)) {
            (Some(a), _) if !inside(area, a) => {}
            (Some(_), None) => smallest = Some(x),
            (Some(a), Some(s)) => {
                if s[0] * s[1] > a[0] * a[1] {
                    smallest = Some(x);
                }
            }
            (None, _) => {
                if smallest.is_none() {
                    smallest = Some(x);
                }
            }
        }
    }
    let s = smallest?;
    if s.area == Some(area) {
        return None;
    }
    Some(Resolved {
        entry: c.entry,
        model: s.model,
        model_negative: s.model_negative,
        area: c.area,
        mask: c.mask.clone(),
    })
}

/// Every entry of `conds` (positive, then negative) as the sampler runs
/// it on a `[b, channels, h, w]` latent.
pub(crate) fn items<'a>(
    model: &Model,
    conds: &[&'a Conditioning],
    (b, channels, h, w): (usize, usize, usize, usize),
) -> Result<Vec<Item<'a>>, NodeError> {
    let mut lists: Vec<Vec<Resolved<'a>>> = conds
        .iter()
        .enumerate()
        .map(|(ci, c)| c.0.iter().map(|e| resolve(e, ci == 1, h, w)).collect())
        .collect::<Result<_, _>>()?;
    for k in 0..lists.len() {
        let mut i = 0;
        while i < lists[k].len() {
            for kk in 0..lists.len() {
                if kk == k {
                    continue;
                }
                if let Some(extra) = opposite(&lists[k][i], &lists[kk]) {
                    lists[kk].push(extra);
                }
            }
            i += 1;
        }
    }
    let sigma = |p: Option<f64>| p.map(|p| model.schedule.percent_to_sigma(p) as f32);
    let mut out = Vec::new();
    for (ci, list) in lists.into_iter().enumerate() {
        for r in list {
            let e = r.entry;
            let mut area = r.area.unwrap_or([h, w, 0, 0]);
            if area[2] >= h || area[3] >= w {
                return Err(NodeError::invalid(format!(
                    "a conditioning area at ({}, {}) (latent cells) lies outside the {h}×{w} latent",
                    area[2], area[3]
                )));
            }
            area[0] = area[0].min(h - area[2]);
            area[1] = area[1].min(w - area[3]);
            let [ah, aw, ay, ax] = area;
            let mult = match (&r.mask, r.area) {
                (Some((mb, m)), _) => {
                    // mask[:b], narrowed to the area, × mask strength,
                    // repeated over the batch and channels, × strength.
                    let ms = e.mask.as_ref().map_or(1.0, |m| m.strength);
                    let used = (*mb).min(b);
                    if b % used != 0 {
                        return Err(NodeError::invalid(format!(
                            "a conditioning mask batch of {mb} does not divide the latent batch of {b}"
                        )));
                    }
                    let mut v = Vec::with_capacity(b * channels * ah * aw);
                    for bi in 0..b {
                        // repeat() tiles the mask batch.
                        let mi = bi % used;
                        for _ in 0..channels {
                            for y in 0..ah {
                                let row = (mi * h + ay + y) * w + ax;
                                v.extend(m[row..row + aw].iter().map(|&x| x * ms * e.strength));
                            }
                        }
                    }
                    Mult::Map(v)
                }
                (None, Some(_)) => Mult::Map(feathered(e.strength, [b, channels], area, h, w)),
                (None, None) => Mult::Scalar(e.strength),
            };
            out.push(Item {
                cond: ci,
                model: r.model,
                model_negative: r.model_negative,
                area,
                mult,
                sigma_start: sigma(e.start_percent),
                sigma_end: sigma(e.end_percent),
                control: e.control.clone(),
            });
        }
    }
    Ok(out)
}

/// An area's `mult` without a mask: the strength, faded in over up to 8
/// cells (a quarter of the area) from each edge that is not the latent's.
fn feathered(
    strength: f32,
    [b, c]: [usize; 2],
    [ah, aw, ay, ax]: [usize; 4],
    h: usize,
    w: usize,
) -> Vec<f32> {
    let mut m = vec![strength; b * c * ah * aw];
    let fade = |len: usize, lo: bool, hi: bool, i: usize| -> f32 {
        let rr = 8.min(len / 4);
        let mut f = 1.0f32;
        // ComfyUI multiplies the rows in place, start edge first.
        // (1.0 / rr) * (t + 1) in Python floats, then an f32 factor.
        let step = |t: usize| ((1.0 / rr as f64) * (t + 1) as f64) as f32;
        if lo && i < rr {
            f *= step(i);
        }
        if hi && i + rr >= len {
            f *= step(len - 1 - i);
        }
        f
    };
    for plane in m.chunks_mut(ah * aw) {
        for y in 0..ah {
            let fy = fade(ah, ay != 0, ay + ah < h, y);
            for x in 0..aw {
                let fx = fade(aw, ax != 0, ax + aw < w, x);
                let v = &mut plane[y * aw + x];
                // Rows first (dimension 2), then columns, each a multiply.
                if fy != 1.0 {
                    *v *= fy;
                }
                if fx != 1.0 {
                    *v *= fx;
                }
            }
        }
    }
    m
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Items that run as one batch, and the context length they share.
pub(crate) struct Group {
    pub items: Vec<usize>,
    pub tokens: usize,
}

/// Groups items: the same area size, sigma range, ControlNet chain
/// (the identical object) and reference latents' shapes and method (a
/// `CONDList`), and contexts within
/// 4× of the group's first (ComfyUI's `can_concat`), repeated to the least
/// common multiple of the group's lengths. Without `repeat_context` (Flux:
/// its context is a `CONDRegular`, which joins only equal shapes) contexts
/// must be the same length. Within a group ComfyUI adds the outputs
/// last-first, so the items are listed that way.
pub(crate) fn groups(items: &[Item<'_>], repeat_context: bool) -> Vec<Group> {
    groups_where(items, repeat_context, |_| true)
}

/// [`groups`] of the items `keep` accepts (one conditioning's, as
/// `calc_cond_batch` runs a list of them), indices into all of `items`.
pub(crate) fn groups_where(
    items: &[Item<'_>],
    repeat_context: bool,
    keep: impl Fn(&Item<'_>) -> bool,
) -> Vec<Group> {
    let mut left: Vec<usize> = (0..items.len()).filter(|&i| keep(&items[i])).collect();
    let mut out = Vec::new();
    while let Some(&first) = left.first() {
        let f = &items[first];
        let ft = f.model.cross_attn.dim(1);
        let fits = |i: &Item<'_>| {
            let t = i.model.cross_attn.dim(1);
            let l = ft / gcd(ft, t) * t;
            i.area[..2] == f.area[..2]
                && i.sigma_start == f.sigma_start
                && i.sigma_end == f.sigma_end
                && super::control::same(&i.control, &f.control)
                && super::denoiser::ref_shapes(i.model) == super::denoiser::ref_shapes(f.model)
                && i.model.reference_method == f.model.reference_method
                && l / ft.min(t) <= 4
                && (repeat_context || t == ft)
        };
        let (mut take, rest): (Vec<usize>, Vec<usize>) =
            left.iter().partition(|&&i| fits(&items[i]));
        take.reverse();
        let tokens = take.iter().fold(1, |l, &i| {
            let t = items[i].model.cross_attn.dim(1);
            l / gcd(l, t) * t
        });
        out.push(Group {
            items: take,
            tokens,
        });
        left = rest;
    }
    out
}

/// The item's crop of `x` `[b, c, h, w]`, appended to `out`.
pub(crate) fn crop_into(out: &mut Vec<f32>, x: &[f32], [b, c, h, w]: [usize; 4], area: [usize; 4]) {
    let [ah, aw, ay, ax] = area;
    if (ah, aw) == (h, w) {
        out.extend_from_slice(x);
        return;
    }
    for plane in x.chunks(h * w).take(b * c) {
        for y in ay..ay + ah {
            out.extend_from_slice(&plane[y * w + ax..y * w + ax + aw]);
        }
    }
}

/// Adds `denoised × mult` into `sums` and `mult` into `counts` over the
/// item's area.
pub(crate) fn accumulate(
    sums: &mut [f32],
    counts: &mut [f32],
    denoised: &[f32],
    item: &Item<'_>,
    [b, c, h, w]: [usize; 4],
) {
    let [ah, aw, ay, ax] = item.area;
    for p in 0..b * c {
        for y in 0..ah {
            for x in 0..aw {
                let local = (p * ah + y) * aw + x;
                let at = (p * h + ay + y) * w + ax + x;
                let m = match &item.mult {
                    Mult::Scalar(s) => *s,
                    Mult::Map(v) => v[local],
                };
                sums[at] += denoised[local] * m;
                counts[at] += m;
            }
        }
    }
}
