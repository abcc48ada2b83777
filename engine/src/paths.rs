//! Folder layout, following ComfyUI's: `models/<kind>/`, `input/`,
//! `output/`, `temp/` under a base directory.

use sdkit_schema::export::ComboSource;
use sdkit_schema::spec::ComboOptions;
use std::path::{Component, Path, PathBuf};

/// Model folders ComfyUI knows, and the extensions it lists in them.
pub const MODEL_FOLDERS: &[&str] = &[
    "checkpoints",
    "loras",
    "vae",
    "vae_approx",
    "controlnet",
    "embeddings",
    "clip",
    "text_encoders",
    "diffusion_models",
    "unet",
    "clip_vision",
    "style_models",
    "upscale_models",
    "gligen",
    "hypernetworks",
    "configs",
];

/// Folders that are one kind in ComfyUI: `text_encoders` also lists
/// `models/clip`, `diffusion_models` also `models/unet` (and the legacy
/// names mean the same pair), in ComfyUI's search order.
const FOLDER_ALIASES: &[(&str, &[&str])] = &[
    ("text_encoders", &["text_encoders", "clip"]),
    ("clip", &["text_encoders", "clip"]),
    ("diffusion_models", &["unet", "diffusion_models"]),
    ("unet", &["unet", "diffusion_models"]),
    // ComfyUI-GGUF's folder kinds: the same folders, GGUF files only
    // (`unet_gguf`) or both kinds (`clip_gguf`).
    ("unet_gguf", &["unet", "diffusion_models"]),
    ("clip_gguf", &["text_encoders", "clip"]),
];

/// The folders under `models/` that `folder` searches.
fn folder_dirs(folder: &str) -> Vec<&str> {
    FOLDER_ALIASES
        .iter()
        .find(|(k, _)| *k == folder)
        .map_or_else(|| vec![folder], |(_, v)| v.to_vec())
}

const MODEL_EXTENSIONS: &[&str] = &[
    "safetensors",
    "sft",
    "ckpt",
    "pt",
    "pt2",
    "bin",
    "pth",
    "pkl",
    "gguf",
];

const IMAGE_EXTENSIONS: &[&str] = &["png", "jpg", "jpeg", "webp", "bmp", "gif", "tif", "tiff"];

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Paths {
    pub models: PathBuf,
    pub input: PathBuf,
    pub output: PathBuf,
    pub temp: PathBuf,
}

impl Paths {
    /// The default layout under `base`.
    pub fn under(base: &Path) -> Self {
        Paths {
            models: base.join("models"),
            input: base.join("input"),
            output: base.join("output"),
            temp: base.join("temp"),
        }
    }

    /// Resolves a file name chosen in a combo (possibly with ComfyUI's
    /// `name [input]` / `[output]` / `[temp]` annotation and subfolders)
    /// to a path, refusing names that escape the folder.
    pub fn annotated_input(&self, name: &str) -> Option<PathBuf> {
        let (name, base) = if let Some(n) = name.strip_suffix(" [output]") {
            (n, &self.output)
        } else if let Some(n) = name.strip_suffix(" [temp]") {
            (n, &self.temp)
        } else {
            (name.strip_suffix(" [input]").unwrap_or(name), &self.input)
        };
        safe_join(base, name)
    }

    /// Path of a model file in a model folder, e.g. (`checkpoints`,
    /// `sd15.safetensors`): the first folder of the kind that has it (the
    /// first folder's path when none has).
    pub fn model(&self, folder: &str, name: &str) -> Option<PathBuf> {
        let dirs = folder_dirs(folder);
        let paths: Vec<PathBuf> = dirs
            .iter()
            .map(|d| safe_join(&self.models.join(d), name))
            .collect::<Option<_>>()?;
        let first = paths.first().cloned();
        paths.into_iter().find(|p| p.is_file()).or(first)
    }

    /// The approximate VAEs both of whose halves (`NAME_encoder.*`,
    /// `NAME_decoder.*`) are in `vae_approx`, in ComfyUI's order.
    fn vae_approximations(&self) -> Vec<String> {
        let files = self.model_files("vae_approx");
        let has = |stem: &str| files.iter().any(|f| f.starts_with(stem));
        ["taesd", "taesdxl", "taesd3", "taef1"]
            .iter()
            .filter(|n| has(&format!("{n}_encoder.")) && has(&format!("{n}_decoder.")))
            .map(|n| n.to_string())
            .collect()
    }

    /// Every model file of a folder kind, relative, sorted, deduplicated.
    pub fn model_files(&self, folder: &str) -> Vec<String> {
        let exts: &[&str] = if folder == "unet_gguf" {
            &["gguf"]
        } else {
            MODEL_EXTENSIONS
        };
        let mut out: Vec<String> = folder_dirs(folder)
            .iter()
            .flat_map(|d| list_files(&self.models.join(d), exts, true))
            .collect();
        out.sort();
        out.dedup();
        out
    }
}

/// Joins a relative, user-supplied path below `base`; None if it is
/// absolute or climbs out with `..`.
pub fn safe_join(base: &Path, rel: &str) -> Option<PathBuf> {
    let p = Path::new(rel);
    if rel.is_empty() {
        return None;
    }
    for c in p.components() {
        match c {
            Component::Normal(_) | Component::CurDir => {}
            _ => return None,
        }
    }
    Some(base.join(p))
}

fn has_ext(p: &Path, exts: &[&str]) -> bool {
    p.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| exts.contains(&e.to_ascii_lowercase().as_str()))
}

/// Lists files below `dir` (recursively, `/`-separated, sorted), as ComfyUI
/// lists model folders.
fn list_files(dir: &Path, exts: &[&str], recursive: bool) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![(dir.to_path_buf(), String::new())];
    while let Some((d, prefix)) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let path = e.path();
            let rel = if prefix.is_empty() {
                name.clone()
            } else {
                format!("{prefix}/{name}")
            };
            if path.is_dir() {
                if recursive && !name.starts_with('.') {
                    stack.push((path, rel));
                }
            } else if has_ext(&path, exts) {
                out.push(rel);
            }
        }
    }
    out.sort();
    out
}

impl ComboSource for Paths {
    fn options(&self, options: &ComboOptions) -> Vec<String> {
        match options {
            ComboOptions::Static(v) => v.clone(),
            // ComfyUI lists the top level of the input folder only.
            ComboOptions::InputImages => list_files(&self.input, IMAGE_EXTENSIONS, false),
            ComboOptions::Models(folder) => self.model_files(folder),
            ComboOptions::Vaes => {
                let mut v = self.model_files("vae");
                v.extend(self.vae_approximations());
                v.push("pixel_space".to_string());
                v
            }
        }
    }

    fn contains(&self, options: &ComboOptions, value: &str) -> bool {
        match options {
            ComboOptions::Static(v) => v.iter().any(|o| o == value),
            // LoadImage accepts any existing file, subfolders and
            // annotations included, as ComfyUI's VALIDATE_INPUTS does.
            ComboOptions::InputImages => self.annotated_input(value).is_some_and(|p| p.is_file()),
            ComboOptions::Models(folder) => self.model(folder, value).is_some_and(|p| p.is_file()),
            ComboOptions::Vaes => {
                value == "pixel_space"
                    || self.vae_approximations().iter().any(|a| a == value)
                    || self.model("vae", value).is_some_and(|p| p.is_file())
            }
        }
    }

    /// For model files: the folder searched, as an absolute path, and that
    /// the file goes there; a first run's `not in []` says nothing else.
    fn missing_hint(&self, options: &ComboOptions) -> Option<String> {
        let folder = match options {
            ComboOptions::Models(folder) => *folder,
            ComboOptions::Vaes => "vae",
            _ => return None,
        };
        let dir = self.models.join(folder_dirs(folder)[0]);
        let dir = std::path::absolute(&dir).unwrap_or(dir);
        // "checkpoints" → "checkpoint", "text_encoders" → "text encoder".
        let kind = folder.strip_suffix('s').unwrap_or(folder).replace('_', " ");
        let found = if self.model_files(folder).is_empty() {
            "no files in"
        } else {
            "looked in"
        };
        Some(format!(
            "{found} {}; put the {kind} file there or pass --models-dir",
            dir.display()
        ))
    }
}
