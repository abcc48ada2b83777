//! A cluster on one machine for the tests and the benchmark: a private
//! `redis-server` on a free loopback port, `sdkit serve --queue` and
//! `sdkit worker` processes, and a few raw Redis commands to look inside.

use serde_json::{json, Value as Json};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Kills its process when dropped (a failing test leaves nothing running).
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn redis_binary() -> Option<PathBuf> {
    which("redis-server")
}

/// A loopback port that was free a moment ago and that this test process
/// has not handed out before (parallel tests would otherwise be given the
/// same one by the kernel once the probe socket closes).
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// A RESP reply, as far as the test reads them.
#[derive(Debug)]
pub enum Resp {
    Str(String),
    Int(i64),
    Nil,
    List(Vec<Resp>),
}

impl Resp {
    pub fn str(&self) -> Option<&str> {
        match self {
            Resp::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn list(&self) -> &[Resp] {
        match self {
            Resp::List(l) => l,
            _ => &[],
        }
    }
}

pub fn read_resp(r: &mut BufReader<TcpStream>) -> Resp {
    let mut line = String::new();
    r.read_line(&mut line).expect("redis reply");
    let (kind, rest) = line.trim_end().split_at(1);
    match kind {
        "+" => Resp::Str(rest.to_string()),
        "-" => panic!("redis error: {rest}"),
        ":" => Resp::Int(rest.parse().expect("integer")),
        "$" => {
            let n: i64 = rest.parse().expect("length");
            if n < 0 {
                return Resp::Nil;
            }
            let mut b = vec![0; n as usize + 2];
            r.read_exact(&mut b).expect("bulk");
            b.truncate(n as usize);
            Resp::Str(String::from_utf8_lossy(&b).into_owned())
        }
        "*" => {
            let n: i64 = rest.parse().expect("length");
            Resp::List((0..n.max(0)).map(|_| read_resp(r)).collect())
        }
        other => panic!("unexpected redis reply {other}{rest}"),
    }
}

/// One command on a fresh connection.
pub fn redis(port: u16, args: &[&str]) -> Resp {
    let s = TcpStream::connect(("127.0.0.1", port)).expect("redis connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).ok();
    (&s).write_all(encode(args).as_bytes())
        .expect("redis write");
    read_resp(&mut BufReader::new(s))
}

/// A private redis-server on a free port, keeping nothing on disk; None
/// (after saying so) where redis-server is not installed and
/// `SDKIT_REQUIRE_REDIS` is unset.
pub fn start_redis(dir: &Path) -> Option<(Proc, u16)> {
    let Some(bin) = redis_binary() else {
        assert!(
            std::env::var_os("SDKIT_REQUIRE_REDIS").is_none(),
            "SDKIT_REQUIRE_REDIS is set but redis-server is not installed"
        );
        eprintln!(
            "skipped: redis-server is not installed (set SDKIT_REQUIRE_REDIS to fail instead)"
        );
        return None;
    };
    // Another process can take the port between the probe and the bind
    // (an ephemeral port given to an outgoing connection or to a server on
    // port 0); then try another.
    for _ in 0..10 {
        let port = free_port();
        if let Some(p) = redis_on(&bin, dir, port) {
            return Some((p, port));
        }
    }
    panic!("redis-server could not bind any of 10 free ports");
}

/// redis-server on `port`, once it answers as itself; None where it could
/// not take the port (it exited, or another server answers there).
pub fn redis_on(bin: &Path, dir: &Path, port: u16) -> Option<Proc> {
    redis_with(bin, dir, port, &[])
}

/// [`redis_on`] with `extra` arguments (INFO is asked on the plain `port`).
pub fn redis_with(bin: &Path, dir: &Path, port: u16, extra: &[&str]) -> Option<Proc> {
    let child = Command::new(bin)
        .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .args(["--port", &port.to_string()])
        .args(extra)
        .arg("--dir")
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server starts");
    let mut proc = Proc(child);
    let pid = format!("process_id:{}", proc.0.id());
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(Some(_)) = proc.0.try_wait() {
            return None;
        }
        // Whoever answers must be this child: INFO names its process.
        if let Some(info) = try_redis(port, &["INFO", "server"]) {
            return info.lines().any(|l| l.trim() == pid).then_some(proc);
        }
        assert!(Instant::now() < deadline, "redis-server did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `args` on a fresh connection; None where the port does not answer RESP
/// with a bulk string.
fn try_redis(port: u16, args: &[&str]) -> Option<String> {
    let s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok();
    (&s).write_all(encode(args).as_bytes()).ok()?;
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).ok()?;
    let n: usize = line.trim_end().strip_prefix('$')?.parse().ok()?;
    let mut b = vec![0; n];
    r.read_exact(&mut b).ok()?;
    String::from_utf8(b).ok()
}

fn encode(args: &[&str]) -> String {
    let mut req = format!("*{}\r\n", args.len());
    for a in args {
        req.push_str(&format!("${}\r\n{a}\r\n", a.len()));
    }
    req
}

/// A Redis that speaks only TLS on its second port, with a certificate for
/// 127.0.0.1 from a private CA, and wants `password`; returns it, the TLS
/// port and the CA's PEM file. None (after saying so) where redis-server
/// or openssl is missing and `SDKIT_REQUIRE_REDIS` is unset.
pub fn start_redis_tls(dir: &Path, password: &str) -> Option<(Proc, u16, PathBuf)> {
    let bins = redis_binary().zip(which("openssl"));
    let Some((bin, openssl)) = bins else {
        assert!(
            std::env::var_os("SDKIT_REQUIRE_REDIS").is_none(),
            "SDKIT_REQUIRE_REDIS is set but redis-server or openssl is not installed"
        );
        eprintln!("skipped: redis-server or openssl is not installed");
        return None;
    };
    let run = |args: &[&str]| {
        let out = Command::new(&openssl)
            .args(args)
            .current_dir(dir)
            .output()
            .expect("openssl runs");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"];
    let ca: &[&str] = &[
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-subj",
        "/CN=sdkit test CA",
    ];
    run(&[&["req", "-x509", "-nodes", "-days", "2"][..], &ec, ca].concat());
    let csr: &[&str] = &[
        "-keyout",
        "srv.key",
        "-out",
        "srv.csr",
        "-subj",
        "/CN=127.0.0.1",
    ];
    run(&[&["req", "-nodes"][..], &ec, csr].concat());
    std::fs::write(dir.join("san.ext"), "subjectAltName=IP:127.0.0.1\n").expect("ext");
    run(&[
        "x509",
        "-req",
        "-in",
        "srv.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "srv.pem",
        "-days",
        "2",
        "-extfile",
        "san.ext",
    ]);
    let (srv, key, ca) = (dir.join("srv.pem"), dir.join("srv.key"), dir.join("ca.pem"));
    for _ in 0..10 {
        let (plain, tls) = (free_port(), free_port());
        let tls_port = tls.to_string();
        let extra = [
            "--tls-port",
            &tls_port,
            "--tls-auth-clients",
            "no",
            "--tls-cert-file",
            path_str(&srv),
            "--tls-key-file",
            path_str(&key),
            "--tls-ca-cert-file",
            path_str(&ca),
        ];
        // Redis binds every port before it answers on any.
        if let Some(p) = redis_with(&bin, dir, plain, &extra) {
            redis(plain, &["CONFIG", "SET", "requirepass", password]);
            return Some((p, tls, ca));
        }
    }
    panic!("redis-server could not bind any of 10 free port pairs");
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("a UTF-8 temporary path")
}

/// `name` on the PATH or in the system's binary folders.
fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/sbin")])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Starts `sdkit` with `args`; returns it and its first stdout line.
pub fn sdkit(args: &[String]) -> (Proc, String) {
    sdkit_env(args, &[])
}

/// [`sdkit`] with environment variables set.
pub fn sdkit_env(args: &[String], env: &[(&str, &Path)]) -> (Proc, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_sdkit"))
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("sdkit starts");
    let stdout = child.stdout.take().expect("stdout");
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).expect("line");
    (Proc(child), line)
}

/// `sdkit serve --queue` on a free port; returns it and its address.
pub fn api(queue: &str, base: &Path) -> (Proc, String) {
    serve_with(Some(queue), base, &[])
}

/// `sdkit serve` on a free port, with `--queue` when given.
pub fn serve(queue: Option<&str>, base: &Path) -> (Proc, String) {
    serve_with(queue, base, &[])
}

/// [`serve`] with `extra` arguments.
pub fn serve_with(queue: Option<&str>, base: &Path, extra: &[&str]) -> (Proc, String) {
    let mut args: Vec<String> = vec!["serve".into(), "--port".into(), "0".into()];
    if let Some(q) = queue {
        args.extend(["--queue".into(), q.to_string()]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    args.extend(common(base));
    let (p, line) = sdkit(&args);
    (p, super::http::listening_addr(&line))
}

pub fn common(base: &Path) -> Vec<String> {
    ["--device", "cpu", "--precision", "f32", "--base-dir"]
        .iter()
        .map(|s| s.to_string())
        .chain([base.display().to_string()])
        .collect()
}

/// `sdkit worker` named `name`, whose prompts are taken over 5 s after it
/// stops answering.
pub fn worker(queue: &str, base: &Path, name: &str) -> Proc {
    worker_with(queue, base, name, &[])
}

/// [`worker`] with `extra` arguments.
pub fn worker_with(queue: &str, base: &Path, name: &str, extra: &[&str]) -> Proc {
    let mut args: Vec<String> = ["worker", "--queue", queue, "--name", name]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect();
    // Short for the tests, with room for a loaded CI machine to delay a
    // live worker's keep-alive (every 1.25 s).
    args.extend(["--claim-timeout".into(), "5".into()]);
    args.extend(common(base));
    let (p, line) = sdkit(&args);
    assert!(line.contains("connected"), "worker said {line:?}");
    p
}

/// graphs/`graph`.json (the tiny SD1 or SDXL txt2img), one 64² image in
/// 3 steps, saving under `prefix`.
pub fn prompt(graph: &str, seed: u64, prefix: &str) -> Json {
    let mut p: Json = serde_json::from_str(
        &std::fs::read_to_string(super::root().join(format!("graphs/{graph}.json")))
            .expect("graph"),
    )
    .expect("json");
    let m = p.as_object_mut().expect("object");
    m.remove("99");
    m["5"]["inputs"]["batch_size"] = json!(1);
    m["6"]["inputs"]["seed"] = json!(seed);
    m["6"]["inputs"]["steps"] = json!(3);
    m["8"]["inputs"]["filename_prefix"] = json!(prefix);
    p
}

pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

pub fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out
}
