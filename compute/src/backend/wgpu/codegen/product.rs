//! Matrix products (matmul, and conv as an implicit GEMM) described as
//! data: where each operand's elements live ([`Source`]), where results
//! go ([`Sink`]), and, in `gemm.rs`, how a kernel tiles and stages them
//! ([`super::gemm::CoopGemm`]). The WGSL below is one rendering of these
//! descriptions; nothing in them is WGSL text, so another renderer
//! (PTX) can read the same descriptions.

use super::gemm::{Direct, Gemm};
use super::units::{ChannelsLast, UnitAt, Vector};
use super::{Caps, Operand};
use crate::tensor::Conv2dParams;

/// Where an operand's elements live. A's element (z, row, depth) and B's
/// element (z, depth, column) are addressed through these.
#[derive(Clone, Debug)]
pub(super) enum Source {
    /// A strided matrix view of input `input`: element (z, r, c) at
    /// `offset + z·batch + r·row + c·col`.
    View {
        input: usize,
        offset: usize,
        batch: usize,
        row: usize,
        col: usize,
    },
    /// A conv's weights, [output channels][depth] with the output
    /// channels of each group together; batch index z = image·groups +
    /// group.
    ConvWeights {
        input: usize,
        groups: usize,
        per_group: usize,
        depth: usize,
    },
    /// A conv input read as its im2col matrix: depth = (input channel,
    /// tap), columns = output pixels, zero outside the image.
    Im2col(Im2col),
}

/// The implicit im2col operand of a conv over an NCHW input.
#[derive(Clone, Debug)]
pub(super) struct Im2col {
    pub input: usize,
    pub groups: usize,
    pub channels: usize,
    /// Input channels per group.
    pub per_group: usize,
    pub h: usize,
    pub w: usize,
    pub out_w: usize,
    pub kw: usize,
    pub taps: usize,
    pub params: Conv2dParams,
    /// The depth runs tap by tap over the channels (the weights are
    /// stored tap-major, [`super::conv_taps_first`]); else channel by
    /// channel over the taps.
    pub taps_first: bool,
    /// Staged from the channels-last f16 copy of the input that the
    /// kernel's first pass writes (tap-major, one group, channels a
    /// multiple of 8: [`UnitAt::ChannelsLast`]).
    pub channels_last: bool,
}

/// Where a product's results go: `store(z, r, c, v)` applies the kernel's
/// epilogue at the output index.
#[derive(Clone, Debug)]
pub(super) enum Sink {
    /// Dense [batch][rows][cols]; `plain` where the kernel has no
    /// epilogue (results are stored as they are).
    Dense {
        rows: usize,
        cols: usize,
        plain: bool,
    },
    /// A conv's NCHW output: rows are a group's output channels, columns
    /// output pixels, batch index z = image·groups + group; the bias
    /// (input `bias`) added per output channel.
    Conv {
        groups: usize,
        per_group: usize,
        channels: usize,
        pixels: usize,
        bias: Option<usize>,
    },
}

impl Source {
    /// Whether consecutive depth indices (A) or columns (B) are adjacent
    /// in memory: neighbouring threads then walk them when staging.
    fn fast_along_cols(&self) -> bool {
        match self {
            Source::View { row, col, .. } => col <= row,
            Source::ConvWeights { .. } | Source::Im2col(_) => true,
        }
    }

    /// The source read as fragments straight from its f16 binding, where
    /// its layout allows ([`Direct::of`]). `a`: the source is operand A
    /// (depth along its columns), else B (depth along its rows).
    fn direct(&self, operands: &[Operand], a: bool) -> Option<Direct> {
        match *self {
            Source::View {
                input,
                offset,
                batch,
                row,
                col,
            } => {
                let (depth, across) = if a { (col, row) } else { (row, col) };
                operands
                    .get(input)
                    .and_then(|o| Direct::of(input, o, depth, (offset, batch), across))
            }
            Source::ConvWeights { .. } => self
                .plain_weights(operands)
                .and_then(|(j, o, depth)| Direct::of(j, o, 1, (0, 0), depth)),
            Source::Im2col(_) => None,
        }
    }

    /// Conv weights of one group, `(input, operand, depth)`: a plain
    /// `[out][depth]` matrix, the same for every image (with more groups
    /// the matrix an image reads depends on its group).
    fn plain_weights<'o>(&self, operands: &'o [Operand]) -> Option<(usize, &'o Operand, usize)> {
        match *self {
            Source::ConvWeights {
                input,
                groups: 1,
                depth,
                ..
            } => operands.get(input).map(|o| (input, o, depth)),
            _ => None,
        }
    }

    /// The source staged in 16-byte units, where it is a view of one
    /// binding of whole units with one unit stride ([`Vector::of`]).
    fn vector(&self, operands: &[Operand]) -> Option<Vector> {
        match *self {
            Source::View {
                input,
                offset,
                batch,
                row,
                col,
            } => operands
                .get(input)
                .and_then(|o| Vector::of(input, o, offset, batch, [row, col])),
            // A 1×1 conv of stride 1 without padding reads its input as
            // it lies: [channel][pixel] per image.
            Source::Im2col(ref i)
                if i.taps == 1
                    && i.groups == 1
                    && i.params.stride == [1, 1]
                    && i.params.padding == [0, 0] =>
            {
                let pixels = i.h * i.w;
                operands
                    .get(i.input)
                    .and_then(|o| Vector::of(i.input, o, 0, i.channels * pixels, [pixels, 1]))
            }
            Source::Im2col(ref i) if i.channels_last => Some(Vector {
                at: UnitAt::ChannelsLast(ChannelsLast {
                    channels: i.channels,
                    h: i.h,
                    w: i.w,
                    out_w: i.out_w,
                    kw: i.kw,
                    params: i.params,
                }),
                width: 8,
            }),
            Source::ConvWeights { .. } => self
                .plain_weights(operands)
                .and_then(|(j, o, depth)| Vector::of(j, o, 0, 0, [depth, 1])),
            Source::Im2col(_) => None,
        }
    }

    /// WGSL `load_a(z, r, c)` for A, or `load_b(z, k0, kr, c)` (depth
    /// k0 + kr, k0 a depth step's start) for B. `depth_step`: the
    /// kernel's depth step, None on the portable kernel.
    fn wgsl(&self, a: bool, depth_step: Option<usize>) -> String {
        let head = if a {
            "fn load_a(z: u32, r: u32, c: u32) -> f32 {"
        } else {
            "fn load_b(z: u32, k0: u32, kr: u32, c: u32) -> f32 {"
        };
        match self {
            Source::View {
                input,
                offset,
                batch,
                row,
                col,
            } => {
                let r = if a { "" } else { " let r = k0 + kr;" };
                format!("{head}{r} return rd{input}({offset}u + z * {batch}u + r * {row}u + c * {col}u); }}")
            }
            Source::ConvWeights {
                input,
                groups,
                per_group,
                depth,
            } => format!(
                "{head} let g = z % {groups}u; return rd{input}((g * {per_group}u + r) * {depth}u + c); }}"
            ),
            Source::Im2col(i) => i.wgsl(head, depth_step),
        }
    }
}

impl Im2col {
    fn wgsl(&self, head: &str, depth_step: Option<usize>) -> String {
        let Im2col {
            input,
            groups: g,
            channels: c,
            per_group: cg,
            h,
            w,
            out_w: ow,
            kw,
            taps,
            params,
            taps_first,
            ..
        } = self;
        // The depth index r = k0 + kr as (channel, ky, kx). Tap-major
        // with whole steps of channels (every SD conv but the first),
        // the tap and first channel come from the step's start alone,
        // so everything but the final `+ kr·H·W` is the same for all of
        // a thread's elements in a step and is computed once.
        let step_whole = depth_step.is_some_and(|bk| cg.is_multiple_of(bk));
        let (depth, tail) = match (taps_first, step_whole) {
            (false, _) => (
                format!("let r = k0 + kr; let ci = r / {taps}u; let tap = r % {taps}u;"),
                String::new(),
            ),
            (true, false) => (
                format!("let r = k0 + kr; let tap = r / {cg}u; let ci = r % {cg}u;"),
                String::new(),
            ),
            (true, true) => (
                format!("let tap = k0 / {cg}u; let ci = k0 % {cg}u;"),
                format!(" + kr * {}u", h * w),
            ),
        };
        format!(
            "{head}
    let b = z / {g}u; let g = z % {g}u;
    {depth}
    {}
    if (iy < 0 || ix < 0 || iy >= {h} || ix >= {w}) {{ return 0.0; }}
    return rd{input}(((b * {c}u + g * {cg}u + ci) * {h}u + u32(iy)) * {w}u + u32(ix){tail});
}}",
            input_pixel(params, *ow, *kw, "c", "tap"),
        )
    }
}

/// WGSL: `iy`, `ix` (i32, outside the image in the padding), the input
/// pixel that output pixel `pixel` (of rows `out_w` wide) reads at kernel
/// tap `tap` (of rows `kw` wide).
pub(super) fn input_pixel(
    params: &Conv2dParams,
    out_w: usize,
    kw: usize,
    pixel: &str,
    tap: &str,
) -> String {
    format!(
        "let iy = i32(({pixel} / {out_w}u) * {sh}u + ({tap} / {kw}u) * {dh}u) - {ph}; \
         let ix = i32(({pixel} % {out_w}u) * {sw}u + ({tap} % {kw}u) * {dw}u) - {pw};",
        sh = params.stride[0],
        sw = params.stride[1],
        dh = params.dilation[0],
        dw = params.dilation[1],
        ph = params.padding[0],
        pw = params.padding[1],
    )
}

impl Sink {
    /// WGSL `store(z, r, c, v)`.
    fn wgsl(&self) -> String {
        let head = "fn store(z: u32, r: u32, c: u32, v: f32) {";
        match self {
            Sink::Dense { rows, cols, .. } => format!(
                "{head} let oi = z * {}u + r * {cols}u + c; wr(oi, epi(v, oi)); }}",
                rows * cols
            ),
            Sink::Conv {
                groups: g,
                per_group: og,
                channels: o,
                pixels,
                bias,
            } => {
                let bias_term = match bias {
                    Some(j) => format!("rd{j}(oc)"),
                    None => "0.0".to_string(),
                };
                format!(
                    "{head} let b = z / {g}u; let g = z % {g}u; let oc = g * {og}u + r; let oi = (b * {o}u + oc) * {pixels}u + c; wr(oi, epi(v + {bias_term}, oi)); }}"
                )
            }
        }
    }
}

/// A matrix product as data: `batch` products of `m`×`k` A by `k`×`n` B.
#[derive(Clone, Debug)]
pub(super) struct Product {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub batch: usize,
    pub a: Source,
    pub b: Source,
    pub out: Sink,
}

impl Product {
    /// The problem the GEMM kernels tile, with the operands that may be
    /// read directly as fragments (`operands`: each input's binding, then
    /// the output's).
    pub(super) fn gemm(&self, operands: &[Operand]) -> Gemm {
        Gemm {
            m: self.m,
            n: self.n,
            k: self.k,
            batch: self.batch,
            a_k_contiguous: self.a.fast_along_cols(),
            b_n_contiguous: self.b.fast_along_cols(),
            direct_a: self.a.direct(operands, true),
            direct_b: self.b.direct(operands, false),
            vector_a: self.a.vector(operands),
            vector_b: self.b.vector(operands),
            // Fragments can go straight to a plain f32 output binding.
            store_fragments: matches!(self.out, Sink::Dense { plain: true, .. })
                && operands
                    .last()
                    .is_some_and(|o| !o.f16 && o.chunks == 1 && o.quant.is_none()),
        }
    }

    /// The shader body, launch grid and split-K second pass.
    #[allow(clippy::type_complexity)]
    pub(super) fn emit(
        &self,
        operands: &[Operand],
        caps: &Caps,
    ) -> Result<(String, [u32; 3], Option<(String, [u32; 3], usize)>), String> {
        if self.batch > 65535 {
            return Err(match self.out {
                Sink::Dense { .. } => format!("batch {} exceeds 65535 workgroups", self.batch),
                Sink::Conv { .. } => {
                    format!("batch x groups {} exceeds 65535 workgroups", self.batch)
                }
            });
        }
        let gemm = self.gemm(operands);
        let step = gemm.coop_depth_step(caps);
        Ok(gemm.emit(
            caps,
            &self.a.wgsl(true, step),
            &self.b.wgsl(false, step),
            &self.out.wgsl(),
        ))
    }
}
