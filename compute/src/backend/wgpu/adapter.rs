//! The adapters: listing and describing them, their cooperative-matrix
//! configuration, and the device-side settings (pipeline cache, shader
//! checks) a backend opens them with.

use super::*;

/// A description of an adapter, for `sdkit devices`.
#[derive(Clone, Debug)]
pub struct AdapterReport {
    pub name: String,
    pub backend: String,
    pub device_type: String,
    pub driver: String,
    pub features: Vec<String>,
    /// Cooperative-matrix shapes (M×N×K, input → accumulator types), where
    /// the adapter has the experimental feature.
    pub cooperative_matrix: Vec<String>,
    pub max_storage_buffer_binding_size: u64,
    pub max_buffer_size: u64,
    pub max_compute_workgroup_storage_size: u32,
    /// Lanes per subgroup (min, max); 0 where the adapter does not say.
    pub subgroup_size: (u32, u32),
    /// Kernels tuned on this adapter and driver ([`Tuning`]): in the
    /// default cache folder for [`adapters_with_tuning`], in the
    /// backend's own for a backend; 0 from [`adapters`], which reads no
    /// file (device selection calls it).
    pub tuned_kernels: usize,
}

pub(super) fn report(a: &wgpu::Adapter) -> AdapterReport {
    let info = a.get_info();
    let limits = a.limits();
    let feats = a.features();
    let mut features = Vec::new();
    for (f, name) in [
        (wgpu::Features::SHADER_F16, "SHADER_F16"),
        (wgpu::Features::SUBGROUP, "SUBGROUP"),
        (wgpu::Features::TIMESTAMP_QUERY, "TIMESTAMP_QUERY"),
        (wgpu::Features::PIPELINE_CACHE, "PIPELINE_CACHE"),
        (
            wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX,
            "EXPERIMENTAL_COOPERATIVE_MATRIX",
        ),
    ] {
        if feats.contains(f) {
            features.push(name.to_string());
        }
    }
    // The tile shapes a cooperative-matrix kernel would be built from.
    let cooperative_matrix = if feats.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX) {
        a.cooperative_matrix_properties()
            .iter()
            .map(|p| {
                format!(
                    "{}x{}x{} {:?}->{:?}",
                    p.m_size, p.n_size, p.k_size, p.ab_type, p.cr_type
                )
            })
            .collect()
    } else {
        Vec::new()
    };
    AdapterReport {
        name: info.name,
        backend: format!("{:?}", info.backend),
        device_type: format!("{:?}", info.device_type),
        driver: format!("{} {}", info.driver, info.driver_info),
        features,
        cooperative_matrix,
        max_storage_buffer_binding_size: limits.max_storage_buffer_binding_size,
        max_buffer_size: limits.max_buffer_size,
        max_compute_workgroup_storage_size: limits.max_compute_workgroup_storage_size,
        subgroup_size: (info.subgroup_min_size, info.subgroup_max_size),
        tuned_kernels: 0,
    }
}

pub(super) fn instance() -> wgpu::Instance {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12;
    wgpu::Instance::new(desc)
}

/// Every adapter this machine offers.
pub fn adapters() -> Vec<AdapterReport> {
    list_adapters(false)
}

/// [`adapters`], each with the kernels tuned for it in the default cache
/// folder (`sdkit devices`).
pub fn adapters_with_tuning() -> Vec<AdapterReport> {
    list_adapters(true)
}

pub(super) fn list_adapters(tuning: bool) -> Vec<AdapterReport> {
    let dir = tuning.then(default_cache_dir).flatten();
    let inst = instance();
    pollster::block_on(inst.enumerate_adapters(wgpu::Backends::all()))
        .iter()
        .map(|a| AdapterReport {
            tuned_kernels: tune::Table::open(dir.as_deref(), &a.get_info()).len(),
            ..report(a)
        })
        .collect()
}

/// The cooperative-matrix configuration matrix kernels use: square f16
/// products into f32 (16×16 preferred: NVIDIA/AMD tensor cores; 8×8:
/// Apple's simdgroup matrices), on an adapter whose subgroup size is fixed
/// (the kernels divide a workgroup into subgroups by that size).
pub(super) fn coop_config(a: &wgpu::Adapter) -> Option<codegen::Coop> {
    if !a
        .features()
        .contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
    {
        return None;
    }
    let info = a.get_info();
    if info.subgroup_min_size != info.subgroup_max_size || info.subgroup_min_size == 0 {
        return None;
    }
    let props = a.cooperative_matrix_properties();
    [16, 8].into_iter().find_map(|t| {
        props
            .iter()
            .any(|p| {
                p.m_size == t
                    && p.n_size == t
                    && p.k_size == t
                    && p.ab_type == wgpu::CooperativeScalarType::F16
                    && p.cr_type == wgpu::CooperativeScalarType::F32
            })
            .then_some(codegen::Coop {
                tile: t,
                subgroup: info.subgroup_min_size,
                emulated: false,
            })
    })
}

/// Emulated fragments ([`Options::emulate_coopmat`]): a row per lane, so
/// tiles as wide as the adapter's fixed subgroup (8 or 16 lanes).
pub(super) fn emulated_coop(a: &wgpu::Adapter) -> Option<codegen::Coop> {
    let info = a.get_info();
    let lanes = info.subgroup_min_size;
    (lanes == info.subgroup_max_size && matches!(lanes, 8 | 16)).then_some(codegen::Coop {
        tile: lanes,
        subgroup: lanes,
        emulated: true,
    })
}

/// The pipeline cache for `device`, primed with `data` from an earlier
/// run where it is valid (wgpu checks its header against the adapter and
/// falls back to an empty cache otherwise).
#[allow(unsafe_code)]
pub(super) fn load_pipeline_cache(
    device: &wgpu::Device,
    data: Option<&[u8]>,
) -> wgpu::PipelineCache {
    // SAFETY: `data` is only ever bytes this function's caller wrote from
    // `PipelineCache::get_data` into a file named by
    // `wgpu::util::pipeline_cache_key` for the same adapter; wgpu validates
    // the header (adapter, driver, wgpu version) and `fallback` makes any
    // mismatch or corruption an empty cache instead of an error.
    unsafe {
        device.create_pipeline_cache(&wgpu::PipelineCacheDescriptor {
            label: Some("sdkit pipelines"),
            data,
            fallback: true,
        })
    }
}

/// The runtime checks generated shaders go without
/// ([`Options::shader_checks`] off): the counter wgpu puts in every loop
/// (which stops drivers unrolling it) and the guards on integer division
/// everywhere; bounds checks (index clamps, and buffer accesses where
/// the platform has no checks of its own) only on Vulkan, where wgpu
/// enables the device's robust buffer access, which keeps buffer accesses
/// checked. On Metal and DX12 they stay.
/// `bounds` keeps the bounds checks on Vulkan too
/// ([`Options::bounds_checks`]).
pub(super) fn trusted_checks(backend: wgpu::Backend, bounds: bool) -> wgpu::ShaderRuntimeChecks {
    let mut checks = wgpu::ShaderRuntimeChecks::checked();
    checks.force_loop_bounding = false;
    checks.int_div_checks = false;
    checks.bounds_checks = bounds || backend != wgpu::Backend::Vulkan;
    checks
}

/// A shader module compiled with only `checks` of wgpu's runtime checks.
#[allow(unsafe_code)]
pub(super) fn trusted_module(
    device: &wgpu::Device,
    desc: wgpu::ShaderModuleDescriptor,
    checks: wgpu::ShaderRuntimeChecks,
) -> wgpu::ShaderModule {
    // SAFETY: every shader comes from `codegen`, whose kernels bound every
    // loop by a constant or a monotone count (no infinite loops), divide
    // integers only by non-zero constants, index arrays and buffers only
    // within their lengths (edge tiles are guarded by explicit
    // comparisons or clamped indices, never by the runtime's clamping)
    // and write workgroup memory before reading it. The conformance suite
    // runs them this way, with workgroup memory poisoned, and a backend
    // test holds them to the checked build's bits. `checks` keeps bounds
    // checks wherever the device does not check buffer accesses itself.
    unsafe { device.create_shader_module_trusted(desc, checks) }
}

/// Where the CLI keeps the pipeline cache: `SDKIT_CACHE_DIR`, else the
/// platform's cache folder (`XDG_CACHE_HOME` or `~/.cache` on Linux,
/// `~/Library/Caches` on macOS, `%LOCALAPPDATA%` on Windows) + `sdkit`.
pub fn default_cache_dir() -> Option<std::path::PathBuf> {
    use std::path::PathBuf;
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(d) = env("SDKIT_CACHE_DIR") {
        return Some(d);
    }
    let base = if cfg!(windows) {
        env("LOCALAPPDATA")
    } else if cfg!(target_os = "macos") {
        env("HOME").map(|h| h.join("Library/Caches"))
    } else {
        env("XDG_CACHE_HOME").or_else(|| env("HOME").map(|h| h.join(".cache")))
    };
    base.map(|b| b.join("sdkit"))
}

/// The token wgpu asks for before it enables an experimental feature
/// (here only cooperative matrices, whose kernels the conformance suite
/// checks on the adapter before they are trusted).
#[allow(unsafe_code)]
pub(super) fn experimental() -> wgpu::ExperimentalFeatures {
    // SAFETY: wgpu marks the token unsafe because experimental features may
    // have implementation bugs; we only enable cooperative matrices and use
    // them through naga-validated WGSL in uniform control flow.
    unsafe { wgpu::ExperimentalFeatures::enabled() }
}

pub(super) fn rank(t: wgpu::DeviceType) -> u8 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Other => 3,
        wgpu::DeviceType::Cpu => 4,
    }
}
