//! One name space over several weight files ([`WeightStore`]), and
//! tensors left in their file until a kernel needs them ([`StoredWeight`]).

use super::convert::rounding;
use super::{DType, Memory, SafeTensors, TensorInfo, WeightError};
use std::path::Path;
use std::sync::Arc;

/// Where a store name resolved to.
#[derive(Debug, Clone, Copy)]
pub struct Resolved<'a> {
    pub file: &'a SafeTensors,
    /// The tensor; `info.name` is its name in `file`, which differs from the
    /// store name when the mount remaps prefixes.
    pub info: &'a TensorInfo,
}

impl Resolved<'_> {
    /// The tensor's bytes (see [`SafeTensors::raw`]).
    pub fn raw(&self) -> Result<&[u8], WeightError> {
        self.file.raw_of(self.info)
    }

    /// The tensor in f32 (see [`SafeTensors::to_f32`]).
    pub fn to_f32(&self) -> Result<Vec<f32>, WeightError> {
        Ok(self.file.decode(self.info, self.raw()?))
    }
}

/// A tensor left in its file, in its stored dtype, until a kernel needs
/// it: the CPU backend converts it to f32 for the kernels that read it and
/// drops the copy after the last one, so no f32 copy of a model lives
/// beside the memory-mapped file.
#[derive(Debug, Clone)]
pub struct StoredWeight {
    file: Arc<SafeTensors>,
    key: String,
    dtype: DType,
    len: usize,
    /// Read as if stored in this (narrower) dtype: UNETLoader's fp8
    /// `weight_dtype` (ComfyUI casts the weights to it when loading and
    /// back to the compute dtype per layer).
    cast: Option<DType>,
    /// A tensor of a scaled-fp8 layer (see [`super::Scaled`]): ComfyUI's
    /// scaled ops hold it in fp8 (times its scale) whatever the model's
    /// dtype, so `cast` does not round it.
    scaled: bool,
}

impl StoredWeight {
    /// The dtype it is read as if cast to, if any.
    pub fn cast(&self) -> Option<DType> {
        self.cast
    }

    /// The same tensor read as if cast to `dtype` first (F16, F8E4M3 or
    /// F8E5M2; other dtypes read as stored).
    pub fn cast_to(mut self, dtype: DType) -> Self {
        self.cast = Some(dtype);
        self
    }

    /// Whether it belongs to a scaled-fp8 layer (see [`super::Scaled`]).
    pub fn scaled(&self) -> bool {
        self.scaled
    }

    fn finish(&self, mut v: Vec<f32>) -> Vec<f32> {
        if self.scaled || self.cast.is_none_or(|c| exact_in(self.dtype, c)) {
            return v;
        }
        if let Some(round) = self.cast.and_then(rounding) {
            v.iter_mut().for_each(|x| *x = round(*x));
        }
        v
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The file it is read from.
    pub fn file(&self) -> &Arc<SafeTensors> {
        &self.file
    }

    /// Its name in that file.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The tensor in f32 (see [`SafeTensors::to_f32`]).
    pub fn to_f32(&self) -> Result<Vec<f32>, WeightError> {
        Ok(self.finish(self.file.to_f32(&self.key)?))
    }

    /// Drops this tensor's file pages from the process (see
    /// [`SafeTensors::release_pages`]).
    pub fn release_pages(&self) {
        self.file.release_pages(&self.key)
    }

    /// Elements `[start, start + len)` in f32, the rest left unread.
    pub fn range_f32(&self, start: usize, len: usize) -> Result<Vec<f32>, WeightError> {
        // Whole storage units: elements, or a quantized type's blocks (a
        // row of a GGUF table is whole blocks).
        let (per, size) = self.dtype.block();
        let raw = self.file.raw(&self.key)?;
        let bytes = start
            .checked_add(len)
            .filter(|&end| end <= self.len && start.is_multiple_of(per) && end.is_multiple_of(per))
            .and_then(|end| raw.get(start / per * size..end / per * size))
            .ok_or_else(|| WeightError::NotInStore {
                tensor: self.key.clone(),
                detail: format!(
                    "elements {start}..{} are outside its {} elements",
                    start.saturating_add(len),
                    self.len
                ),
            })?;
        let info = self
            .file
            .get(&self.key)
            .ok_or_else(|| WeightError::TensorNotFound {
                path: self.file.path().to_path_buf(),
                tensor: self.key.clone(),
            })?;
        Ok(self.finish(self.file.decode(info, bytes)))
    }
}

/// Whether every value of `from` is a value of `to`, so a cast changes
/// nothing (fp8 files read as a text encoder's f16 skip the rounding).
fn exact_in(from: DType, to: DType) -> bool {
    use DType::*;
    from == to
        || matches!(
            (from, to),
            (F8E4M3 | F8E5M2, F16) | (F8E4M3 | F8E5M2 | F16 | BF16, F32)
        )
}

#[derive(Debug)]
struct Mount {
    file: Arc<SafeTensors>,
    from: String,
    to: String,
}

/// One name space over several weight files.
///
/// Each [`mount`](WeightStore::mount) makes the tensors of a file whose
/// names start with `from` visible under `to` instead (`from + rest` is seen
/// as `to + rest`). A later mount *shadows* everything under its `to` prefix
/// from earlier mounts, whole: mounting a separate VAE at
/// `first_stage_model.` replaces the checkpoint's VAE rather than mixing
/// the two, and a name under that prefix the VAE lacks is missing, not
/// taken from the checkpoint.
///
/// ```no_run
/// # use sdkit_compute::weights::*;
/// # use std::path::Path;
/// # fn main() -> Result<(), WeightError> {
/// let mut store = WeightStore::new();
/// store.open_mount(Path::new("sd15.safetensors"), "", "")?;
/// store.open_mount(Path::new("vae.safetensors"), "", "first_stage_model.")?;
/// let w = store.to_f32("first_stage_model.decoder.conv_in.weight")?;
/// # Ok(()) }
/// ```
#[derive(Debug, Default)]
pub struct WeightStore {
    mounts: Vec<Mount>,
}

impl WeightStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes `file`'s tensors named `from + rest` visible as `to + rest`,
    /// shadowing earlier mounts under `to`. A file may be mounted several
    /// times with different prefixes.
    pub fn mount(&mut self, file: Arc<SafeTensors>, from: &str, to: &str) {
        self.mounts.push(Mount {
            file,
            from: from.to_string(),
            to: to.to_string(),
        });
    }

    /// Opens `path` and mounts it; returns the file for further mounts.
    pub fn open_mount(
        &mut self,
        path: &Path,
        from: &str,
        to: &str,
    ) -> Result<Arc<SafeTensors>, WeightError> {
        let file = Arc::new(SafeTensors::open(path)?);
        self.mount(Arc::clone(&file), from, to);
        Ok(file)
    }

    /// The files mounted, in mount order (a file mounted twice appears twice).
    pub fn files(&self) -> impl Iterator<Item = &Arc<SafeTensors>> {
        self.mounts.iter().map(|m| &m.file)
    }

    /// The mount that owns `name`: the latest whose `to` prefixes it.
    fn owner(&self, name: &str) -> Option<(&Mount, String)> {
        self.mounts.iter().rev().find_map(|m| {
            name.strip_prefix(m.to.as_str())
                .map(|rest| (m, format!("{}{rest}", m.from)))
        })
    }

    /// Where `name` resolves to, if anywhere.
    pub fn get(&self, name: &str) -> Option<Resolved<'_>> {
        let (mount, key) = self.owner(name)?;
        let info = mount.file.get(&key)?;
        Some(Resolved {
            file: &mount.file,
            info,
        })
    }

    /// Whether `name` resolves.
    pub fn contains(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    /// Like [`get`](Self::get), with an error saying where it looked.
    pub fn resolve(&self, name: &str) -> Result<Resolved<'_>, WeightError> {
        let not_found = |detail: String| WeightError::NotInStore {
            tensor: name.to_string(),
            detail,
        };
        let Some((mount, key)) = self.owner(name) else {
            let prefixes: Vec<String> = self
                .mounts
                .iter()
                .map(|m| format!("{:?} ({})", m.to, m.file.path().display()))
                .collect();
            return Err(not_found(if prefixes.is_empty() {
                "nothing is mounted".to_string()
            } else {
                format!(
                    "no mount covers it; mounted prefixes: {}",
                    prefixes.join(", ")
                )
            }));
        };
        let info = mount.file.get(&key).ok_or_else(|| {
            not_found(format!(
                "it maps to {key:?} in {}, which has no such tensor",
                mount.file.path().display()
            ))
        })?;
        Ok(Resolved {
            file: &mount.file,
            info,
        })
    }

    /// A handle on the tensor `name` that reads it when asked.
    pub fn stored(&self, name: &str) -> Result<StoredWeight, WeightError> {
        let r = self.resolve(name)?;
        let (mount, key) = self.owner(name).ok_or_else(|| WeightError::NotInStore {
            tensor: name.to_string(),
            detail: "no mount covers it".to_string(),
        })?;
        Ok(StoredWeight {
            file: Arc::clone(&mount.file),
            key,
            dtype: r.info.dtype,
            len: r.info.numel(),
            cast: None,
            scaled: r.info.scaled.is_some(),
        })
    }

    /// The bytes of a tensor (see [`SafeTensors::raw`]).
    pub fn raw(&self, name: &str) -> Result<&[u8], WeightError> {
        let r = self.resolve(name)?;
        r.file.raw_of(r.info)
    }

    /// A tensor in f32 (see [`SafeTensors::to_f32`]).
    pub fn to_f32(&self, name: &str) -> Result<Vec<f32>, WeightError> {
        self.resolve(name)?.to_f32()
    }

    /// Every visible name with where it resolves, sorted by name.
    pub fn entries(&self) -> Vec<(String, Resolved<'_>)> {
        let mut out = Vec::new();
        for (i, m) in self.mounts.iter().enumerate() {
            let later = &self.mounts[i + 1..];
            for key in m.file.keys_with_prefix(&m.from) {
                let Some(rest) = key.strip_prefix(m.from.as_str()) else {
                    continue;
                };
                let name = format!("{}{rest}", m.to);
                // Shadowed by a later mount: that mount answers for it.
                if later.iter().any(|l| name.starts_with(l.to.as_str())) {
                    continue;
                }
                if let Some(info) = m.file.get(key) {
                    out.push((
                        name,
                        Resolved {
                            file: &m.file,
                            info,
                        },
                    ));
                }
            }
        }
        // A visible name comes from exactly one mount (the owner), so
        // there are no duplicates to remove.
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Every visible name, sorted.
    pub fn names(&self) -> Vec<String> {
        self.entries().into_iter().map(|(n, _)| n).collect()
    }

    /// Visible names starting with `prefix`, sorted.
    pub fn keys_with_prefix(&self, prefix: &str) -> Vec<String> {
        self.entries()
            .into_iter()
            .map(|(n, _)| n)
            .filter(|n| n.starts_with(prefix))
            .collect()
    }

    /// Bytes of all visible tensors as stored.
    pub fn total_bytes(&self) -> u64 {
        self.memory().bytes
    }

    /// Size estimate of all visible tensors (see [`Memory`]).
    pub fn memory(&self) -> Memory {
        let entries = self.entries();
        Memory::of(entries.iter().map(|(_, r)| r.info))
    }
}
