//! A plain HTTP/1.1 client and a WebSocket client for the server tests:
//! requests as ComfyUI's API clients send them, on fresh connections.

use serde_json::{json, Value as Json};
use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

pub struct Reply {
    pub status: u16,
    pub headers: String,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn json(&self) -> Json {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }
}

/// One HTTP/1.1 request on a fresh connection.
pub fn http(addr: &str, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60))).ok();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        req.push_str(&format!("Host: {addr}\r\n"));
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).expect("write");
    s.write_all(body).expect("write body");
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("header end");
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status");
    let mut body = raw[split + 4..].to_vec();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body = dechunk(&body);
    }
    Reply {
        status,
        headers: head,
        body,
    }
}

pub fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = b.windows(2).position(|w| w == b"\r\n") {
        let n = usize::from_str_radix(String::from_utf8_lossy(&b[..eol]).trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.extend_from_slice(&b[eol + 2..eol + 2 + n]);
        b = &b[eol + 2 + n + 2..];
    }
    out
}

/// The address in `sdkit serve`'s first line ("… listening on
/// http://ADDR").
pub fn listening_addr(line: &str) -> String {
    let addr = line
        .trim()
        .rsplit("http://")
        .next()
        .unwrap_or_default()
        .to_string();
    assert!(addr.contains(':'), "unexpected first line {line:?}");
    addr
}

pub fn get(addr: &str, path: &str) -> Reply {
    http(addr, "GET", path, &[], b"")
}

pub fn post_json(addr: &str, path: &str, body: &Json) -> Reply {
    http(
        addr,
        "POST",
        path,
        &[("Content-Type", "application/json")],
        body.to_string().as_bytes(),
    )
}

pub type Ws = tungstenite::WebSocket<TcpStream>;

pub fn ws_connect(addr: &str, client_id: &str) -> Ws {
    let stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(Duration::from_secs(60))).ok();
    let url = format!("ws://{addr}/ws?clientId={client_id}");
    let (ws, _) = tungstenite::client(url.as_str(), stream).expect("handshake");
    ws
}

pub fn ws_next(ws: &mut Ws) -> Json {
    loop {
        match ws.read().expect("ws message") {
            tungstenite::Message::Text(t) => {
                return serde_json::from_str(t.as_str()).expect("json")
            }
            tungstenite::Message::Close(_) => panic!("closed"),
            _ => {}
        }
    }
}

/// Messages for `prompt_id` until its run ends (`executing` with a null
/// node), skipping `status`.
pub fn ws_until_done(ws: &mut Ws, prompt_id: &str) -> Vec<Json> {
    let mut out = Vec::new();
    loop {
        let m = ws_next(ws);
        if m["type"] == "status" || m["type"] == "feature_flags" {
            continue;
        }
        if m["data"]["prompt_id"] != prompt_id {
            continue;
        }
        let done = m["type"] == "executing" && m["data"]["node"].is_null();
        out.push(m);
        if done {
            return out;
        }
    }
}

/// EmptyImage → ImageInvert → SaveImage.
pub fn small(color: u32, prefix: &str) -> Json {
    json!({
        "1": {"class_type": "EmptyImage", "inputs": {"width": 32, "height": 24, "batch_size": 1, "color": color}},
        "2": {"class_type": "ImageInvert", "inputs": {"image": ["1", 0]}},
        "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": prefix}},
    })
}

/// A chain of large blurs: long enough to interrupt.
pub fn slow(color: u32) -> Json {
    let mut p = serde_json::Map::new();
    p.insert("0".into(), json!({"class_type": "EmptyImage", "inputs": {"width": 1536, "height": 1536, "batch_size": 1, "color": color}}));
    for i in 1..=12 {
        p.insert(
            i.to_string(),
            json!({"class_type": "ImageBlur", "inputs": {"image": [(i - 1).to_string(), 0], "blur_radius": 31, "sigma": 9.0}}),
        );
    }
    p.insert("99".into(), json!({"class_type": "SaveImage", "inputs": {"images": ["12", 0], "filename_prefix": "slow"}}));
    Json::Object(p)
}

/// Reads messages until each of `ids` has ended.
pub fn follow_all(ws: &mut Ws, mut ids: HashSet<String>) {
    let deadline = Instant::now() + Duration::from_secs(240);
    while !ids.is_empty() {
        assert!(Instant::now() < deadline, "prompts did not end: {ids:?}");
        let m = ws_next(ws);
        if m["type"] == "executing" && m["data"]["node"].is_null() {
            if let Some(id) = m["data"]["prompt_id"].as_str() {
                ids.remove(id);
            }
        }
    }
}

pub fn multipart(fields: &[(&str, Option<&str>, &[u8])]) -> (String, Vec<u8>) {
    let boundary = "sdkitboundary7MA4YWxk";
    let mut body = Vec::new();
    for (name, file, data) in fields {
        body.extend_from_slice(format!("--{boundary}\r\n").as_bytes());
        match file {
            Some(f) => body.extend_from_slice(
                format!("Content-Disposition: form-data; name=\"{name}\"; filename=\"{f}\"\r\nContent-Type: image/png\r\n\r\n").as_bytes(),
            ),
            None => body.extend_from_slice(
                format!("Content-Disposition: form-data; name=\"{name}\"\r\n\r\n").as_bytes(),
            ),
        }
        body.extend_from_slice(data);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={boundary}"), body)
}

pub fn png(color: [u8; 3]) -> Vec<u8> {
    let img = image::RgbImage::from_pixel(4, 4, image::Rgb(color));
    let mut buf = Vec::new();
    image::DynamicImage::ImageRgb8(img)
        .write_to(&mut std::io::Cursor::new(&mut buf), image::ImageFormat::Png)
        .expect("png");
    buf
}

pub fn upload(a: &str, fields: &[(&str, Option<&str>, &[u8])]) -> Reply {
    let (ctype, body) = multipart(fields);
    http(
        a,
        "POST",
        "/upload/image",
        &[("Content-Type", &ctype)],
        &body,
    )
}
