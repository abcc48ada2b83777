//! Replays a [`Program`] on the CPU.
//!
//! Activations live in one f32 arena laid out by the planner; weights and
//! inputs are separate f32 slices. Each dispatch splits the arena around its
//! output, so inputs are read and the output written without copies or
//! `unsafe`: the planner guarantees that buffers live at the same kernel
//! never overlap.

use super::kernels::{self, MatView, Products};
use crate::backend::BindError;
use crate::plan::{BufferKind, Command, Expr, Kernel, KernelKind, Program, View};
use crate::tensor::reference::{binary, unary, Array};
use crate::tensor::{
    contiguous_strides, reflect_index, BinaryOp, PadMode, ReduceOp, UnaryOp, UpsampleMode,
};
use rayon::prelude::*;
use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

#[derive(Debug, thiserror::Error)]
pub enum CpuError {
    #[error(transparent)]
    Bind(#[from] crate::backend::BindError),
    #[error("weight \"{name}\": {message}")]
    Weight { name: String, message: String },
    #[error("kernel k{kernel} ({kind}): {message}")]
    Kernel {
        kernel: usize,
        kind: &'static str,
        message: String,
    },
}

pub use crate::runtime::Bindings;

impl Bindings {
    /// Binds every weight the program uploads, from a weight store,
    /// converting f16/bf16/... to f32 once. Weights already bound (e.g. by
    /// an earlier call for another program of the same model) are kept.
    pub fn bind_weights(
        &mut self,
        prog: &Program,
        store: &crate::weights::WeightStore,
    ) -> Result<(), CpuError> {
        for c in &prog.commands {
            let Command::Upload { buffer, name } = c else {
                continue;
            };
            if self.weights.contains_key(name) {
                continue;
            }
            let data = store.to_f32(name).map_err(|e| CpuError::Weight {
                name: name.clone(),
                message: e.to_string(),
            })?;
            BindError::check_len(name, data.len(), prog.buffer(*buffer).len)?;
            self.weights.insert(name.clone(), Arc::new(data));
        }
        Ok(())
    }
}

/// A weight packed for the bf16 (AMX) kernels.
pub enum PackedWeight {
    Conv(kernels::PackedConvWeight),
    Rhs(kernels::PackedRhs),
}

/// Weights packed for the bf16 kernels, by weight name and use. Clones
/// share it, so a sampler's session packs each weight at its first step
/// and every later step reads the packed copy (no conversion from the
/// file, no packing); it is dropped with the last clone.
///
/// The cache holds every packed weight (bf16: 2 bytes a parameter, twice
/// an fp8 file) only where that fits: the first run decides, from the
/// program's weights and the host's available memory, whether to keep
/// them; if not, each weight is packed where it is used and dropped after,
/// so a model larger than memory runs with a layer's worth resident.
#[derive(Clone, Default)]
pub struct PackedWeights {
    map: Arc<Mutex<HashMap<String, Arc<PackedWeight>>>>,
    /// Whether packed weights are kept (decided once, at the first run).
    keep: Arc<std::sync::OnceLock<bool>>,
}

impl PackedWeights {
    fn get(&self, key: &str) -> Option<Arc<PackedWeight>> {
        self.map.lock().ok()?.get(key).cloned()
    }

    fn insert(&self, key: &str, w: PackedWeight) -> Arc<PackedWeight> {
        let w = Arc::new(w);
        if self.keep.get().copied().unwrap_or(true) {
            if let Ok(mut map) = self.map.lock() {
                map.insert(key.to_string(), w.clone());
            }
        }
        w
    }

    /// Decides, once, whether to keep packed weights: when all of
    /// `packed_bytes` take at most half of what the host can still give.
    fn decide(&self, packed_bytes: u64) {
        self.keep.get_or_init(|| match available_memory() {
            Some(avail) => packed_bytes <= avail / 2,
            None => true,
        });
    }

    /// Keeps no packed weight (a one-shot run: none is read twice), where
    /// not decided already.
    pub fn keep_none(&self) {
        self.keep.get_or_init(|| false);
    }

    /// Whether packed weights are kept (None before the first run).
    pub fn keeps(&self) -> Option<bool> {
        self.keep.get().copied()
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.map.lock().map_or(0, |m| {
            m.values()
                .map(|w| match &**w {
                    PackedWeight::Conv(c) => c.bytes(),
                    PackedWeight::Rhs(r) => r.bytes(),
                })
                .sum()
        })
    }
}

/// The cache key of the weight that kernel `k` can take packed, if any:
/// a convolution's weight, or a weight that is B of a matrix product
/// shared by its whole batch, when the product runs on AMX tiles.
/// How a matmul or convolution reads its weight (input 1).
enum Rhs<'a> {
    /// As converted f32 data in the kernel's inputs.
    Plain,
    /// Packed for the bf16 products, under this key of the session's
    /// cache (with the entry, if already packed).
    Packed(&'a str, &'a PackedWeights, Option<Arc<PackedWeight>>),
    /// Decoded from the file a panel of rows at a time ([`rows_operand`]).
    Rows(&'a crate::weights::StoredWeight),
}

/// A block-quantized dtype (GGUF's): decoded inside the products that
/// read it ([`rows_operand`]), never whole, and never packed.
fn quantized(w: &crate::weights::StoredWeight) -> bool {
    w.dtype().block().0 > 1
}

/// The weight of a matmul whose B is a stored weight read as its plain
/// transpose (a Linear layer: `x · wᵀ`, `w` `[n, k]`), not converted yet:
/// the product decodes it a panel of rows at a time
/// ([`kernels::matmul_rows`]), so no f32 copy of the whole weight is
/// made (for T5-XXL's fp8 weights that copy's allocation and page faults
/// cost twice the products). Block-quantized weights always go this way;
/// others unless the session keeps bf16 packs (`packs_kept`), which are
/// read instead. Any other reading converts the weight whole.
fn rows_operand<'a>(
    k: &Kernel,
    stored: &HashMap<u32, (&str, &'a crate::weights::StoredWeight)>,
    external: &HashMap<u32, Arc<Vec<f32>>>,
    packs_kept: bool,
) -> Option<&'a crate::weights::StoredWeight> {
    let KernelKind::MatMul {
        batch, n, k: kk, ..
    } = &k.kind
    else {
        return None;
    };
    let v = k.inputs.get(1)?;
    let (_, w) = stored.get(&v.buffer.0)?;
    let r = v.shape.len();
    let plain = r >= 2
        && v.offset == 0
        && v.strides[r - 2] == 1
        && v.strides[r - 1] == *kk
        && (*batch == 1 || v.batch_stride(r - 2) == Some(0))
        && w.len() == n * kk;
    let by_rows = quantized(w) || !packs_kept;
    (plain && by_rows && !external.contains_key(&v.buffer.0)).then_some(*w)
}

fn packed_key(k: &Kernel, names: &HashMap<u32, &str>, products: Products) -> Option<String> {
    if products != Products::Bf16 {
        return None;
    }
    let w = k.inputs.get(1)?;
    let name = names.get(&w.buffer.0)?;
    match &k.kind {
        KernelKind::Conv2d {
            c,
            o,
            kh,
            kw,
            params,
            ..
        } => {
            let groups = params.groups.max(1);
            let og = o / groups;
            let p: usize = k.output.shape.iter().skip(2).product();
            let dense = w.offset == 0 && w.is_contiguous();
            (dense && products.uses_amx(og, p, c / groups * kh * kw))
                .then(|| format!("{name}#conv/{groups}"))
        }
        KernelKind::MatMul { batch, m, n, k: kk } => {
            let r = w.shape.len();
            let shared = *batch == 1 || w.batch_stride(r - 2) == Some(0);
            (r >= 2 && shared && products.uses_amx(*m, *n, *kk)).then(|| {
                format!(
                    "{name}#rhs/{}/{}/{}/{kk}/{n}",
                    w.offset,
                    w.strides[r - 2],
                    w.strides[r - 1]
                )
            })
        }
        _ => None,
    }
}

/// Elements per unit of parallel elementwise work: large enough to
/// amortise scheduling, small enough to stay in L1/L2.
const CHUNK: usize = 4096;

/// Runs a program with f32 products; returns the graph outputs.
pub fn run(prog: &Program, bind: &Bindings) -> Result<Vec<Array>, CpuError> {
    run_with(prog, bind, Products::F32)
}

/// Runs a program, its matrix products in `products` arithmetic.
pub fn run_with(
    prog: &Program,
    bind: &Bindings,
    products: Products,
) -> Result<Vec<Array>, CpuError> {
    let mut times = crate::backend::KernelTimes::from_env();
    let profile = times.is_some();
    let mut arena = vec![0f32; prog.stats.arena_bytes / 4];
    let mut external: HashMap<u32, Arc<Vec<f32>>> = HashMap::new();
    // Stored weights by buffer, and the last dispatch that reads each.
    let mut stored: HashMap<u32, (&str, &crate::weights::StoredWeight)> = HashMap::new();
    let mut last_read: HashMap<u32, usize> = HashMap::new();
    let names: HashMap<u32, &str> = prog
        .commands
        .iter()
        .filter_map(|c| match c {
            Command::Upload { buffer, name } => Some((buffer.0, name.as_str())),
            _ => None,
        })
        .collect();
    if products == Products::Bf16 && bind.packed.keeps().is_none() {
        // bf16 copies of the file-backed weights this program reads
        // (decided at a session's first run, not every step).
        let packed: u64 = prog
            .commands
            .iter()
            .filter_map(|c| match c {
                Command::Upload { name, .. } => bind.stored.get(name),
                _ => None,
            })
            .filter(|w| !quantized(w))
            .map(|w| 2 * w.len() as u64)
            .sum();
        bind.packed.decide(packed);
    }
    for c in &prog.commands {
        match c {
            Command::Upload { buffer, name } => {
                if let Some(w) = bind.weights.get(name) {
                    BindError::check_len(name, w.len(), prog.buffer(*buffer).len)?;
                    external.insert(buffer.0, w.clone());
                    continue;
                }
                let w = bind
                    .stored
                    .get(name)
                    .ok_or_else(|| BindError::MissingWeight(name.clone()))?;
                BindError::check_len(name, w.len(), prog.buffer(*buffer).len)?;
                stored.insert(buffer.0, (name.as_str(), w));
                if last_read.is_empty() {
                    for (i, k) in prog.kernels.iter().enumerate() {
                        for v in &k.inputs {
                            last_read.insert(v.buffer.0, i);
                        }
                    }
                }
            }
            Command::Bind { buffer, name } => {
                let v = bind
                    .inputs
                    .get(name)
                    .ok_or_else(|| BindError::MissingInput(name.clone()))?;
                BindError::check_len(name, v.len(), prog.buffer(*buffer).len)?;
                external.insert(buffer.0, v.clone());
            }
            Command::Dispatch { kernel } => {
                let k = &prog.kernels[kernel.0 as usize];
                let packs_kept = products == Products::Bf16 && bind.packed.keeps() == Some(true);
                let by_rows = rows_operand(k, &stored, &external, packs_kept);
                let key = match by_rows {
                    Some(_) => None,
                    None => packed_key(k, &names, products),
                };
                let packed = key.as_deref().and_then(|key| bind.packed.get(key));
                let convert = profile.then(std::time::Instant::now);
                for (i, v) in k.inputs.iter().enumerate() {
                    let b = v.buffer.0;
                    if i == 1 && (packed.is_some() || by_rows.is_some()) {
                        continue; // read packed or by rows: no conversion
                    }
                    if let (Some((name, w)), false) = (stored.get(&b), external.contains_key(&b)) {
                        let data = w.to_f32().map_err(|e| CpuError::Weight {
                            name: name.to_string(),
                            message: e.to_string(),
                        })?;
                        external.insert(b, Arc::new(data));
                    }
                }
                if let (Some(c), Some(times)) = (convert, times.as_mut()) {
                    times.add_other("weight read", c.elapsed().as_secs_f64(), 0);
                }
                let t = profile.then(std::time::Instant::now);
                let newly_packed = key.is_some() && packed.is_none();
                let rhs = match (by_rows, key.as_deref()) {
                    (Some(w), _) => Rhs::Rows(w),
                    (None, Some(key)) => Rhs::Packed(key, &bind.packed, packed),
                    (None, None) => Rhs::Plain,
                };
                dispatch(
                    prog,
                    k,
                    kernel.0 as usize,
                    &mut arena,
                    &external,
                    products,
                    rhs,
                )?;
                if newly_packed {
                    // The packed copy stands in for the file from now on.
                    if let Some((_, w)) = stored.get(&k.inputs[1].buffer.0) {
                        w.release_pages();
                    }
                }
                for v in &k.inputs {
                    let b = v.buffer.0;
                    if let (Some((_, w)), true) = (
                        stored.get(&b),
                        last_read.get(&b) == Some(&(kernel.0 as usize)),
                    ) {
                        external.remove(&b);
                        // Its file pages too: a model larger than memory
                        // then holds a layer's worth, not every page it
                        // touched (the next run reads them back from the
                        // page cache).
                        w.release_pages();
                    }
                }
                if let (Some(t), Some(times)) = (t, times.as_mut()) {
                    times.add(prog, *kernel, t.elapsed().as_secs_f64());
                }
            }
            Command::Download { .. } => {}
        }
    }
    if let Some(times) = times {
        times.print();
    }
    let mut outs = Vec::new();
    for v in &prog.outputs {
        let data = {
            let base = buffer_slice(prog, v, &arena, &[], 0, &external);
            read_view(v, base).into_owned()
        };
        outs.push(Array::new(v.shape.clone(), data));
    }
    Ok(outs)
}

/// The whole storage of the buffer a view reads. `left`/`right` are the
/// arena parts around the current output (which starts at `out_start`).
fn buffer_slice<'a>(
    prog: &Program,
    v: &View,
    left: &'a [f32],
    right: &'a [f32],
    out_end: usize,
    external: &'a HashMap<u32, Arc<Vec<f32>>>,
) -> &'a [f32] {
    let b = prog.buffer(v.buffer);
    match b.kind {
        BufferKind::Arena => {
            if b.offset + b.len <= left.len() {
                &left[b.offset..b.offset + b.len]
            } else {
                let s = b.offset.saturating_sub(out_end);
                right.get(s..s + b.len).unwrap_or(&[])
            }
        }
        _ => external.get(&v.buffer.0).map_or(&[], |a| a.as_slice()),
    }
}

/// A view's elements in row-major order; borrowed when already dense.
fn read_view<'a>(v: &View, base: &'a [f32]) -> Cow<'a, [f32]> {
    let n = v.numel();
    if v.is_contiguous() {
        return Cow::Borrowed(&base[v.offset..v.offset + n]);
    }
    let mut out = vec![0f32; n];
    gather_range(v, base, 0, &mut out);
    Cow::Owned(out)
}

/// Reads elements `start..start + out.len()` (row-major order of the
/// view's shape) into `out`.
fn gather_range(v: &View, base: &[f32], start: usize, out: &mut [f32]) {
    let rank = v.shape.len();
    if rank == 0 {
        out.fill(base[v.offset]);
        return;
    }
    if v.strides.iter().all(|&s| s == 0) {
        out.fill(base[v.offset]);
        return;
    }
    if v.is_contiguous() {
        out.copy_from_slice(&base[v.offset + start..v.offset + start + out.len()]);
        return;
    }
    let mut idx = vec![0usize; rank];
    let mut rem = start;
    for d in (0..rank).rev() {
        idx[d] = rem % v.shape[d];
        rem /= v.shape[d];
    }
    let mut off: usize = v.offset
        + idx
            .iter()
            .zip(&v.strides)
            .map(|(i, s)| i * s)
            .sum::<usize>();
    let (last, ls) = (v.shape[rank - 1], v.strides[rank - 1]);
    let mut i = 0;
    while i < out.len() {
        // Run along the innermost dim, then carry.
        let run = (last - idx[rank - 1]).min(out.len() - i);
        if ls == 1 {
            out[i..i + run].copy_from_slice(&base[off..off + run]);
        } else {
            for (j, o) in out[i..i + run].iter_mut().enumerate() {
                *o = base[off + j * ls];
            }
        }
        i += run;
        off += run * ls;
        idx[rank - 1] += run;
        let mut d = rank - 1;
        while idx[d] == v.shape[d] && d > 0 {
            off -= idx[d] * v.strides[d];
            idx[d] = 0;
            d -= 1;
            idx[d] += 1;
            off += v.strides[d];
        }
    }
}

/// Applies an epilogue (or a whole elementwise kernel) over `out`, in
/// parallel chunks. With an anchor, `out` holds its result (`acc`) first.
fn apply_expr(e: &Expr, inputs: &[(&View, &[f32])], out: &mut [f32], has_acc: bool) {
    out.par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(ci, chunk)| {
            let start = ci * CHUNK;
            let acc_copy;
            let acc = if has_acc {
                acc_copy = chunk.to_vec();
                Some(acc_copy.as_slice())
            } else {
                None
            };
            let vals = eval_chunk(e, start, chunk.len(), inputs, acc);
            chunk.copy_from_slice(&vals);
        });
}

/// `unary` over a slice, the op matched once so the loop can vectorise.
fn unary_slice(op: UnaryOp, x: &mut [f32]) {
    macro_rules! each {
        ($f:expr) => {
            for v in x.iter_mut() {
                *v = $f(*v);
            }
        };
    }
    match op {
        UnaryOp::Neg => each!(|v: f32| -v),
        UnaryOp::Abs => each!(f32::abs),
        UnaryOp::Recip => each!(|v: f32| 1.0 / v),
        UnaryOp::Sqrt => each!(f32::sqrt),
        UnaryOp::Silu => each!(|v: f32| v / (1.0 + (-v).exp())),
        UnaryOp::GeluErf if super::amx::gelu_erf(x) => {}
        op => each!(|v| unary(op, v)),
    }
}

/// `binary` over slices, the op matched once so the loop can vectorise.
fn binary_slice(op: BinaryOp, a: &mut [f32], b: &[f32]) {
    macro_rules! each {
        ($f:expr) => {
            for (p, q) in a.iter_mut().zip(b) {
                *p = $f(*p, *q);
            }
        };
    }
    match op {
        BinaryOp::Add => each!(|p: f32, q: f32| p + q),
        BinaryOp::Sub => each!(|p: f32, q: f32| p - q),
        BinaryOp::Mul => each!(|p: f32, q: f32| p * q),
        BinaryOp::Div => each!(|p: f32, q: f32| p / q),
        op => each!(|p, q| binary(op, p, q)),
    }
}

fn eval_chunk(
    e: &Expr,
    start: usize,
    len: usize,
    inputs: &[(&View, &[f32])],
    acc_chunk: Option<&[f32]>,
) -> Vec<f32> {
    match e {
        Expr::Acc => acc_chunk.map_or_else(|| vec![0.0; len], <[f32]>::to_vec),
        Expr::Input(i) => {
            let mut out = vec![0f32; len];
            if let Some((v, base)) = inputs.get(*i) {
                gather_range(v, base, start, &mut out);
            }
            out
        }
        Expr::Const(c) => vec![*c; len],
        Expr::Unary(u, a) => {
            let mut x = eval_chunk(a, start, len, inputs, acc_chunk);
            unary_slice(*u, &mut x);
            x
        }
        Expr::Binary(b, x, y) => {
            let mut a = eval_chunk(x, start, len, inputs, acc_chunk);
            let bb = eval_chunk(y, start, len, inputs, acc_chunk);
            binary_slice(*b, &mut a, &bb);
            a
        }
        Expr::Where(c, x, y) => {
            let c = eval_chunk(c, start, len, inputs, acc_chunk);
            let mut a = eval_chunk(x, start, len, inputs, acc_chunk);
            let b = eval_chunk(y, start, len, inputs, acc_chunk);
            for i in 0..len {
                if c[i] == 0.0 {
                    a[i] = b[i];
                }
            }
            a
        }
        Expr::Clamp(a, lo, hi) => {
            let mut x = eval_chunk(a, start, len, inputs, acc_chunk);
            for v in &mut x {
                *v = v.max(*lo).min(*hi);
            }
            x
        }
    }
}

fn dispatch(
    prog: &Program,
    k: &Kernel,
    index: usize,
    arena: &mut [f32],
    external: &HashMap<u32, Arc<Vec<f32>>>,
    products: Products,
    rhs: Rhs<'_>,
) -> Result<(), CpuError> {
    let ob = prog.buffer(k.output.buffer);
    let (out_start, out_len) = (ob.offset, ob.len);
    let (left, rest) = arena.split_at_mut(out_start);
    let (out, right) = rest.split_at_mut(out_len);
    let out_end = out_start + out_len;
    let ins: Vec<(&View, &[f32])> = k
        .inputs
        .iter()
        .map(|v| (v, buffer_slice(prog, v, left, right, out_end, external)))
        .collect();
    let fail = |m: String| CpuError::Kernel {
        kernel: index,
        kind: k.kind.name(),
        message: m,
    };
    let dense = |i: usize| -> Cow<'_, [f32]> { read_view(ins[i].0, ins[i].1) };
    let anchor_inputs = match &k.kind {
        KernelKind::Elementwise => 0,
        KernelKind::MatMul { .. } => 2,
        KernelKind::Conv2d { bias, .. } => 2 + usize::from(*bias),
        KernelKind::GroupNorm { affine, .. } | KernelKind::LayerNorm { affine, .. } => {
            1 + 2 * usize::from(*affine)
        }
        KernelKind::RmsNorm { affine, .. } => 1 + usize::from(*affine),
        KernelKind::Attention { masked, .. } => 3 + usize::from(*masked),
        KernelKind::Gather { .. } => 2,
        KernelKind::Concat { parts, .. } => *parts,
        KernelKind::Softmax { .. }
        | KernelKind::Reduce { .. }
        | KernelKind::Upsample { .. }
        | KernelKind::Pad { .. } => 1,
    };
    match &k.kind {
        KernelKind::Elementwise => {}
        KernelKind::MatMul { batch, m, n, k: kk } => {
            let mv = |v: &View| -> Option<MatView> {
                let r = v.shape.len();
                Some(MatView {
                    offset: v.offset,
                    batch_stride: v.batch_stride(r - 2)?,
                    row_stride: v.strides[r - 2],
                    col_stride: v.strides[r - 1],
                })
            };
            let (Some(av), Some(bv)) = (mv(ins[0].0), mv(ins[1].0)) else {
                return Err(fail("operand batch dims are not uniformly strided".into()));
            };
            if let Rhs::Rows(w) = rhs {
                let rows = |start: usize, count: usize| {
                    w.range_f32(start * kk, count * kk)
                        .map_err(|e| e.to_string())
                };
                kernels::matmul_rows(ins[0].1, av, &rows, out, *batch, *m, *n, *kk, products)
                    .map_err(|e| fail(e.to_string()))?;
            } else if let Rhs::Packed(key, cache, found) = rhs {
                let w = match found {
                    Some(w) => w,
                    None => {
                        let w = kernels::pack_matmul_rhs(ins[1].1, bv, *kk, *n)
                            .map_err(|e| fail(e.to_string()))?;
                        cache.insert(key, PackedWeight::Rhs(w))
                    }
                };
                let PackedWeight::Rhs(w) = &*w else {
                    return Err(fail(format!(
                        "weight cache entry {key} is not a matmul operand"
                    )));
                };
                kernels::matmul_packed(ins[0].1, av, w, &mut out[..], *batch, *m)
                    .map_err(|e| fail(e.to_string()))?;
            } else {
                kernels::matmul(
                    ins[0].1,
                    av,
                    ins[1].1,
                    bv,
                    &mut out[..],
                    *batch,
                    *m,
                    *n,
                    *kk,
                    products,
                )
                .map_err(|e| fail(e.to_string()))?;
            }
        }
        KernelKind::Conv2d {
            n,
            c,
            h,
            w,
            o,
            kh,
            kw,
            params,
            bias,
        } => {
            let x = dense(0);
            let b = bias.then(|| dense(2));
            let w_shape = [*o, c / params.groups, *kh, *kw];
            if let Rhs::Packed(key, cache, found) = rhs {
                let entry = match found {
                    Some(entry) => entry,
                    None => {
                        let packed = kernels::pack_conv_weight(&dense(1), w_shape, params.groups)
                            .map_err(|e| fail(e.to_string()))?;
                        cache.insert(key, PackedWeight::Conv(packed))
                    }
                };
                let PackedWeight::Conv(packed) = &*entry else {
                    return Err(fail(format!(
                        "weight cache entry {key} is not a conv weight"
                    )));
                };
                kernels::conv2d_packed(
                    &x,
                    [*n, *c, *h, *w],
                    packed,
                    b.as_deref(),
                    params.stride,
                    params.padding,
                    params.dilation,
                    out,
                )
                .map_err(|e| fail(e.to_string()))?;
                return finish(k, &ins, out);
            }
            let wt = dense(1);
            kernels::conv2d(
                &x,
                [*n, *c, *h, *w],
                &wt,
                [*o, c / params.groups, *kh, *kw],
                b.as_deref(),
                params.stride,
                params.padding,
                params.dilation,
                params.groups,
                out,
                products,
            )
            .map_err(|e| fail(e.to_string()))?;
        }
        KernelKind::GroupNorm {
            n,
            c,
            spatial,
            groups,
            eps,
            affine,
        } => {
            let x = dense(0);
            let (w, b) = if *affine {
                (Some(dense(1)), Some(dense(2)))
            } else {
                (None, None)
            };
            kernels::group_norm(
                &x,
                *n,
                *c,
                *spatial,
                *groups,
                *eps,
                w.as_deref(),
                b.as_deref(),
                out,
            )
            .map_err(|e| fail(e.to_string()))?;
        }
        KernelKind::LayerNorm {
            rows,
            cols,
            eps,
            affine,
        } => {
            let x = dense(0);
            let (w, b) = if *affine {
                (Some(dense(1)), Some(dense(2)))
            } else {
                (None, None)
            };
            kernels::layer_norm(&x, *rows, *cols, *eps, w.as_deref(), b.as_deref(), out)
                .map_err(|e| fail(e.to_string()))?;
        }
        KernelKind::RmsNorm {
            rows,
            cols,
            eps,
            affine,
        } => {
            let x = dense(0);
            let w = affine.then(|| dense(1));
            kernels::rms_norm(&x, *rows, *cols, *eps, w.as_deref(), out)
                .map_err(|e| fail(e.to_string()))?;
        }
        KernelKind::Softmax { outer, len, inner } => {
            let x = dense(0);
            if *inner == 1 {
                kernels::softmax_rows(&x, *outer, *len, out).map_err(|e| fail(e.to_string()))?;
            } else {
                softmax_strided(&x, *outer, *len, *inner, out);
            }
        }
        KernelKind::Reduce { op, shape, axes } => reduce(&dense(0), shape, axes, *op, out),
        KernelKind::Attention {
            b,
            h,
            sq,
            skv,
            d,
            dv,
            scale,
            masked,
        } => {
            let (q, kk, v) = (dense(0), dense(1), dense(2));
            let mask = masked.then(|| dense(3));
            kernels::attention(
                &q,
                &kk,
                &v,
                mask.as_deref(),
                b * h,
                *sq,
                *skv,
                *d,
                *dv,
                *scale,
                out,
                products,
            )
            .map_err(|e| fail(e.to_string()))?;
        }
        KernelKind::Gather { rows, cols } => {
            let (t, ids) = (dense(0), dense(1));
            for (i, &id) in ids.iter().enumerate() {
                let r = id as usize;
                if id < 0.0 || r >= *rows {
                    return Err(fail(format!("id {id} out of range 0..{rows}")));
                }
                out[i * cols..(i + 1) * cols].copy_from_slice(&t[r * cols..(r + 1) * cols]);
            }
        }
        KernelKind::Upsample {
            n,
            c,
            h,
            w,
            oh,
            ow,
            mode,
        } => {
            let x = dense(0);
            match mode {
                UpsampleMode::Nearest => {
                    kernels::upsample_nearest2d(&x, [*n, *c, *h, *w], *oh, *ow, out)
                }
                UpsampleMode::Bilinear { align_corners } => kernels::upsample_bilinear2d(
                    &x,
                    [*n, *c, *h, *w],
                    *oh,
                    *ow,
                    *align_corners,
                    out,
                ),
            }
            .map_err(|e| fail(e.to_string()))?;
        }
        KernelKind::Concat { axis, .. } => {
            let shape = &k.output.shape;
            let inner: usize = shape[axis + 1..].iter().product();
            let outer: usize = shape[..*axis].iter().product();
            let total = shape[*axis] * inner;
            let mut at = 0;
            for (i, (view, _)) in ins.iter().enumerate().take(anchor_inputs) {
                let x = dense(i);
                let part = view.shape[*axis] * inner;
                for o in 0..outer {
                    out[o * total + at..o * total + at + part]
                        .copy_from_slice(&x[o * part..(o + 1) * part]);
                }
                at += part;
            }
        }
        KernelKind::Pad { pads, mode } => {
            let x = dense(0);
            match mode {
                PadMode::Constant(value) => {
                    pad(&x, &ins[0].0.shape, pads, *value, &k.output.shape, out)
                }
                PadMode::Reflect => pad_reflect(&x, &ins[0].0.shape, pads, &k.output.shape, out),
            }
        }
    }
    finish(k, &ins, out)
}

/// Runs a kernel's epilogue (or a whole elementwise kernel) over `out`.
fn finish(k: &Kernel, ins: &[(&View, &[f32])], out: &mut [f32]) -> Result<(), CpuError> {
    if let Some(e) = &k.epilogue {
        let has_acc = !matches!(k.kind, KernelKind::Elementwise);
        apply_expr(e, ins, out, has_acc);
    }
    Ok(())
}

fn softmax_strided(x: &[f32], outer: usize, len: usize, inner: usize, out: &mut [f32]) {
    for o in 0..outer {
        for i in 0..inner {
            let at = |j: usize| (o * len + j) * inner + i;
            let m = (0..len).map(|j| x[at(j)]).fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for j in 0..len {
                let e = (x[at(j)] - m).exp();
                out[at(j)] = e;
                sum += e;
            }
            for j in 0..len {
                out[at(j)] /= sum;
            }
        }
    }
}

fn reduce(x: &[f32], shape: &[usize], axes: &[usize], op: ReduceOp, out: &mut [f32]) {
    let out_shape: Vec<usize> = shape
        .iter()
        .enumerate()
        .map(|(i, &d)| if axes.contains(&i) { 1 } else { d })
        .collect();
    let ostr = contiguous_strides(&out_shape);
    let n_out: usize = out_shape.iter().product();
    let count = (x.len() / n_out.max(1)) as f64;
    let mut sum = vec![0f64; n_out];
    let mut sq = vec![0f64; n_out];
    let mut mx = vec![f64::NEG_INFINITY; n_out];
    let mut idx = vec![0usize; shape.len()];
    for &v in x {
        let o: usize = idx
            .iter()
            .enumerate()
            .map(|(d, &c)| if axes.contains(&d) { 0 } else { c * ostr[d] })
            .sum();
        let v = f64::from(v);
        sum[o] += v;
        sq[o] += v * v;
        mx[o] = mx[o].max(v);
        for d in (0..shape.len()).rev() {
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    for o in 0..n_out {
        out[o] = match op {
            ReduceOp::Sum => sum[o],
            ReduceOp::Mean => sum[o] / count,
            ReduceOp::Max => mx[o],
            ReduceOp::Var => {
                let m = sum[o] / count;
                (sq[o] / count - m * m).max(0.0)
            }
        } as f32;
    }
}

fn pad(
    x: &[f32],
    shape: &[usize],
    pads: &[(usize, usize)],
    value: f32,
    out_shape: &[usize],
    out: &mut [f32],
) {
    out.fill(value);
    let ostr = contiguous_strides(out_shape);
    let mut idx = vec![0usize; shape.len()];
    for &v in x {
        let o: usize = idx
            .iter()
            .enumerate()
            .map(|(d, &c)| (c + pads[d].0) * ostr[d])
            .sum();
        out[o] = v;
        for d in (0..shape.len()).rev() {
            idx[d] += 1;
            if idx[d] < shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// Reflect padding: each output position reads the input mirrored at the
/// edges (`-1` → `1`, `n` → `n − 2`); the builder keeps pads below their
/// dimension, so one reflection lands inside.
fn pad_reflect(
    x: &[f32],
    shape: &[usize],
    pads: &[(usize, usize)],
    out_shape: &[usize],
    out: &mut [f32],
) {
    let istr = contiguous_strides(shape);
    // Per dim, each output coordinate's contribution to the source offset.
    let maps: Vec<Vec<usize>> = (0..shape.len())
        .map(|d| {
            (0..out_shape[d])
                .map(|c| reflect_index(c as isize - pads[d].0 as isize, shape[d]) * istr[d])
                .collect()
        })
        .collect();
    let mut idx = vec![0usize; out_shape.len()];
    for o in out.iter_mut() {
        *o = x[idx.iter().zip(&maps).map(|(&c, m)| m[c]).sum::<usize>()];
        for d in (0..out_shape.len()).rev() {
            idx[d] += 1;
            if idx[d] < out_shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// Bytes the host can still give: Linux's `MemAvailable` (reclaimable page
/// cache counted, the mapped weight files' clean pages among it); None
/// where it cannot be read.
fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
