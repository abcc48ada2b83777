//! The bindings of a Stability control-LoRA's ControlNet: built at
//! sampling time from the sampling model's own (patched) weights, the
//! file's full tensors replacing some and its `up`/`down` pairs added to
//! others (`W + up·down`), as ComfyUI's `ControlLora` does.

use super::{Model, ModelFile};
use sdkit_compute::backend::cpu::Bindings;
use sdkit_compute::plan::{Command, Program};
use sdkit_compute::weights::WeightStore;
use sdkit_engine::NodeError;
use std::sync::Arc;

/// A control-LoRA's weights for `prog` (ComfyUI's `ControlLora.pre_run`):
/// the file's full tensors; where it has `X.up`/`X.down`, the model's
/// (LoRA-patched) `X.weight` plus `up·down` (in f32, the model's dtype on
/// the CPU); everything else the model's own weight.
pub(crate) fn bindings(
    prog: &Program,
    file: &ModelFile,
    model: &Model,
) -> Result<Bindings, NodeError> {
    let mut b = Bindings::default();
    let model_weight = |name: &str| -> Result<Option<Arc<Vec<f32>>>, NodeError> {
        let full = format!("{}{name}", model.prefix);
        model.patches.patched(&model.file, &full, None)
    };
    for c in &prog.commands {
        let Command::Upload { name, .. } = c else {
            continue;
        };
        if file.store.contains(name) {
            b.stored.insert(
                name.clone(),
                file.store
                    .stored(name)
                    .map_err(|e| NodeError::invalid(format!("{}: {e}", file.name)))?,
            );
            continue;
        }
        let base = name.strip_suffix(".weight");
        let pair = base.filter(|x| {
            file.store.contains(&format!("{x}.up")) && file.store.contains(&format!("{x}.down"))
        });
        if let Some(x) = pair {
            let mut w = match model_weight(name)? {
                Some(p) => p.to_vec(),
                None => model.file.tensor_f32(&format!("{}{name}", model.prefix))?,
            };
            let up = file.tensor_f32(&format!("{x}.up"))?;
            let down = file.tensor_f32(&format!("{x}.down"))?;
            // up [out, r(, 1, 1)], down [r, in·kh·kw]: W += up · down.
            let r = rank_of(&file.store, x)?;
            let out = up.len() / r;
            let cols = w.len() / out.max(1);
            if out * cols != w.len() || down.len() != r * cols {
                return Err(NodeError::invalid(format!(
                    "{}: {x}.up/.down do not fit the model's {name}",
                    file.name
                )));
            }
            for o in 0..out {
                for (k, wv) in w[o * cols..(o + 1) * cols].iter_mut().enumerate() {
                    let mut d = 0f32;
                    for j in 0..r {
                        d += up[o * r + j] * down[j * cols + k];
                    }
                    *wv += d;
                }
            }
            b.weights.insert(name.clone(), Arc::new(w));
            continue;
        }
        super::bind_model_weight(model, name, name, &mut b)?;
    }
    Ok(b)
}

/// The rank of a control-LoRA pair: `X.up`'s second dimension.
fn rank_of(store: &WeightStore, x: &str) -> Result<usize, NodeError> {
    store
        .get(&format!("{x}.up"))
        .and_then(|r| r.info.shape.get(1).copied())
        .filter(|&r| r > 0)
        .ok_or_else(|| NodeError::invalid(format!("{x}.up has no rank dimension")))
}
