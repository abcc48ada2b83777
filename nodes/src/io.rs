//! Image file nodes: LoadImage, SaveImage, PreviewImage. Decoding with
//! size limits lives in [`crate::imagefile`].
//!
//! Pixel conversions follow ComfyUI exactly: loading divides 8-bit values by
//! 255 in f32; saving computes `clip(255 * x, 0, 255)` and truncates to u8,
//! as numpy's `astype(np.uint8)` does.

use sdkit_engine::{Inputs, NodeContext, NodeError, NodeImpl, NodeOutput, Tensor, Value};
use serde_json::{json, Value as Json};
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// ComfyUI's LoadImage: IMAGE (RGB) and MASK (1 - alpha, or a 64x64 zero
/// mask when the file has no alpha).
pub struct LoadImage;

pub use crate::imagefile::{decode, image_to_tensors};

pub(crate) fn input_path(ctx: &NodeContext, name: &str) -> Result<PathBuf, NodeError> {
    ctx.paths
        .annotated_input(name)
        .ok_or_else(|| NodeError::invalid(format!("Invalid image file: {name}")))
}

impl NodeImpl for LoadImage {
    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let path = input_path(ctx, inputs.string("image")?)?;
        let (image, mask) = crate::imagefile::load_tensors(&path, &ctx.cancel)?;
        Ok(NodeOutput::values(vec![
            Value::image(image),
            Value::mask(mask),
        ]))
    }

    /// From the file's header: refuses a decompression bomb before it is
    /// decoded even when the process could hold it.
    fn estimate_bytes(&self, ctx: &NodeContext, inputs: &Inputs) -> Option<u64> {
        let path = input_path(ctx, inputs.string("image").ok()?).ok()?;
        crate::imagefile::estimate_load_bytes(&path)
    }

    /// The file's contents, so replacing the file re-runs the node.
    fn fingerprint(&self, ctx: &NodeContext, inputs: &Inputs) -> Option<String> {
        let path = input_path(ctx, inputs.string("image").ok()?).ok()?;
        let bytes = std::fs::read(path).ok()?;
        let mut h = DefaultHasher::new();
        bytes.hash(&mut h);
        Some(format!("{:016x}", h.finish()))
    }
}

/// `clip(255 * x, 0, 255).astype(uint8)`: f32 multiply, then truncation.
pub fn to_u8(x: f32) -> u8 {
    let v = 255.0f32 * x;
    if v.is_nan() {
        0
    } else {
        v.clamp(0.0, 255.0) as u8
    }
}

/// Python's `json.dumps` with its default separators and ASCII escaping, so
/// PNG text chunks read the same as ComfyUI's.
pub fn python_json(v: &Json) -> String {
    let mut s = String::new();
    write_py_json(v, &mut s);
    s
}

fn write_py_json(v: &Json, out: &mut String) {
    match v {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::Number(n) => {
            if n.is_f64() {
                let f = n.as_f64().unwrap_or(0.0);
                out.push_str(&python_float(f));
            } else {
                out.push_str(&n.to_string());
            }
        }
        Json::String(s) => {
            out.push('"');
            for c in s.chars() {
                match c {
                    '"' => out.push_str("\\\""),
                    '\\' => out.push_str("\\\\"),
                    '\n' => out.push_str("\\n"),
                    '\r' => out.push_str("\\r"),
                    '\t' => out.push_str("\\t"),
                    '\u{8}' => out.push_str("\\b"),
                    '\u{c}' => out.push_str("\\f"),
                    c if (c as u32) < 0x20 || (c as u32) > 0x7e => {
                        let mut buf = [0u16; 2];
                        for u in c.encode_utf16(&mut buf) {
                            out.push_str(&format!("\\u{u:04x}"));
                        }
                    }
                    c => out.push(c),
                }
            }
            out.push('"');
        }
        Json::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_py_json(x, out);
            }
            out.push(']');
        }
        Json::Object(o) => {
            out.push('{');
            for (i, (k, x)) in o.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_py_json(&Json::String(k.clone()), out);
                out.push_str(": ");
                write_py_json(x, out);
            }
            out.push('}');
        }
    }
}

/// Python's `repr(float)`: shortest round-trip digits, `.0` on integers,
/// exponent form outside 1e-4..1e16 with a two-digit exponent.
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let a = f.abs();
    if a != 0.0 && !(1e-4..1e16).contains(&a) {
        let s = format!("{f:e}");
        let (m, e) = s.split_once('e').unwrap_or((&s, "0"));
        let e: i32 = e.parse().unwrap_or(0);
        let sign = if e < 0 { '-' } else { '+' };
        return format!("{m}e{sign}{:02}", e.abs());
    }
    let s = format!("{f}");
    if s.contains('.') {
        s
    } else {
        format!("{s}.0")
    }
}

/// Serialises counter selection and renames, so concurrent saves never
/// pick the same file name.
pub(crate) static SAVE_LOCK: Mutex<()> = Mutex::new(());

/// ComfyUI's `get_save_image_path`: the folder, base name and the next
/// counter after existing `{name}_{counter:05}_` files.
pub(crate) fn save_target(
    root: &Path,
    prefix: &str,
    width: usize,
    height: usize,
) -> Result<(PathBuf, String, String, u64), NodeError> {
    let prefix = expand_vars(prefix, width, height);
    let rel = Path::new(&prefix);
    let mut subfolder = PathBuf::new();
    let mut parts: Vec<String> = Vec::new();
    for c in rel.components() {
        match c {
            std::path::Component::Normal(s) => parts.push(s.to_string_lossy().into_owned()),
            std::path::Component::CurDir => {}
            _ => {
                return Err(NodeError::invalid(format!(
                    "Saving image outside the output folder is not allowed: {prefix}"
                )))
            }
        }
    }
    let Some(name) = parts.pop() else {
        return Err(NodeError::invalid("filename_prefix is empty"));
    };
    for p in &parts {
        subfolder.push(p);
    }
    let folder = root.join(&subfolder);
    std::fs::create_dir_all(&folder).map_err(|e| NodeError::file(&folder, e))?;
    let mut counter = 0u64;
    if let Ok(rd) = std::fs::read_dir(&folder) {
        for e in rd.flatten() {
            let f = e.file_name().to_string_lossy().into_owned();
            let Some(rest) = f.strip_prefix(&name).and_then(|r| r.strip_prefix('_')) else {
                continue;
            };
            let digits = rest.split('_').next().unwrap_or("");
            counter = counter.max(digits.parse::<u64>().unwrap_or(0));
        }
    }
    let sub = parts.join("/");
    Ok((folder, name, sub, counter + 1))
}

/// ComfyUI's `%width%`, `%height%`, `%year%` ... substitutions. Dates are
/// UTC (ComfyUI uses local time; the host's zone is not known here).
fn expand_vars(prefix: &str, width: usize, height: usize) -> String {
    if !prefix.contains('%') {
        return prefix.to_string();
    }
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as i64;
    let (y, mo, d) = civil_from_days(secs.div_euclid(86400));
    let tod = secs.rem_euclid(86400);
    prefix
        .replace("%width%", &width.to_string())
        .replace("%height%", &height.to_string())
        .replace("%year%", &y.to_string())
        .replace("%month%", &format!("{mo:02}"))
        .replace("%day%", &format!("{d:02}"))
        .replace("%hour%", &format!("{:02}", tod / 3600))
        .replace("%minute%", &format!("{:02}", tod % 3600 / 60))
        .replace("%second%", &format!("{:02}", tod % 60))
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// Encodes one [h, w, 3] image as PNG with text chunks.
fn encode_png(
    pixels: &[f32],
    w: usize,
    h: usize,
    channels: usize,
    texts: &[(String, String)],
    level: png::Compression,
) -> Result<Vec<u8>, String> {
    let color = match channels {
        1 => png::ColorType::Grayscale,
        3 => png::ColorType::Rgb,
        4 => png::ColorType::Rgba,
        c => return Err(format!("cannot save an image with {c} channels")),
    };
    let bytes: Vec<u8> = pixels.iter().map(|&x| to_u8(x)).collect();
    let mut out = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut out, w as u32, h as u32);
        enc.set_color(color);
        enc.set_depth(png::BitDepth::Eight);
        enc.set_compression(level);
        for (k, v) in texts {
            enc.add_text_chunk(k.clone(), v.clone())
                .map_err(|e| e.to_string())?;
        }
        let mut writer = enc.write_header().map_err(|e| e.to_string())?;
        writer.write_image_data(&bytes).map_err(|e| e.to_string())?;
        writer.finish().map_err(|e| e.to_string())?;
    }
    Ok(out)
}

/// Saves a batch atomically: every image is written to a temporary file
/// first and renamed into place only when all succeeded, so an interrupted
/// or failed save leaves no partial files.
fn save_batch(
    ctx: &NodeContext,
    images: &Tensor,
    root: &Path,
    prefix: &str,
    kind: &str,
    level: png::Compression,
) -> Result<NodeOutput, NodeError> {
    if images.shape.len() != 4 {
        return Err(NodeError::invalid(format!(
            "expected an image batch [B, H, W, C], got shape {:?}",
            images.shape
        )));
    }
    let (b, h, w, c) = (
        images.shape[0],
        images.shape[1],
        images.shape[2],
        images.shape[3],
    );
    let mut texts = vec![("prompt".to_string(), python_json(&ctx.prompt))];
    for (k, v) in ctx.extra_pnginfo.iter() {
        texts.push((k.clone(), python_json(v)));
    }
    let per = h * w * c;
    let mut temps: Vec<PathBuf> = Vec::new();
    let cleanup = |temps: &[PathBuf]| {
        for t in temps {
            let _ = std::fs::remove_file(t);
        }
    };
    std::fs::create_dir_all(root).map_err(|e| NodeError::file(root, e))?;
    for i in 0..b {
        if let Err(e) = ctx.check_cancel() {
            cleanup(&temps);
            return Err(e);
        }
        let png = match encode_png(&images.data[i * per..(i + 1) * per], w, h, c, &texts, level) {
            Ok(p) => p,
            Err(e) => {
                cleanup(&temps);
                return Err(NodeError::invalid(e));
            }
        };
        // Unique per call, so concurrent runs in one server never share a
        // temporary file; pid-named, so a killed process's are swept.
        let tmp = sdkit_compute::atomic::temp_path(root, &format!("{}-{i}.png", ctx.node_id));
        let written = std::fs::File::create(&tmp).and_then(|mut f| {
            f.write_all(&png)?;
            f.sync_all()
        });
        if let Err(e) = written {
            temps.push(tmp.clone());
            cleanup(&temps);
            return Err(NodeError::file(&tmp, e));
        }
        temps.push(tmp);
    }
    if let Err(e) = ctx.check_cancel() {
        cleanup(&temps);
        return Err(e);
    }
    let _guard = SAVE_LOCK
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let (folder, name, subfolder, mut counter) = match save_target(root, prefix, w, h) {
        Ok(t) => t,
        Err(e) => {
            cleanup(&temps);
            return Err(e);
        }
    };
    let mut results = Vec::new();
    for (i, tmp) in temps.iter().enumerate() {
        let file = format!(
            "{}_{counter:05}_.png",
            name.replace("%batch_num%", &i.to_string())
        );
        let dest = folder.join(&file);
        if let Err(e) = std::fs::rename(tmp, &dest) {
            cleanup(&temps[i..]);
            return Err(NodeError::file(&dest, e));
        }
        results.push(json!({"filename": file, "subfolder": subfolder, "type": kind}));
        counter += 1;
    }
    Ok(NodeOutput {
        values: Vec::new(),
        ui: Some(json!({ "images": results })),
    })
}

/// ComfyUI's SaveImage: `{prefix}_{counter:05}_.png` in the output folder,
/// with `prompt` and `workflow` text chunks.
pub struct SaveImage;

impl NodeImpl for SaveImage {
    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let images = inputs.image("images")?;
        let prefix = inputs.string("filename_prefix")?;
        save_batch(
            ctx,
            images,
            &ctx.paths.output,
            prefix,
            "output",
            png::Compression::Default,
        )
    }
}

/// ComfyUI's PreviewImage: like SaveImage, into the temp folder with a
/// random `ComfyUI_temp_xxxxx` prefix and fast compression.
pub struct PreviewImage;

impl NodeImpl for PreviewImage {
    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let images = inputs.image("images")?;
        let mut h = DefaultHasher::new();
        ctx.prompt_id.hash(&mut h);
        ctx.node_id.hash(&mut h);
        std::time::SystemTime::now().hash(&mut h);
        let mut x = h.finish();
        let letters = b"abcdefghijklmnopqrstupvxyz";
        let suffix: String = (0..5)
            .map(|_| {
                let c = letters[(x % letters.len() as u64) as usize] as char;
                x /= letters.len() as u64;
                c
            })
            .collect();
        save_batch(
            ctx,
            images,
            &ctx.paths.temp,
            &format!("ComfyUI_temp_{suffix}"),
            "temp",
            png::Compression::Fast,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_json_matches_json_dumps() {
        let v = json!({"a": [1, 2.5, "é\n"], "b": {"c": null, "d": 8.0, "e": 1e-5}});
        assert_eq!(
            python_json(&v),
            r#"{"a": [1, 2.5, "\u00e9\n"], "b": {"c": null, "d": 8.0, "e": 1e-05}}"#
        );
    }

    #[test]
    fn u8_conversion_truncates_like_numpy() {
        assert_eq!(to_u8(1.0), 255);
        assert_eq!(to_u8(0.999), 254);
        assert_eq!(to_u8(-0.5), 0);
        assert_eq!(to_u8(2.0), 255);
        assert_eq!(to_u8(0.5), 127);
    }

    #[test]
    fn counter_continues_after_existing_files() {
        let dir = std::env::temp_dir().join(format!("sdkit-save-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("sub")).expect("mkdir");
        for f in [
            "sub/pic_00007_.png",
            "sub/pic_00002_.png",
            "sub/other_00099_.png",
        ] {
            std::fs::write(dir.join(f), b"x").expect("write");
        }
        let (_, name, sub, counter) = save_target(&dir, "sub/pic", 8, 8).expect("target");
        assert_eq!((name.as_str(), sub.as_str(), counter), ("pic", "sub", 8));
        assert!(save_target(&dir, "../escape", 8, 8).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn civil_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_000), (2024, 10, 4));
    }
}
