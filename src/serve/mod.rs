//! `sdkit serve`: a ComfyUI-compatible HTTP/WebSocket backend.
//!
//! ComfyUI's front end and API clients drive it unchanged: the same
//! routes (each also under `/api/`), JSON shapes, WebSocket messages and
//! queue semantics as ComfyUI's `server.py`. One worker drains the queue
//! through the shared [`Executor`], so a re-queued edit re-runs only the
//! nodes whose inputs changed, and weights stay resident between prompts.
//!
//! With `--queue redis://…` the queue and history live in Redis and
//! `sdkit worker` processes run the prompts ([`cluster`], [`worker`]); any
//! number of API processes can then serve the same cluster.
//!
//! Layout: [`queue`] (pending/running/history and the worker), [`backend`]
//! (that queue or the cluster's, behind one interface), [`prompt_run`]
//! (one prompt's run and its messages), [`ws`]
//! (clients and message fan-out), [`files`] (`/view`, `/upload/image`,
//! `/userdata`, the front-end folder; every path confined to its base),
//! [`routes`] (the router, the Host/Origin check and the JSON routes),
//! [`templates`] (sdkit's example workflows as the front end's templates).

mod backend;
mod cluster;
mod combos;
mod files;
mod jobs;
mod objects;
mod prompt_run;
mod publisher;
mod queue;
mod routes;
mod templates;
pub mod worker;
mod ws;

use crate::cli::DirArgs;
use anyhow::{Context, Result};
use clap::Args;
use sdkit_engine::{Executor, NodeLibrary, Paths};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// Address to listen on (loopback by default; 0.0.0.0 for every interface).
    #[arg(long, default_value = "127.0.0.1")]
    pub listen: String,
    /// Port to listen on (0: any free port, printed at start).
    #[arg(long, default_value_t = 8188)]
    pub port: u16,
    #[command(flatten)]
    pub dirs: DirArgs,
    /// Folder of user data and settings (default: BASE/user).
    #[arg(long, value_name = "DIR")]
    pub user_dir: Option<PathBuf>,
    /// A folder of static front-end files to serve at `/` (e.g. the
    /// `comfyui-frontend-package`'s `static` folder).
    #[arg(long, value_name = "DIR")]
    pub front_end: Option<PathBuf>,
    /// Largest request body accepted, in MB (uploads, prompts).
    #[arg(long, value_name = "MB", default_value_t = 100.0)]
    pub max_upload_size: f64,
    /// A Host name to accept besides loopback ones while listening on
    /// loopback (a reverse proxy's public name; `*` accepts any). Other
    /// Hosts are refused, which stops DNS-rebinding pages.
    #[arg(long = "allow-host", value_name = "NAME")]
    pub allow_hosts: Vec<String>,
    #[command(flatten)]
    pub runner: RunnerArgs,
    /// Keep the queue and history in Redis and let `sdkit worker`s run the
    /// prompts (a cluster; several API processes may share one Redis).
    /// Without it this process runs them itself.
    #[arg(long, value_name = "redis://HOST:PORT[/DB]")]
    pub queue: Option<String>,
    /// With `--queue`: the object store the workers put outputs in
    /// (`file:///DIR` or `s3://BUCKET[/PREFIX]`); `/view` fetches from it
    /// what is not in this process's folders, and uploads go there too.
    #[arg(long, value_name = "URL", requires = "queue")]
    pub output_store: Option<String>,
}

/// How a process that runs prompts runs them (`serve`, `worker`).
#[derive(Args, Debug, Clone)]
pub struct RunnerArgs {
    /// Where models run: auto, cpu, wgpu or an adapter name.
    #[arg(long, value_name = "auto|cpu|wgpu|NAME", default_value = "auto")]
    pub device: String,
    /// GPU memory the runs may use (e.g. 6G); `auto`: 4 GiB.
    #[arg(long, value_name = "BYTES|auto")]
    pub vram_budget: Option<String>,
    /// Matrix products: `auto` (GPU tensor cores, CPU AMX tiles, where
    /// present) or `f32`.
    #[arg(long, value_name = "auto|f32", default_value = "auto")]
    pub precision: crate::cli::Precision,
    /// Tune tensor-core kernels on first use (see `sdkit run --tune`).
    #[arg(long)]
    pub tune: bool,
    /// Sampler previews: `auto` (TAESD when the family's decoder is in
    /// models/vae_approx, latent2rgb otherwise), `taesd` (the same),
    /// `latent2rgb`, or `none`.
    #[arg(
        long,
        value_name = "auto|taesd|latent2rgb|none",
        default_value = "auto"
    )]
    pub preview_method: String,
}

impl RunnerArgs {
    /// The executor these options ask for, on `device` (which a cluster's
    /// API process sets to the CPU).
    pub fn executor(
        &self,
        device: &str,
        lib: Arc<NodeLibrary>,
        paths: sdkit_engine::Paths,
    ) -> Result<Executor> {
        crate::cli::make_executor(
            device,
            self.vram_budget.as_deref(),
            self.precision,
            self.tune,
            lib,
            paths,
        )
    }
}

/// `--preview-method`.
pub fn preview_method(s: &str) -> Result<sdkit_engine::event::PreviewMethod> {
    use sdkit_engine::event::PreviewMethod;
    Ok(match s {
        "auto" | "taesd" => PreviewMethod::Taesd,
        "latent2rgb" => PreviewMethod::Latent2Rgb,
        "none" => PreviewMethod::None,
        other => {
            anyhow::bail!("--preview-method {other:?}: expected auto, taesd, latent2rgb or none")
        }
    })
}

/// Which `Host` headers the server answers. Bound to loopback, only
/// loopback names and addresses (and `--allow-host` names): a DNS-rebinding
/// page reaches a loopback server under its own host name, with a
/// matching Origin, so the Origin check alone cannot stop it (Jupyter's
/// rule). Bound to another address the operator chose exposure, and any
/// Host is answered.
#[derive(Clone, Debug, Default)]
pub struct HostPolicy {
    pub loopback_only: bool,
    pub allowed: Vec<String>,
}

impl HostPolicy {
    pub fn for_listen(listen: &str, allowed: &[String]) -> Self {
        let l = listen.trim_matches(|c| c == '[' || c == ']');
        HostPolicy {
            loopback_only: l.eq_ignore_ascii_case("localhost")
                || l.parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback()),
            allowed: allowed.iter().map(|h| h.to_ascii_lowercase()).collect(),
        }
    }

    /// Whether a request for host name `name` (port stripped, lower case)
    /// is answered.
    pub fn accepts(&self, name: &str) -> bool {
        !self.loopback_only
            || routes::is_loopback(name)
            || self.allowed.iter().any(|a| a == "*" || a == name)
    }
}

/// What every handler shares.
pub struct Server {
    pub exec: Arc<Executor>,
    pub lib: Arc<NodeLibrary>,
    pub paths: Arc<Paths>,
    /// The single user's data folder (ComfyUI's `user/default`).
    pub user_dir: PathBuf,
    pub front_end: Option<PathBuf>,
    pub max_body: usize,
    pub hosts: HostPolicy,
    pub queue: backend::Backend,
    pub clients: Arc<ws::Clients>,
    /// How samplers preview ([`ServeArgs::preview_method`]).
    pub preview: sdkit_engine::event::PreviewMethod,
    /// A cluster's object store ([`ServeArgs::output_store`]).
    pub objects: Option<Arc<objects::Objects>>,
}

impl Server {
    /// What combo inputs accept here (see [`combos`]).
    pub fn combos(&self) -> combos::Combos<'_> {
        combos::Combos {
            paths: &self.paths,
            workers: match &self.queue {
                backend::Backend::Redis(s) => Some(s.advertised()),
                backend::Backend::Local(_) => None,
            },
        }
    }

    /// Re-reads a cluster's model lists before they are shown (the
    /// front end's node definitions, the model routes).
    pub async fn refresh_combos(&self) {
        if let backend::Backend::Redis(s) = &self.queue {
            if let Err(e) = s.refresh_files().await {
                tracing::warn!("cannot read the workers' model lists: {e}");
            }
        }
    }

    /// Tells every client the queue's size.
    pub async fn broadcast_status(&self) {
        if let Ok(info) = self.queue.info().await {
            self.clients.broadcast_status(info);
        }
    }
}

/// Runs the server until Ctrl-C.
pub fn serve(args: ServeArgs) -> Result<i32> {
    let paths = args.dirs.paths()?;
    let base = match &args.dirs.base_dir {
        Some(b) => b.clone(),
        None => std::env::current_dir().context("cannot read the current folder")?,
    };
    for dir in [&paths.input, &paths.output, &paths.temp] {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let user_dir = args
        .user_dir
        .clone()
        .unwrap_or_else(|| base.join("user"))
        .join("default");
    // The front end lists these two at start-up.
    for sub in ["workflows", "subgraphs"] {
        std::fs::create_dir_all(user_dir.join(sub))
            .with_context(|| format!("cannot create {}", user_dir.join(sub).display()))?;
    }
    crate::sweep::stale_temp_files(&paths, Some(&user_dir));
    if let Some(fe) = &args.front_end {
        if !fe.join("index.html").is_file() {
            anyhow::bail!("--front-end {}: no index.html there", fe.display());
        }
    }
    let lib = Arc::new(sdkit_nodes::library());
    // A cluster's API process runs nothing: its executor never touches a
    // GPU.
    let device = if args.queue.is_some() {
        "cpu"
    } else {
        args.runner.device.as_str()
    };
    let exec = args.runner.executor(device, Arc::clone(&lib), paths)?;
    let max_body = (args.max_upload_size * 1024.0 * 1024.0).max(0.0) as usize;
    let hosts = HostPolicy::for_listen(&args.listen, &args.allow_hosts);
    let preview = preview_method(&args.runner.preview_method)?;
    let objects = match &args.output_store {
        Some(url) => Some(Arc::new(objects::open(url)?)),
        None => None,
    };
    let rt = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    rt.block_on(async move {
        let (queue, local) = match &args.queue {
            Some(url) => {
                let store = Arc::new(cluster::connect(url).await?);
                (backend::Backend::Redis(store), None)
            }
            None => {
                let q = Arc::new(queue::Queue::default());
                (backend::Backend::Local(Arc::clone(&q)), Some(q))
            }
        };
        let paths = Arc::clone(exec.paths());
        let server = Arc::new(Server {
            exec: Arc::new(exec),
            lib,
            paths,
            user_dir,
            front_end: args.front_end.clone(),
            max_body,
            hosts,
            queue,
            clients: Arc::default(),
            preview,
            objects,
        });
        let listener = tokio::net::TcpListener::bind((args.listen.as_str(), args.port))
            .await
            .with_context(|| format!("cannot listen on {}:{}", args.listen, args.port))?;
        let addr = listener.local_addr()?;
        // Tests and scripts read this line to find an ephemeral port.
        println!("sdkit serve: listening on http://{addr}");
        match (&local, &server.queue) {
            (Some(q), _) => drop(tokio::spawn(queue::worker(
                Arc::clone(&server),
                Arc::clone(q),
            ))),
            (None, backend::Backend::Redis(store)) => {
                drop(tokio::spawn(cluster::relay(
                    Arc::clone(&server),
                    Arc::clone(store),
                )));
                let store = Arc::clone(store);
                drop(tokio::spawn(async move {
                    loop {
                        if let Err(e) = store.refresh_files().await {
                            tracing::warn!("cannot read the workers' model lists: {e}");
                        }
                        tokio::time::sleep(std::time::Duration::from_secs(5)).await;
                    }
                }));
            }
            (None, backend::Backend::Local(_)) => {}
        }
        let app = routes::router(Arc::clone(&server));
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await
            .context("server failed")?;
        // Stop a run in progress so the process can exit promptly.
        if let Some(q) = &local {
            q.interrupt(None);
        }
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(0)
}
