//! Adapters on top of a loaded model: LoRA/LoCon (LoraLoader,
//! LoraLoaderModelOnly).
//!
//! The base weights are never modified. A MODEL or CLIP carries
//! [`Patches`]: per tensor, the layers applied to it in stack order. When a
//! program binds its weights, each patched tensor is computed from the
//! file (base + patches) once per patch set and bound as f32; the others
//! stay in the file as before.

pub mod keys;
pub mod lora;
pub mod stochastic;

use crate::diffusion::{input, opaque, Clip, Model, ModelFile};
use crate::models::detect::Net;
use keys::Target;
use lora::TensorPatch;
use sdkit_compute::weights::{rounding, DType, SafeTensors};
use sdkit_engine::{Inputs, NodeContext, NodeError, NodeImpl, NodeOutput};
use sdkit_schema::SocketType;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

/// The patches on one model's tensors, and the patched tensors computed so
/// far (shared by every handle on this patch set, so a sampler's steps and
/// later runs patch each tensor once).
#[derive(Debug, Default)]
pub struct Patches {
    pub by_tensor: BTreeMap<String, Vec<TensorPatch>>,
    /// How ComfyUI names these tensors: our prefix and its (a model's
    /// tensor `{ours}x` is its `diffusion_model.x`); the name seeds the
    /// stochastic rounding of fp8-held weights.
    pub comfy_names: Option<(String, String)>,
    computed: Mutex<HashMap<String, Arc<Vec<f32>>>>,
}

impl Patches {
    pub fn is_empty(&self) -> bool {
        self.by_tensor.is_empty()
    }

    /// These patches followed by `more`.
    pub fn with(&self, more: impl IntoIterator<Item = (String, TensorPatch)>) -> Patches {
        let mut by_tensor = self.by_tensor.clone();
        for (t, p) in more {
            by_tensor.entry(t).or_default().push(p);
        }
        Patches {
            by_tensor,
            comfy_names: self.comfy_names.clone(),
            computed: Mutex::new(HashMap::new()),
        }
    }

    /// Tensor `name` of `file` with its patches applied, or None when it
    /// has none. `held_as`: the dtype the weight is held in (its base
    /// read as that, the patched result rounded back to it, as ComfyUI
    /// casts a patched weight to the weight's dtype; to fp8 stochastically,
    /// seeded by ComfyUI's name of the tensor, [`stochastic`]).
    pub fn patched(
        &self,
        file: &ModelFile,
        name: &str,
        held_as: Option<DType>,
    ) -> Result<Option<Arc<Vec<f32>>>, NodeError> {
        let Some(list) = self.by_tensor.get(name) else {
            return Ok(None);
        };
        // A scaled-fp8 layer's tensor: ComfyUI patches `stored · scale`
        // and keeps `stochastic(result / scale)` (its set_weight; a bias's
        // scale is 1), which the forward multiplies by the scale again.
        let scaled = file.store.get(name).and_then(|r| r.info.scaled);
        let held_as = scaled.map(|s| s.held_as).or(held_as);
        let mut computed = self
            .computed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(d) = computed.get(name) {
            return Ok(Some(Arc::clone(d)));
        }
        if let Some(d) = file.patched.get(name, list, held_as) {
            computed.insert(name.to_string(), Arc::clone(&d));
            return Ok(Some(d));
        }
        let mut w = file.tensor_held(name, held_as)?;
        lora::apply(&mut w, list)
            .map_err(|e| NodeError::invalid(format!("{}: tensor \"{name}\": {e}", file.name)))?;
        match held_as {
            Some(d @ (DType::F8E4M3 | DType::F8E5M2)) => {
                let key = match &self.comfy_names {
                    Some((ours, theirs)) => {
                        format!(
                            "{theirs}{}",
                            name.strip_prefix(ours.as_str()).unwrap_or(name)
                        )
                    }
                    None => name.to_string(),
                };
                let scale = scaled.map_or(1.0, |s| s.scale);
                if scale != 1.0 {
                    w.iter_mut().for_each(|x| *x /= scale);
                }
                stochastic::stochastic_round(&mut w, d, stochastic::string_to_seed(&key));
                if scale != 1.0 {
                    w.iter_mut().for_each(|x| *x *= scale);
                }
            }
            Some(d) => {
                if let Some(round) = rounding(d) {
                    w.iter_mut().for_each(|x| *x = round(*x));
                }
            }
            None => {}
        }
        let d = Arc::new(w);
        file.patched.insert(name, list, held_as, Arc::clone(&d));
        computed.insert(name.to_string(), Arc::clone(&d));
        Ok(Some(d))
    }
}

/// One patch of a list as the cache compares it: the layer (held weakly),
/// the strength's bits, the row range and whether the halves swap.
type PatchKey = (
    std::sync::Weak<lora::LoraLayer>,
    u64,
    (Option<(usize, usize)>, bool),
);

/// One patched tensor: the patch list it was made with (each layer held
/// weakly, so an entry lives only while all its layers do) and the result.
#[derive(Debug)]
struct PatchedEntry {
    layers: Vec<PatchKey>,
    held_as: Option<DType>,
    data: Arc<Vec<f32>>,
}

impl PatchedEntry {
    fn matches(&self, list: &[TensorPatch], held_as: Option<DType>) -> bool {
        self.held_as == held_as
            && self.layers.len() == list.len()
            && self.layers.iter().zip(list).all(|((w, s, r), p)| {
                w.upgrade().is_some_and(|l| Arc::ptr_eq(&l, &p.layer))
                    && *s == p.strength.to_bits()
                    && *r == (p.rows, p.swap_halves)
            })
    }

    fn alive(&self) -> bool {
        self.layers.iter().all(|(w, ..)| w.strong_count() > 0)
    }
}

/// A file's patched tensors by patch list. When a LoRA stack runs again
/// with one strength changed (`watch`, the server), only the loader that
/// changed makes new layers: tensors the other LoRAs patch keep their list
/// and are found here, not recomputed, and being the same host data they
/// are not uploaded again. Entries go when one of their layers is dropped.
#[derive(Debug, Default)]
pub struct PatchedCache(Mutex<HashMap<String, Vec<PatchedEntry>>>);

impl PatchedCache {
    fn get(
        &self,
        name: &str,
        list: &[TensorPatch],
        held_as: Option<DType>,
    ) -> Option<Arc<Vec<f32>>> {
        let map = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        map.get(name)?
            .iter()
            .find(|e| e.matches(list, held_as))
            .map(|e| Arc::clone(&e.data))
    }

    fn insert(
        &self,
        name: &str,
        list: &[TensorPatch],
        held_as: Option<DType>,
        data: Arc<Vec<f32>>,
    ) {
        let mut map = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Drop what can no longer match, here and for every tensor (a
        // stack's tensors are inserted together, so this stays small).
        map.retain(|_, v| {
            v.retain(PatchedEntry::alive);
            !v.is_empty()
        });
        map.entry(name.to_string()).or_default().push(PatchedEntry {
            layers: list
                .iter()
                .map(|p| {
                    (
                        Arc::downgrade(&p.layer),
                        p.strength.to_bits(),
                        (p.rows, p.swap_halves),
                    )
                })
                .collect(),
            held_as,
            data,
        });
    }
}

/// Patches by tensor name, and the file keys they came from.
type Loaded = (Vec<(String, TensorPatch)>, BTreeSet<String>);

/// The LoRA file `name` from `models/loras`.
fn open_lora(ctx: &NodeContext, name: &str) -> Result<SafeTensors, NodeError> {
    let path = crate::diffusion::loaders::model_path(ctx, "loras", name)?;
    SafeTensors::open(&path).map_err(|e| NodeError::invalid(e.to_string()))
}

/// The patches a LoRA file makes on a model at `strength`, and the file
/// keys they used.
fn model_patches(file: &SafeTensors, model: &Model, strength: f64) -> Result<Loaded, NodeError> {
    let names: Vec<String> = model
        .file
        .store
        .entries()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let map = match &model.net {
        Net::Flux(f) => keys::flux_keys(
            f.hidden,
            f.mlp,
            &model.prefix,
            names.iter().map(String::as_str),
        ),
        Net::Mmdit(m) => {
            keys::mmdit_keys(m.hidden, &model.prefix, names.iter().map(String::as_str))
        }
        _ => keys::unet_keys(
            model.unet("LoRA")?,
            &model.prefix,
            names.iter().map(String::as_str),
        ),
    };
    patches_from(file, &map, strength)
}

fn patches_from(
    file: &SafeTensors,
    map: &HashMap<String, Target>,
    strength: f64,
) -> Result<Loaded, NodeError> {
    let loaded = lora::load(file, map).map_err(NodeError::invalid)?;
    let all: BTreeSet<String> = file.tensors().map(|t| t.name.clone()).collect();
    let unused: BTreeSet<String> = loaded.unused.into_iter().collect();
    let used = all.difference(&unused).cloned().collect();
    let patches = loaded
        .layers
        .into_iter()
        .map(|(t, layer)| {
            (
                t.tensor,
                TensorPatch {
                    layer,
                    strength,
                    rows: t.rows,
                    swap_halves: t.swap_halves,
                },
            )
        })
        .collect();
    Ok((patches, used))
}

/// Warns, as ComfyUI does, about the file's keys no model part took.
fn report_unused(ctx: &NodeContext, name: &str, file: &SafeTensors, used: &BTreeSet<String>) {
    let unused: Vec<&str> = file
        .tensors()
        .map(|t| t.name.as_str())
        .filter(|n| !used.contains(*n))
        .collect();
    if !unused.is_empty() {
        let shown: Vec<&str> = unused.iter().take(5).copied().collect();
        tracing::warn!(
            "node {} ({}): LoRA {name}: {} keys not loaded (no matching model weight), e.g. {}",
            ctx.node_id,
            ctx.class_type,
            unused.len(),
            shown.join(", ")
        );
    }
}

fn patched_model(model: &Model, patches: Vec<(String, TensorPatch)>) -> Model {
    let mut m = model.clone();
    let mut p = model.patches.with(patches);
    p.comfy_names = Some((model.prefix.clone(), "diffusion_model.".to_string()));
    m.patches = Arc::new(p);
    m
}

/// ComfyUI's LoraLoader: the LoRA's UNet layers on the model at
/// `strength_model`, its text-encoder layers on the CLIP at
/// `strength_clip` (either may be negative; 0 leaves that part as it is).
pub struct LoraLoader;

impl NodeImpl for LoraLoader {
    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let model: Arc<Model> = input(inputs, "model", "MODEL")?;
        let clip: Arc<Clip> = input(inputs, "clip", "CLIP")?;
        let name = inputs.string("lora_name")?;
        let (sm, sc) = (
            inputs.float("strength_model")?,
            inputs.float("strength_clip")?,
        );
        if sm == 0.0 && sc == 0.0 {
            return Ok(NodeOutput::values(vec![
                opaque(SocketType::Model, (*model).clone()),
                opaque(SocketType::Clip, (*clip).clone()),
            ]));
        }
        let file = open_lora(ctx, name)?;
        let (mp, mut used) = model_patches(&file, &model, sm)?;
        let mut clip_out = (*clip).clone();
        let parts: Vec<_> = clip
            .encoders
            .iter()
            .map(|e| (e.rule.encoder, e.prefix.as_str(), &e.arch))
            .collect();
        let by_key = keys::clip_keys(&parts);
        for (i, enc) in clip_out.encoders.iter_mut().enumerate() {
            let map: HashMap<String, Target> = by_key
                .iter()
                .filter(|(_, (e, _))| *e == i)
                .map(|(k, (_, t))| (k.clone(), t.clone()))
                .collect();
            let (cp, u) = patches_from(&file, &map, sc)?;
            used.extend(u);
            if sc != 0.0 {
                enc.patches = Arc::new(enc.patches.with(cp));
            }
        }
        report_unused(ctx, name, &file, &used);
        let model_out = if sm != 0.0 {
            patched_model(&model, mp)
        } else {
            (*model).clone()
        };
        Ok(NodeOutput::values(vec![
            opaque(SocketType::Model, model_out),
            opaque(SocketType::Clip, clip_out),
        ]))
    }
}

/// ComfyUI's LoraLoaderModelOnly: the UNet layers only.
pub struct LoraLoaderModelOnly;

impl NodeImpl for LoraLoaderModelOnly {
    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let model: Arc<Model> = input(inputs, "model", "MODEL")?;
        let name = inputs.string("lora_name")?;
        let sm = inputs.float("strength_model")?;
        if sm == 0.0 {
            return Ok(NodeOutput::values(vec![opaque(
                SocketType::Model,
                (*model).clone(),
            )]));
        }
        let file = open_lora(ctx, name)?;
        let (mp, used) = model_patches(&file, &model, sm)?;
        report_unused(ctx, name, &file, &used);
        Ok(NodeOutput::values(vec![opaque(
            SocketType::Model,
            patched_model(&model, mp),
        )]))
    }
}
