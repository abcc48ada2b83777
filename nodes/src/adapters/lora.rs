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

/// One adapter layer, in f32, with the scale ComfyUI applies to its
/// delta (`alpha / rank`, or 1 without an alpha).
#[derive(Debug)]
pub struct LoraLayer {
    pub kind: Kind,
    pub scale: f64,
}

/// The adapter types ComfyUI's `weight_adapter` reads.
#[derive(Debug)]
pub enum Kind {
    /// LoRA/LoCon: `up` `[out, rank]`, `down` `[rank, in × kh × kw]` (the
    /// Tucker mid already folded in); the delta is `up · down`.
    Lora {
        up: Vec<f32>,
        down: Vec<f32>,
        rank: usize,
    },
    /// LoHa: the delta is the elementwise product of two rank-r products
    /// (`m1 ⊙ m2`, both already multiplied out).
    Loha { m1: Vec<f32>, m2: Vec<f32> },
    /// LoKr: the delta is `kron(w1, w2)`; `w1` `[a1, a2]`, `w2`
    /// `[b1, b2, taps]` (taps 1 for a Linear).
    Lokr {
        w1: Vec<f32>,
        w1_shape: [usize; 2],
        w2: Vec<f32>,
        w2_shape: [usize; 3],
    },
    /// A full difference (`.diff`, `.diff_b`), added at the strength alone.
    Diff { diff: Vec<f32> },
}

/// `a` `[n, k]` · `b` `[k, m]`, summed over k in order.
fn matmul(a: &[f32], b: &[f32], n: usize, k: usize, m: usize) -> Vec<f32> {
    let mut out = vec![0f32; n * m];
    for i in 0..n {
        let row = &mut out[i * m..(i + 1) * m];
        for kk in 0..k {
            let x = a[i * k + kk];
            for (v, &y) in row.iter_mut().zip(&b[kk * m..(kk + 1) * m]) {
                *v += x * y;
            }
        }
    }
    out
}

impl LoraLayer {
    /// The delta before scaling, row-major in the weight's layout.
    pub fn diff(&self) -> Vec<f32> {
        match &self.kind {
            Kind::Lora { up, down, rank } => {
                let r = (*rank).max(1);
                matmul(up, down, up.len() / r, r, down.len() / r)
            }
            Kind::Loha { m1, m2 } => m1.iter().zip(m2).map(|(a, b)| a * b).collect(),
            Kind::Lokr {
                w1,
                w1_shape: [a1, a2],
                w2,
                w2_shape: [b1, b2, taps],
            } => {
                let (rows, cols) = (a1 * b1, a2 * b2);
                let mut d = vec![0f32; rows * cols * taps];
                for i1 in 0..*a1 {
                    for j1 in 0..*a2 {
                        let x = w1[i1 * a2 + j1];
                        for i2 in 0..*b1 {
                            for j2 in 0..*b2 {
                                let src = (i2 * b2 + j2) * taps;
                                let dst = ((i1 * b1 + i2) * cols + j1 * b2 + j2) * taps;
                                for t in 0..*taps {
                                    d[dst + t] = x * w2[src + t];
                                }
                            }
                        }
                    }
                }
                d
            }
            Kind::Diff { diff } => diff.clone(),
        }
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

fn tensor(file: &SafeTensors, name: &str) -> Result<Shaped, String> {
    let info = file
        .get(name)
        .ok_or_else(|| format!("{}: no tensor {name}", file.path().display()))?;
    let data = file.to_f32(name).map_err(|e| e.to_string())?;
    Ok((info.shape.clone(), data))
}

/// Reads every layer of `file` that `map` (adapter key → target) names,
/// trying ComfyUI's adapter types in its order (LoRA, LoHa, LoKr), then a
/// full `.diff` (which replaces an adapter of the same key, as in
/// ComfyUI) and `.diff_b` (on the layer's bias).
pub fn load(file: &SafeTensors, map: &HashMap<String, Target>) -> Result<LoraFile, String> {
    let mut used = BTreeSet::new();
    let mut layers = Vec::new();
    // Sorted, so the order of patches (and so of their sums) is fixed.
    let mut keys: Vec<(&String, &Target)> = map.iter().collect();
    keys.sort();
    for (x, target) in keys {
        let mut r = Reader {
            file,
            used: &mut used,
        };
        let alpha = r
            .opt(&format!("{x}.alpha"))?
            .map(|(_, v)| f64::from(v.first().copied().unwrap_or(0.0)));
        for (suffix, what) in [
            ("dora_scale", "DoRA layers (dora_scale)"),
            ("a1.weight", "GLoRA layers (a1/a2/b1/b2)"),
            ("oft_blocks", "OFT/BOFT layers (oft_blocks)"),
        ] {
            if r.file.get(&format!("{x}.{suffix}")).is_some() {
                return Err(bad(file, format!("{x}: {what} are not supported yet")));
            }
        }
        let mut layer = match lora(&mut r, x)? {
            Some((kind, rank)) => Some(LoraLayer {
                kind,
                scale: alpha.map_or(1.0, |a| a / rank as f64),
            }),
            None => match loha(&mut r, x)? {
                Some((kind, rank)) => Some(LoraLayer {
                    kind,
                    scale: alpha.map_or(1.0, |a| a / rank as f64),
                }),
                None => lokr(&mut r, x)?.map(|(kind, dim)| LoraLayer {
                    kind,
                    scale: match (alpha, dim) {
                        (Some(a), Some(d)) => a / d as f64,
                        _ => 1.0,
                    },
                }),
            },
        };
        let bias = |diff: Vec<f32>| {
            target.tensor.strip_suffix(".weight").map(|b| {
                (
                    Target::whole(format!("{b}.bias")),
                    Arc::new(LoraLayer {
                        kind: Kind::Diff { diff },
                        scale: 1.0,
                    }),
                )
            })
        };
        // ComfyUI keeps one patch per tensor here: a later one replaces
        // an earlier (`diff_b` over `b_norm`, `diff` over an adapter).
        let mut bias_patch = None;
        // Normalisation layers' full weights (`w_norm`, `b_norm`).
        if let Some((_, w)) = r.opt(&format!("{x}.w_norm"))? {
            layer = Some(LoraLayer {
                kind: Kind::Diff { diff: w },
                scale: 1.0,
            });
            if let Some((_, b)) = r.opt(&format!("{x}.b_norm"))? {
                bias_patch = bias(b);
            }
        }
        if let Some((_, diff)) = r.opt(&format!("{x}.diff"))? {
            layer = Some(LoraLayer {
                kind: Kind::Diff { diff },
                scale: 1.0,
            });
        }
        if let Some(l) = layer {
            layers.push((target.clone(), Arc::new(l)));
        }
        if let Some((_, diff)) = r.opt(&format!("{x}.diff_b"))? {
            bias_patch = bias(diff);
        }
        layers.extend(bias_patch);
    }
    let unused = file
        .tensors()
        .map(|t| t.name.clone())
        .filter(|n| !used.contains(n))
        .collect();
    Ok(LoraFile { layers, unused })
}

/// A tensor's shape and f32 values.
type Shaped = (Vec<usize>, Vec<f32>);

/// Reads tensors of one file, noting which it took.
struct Reader<'a> {
    file: &'a SafeTensors,
    used: &'a mut BTreeSet<String>,
}

impl Reader<'_> {
    fn opt(&mut self, name: &str) -> Result<Option<Shaped>, String> {
        if self.file.get(name).is_none() {
            return Ok(None);
        }
        self.used.insert(name.to_string());
        tensor(self.file, name).map(Some)
    }

    fn req(&mut self, name: &str) -> Result<Shaped, String> {
        self.opt(name)?
            .ok_or_else(|| format!("{}: {name} is missing", self.file.path().display()))
    }
}

fn bad(file: &SafeTensors, what: String) -> String {
    format!("{}: {what}", file.path().display())
}

/// A LoRA/LoCon layer and its rank.
fn lora(r: &mut Reader<'_>, x: &str) -> Result<Option<(Kind, usize)>, String> {
    let Some((up_n, down_n, mid_n)) = names(x)
        .into_iter()
        .find(|(up, _, _)| r.file.get(up).is_some())
    else {
        return Ok(None);
    };
    let (up_s, up) = r.req(&up_n)?;
    let (down_s, mut down) = r.req(&down_n)?;
    let rank = down_s.first().copied().unwrap_or(0);
    if rank == 0 || up_s.get(1) != Some(&rank) {
        return Err(bad(
            r.file,
            format!("{up_n} {up_s:?} and {down_n} {down_s:?} do not share a rank"),
        ));
    }
    if let Some(mid_n) = mid_n {
        if let Some((mid_s, mid)) = r.opt(&mid_n)? {
            down = fold_mid(&down, &down_s, &mid, &mid_s)?;
        }
    }
    Ok(Some((Kind::Lora { up, down, rank }, rank)))
}

/// `a` `[n, r]` · `b` `[r, m…]`, or with a CP core `t` `[r, r, kh, kw]`:
/// ComfyUI's `einsum('i j k l, j r, i p -> p r k l', t, b, a)` with `a`
/// `[r, out]` and `b` `[r, in]`.
fn hada_product(a: Shaped, b: Shaped, t: Option<Shaped>) -> Result<Vec<f32>, String> {
    let ((as_, a), (bs, b)) = (a, b);
    match t {
        None => {
            let k = as_.get(1).copied().unwrap_or(0);
            if bs.first() != Some(&k) || k == 0 {
                return Err(format!("factors {as_:?} and {bs:?} do not share a rank"));
            }
            Ok(matmul(&a, &b, as_[0], k, b.len() / k))
        }
        Some((ts, t)) => {
            let [ri, rj, kh, kw] = ts[..] else {
                return Err(format!("a CP core of shape {ts:?}; expected 4 dimensions"));
            };
            let (out, inn) = (
                as_.get(1).copied().unwrap_or(0),
                bs.get(1).copied().unwrap_or(0),
            );
            if as_.first() != Some(&ri) || bs.first() != Some(&rj) {
                return Err(format!("CP core {ts:?} does not fit {as_:?} and {bs:?}"));
            }
            let taps = kh * kw;
            let mut m = vec![0f32; out * inn * taps];
            for p in 0..out {
                for rr in 0..inn {
                    for q in 0..taps {
                        let mut s = 0f32;
                        for i in 0..ri {
                            for j in 0..rj {
                                s += t[(i * rj + j) * taps + q] * b[j * inn + rr] * a[i * out + p];
                            }
                        }
                        m[(p * inn + rr) * taps + q] = s;
                    }
                }
            }
            Ok(m)
        }
    }
}

/// A LoHa layer and its rank (`hada_w1_b`'s first dimension).
fn loha(r: &mut Reader<'_>, x: &str) -> Result<Option<(Kind, usize)>, String> {
    if r.file.get(&format!("{x}.hada_w1_a")).is_none() {
        return Ok(None);
    }
    let w1a = r.req(&format!("{x}.hada_w1_a"))?;
    let w1b = r.req(&format!("{x}.hada_w1_b"))?;
    let w2a = r.req(&format!("{x}.hada_w2_a"))?;
    let w2b = r.req(&format!("{x}.hada_w2_b"))?;
    let rank = w1b.0.first().copied().unwrap_or(1);
    let t1 = r.opt(&format!("{x}.hada_t1"))?;
    let t2 = if t1.is_some() {
        Some(r.req(&format!("{x}.hada_t2"))?)
    } else {
        None
    };
    let m1 = hada_product(w1a, w1b, t1).map_err(|e| bad(r.file, format!("{x}: {e}")))?;
    let m2 = hada_product(w2a, w2b, t2).map_err(|e| bad(r.file, format!("{x}: {e}")))?;
    if m1.len() != m2.len() {
        return Err(bad(
            r.file,
            format!("{x}: the two LoHa products differ in size"),
        ));
    }
    Ok(Some((Kind::Loha { m1, m2 }, rank)))
}

/// A LoKr layer and the rank its alpha divides by (the decomposed
/// factor's; None when both are full).
fn lokr(r: &mut Reader<'_>, x: &str) -> Result<Option<(Kind, Option<usize>)>, String> {
    let has = |s: &str| r.file.get(&format!("{x}.{s}")).is_some();
    if !(has("lokr_w1") || has("lokr_w1_a")) {
        return Ok(None);
    }
    let mut dim = None;
    let (w1s, w1) = match r.opt(&format!("{x}.lokr_w1"))? {
        Some(w) => w,
        None => {
            let a = r.req(&format!("{x}.lokr_w1_a"))?;
            let b = r.req(&format!("{x}.lokr_w1_b"))?;
            dim = b.0.first().copied();
            let shape = vec![a.0[0], b.0.get(1).copied().unwrap_or(0)];
            (
                shape,
                hada_product(a, b, None).map_err(|e| bad(r.file, format!("{x}: {e}")))?,
            )
        }
    };
    let (w2s, w2) = match r.opt(&format!("{x}.lokr_w2"))? {
        Some(w) => w,
        None => {
            let a = r.req(&format!("{x}.lokr_w2_a"))?;
            let b = r.req(&format!("{x}.lokr_w2_b"))?;
            dim = b.0.first().copied();
            match r.opt(&format!("{x}.lokr_t2"))? {
                Some(t) => {
                    let shape = vec![
                        a.0.get(1).copied().unwrap_or(0),
                        b.0.get(1).copied().unwrap_or(0),
                        t.0[2],
                        t.0[3],
                    ];
                    (
                        shape,
                        hada_product(a, b, Some(t))
                            .map_err(|e| bad(r.file, format!("{x}: {e}")))?,
                    )
                }
                None => {
                    let shape = vec![a.0[0], b.0.get(1).copied().unwrap_or(0)];
                    (
                        shape,
                        hada_product(a, b, None).map_err(|e| bad(r.file, format!("{x}: {e}")))?,
                    )
                }
            }
        }
    };
    let [a1, a2] = w1s[..] else {
        return Err(bad(r.file, format!("{x}: lokr_w1 has shape {w1s:?}")));
    };
    let (b1, b2) = (w2s[0], w2s.get(1).copied().unwrap_or(1));
    let taps: usize = w2s.iter().skip(2).product();
    Ok(Some((
        Kind::Lokr {
            w1,
            w1_shape: [a1, a2],
            w2,
            w2_shape: [b1, b2, taps],
        },
        dim,
    )))
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
    /// Add the layer's second row half to the tensor's first and the first
    /// to the second ([`super::keys::Target::swap_halves`]).
    pub swap_halves: bool,
}

/// Applies `patches` in order to `w` (f32, row-major).
pub fn apply(w: &mut [f32], patches: &[TensorPatch]) -> Result<(), String> {
    for p in patches {
        let mut d = p.layer.diff();
        if p.swap_halves {
            let half = d.len() / 2;
            d.rotate_left(half);
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use sdkit_compute::weights::{serialize_safetensors, DType};
    use std::collections::BTreeMap;

    /// Adapter types sdkit does not build are refused by name rather than
    /// skipped as unknown keys (which would silently do nothing).
    #[test]
    fn unbuilt_adapter_types_are_refused_by_name() {
        let x = "lora_unet_down_blocks_0_attentions_0_proj_in";
        let one = 1.0f32.to_le_bytes();
        for (suffix, what) in [
            ("dora_scale", "DoRA"),
            ("a1.weight", "GLoRA"),
            ("oft_blocks", "OFT/BOFT"),
        ] {
            let name = format!("{x}.{suffix}");
            let bytes = serialize_safetensors(&[(&name, DType::F32, &[1], &one)], &BTreeMap::new())
                .expect("serializes");
            let file = SafeTensors::from_bytes("adapter.safetensors", bytes).expect("parses");
            let mut map = HashMap::new();
            map.insert(x.to_string(), Target::whole("w.weight".into()));
            let Err(err) = load(&file, &map) else {
                panic!("{what} layers were not refused");
            };
            assert!(
                err.contains(what) && err.contains("not supported yet"),
                "{err}"
            );
        }
    }
}
