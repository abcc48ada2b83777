//! `--output-store URL`: a cluster's files in an object store, so API
//! processes and workers need not share a disk. Workers put each output
//! (SaveImage, PreviewImage, …) there as its node finishes, before the
//! client hears of it; API processes fetch what `/view` asks for from there
//! into their own folders (a cache) and put uploads there for the workers,
//! which fetch the inputs a prompt loads before validating it.
//!
//! Keys are `TYPE/SUBFOLDER/NAME` (`output`, `temp`, `input`). Two
//! workers that picked the same output name (each numbers files by what
//! its own folder holds) do not overwrite each other: the store creates a
//! key only once, and the later file takes the next free number, under
//! which the client and the history then see it.

use anyhow::{Context, Result};
use object_store::path::Path as Key;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use serde_json::Value as Json;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub struct Objects {
    store: Arc<dyn ObjectStore>,
    /// Whether the store refuses a second create of a key (else names
    /// are checked first, which two workers can race).
    create_once: bool,
}

/// Opens `file:///DIR` (or a plain folder) or `s3://BUCKET[/PREFIX]` (AWS
/// or any S3-compatible service, configured by the usual AWS_*
/// variables: AWS_ENDPOINT, AWS_REGION, AWS_ACCESS_KEY_ID,
/// AWS_SECRET_ACCESS_KEY, AWS_ALLOW_HTTP).
pub fn open(url: &str) -> Result<Objects> {
    #[cfg(not(feature = "s3"))]
    if url.starts_with("s3://") {
        anyhow::bail!(
            "--output-store {url}: this sdkit was built without S3 support (cargo build --features s3)"
        );
    }
    #[cfg(feature = "s3")]
    if let Some(rest) = url.strip_prefix("s3://") {
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            anyhow::bail!("--output-store {url}: no bucket named");
        }
        // TLS through rustls with ring: installed once for the process.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let s3 = object_store::aws::AmazonS3Builder::from_env()
            .with_bucket_name(bucket)
            .with_conditional_put(object_store::aws::S3ConditionalPut::ETagMatch)
            .build()
            .with_context(|| format!("--output-store {url}"))?;
        let store: Arc<dyn ObjectStore> = if prefix.trim_matches('/').is_empty() {
            Arc::new(s3)
        } else {
            Arc::new(object_store::prefix::PrefixStore::new(
                s3,
                prefix.trim_matches('/'),
            ))
        };
        return Ok(Objects {
            store,
            create_once: true,
        });
    }
    let dir = match url.strip_prefix("file://") {
        Some(p) => PathBuf::from(p),
        None if !url.contains("://") => PathBuf::from(url),
        None => anyhow::bail!("--output-store {url}: expected file:///DIR or s3://BUCKET[/PREFIX]"),
    };
    std::fs::create_dir_all(&dir)
        .with_context(|| format!("--output-store: cannot create {}", dir.display()))?;
    let fs = object_store::local::LocalFileSystem::new_with_prefix(&dir)
        .with_context(|| format!("--output-store {url}"))?;
    Ok(Objects {
        store: Arc::new(fs),
        create_once: true,
    })
}

/// The key of `name` in `subfolder` of folder type `ty`; None for a
/// name or subfolder that climbs out (`..`) or is not a plain path.
pub fn key(ty: &str, subfolder: &str, name: &str) -> Option<Key> {
    let mut parts = vec![ty];
    parts.extend(subfolder.split('/').filter(|p| !p.is_empty()));
    parts.push(name);
    if parts
        .iter()
        .any(|p| p.is_empty() || *p == "." || *p == ".." || p.contains('\\') || p.contains('\0'))
    {
        return None;
    }
    Key::parse(parts.join("/")).ok()
}

/// `name` with its ComfyUI counter (`prefix_00001_.png`) moved on by `n`;
/// other names get `_N` before their extension.
fn renumbered(name: &str, n: usize) -> String {
    let (stem, ext) = match name.rfind('.') {
        Some(i) => (&name[..i], &name[i..]),
        None => (name, ""),
    };
    if let Some(body) = stem.strip_suffix('_') {
        if let Some(i) = body.rfind('_') {
            let digits = &body[i + 1..];
            if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
                if let Ok(c) = digits.parse::<usize>() {
                    let width = digits.len();
                    return format!("{}_{:0width$}_{ext}", &body[..i], c + n);
                }
            }
        }
    }
    format!("{stem}_{n}{ext}")
}

impl Objects {
    /// Puts `bytes` as `name` in `subfolder` of `ty`, never over another
    /// file: on a clash the next free number is taken. Returns the name
    /// used.
    pub async fn put_new(
        &self,
        ty: &str,
        subfolder: &str,
        name: &str,
        bytes: Vec<u8>,
    ) -> Result<String> {
        let payload = PutPayload::from(bytes);
        for n in 0..10_000 {
            let candidate = if n == 0 {
                name.to_string()
            } else {
                renumbered(name, n)
            };
            let k = key(ty, subfolder, &candidate)
                .with_context(|| format!("not a storable name: {subfolder}/{candidate}"))?;
            if !self.create_once && self.store.head(&k).await.is_ok() {
                continue;
            }
            let opts = PutOptions {
                mode: if self.create_once {
                    PutMode::Create
                } else {
                    PutMode::Overwrite
                },
                ..Default::default()
            };
            match self.store.put_opts(&k, payload.clone(), opts).await {
                Ok(_) => return Ok(candidate),
                Err(object_store::Error::AlreadyExists { .. }) => continue,
                Err(e) => return Err(e).with_context(|| format!("cannot store {k}")),
            }
        }
        anyhow::bail!("no free name for {subfolder}/{name} in the output store")
    }

    /// Puts `bytes` at `ty/subfolder/name`, replacing what was there.
    pub async fn put(&self, ty: &str, subfolder: &str, name: &str, bytes: Vec<u8>) -> Result<()> {
        let k = key(ty, subfolder, name)
            .with_context(|| format!("not a storable name: {subfolder}/{name}"))?;
        self.store
            .put(&k, PutPayload::from(bytes))
            .await
            .with_context(|| format!("cannot store {k}"))?;
        Ok(())
    }

    /// Copies `ty/subfolder/name` to `dest` (atomically) when the store
    /// has it; false when it does not.
    pub async fn fetch(&self, ty: &str, subfolder: &str, name: &str, dest: &Path) -> Result<bool> {
        let Some(k) = key(ty, subfolder, name) else {
            return Ok(false);
        };
        let got = match self.store.get(&k).await {
            Ok(g) => g,
            Err(object_store::Error::NotFound { .. }) => return Ok(false),
            Err(e) => return Err(e).with_context(|| format!("cannot read {k} from the store")),
        };
        let bytes = got
            .bytes()
            .await
            .with_context(|| format!("cannot read {k}"))?;
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("cannot create {}", parent.display()))?;
        }
        sdkit_compute::atomic::write_atomic(dest, &bytes)
            .with_context(|| format!("cannot write {}", dest.display()))?;
        Ok(true)
    }
}

/// The files a node's `executed` output lists (`{filename, subfolder,
/// type}` objects in any of its lists), for each a mutable reference.
pub fn output_files(output: &mut Json) -> Vec<&mut serde_json::Map<String, Json>> {
    let mut out = Vec::new();
    if let Some(lists) = output.as_object_mut() {
        for list in lists.values_mut() {
            for f in list.as_array_mut().into_iter().flatten() {
                if let Some(o) = f.as_object_mut() {
                    if o.get("filename").and_then(Json::as_str).is_some() {
                        out.push(o);
                    }
                }
            }
        }
    }
    out
}

/// Renames recorded while uploading: (type, subfolder, old name) → new.
pub type Renames = HashMap<(String, String, String), String>;

/// Applies `renames` to a history entry's `outputs`.
pub fn rename_outputs(outputs: &mut Json, renames: &Renames) {
    if renames.is_empty() {
        return;
    }
    for node in outputs
        .as_object_mut()
        .into_iter()
        .flat_map(|m| m.values_mut())
    {
        for f in output_files(node) {
            let field = |k: &str| f.get(k).and_then(Json::as_str).unwrap_or("").to_string();
            let id = (field("type"), field("subfolder"), field("filename"));
            if let Some(new) = renames.get(&id) {
                f.insert("filename".into(), Json::String(new.clone()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_move_on_by_their_counter() {
        assert_eq!(renumbered("ComfyUI_00001_.png", 1), "ComfyUI_00002_.png");
        assert_eq!(renumbered("a_b_00009_.png", 3), "a_b_00012_.png");
        assert_eq!(renumbered("x_99999_.png", 1), "x_100000_.png");
        assert_eq!(renumbered("photo.png", 2), "photo_2.png");
        assert_eq!(renumbered("noext", 1), "noext_1");
    }

    #[test]
    fn keys_stay_in_their_folder() {
        assert_eq!(
            key("output", "a/b", "x.png").map(|k| k.to_string()),
            Some("output/a/b/x.png".into())
        );
        assert_eq!(
            key("output", "", "x.png").map(|k| k.to_string()),
            Some("output/x.png".into())
        );
        assert!(key("output", "../etc", "x.png").is_none());
        assert!(key("output", "", "..").is_none());
        assert!(key("input", "a\\b", "x.png").is_none());
    }

    #[test]
    fn clashing_names_take_the_next_number() {
        let dir = tempfile::tempdir().expect("tempdir");
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let o = open(&format!("file://{}", dir.path().display())).expect("opens");
        rt.block_on(async {
            let a = o.put_new("output", "s", "C_00001_.png", vec![1]).await;
            let b = o.put_new("output", "s", "C_00001_.png", vec![2]).await;
            assert_eq!(a.expect("first").as_str(), "C_00001_.png");
            assert_eq!(b.expect("second").as_str(), "C_00002_.png");
            let dest = dir.path().join("copy.png");
            assert!(o
                .fetch("output", "s", "C_00002_.png", &dest)
                .await
                .expect("fetch"));
            assert_eq!(std::fs::read(&dest).expect("read"), vec![2]);
            assert!(!o
                .fetch("output", "s", "none.png", &dest)
                .await
                .expect("fetch"));
        });
    }

    #[test]
    fn history_outputs_follow_the_renames() {
        let mut outputs = serde_json::json!({"9": {"images": [
            {"filename": "C_00001_.png", "subfolder": "", "type": "output"},
            {"filename": "C_00002_.png", "subfolder": "", "type": "output"},
        ]}});
        let mut r = Renames::new();
        r.insert(
            ("output".into(), "".into(), "C_00001_.png".into()),
            "C_00007_.png".into(),
        );
        rename_outputs(&mut outputs, &r);
        assert_eq!(outputs["9"]["images"][0]["filename"], "C_00007_.png");
        assert_eq!(outputs["9"]["images"][1]["filename"], "C_00002_.png");
    }
}
