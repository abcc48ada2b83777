//! What a server's combo inputs accept: its own folders, and in a cluster
//! also the model files the live workers advertise, so an API process
//! needs no copy of the models to validate prompts and list them for the
//! front end.

use sdkit_engine::Paths;
use sdkit_schema::export::ComboSource;
use sdkit_schema::spec::ComboOptions;
use std::collections::HashMap;
use std::sync::Arc;

/// Model files by folder (`vae_list` for VAELoader's list).
pub type Advertised = Arc<HashMap<String, Vec<String>>>;

pub struct Combos<'a> {
    pub paths: &'a Paths,
    pub workers: Option<Advertised>,
}

impl Combos<'_> {
    fn advertised(&self, options: &ComboOptions) -> Option<&[String]> {
        let key = match options {
            ComboOptions::Models(folder) => *folder,
            ComboOptions::Vaes => "vae_list",
            _ => return None,
        };
        self.workers.as_ref()?.get(key).map(Vec::as_slice)
    }
}

impl ComboSource for Combos<'_> {
    fn options(&self, options: &ComboOptions) -> Vec<String> {
        let mut list = self.paths.options(options);
        if let Some(more) = self.advertised(options) {
            list.extend(more.iter().cloned());
            // VAELoader's list ends with pixel_space; keep it last.
            let pixel = list.iter().any(|v| v == "pixel_space");
            list.retain(|v| v != "pixel_space");
            list.sort();
            list.dedup();
            if pixel {
                list.push("pixel_space".into());
            }
        }
        list
    }

    fn contains(&self, options: &ComboOptions, value: &str) -> bool {
        self.paths.contains(options, value)
            || self
                .advertised(options)
                .is_some_and(|l| l.iter().any(|v| v == value))
    }

    fn missing_hint(&self, options: &ComboOptions) -> Option<String> {
        let hint = self.paths.missing_hint(options)?;
        Some(match self.workers {
            Some(_) => format!("{hint}, or on a worker"),
            None => hint,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workers_files_join_the_server_s() {
        let dir = tempfile::tempdir().expect("tempdir");
        let paths = Paths::under(dir.path());
        std::fs::create_dir_all(paths.models.join("checkpoints")).expect("mkdir");
        std::fs::write(paths.models.join("checkpoints/here.safetensors"), b"").expect("write");
        let mut files = HashMap::new();
        files.insert(
            "checkpoints".to_string(),
            vec![
                "there.safetensors".to_string(),
                "here.safetensors".to_string(),
            ],
        );
        files.insert(
            "vae_list".to_string(),
            vec!["a.safetensors".into(), "pixel_space".into()],
        );
        let c = Combos {
            paths: &paths,
            workers: Some(Arc::new(files)),
        };
        let ck = ComboOptions::Models("checkpoints");
        assert_eq!(
            c.options(&ck),
            vec!["here.safetensors", "there.safetensors"]
        );
        assert!(c.contains(&ck, "there.safetensors"));
        assert!(!c.contains(&ck, "nowhere.safetensors"));
        assert_eq!(
            c.options(&ComboOptions::Vaes),
            vec!["a.safetensors", "pixel_space"]
        );
        assert!(!c.contains(&ComboOptions::Models("loras"), "there.safetensors"));
    }
}
