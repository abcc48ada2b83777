//! LoRA and LoCon adapters: reading them from a file by ComfyUI's key
//! names and the maths ComfyUI's `LoRAAdapter.calculate_weight` applies.
//!
//! A patched weight is `W + f32(strength · alpha / rank) · (up · down)`,
//! in f32 (ComfyUI's intermediate dtype; the CPU model it compares with is
//! f32, so nothing is rounded back), the patches of a stack applied in
//! load order. LoCon's Tucker form first folds `lora_mid` into `down`:
//! `down'[a, i, y, x] = Σ_b down[b, i] · mid[a, b, y, x]`.

use super::keys::Target;
use sdkit_compute::weights::SafeTensors;
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

/// One LoRA layer's matrices, in f32.
#[derive(Debug)]
pub struct LoraLayer {
    /// `up` `[out, rank]` (any trailing 1×1 dims flattened).
    pub up: Vec<f32>,
    /// `down` `[rank, in × kh × kw]`, the mid already folded in.
    pub down: Vec<f32>,
    pub rank: usize,
    /// `alpha / rank`, or 1 without an alpha (ComfyUI's rule).
    pub scale: f64,
}

impl LoraLayer {
    /// The product `up · down`, `[out, in × kh × kw]`, summed over the
    /// rank in order.
    pub fn diff(&self) -> Vec<f32> {
        let r = self.rank;
        let out = self.up.len() / r.max(1);
        let cols = self.down.len() / r.max(1);
        let mut d = vec![0f32; out * cols];
        for o in 0..out {
            let row = &mut d[o * cols..(o + 1) * cols];
            for k in 0..r {
                let u = self.up[o * r + k];
                for (v, &w) in row.iter_mut().zip(&self.down[k * cols..(k + 1) * cols]) {
                    *v += u * w;
                }
            }
        }
        d
    }
}

/// A loaded adapter file: its layers by target, and the file keys no
/// target took (ComfyUI logs them: "lora key not loaded").
#[derive(Debug, Default)]
pub struct LoraFile {
    pub layers: Vec<(Target, Arc<LoraLayer>)>,
    pub unused: Vec<String>,
}

/// The name pairs a LoRA layer may use: (up, down, mid), as ComfyUI tries
/// them in order (kohya, diffusers, PEFT, diffusers' `.lora.`,
/// transformers').
fn names(x: &str) -> [(String, String, Option<String>); 5] {
    [
        (
            format!("{x}.lora_up.weight"),
            format!("{x}.lora_down.weight"),
            Some(format!("{x}.lora_mid.weight")),
        ),
        (
            format!("{x}_lora.up.weight"),
            format!("{x}_lora.down.weight"),
            None,
        ),
        (
            format!("{x}.lora_B.weight"),
            format!("{x}.lora_A.weight"),
            None,
        ),
        (
            format!("{x}.lora.up.weight"),
            format!("{x}.lora.down.weight"),
            None,
        ),
        (
            format!("{x}.lora_linear_layer.up.weight"),
            format!("{x}.lora_linear_layer.down.weight"),
            None,
        ),
    ]
}

fn tensor(file: &SafeTensors, name: &str) -> Result<(Vec<usize>, Vec<f32>), String> {
    let info = file
        .get(name)
        .ok_or_else(|| format!("{}: no tensor {name}", file.path().display()))?;
    let data = file.to_f32(name).map_err(|e| e.to_string())?;
    Ok((info.shape.clone(), data))
}

/// Reads every layer of `file` that `map` (adapter key → target) names.
pub fn load(file: &SafeTensors, map: &HashMap<String, Target>) -> Result<LoraFile, String> {
    let mut used = BTreeSet::new();
    let mut layers = Vec::new();
    // Sorted, so the order of patches (and so of their sums) is fixed.
    let mut keys: Vec<(&String, &Target)> = map.iter().collect();
    keys.sort();
    for (x, target) in keys {
        let Some((up_n, down_n, mid_n)) = names(x)
            .into_iter()
            .find(|(up, _, _)| file.get(up).is_some())
        else {
            continue;
        };
        let (up_s, up) = tensor(file, &up_n)?;
        let (down_s, mut down) = tensor(file, &down_n)?;
        used.insert(up_n.clone());
        used.insert(down_n.clone());
        let rank = down_s.first().copied().unwrap_or(0);
        if rank == 0 || up_s.get(1) != Some(&rank) {
            return Err(format!(
                "{}: {up_n} {up_s:?} and {down_n} {down_s:?} do not share a rank",
                file.path().display()
            ));
        }
        let alpha_n = format!("{x}.alpha");
        let scale = match file.get(&alpha_n) {
            Some(_) => {
                used.insert(alpha_n.clone());
                let a = file.to_f32(&alpha_n).map_err(|e| e.to_string())?;
                f64::from(a.first().copied().unwrap_or(0.0)) / rank as f64
            }
            None => 1.0,
        };
        if let Some(mid_n) = mid_n.filter(|m| file.get(m).is_some()) {
            let (mid_s, mid) = tensor(file, &mid_n)?;
            used.insert(mid_n);
            down = fold_mid(&down, &down_s, &mid, &mid_s)?;
        }
        layers.push((
            target.clone(),
            Arc::new(LoraLayer {
                up,
                down,
                rank,
                scale,
            }),
        ));
    }
    let unused = file
        .tensors()
        .map(|t| t.name.clone())
        .filter(|n| !used.contains(n))
        .collect();
    Ok(LoraFile { layers, unused })
}

/// LoCon's Tucker mid: `down` `[rank_b, in, 1, 1]` and `mid`
/// `[rank_a, rank_b, kh, kw]` → `[rank_a, in × kh × kw]`.
fn fold_mid(down: &[f32], ds: &[usize], mid: &[f32], ms: &[usize]) -> Result<Vec<f32>, String> {
    let (rb, inn) = (ds[0], ds.get(1).copied().unwrap_or(0));
    let [ra, rb2, kh, kw] = ms[..] else {
        return Err(format!("lora_mid has shape {ms:?}; expected 4 dimensions"));
    };
    if rb2 != rb || down.len() != rb * inn {
        return Err(format!("lora_mid {ms:?} does not fit lora_down {ds:?}"));
    }
    let taps = kh * kw;
    let mut out = vec![0f32; ra * inn * taps];
    for a in 0..ra {
        for i in 0..inn {
            for t in 0..taps {
                let mut s = 0f32;
                for b in 0..rb {
                    s += down[b * inn + i] * mid[(a * rb + b) * taps + t];
                }
                out[(a * inn + i) * taps + t] = s;
            }
        }
    }
    Ok(out)
}

/// One patch on a tensor: a layer at a strength.
#[derive(Debug, Clone)]
pub struct TensorPatch {
    pub layer: Arc<LoraLayer>,
    pub strength: f64,
    pub rows: Option<(usize, usize)>,
    /// Identifies the layer's file for cache keys.
    pub source: String,
}

/// Applies `patches` in order to `w` (f32, row-major).
pub fn apply(w: &mut [f32], patches: &[TensorPatch]) -> Result<(), String> {
    for p in patches {
        let d = p.layer.diff();
        let part = match p.rows {
            Some((a, b)) => {
                let cols = w.len() / fused_rows(w.len(), b, d.len(), a)?;
                &mut w[a * cols..b * cols]
            }
            None => &mut w[..],
        };
        if part.len() != d.len() {
            return Err(format!(
                "a LoRA layer of {} values patches a weight of {}",
                d.len(),
                part.len()
            ));
        }
        // `(strength * alpha) * diff`: the Python float product, then an
        // f32 factor.
        let f = (p.strength * p.layer.scale) as f32;
        for (v, x) in part.iter_mut().zip(&d) {
            *v += f * x;
        }
    }
    Ok(())
}

/// The row count of a fused tensor of `len` values whose rows `[a, b)`
/// take `diff` values.
fn fused_rows(len: usize, b: usize, diff: usize, a: usize) -> Result<usize, String> {
    let cols = diff / (b - a).max(1);
    if cols == 0 || !len.is_multiple_of(cols) {
        return Err(format!(
            "a LoRA layer of {diff} values does not fit rows {a}..{b}"
        ));
    }
    Ok(len / cols)
}
