//! File routes: `/view`, `/upload/image`, `/userdata`, and the front-end
//! folder. Every client-supplied path is confined to its base folder:
//! absolute paths and `..` are refused with 400 (a subfolder that climbs
//! out with 403, as ComfyUI answers), and a path that resolves through a
//! symlink to somewhere outside the base with 403.

use super::routes::{bad_request, status};
use super::Server;
use axum::body::Bytes;
use axum::extract::{Multipart, Path as UrlPath, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json as JsonBody;
use serde_json::{json, Value as Json};
use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

/// `rel` below `base`: no absolute paths, no `..`, no drive prefixes.
fn confined(base: &Path, rel: &str) -> Result<PathBuf, StatusCode> {
    let p = Path::new(rel);
    if rel.contains('\0') {
        return Err(StatusCode::BAD_REQUEST);
    }
    for c in p.components() {
        match c {
            Component::Normal(_) | Component::CurDir => {}
            _ => return Err(StatusCode::BAD_REQUEST),
        }
    }
    // Windows separators are separators too for a path from a browser.
    if rel.split('\\').any(|s| s == "..") {
        return Err(StatusCode::BAD_REQUEST);
    }
    Ok(base.join(p))
}

/// Refuses `path` when it, or the deepest part of it that exists, resolves
/// (through symlinks) outside `base`. A path that does not exist yet is
/// judged by its deepest existing ancestor, since that folder is where a
/// write would land; a dangling symlink on the way is refused, as creating
/// through it would follow it somewhere unchecked.
fn inside(base: &Path, path: &Path) -> Result<(), Refusal> {
    let real_base = base.canonicalize().unwrap_or_else(|_| base.to_path_buf());
    for ancestor in path.ancestors() {
        if ancestor.as_os_str().is_empty() {
            break;
        }
        match ancestor.canonicalize() {
            Ok(real) if real.starts_with(&real_base) => return Ok(()),
            Ok(_) => return Err(Refusal::outside()),
            // Something is there (a dangling link, an unreadable folder)
            // that cannot be resolved: do not write through it.
            Err(_) if ancestor.symlink_metadata().is_ok() => return Err(Refusal::outside()),
            Err(_) => {}
        }
    }
    Err(Refusal::outside())
}

/// Creates `folder` (and its missing parents) below `base`, one level at a
/// time, checking each existing level before going on, so nothing is ever
/// created outside `base` through a symlinked folder.
fn create_inside(base: &Path, folder: &Path) -> Result<(), Refusal> {
    let rel = folder.strip_prefix(base).map_err(|_| Refusal::outside())?;
    std::fs::create_dir_all(base).map_err(Refusal::io)?;
    let mut at = base.to_path_buf();
    inside(base, &at)?;
    for c in rel.components() {
        at.push(c);
        match at.symlink_metadata() {
            Ok(_) => {
                inside(base, &at)?;
                if !at.is_dir() {
                    return Err(Refusal::new(
                        StatusCode::BAD_REQUEST,
                        format!(
                            "{} is a file, not a folder",
                            c.as_os_str().to_string_lossy()
                        ),
                    ));
                }
            }
            Err(_) => match std::fs::create_dir(&at) {
                Ok(()) => {}
                // Another request created it meanwhile: check what it is.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => inside(base, &at)?,
                Err(e) => return Err(Refusal::io(e)),
            },
        }
    }
    Ok(())
}

/// A refused file request: a status and the reason, sent as the body so a
/// client sees why.
#[derive(Debug)]
pub struct Refusal {
    status: StatusCode,
    message: String,
}

impl Refusal {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Refusal {
            status,
            message: message.into(),
        }
    }

    fn outside() -> Self {
        Refusal::new(
            StatusCode::FORBIDDEN,
            "that path leads outside its folder (through \"..\" or a symlink)",
        )
    }

    fn io(e: std::io::Error) -> Self {
        // A name too long for the file system is the client's doing
        // (ENAMETOOLONG on Linux 36, macOS 63; Windows error 206); other
        // I/O errors are the server's.
        match e.raw_os_error() {
            Some(36) | Some(63) | Some(206) => {
                Refusal::new(StatusCode::BAD_REQUEST, "file name too long")
            }
            _ => Refusal::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("cannot write: {e}"),
            ),
        }
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        (self.status, self.message).into_response()
    }
}

impl From<StatusCode> for Refusal {
    fn from(s: StatusCode) -> Self {
        let message = match s {
            StatusCode::BAD_REQUEST => "invalid path: absolute, \"..\" or a NUL byte",
            StatusCode::FORBIDDEN => "that path leads outside its folder",
            StatusCode::NOT_FOUND => "not found",
            _ => "",
        };
        Refusal::new(s, message)
    }
}

fn dir_of_type(server: &Server, ty: Option<&str>) -> Option<(PathBuf, &'static str)> {
    match ty.unwrap_or("output") {
        "output" => Some((server.paths.output.clone(), "output")),
        "input" => Some((server.paths.input.clone(), "input")),
        "temp" => Some((server.paths.temp.clone(), "temp")),
        _ => None,
    }
}

/// ComfyUI's `name [output]` annotation picks the folder.
fn annotated(name: &str) -> (&str, Option<&'static str>) {
    for (suffix, ty) in [
        (" [output]", "output"),
        (" [input]", "input"),
        (" [temp]", "temp"),
    ] {
        if let Some(n) = name.strip_suffix(suffix) {
            return (n, Some(ty));
        }
    }
    (name, None)
}

fn content_type(name: &str) -> &'static str {
    let ext = Path::new(name)
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase)
        .unwrap_or_default();
    match ext.as_str() {
        "png" => "image/png",
        "jpg" | "jpeg" => "image/jpeg",
        "webp" => "image/webp",
        "gif" => "image/gif",
        "bmp" => "image/bmp",
        "tif" | "tiff" => "image/tiff",
        "svg" => "image/svg+xml",
        "json" => "application/json",
        "js" | "mjs" => "application/javascript; charset=utf-8",
        "css" => "text/css",
        "html" | "htm" => "text/html; charset=utf-8",
        "txt" => "text/plain; charset=utf-8",
        "woff" => "font/woff",
        "woff2" => "font/woff2",
        "ttf" => "font/ttf",
        "ico" => "image/x-icon",
        "wasm" => "application/wasm",
        "mp4" => "video/mp4",
        "webm" => "video/webm",
        "mp3" => "audio/mpeg",
        "wav" => "audio/wav",
        "flac" => "audio/flac",
        "latent" | "safetensors" => "application/octet-stream",
        _ => "application/octet-stream",
    }
}

fn file_response(bytes: Vec<u8>, ctype: &str, filename: &str) -> Response {
    (
        [
            (header::CONTENT_TYPE, ctype.to_string()),
            (
                header::CONTENT_DISPOSITION,
                format!("filename=\"{}\"", filename.replace('"', "")),
            ),
        ],
        bytes,
    )
        .into_response()
}

/// GET /view?filename=&type=&subfolder=&preview=&channel=
pub async fn view(
    State(server): State<Arc<Server>>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let Some(name) = q.get("filename") else {
        return status(StatusCode::NOT_FOUND);
    };
    let (name, ty) = annotated(name);
    if name.is_empty()
        || name.contains("..")
        || name.contains('/')
        || name.contains('\\')
        || name.contains('\0')
    {
        return bad_request(
            "invalid file name: it must be a plain name, without folders or \"..\"",
        );
    }
    let Some((mut dir, ty_name)) = dir_of_type(&server, ty.or(q.get("type").map(String::as_str)))
    else {
        return bad_request("type must be output, input or temp");
    };
    let base = dir.clone();
    if let Some(sub) = q.get("subfolder").filter(|s| !s.is_empty()) {
        match confined(&dir, sub) {
            Ok(d) => dir = d,
            // ComfyUI answers a subfolder outside the folder with 403.
            Err(_) => return Refusal::outside().into_response(),
        }
    }
    let file = dir.join(name);
    if let Err(r) = inside(&base, &file) {
        return r.into_response();
    }
    if !file.is_file() {
        // A cluster's outputs are in its object store; this process's
        // folder keeps a copy.
        let fetched = match &server.objects {
            Some(o) => {
                let sub = q.get("subfolder").map(String::as_str).unwrap_or("");
                o.fetch(ty_name, sub, name, &file)
                    .await
                    .unwrap_or_else(|e| {
                        tracing::warn!("{e:#}");
                        false
                    })
            }
            None => false,
        };
        if !fetched {
            return status(StatusCode::NOT_FOUND);
        }
    }
    let name = name.to_string();
    let preview = q.get("preview").cloned();
    let channel = q.get("channel").cloned().unwrap_or_else(|| "rgba".into());
    let result = tokio::task::spawn_blocking(move || -> Result<Response, StatusCode> {
        if preview.is_some() || channel == "rgb" || channel == "a" {
            // Size-limited: a decompression bomb must not take the server down.
            let img = sdkit_nodes::imagefile::decode(&file)
                .map_err(|_| StatusCode::UNSUPPORTED_MEDIA_TYPE)?;
            if let Some(p) = preview {
                // Previews as JPEG (quality from "jpeg;NN"); sdkit has no
                // lossy WebP encoder, and alpha previews go out as PNG.
                let mut parts = p.split(';');
                let _format = parts.next();
                let quality = parts
                    .next_back()
                    .and_then(|s| s.parse::<u8>().ok())
                    .unwrap_or(90)
                    .clamp(1, 100);
                let mut buf = Vec::new();
                if channel.contains('a') && channel != "rgba" {
                    img.write_to(&mut std::io::Cursor::new(&mut buf), image::ImageFormat::Png)
                        .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
                    return Ok(file_response(buf, "image/png", &name));
                }
                let rgb = img.to_rgb8();
                image::codecs::jpeg::JpegEncoder::new_with_quality(&mut buf, quality)
                    .encode_image(&rgb)
                    .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
                return Ok(file_response(buf, "image/jpeg", &name));
            }
            let out: image::DynamicImage = if channel == "rgb" {
                image::DynamicImage::ImageRgb8(img.to_rgb8())
            } else {
                // The alpha channel as an RGBA image's alpha (ComfyUI's
                // `channel=a`).
                let rgba = img.to_rgba8();
                let mut a = image::RgbaImage::new(rgba.width(), rgba.height());
                for (dst, src) in a.pixels_mut().zip(rgba.pixels()) {
                    dst.0 = [0, 0, 0, src.0[3]];
                }
                image::DynamicImage::ImageRgba8(a)
            };
            let mut buf = Vec::new();
            out.write_to(&mut std::io::Cursor::new(&mut buf), image::ImageFormat::Png)
                .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
            return Ok(file_response(buf, "image/png", &name));
        }
        let bytes = std::fs::read(&file).map_err(|_| StatusCode::NOT_FOUND)?;
        let mut ctype = content_type(&name);
        // Never let a viewed file run as a page or script.
        if ctype.starts_with("text/html")
            || ctype.starts_with("application/javascript")
            || ctype == "text/css"
            || ctype == "image/svg+xml"
        {
            ctype = "application/octet-stream";
        }
        Ok(file_response(bytes, ctype, &name))
    })
    .await;
    match result {
        Ok(Ok(r)) => r,
        Ok(Err(s)) => status(s),
        Err(_) => status(StatusCode::INTERNAL_SERVER_ERROR),
    }
}

/// POST /upload/image (multipart: image, overwrite, subfolder, type).
pub async fn upload_image(State(server): State<Arc<Server>>, mut form: Multipart) -> Response {
    let mut image: Option<(String, Bytes)> = None;
    let mut fields: HashMap<String, String> = HashMap::new();
    loop {
        match form.next_field().await {
            Ok(Some(field)) => {
                let name = field.name().unwrap_or_default().to_string();
                let file_name = field.file_name().map(str::to_string);
                let data = match field.bytes().await {
                    Ok(d) => d,
                    Err(e) => return multipart_error(e, server.max_body),
                };
                if name == "image" {
                    image = Some((file_name.unwrap_or_default(), data));
                } else {
                    fields.insert(name, String::from_utf8_lossy(&data).into_owned());
                }
            }
            Ok(None) => break,
            Err(e) => return multipart_error(e, server.max_body),
        }
    }
    let Some((filename, data)) = image else {
        return bad_request("no \"image\" file in the form");
    };
    let ty = fields.get("type").map(String::as_str).unwrap_or("input");
    let Some((base, ty)) = dir_of_type(&server, Some(ty)) else {
        return bad_request("type must be input, output or temp");
    };
    let subfolder = fields.get("subfolder").cloned().unwrap_or_default();
    let folder = if subfolder.is_empty() {
        base.clone()
    } else {
        match confined(&base, &subfolder) {
            Ok(p) => p,
            Err(s) => return Refusal::from(s).into_response(),
        }
    };
    if filename.is_empty()
        || filename.contains('/')
        || filename.contains('\\')
        || filename.contains("..")
        || filename.contains('\0')
    {
        return bad_request("invalid file name");
    }
    if filename.len() > MAX_NAME {
        return bad_request(&format!(
            "file name too long: {} bytes, at most {MAX_NAME}",
            filename.len()
        ));
    }
    let overwrite = matches!(
        fields.get("overwrite").map(String::as_str),
        Some("true") | Some("1")
    );
    let stored = data.clone();
    let result = tokio::task::spawn_blocking(move || -> Result<String, Refusal> {
        // Checked before anything is created: a refused subfolder leaves
        // no trace, inside or outside.
        inside(&base, &folder)?;
        create_inside(&base, &folder)?;
        let mut name = filename.clone();
        let mut path = folder.join(&name);
        if !overwrite {
            // ComfyUI's rule: "name (1).ext", "name (2).ext", … unless the
            // existing file has the same bytes (then it is reused).
            let (stem, ext) = match filename.rfind('.') {
                Some(i) if i > 0 => (&filename[..i], &filename[i..]),
                _ => (filename.as_str(), ""),
            };
            let mut i = 1;
            while path.exists() {
                if std::fs::read(&path).is_ok_and(|old| old == data.as_ref()) {
                    return Ok(name);
                }
                name = format!("{stem} ({i}){ext}");
                path = folder.join(&name);
                i += 1;
            }
        }
        inside(&base, &path)?;
        sdkit_compute::atomic::write_atomic(&path, &data).map_err(Refusal::io)?;
        Ok(name)
    })
    .await;
    match result {
        Ok(Ok(name)) => {
            // A cluster's workers read inputs from the output store.
            if let Some(o) = &server.objects {
                if let Err(e) = o.put(ty, &subfolder, &name, stored.to_vec()).await {
                    tracing::warn!("{e:#}");
                    return super::routes::unavailable(&format!(
                        "the upload could not be put in the output store: {e:#}"
                    ));
                }
            }
            JsonBody(json!({"name": name, "subfolder": subfolder, "type": ty})).into_response()
        }
        Ok(Err(r)) => r.into_response(),
        Err(_) => status(StatusCode::INTERNAL_SERVER_ERROR),
    }
}

/// The longest file name most file systems take (NAME_MAX).
const MAX_NAME: usize = 255;

/// A multipart body that could not be read: over the size cap is 413
/// (with the cap named), anything else 400.
fn multipart_error(e: axum::extract::multipart::MultipartError, max_body: usize) -> Response {
    let status = e.status();
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        return (
            status,
            format!(
                "upload too large: the limit is {:.1} MB (--max-upload-size)",
                max_body as f64 / (1024.0 * 1024.0)
            ),
        )
            .into_response();
    }
    (
        status,
        format!("malformed multipart body: {}", e.body_text()),
    )
        .into_response()
}

fn file_info(path: &Path, base: &Path) -> Json {
    let meta = std::fs::metadata(path).ok();
    let modified = meta
        .as_ref()
        .and_then(|m| m.modified().ok())
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0.0, |d| d.as_secs_f64());
    json!({
        "path": rel_path(path, base),
        "size": meta.map_or(0, |m| m.len()),
        "modified": modified,
    })
}

fn rel_path(path: &Path, base: &Path) -> String {
    path.strip_prefix(base)
        .unwrap_or(path)
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join("/")
}

/// GET /userdata?dir=&recurse=&full_info=&split=
pub async fn list_userdata(
    State(server): State<Arc<Server>>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let Some(dir) = q.get("dir").filter(|d| !d.is_empty()) else {
        return (StatusCode::BAD_REQUEST, "Directory not provided").into_response();
    };
    let path = match confined(&server.user_dir, dir) {
        Ok(p) => p,
        Err(_) => return (StatusCode::FORBIDDEN, "Invalid directory").into_response(),
    };
    if let Err(r) = inside(&server.user_dir, &path) {
        return r.into_response();
    }
    if !path.is_dir() {
        return (StatusCode::NOT_FOUND, "Directory not found").into_response();
    }
    let flag = |k: &str| q.get(k).is_some_and(|v| v.eq_ignore_ascii_case("true"));
    let (recurse, full, split) = (flag("recurse"), flag("full_info"), flag("split"));
    let mut files = Vec::new();
    let mut stack = vec![path.clone()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            // Symlinks are not followed out of the user folder.
            let Ok(ft) = e.file_type() else { continue };
            if ft.is_dir() {
                if recurse {
                    stack.push(p);
                }
            } else if ft.is_file() {
                files.push(p);
            }
        }
    }
    files.sort();
    let out: Vec<Json> = files
        .iter()
        .map(|f| {
            if full {
                file_info(f, &path)
            } else {
                let rel = rel_path(f, &path);
                if split {
                    let mut v = vec![json!(rel)];
                    v.extend(rel.split('/').map(|s| json!(s)));
                    Json::Array(v)
                } else {
                    json!(rel)
                }
            }
        })
        .collect();
    JsonBody(Json::Array(out)).into_response()
}

fn userdata_path(server: &Server, file: &str) -> Result<PathBuf, Refusal> {
    let p = confined(&server.user_dir, file).map_err(|_| Refusal::outside())?;
    inside(&server.user_dir, &p)?;
    Ok(p)
}

/// GET /userdata/{file}
pub async fn get_userdata(
    State(server): State<Arc<Server>>,
    UrlPath(file): UrlPath<String>,
) -> Response {
    let path = match userdata_path(&server, &file) {
        Ok(p) => p,
        Err(r) => return r.into_response(),
    };
    match std::fs::read(&path) {
        Ok(b) if path.is_file() => {
            file_response(b, content_type(&file), &rel_path(&path, &server.user_dir))
        }
        _ => status(StatusCode::NOT_FOUND),
    }
}

/// POST /userdata/{file}?overwrite=&full_info=
pub async fn post_userdata(
    State(server): State<Arc<Server>>,
    UrlPath(file): UrlPath<String>,
    Query(q): Query<HashMap<String, String>>,
    body: Bytes,
) -> Response {
    let path = match userdata_path(&server, &file) {
        Ok(p) => p,
        Err(r) => return r.into_response(),
    };
    let overwrite = q.get("overwrite").map(String::as_str) != Some("false");
    let full = q
        .get("full_info")
        .is_some_and(|v| v.eq_ignore_ascii_case("true"));
    if !overwrite && path.exists() {
        return (StatusCode::CONFLICT, "File already exists").into_response();
    }
    if let Some(parent) = path.parent() {
        if let Err(r) = create_inside(&server.user_dir, parent) {
            return r.into_response();
        }
    }
    if let Err(e) = sdkit_compute::atomic::write_atomic(&path, &body) {
        return Refusal::io(e).into_response();
    }
    if full {
        JsonBody(file_info(&path, &server.user_dir)).into_response()
    } else {
        JsonBody(json!(rel_path(&path, &server.user_dir))).into_response()
    }
}

/// DELETE /userdata/{file}
pub async fn delete_userdata(
    State(server): State<Arc<Server>>,
    UrlPath(file): UrlPath<String>,
) -> Response {
    let path = match userdata_path(&server, &file) {
        Ok(p) => p,
        Err(r) => return r.into_response(),
    };
    if !path.is_file() {
        return status(StatusCode::NOT_FOUND);
    }
    match std::fs::remove_file(&path) {
        Ok(()) => status(StatusCode::NO_CONTENT),
        Err(_) => status(StatusCode::INTERNAL_SERVER_ERROR),
    }
}

/// POST /userdata/{file}/move/{dest}?overwrite=&full_info=
pub async fn move_userdata(
    State(server): State<Arc<Server>>,
    UrlPath((file, dest)): UrlPath<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let (src, dst) = match (userdata_path(&server, &file), userdata_path(&server, &dest)) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(r), _) | (_, Err(r)) => return r.into_response(),
    };
    if !src.is_file() {
        return status(StatusCode::NOT_FOUND);
    }
    if q.get("overwrite").map(String::as_str) == Some("false") && dst.exists() {
        return (StatusCode::CONFLICT, "File already exists").into_response();
    }
    if let Some(parent) = dst.parent() {
        if let Err(r) = create_inside(&server.user_dir, parent) {
            return r.into_response();
        }
    }
    if std::fs::rename(&src, &dst).is_err() {
        return status(StatusCode::INTERNAL_SERVER_ERROR);
    }
    if q.get("full_info")
        .is_some_and(|v| v.eq_ignore_ascii_case("true"))
    {
        JsonBody(file_info(&dst, &server.user_dir)).into_response()
    } else {
        JsonBody(json!(rel_path(&dst, &server.user_dir))).into_response()
    }
}

/// A file of the front-end folder (`/` is its index.html), or 404.
pub async fn front_end(State(server): State<Arc<Server>>, uri: axum::http::Uri) -> Response {
    let Some(root) = server.front_end.clone() else {
        return status(StatusCode::NOT_FOUND);
    };
    let raw = uri.path().trim_start_matches('/');
    let decoded = percent_decode(raw);
    let rel = if decoded.is_empty() {
        "index.html".to_string()
    } else {
        decoded
    };
    let path = match confined(&root, &rel) {
        Ok(p) => p,
        Err(s) => return Refusal::from(s).into_response(),
    };
    if let Err(r) = inside(&root, &path) {
        return r.into_response();
    }
    let path = if path.is_dir() {
        path.join("index.html")
    } else {
        path
    };
    match tokio::task::spawn_blocking(move || std::fs::read(&path))
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e)))
    {
        Ok(bytes) => {
            let mut r = ([(header::CONTENT_TYPE, content_type(&rel))], bytes).into_response();
            if rel == "index.html" {
                r.headers_mut().insert(
                    header::CACHE_CONTROL,
                    header::HeaderValue::from_static("no-cache"),
                );
            }
            r
        }
        Err(_) => status(StatusCode::NOT_FOUND),
    }
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            let hex = std::str::from_utf8(&b[i + 1..i + 3]).ok();
            if let Some(v) = hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}
