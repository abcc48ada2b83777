//! Operands read in 16-byte units: where a staged operand's units are
//! ([`Vector`], [`UnitAt`]), the WGSL that loads one and writes its
//! elements into a workgroup tile. One load per 8 f16 (or 4 f32)
//! elements instead of one per element, each with its own address and
//! bounds test.

use super::product::input_pixel;
use super::Operand;
use std::fmt::Write;

/// An operand read in 16-byte units (8 f16 or 4 f32 elements) when it
/// is staged: one load per unit instead of one per element, the unit
/// running along the operand's contiguous axis.
#[derive(Clone, Copy, Debug)]
pub(super) struct Vector {
    pub(super) at: UnitAt,
    /// Elements per unit: 8 (f16) or 4 (f32).
    pub(super) width: usize,
}

/// Where an operand's units are.
#[derive(Clone, Copy, Debug)]
pub(super) enum UnitAt {
    /// A view of input `input`, whose binding holds whole units: element
    /// (z, R, C) (A: row, depth; B: depth, column) at
    /// `offset + z·z_stride + R·strides[0] + C·strides[1]`, one of the
    /// strides 1; every other stride and the offset are whole units, so
    /// a unit that starts on a multiple of the width along the contiguous
    /// axis is one aligned load.
    View {
        input: usize,
        offset: usize,
        z_stride: usize,
        strides: [usize; 2],
    },
    /// A conv's input as its im2col operand B (depth = tap·C + channel,
    /// columns = output pixels), read from the channels-last f16 copy of
    /// it that the kernel's first pass writes into the scratch binding
    /// (`part`, `[image][y][x][C / 8]` units): a unit is 8 channels of one
    /// input pixel, all zero where the tap falls in the padding.
    ChannelsLast(ChannelsLast),
}

/// A conv's input shape as [`UnitAt::ChannelsLast`] reads it (one group).
#[derive(Clone, Copy, Debug)]
pub(super) struct ChannelsLast {
    pub(super) channels: usize,
    pub(super) h: usize,
    pub(super) w: usize,
    pub(super) out_w: usize,
    pub(super) kw: usize,
    pub(super) params: crate::tensor::Conv2dParams,
}

impl Vector {
    /// For operand `j` bound as `op`, viewed with these offset and
    /// strides, where the layout allows (see [`UnitAt::View`]).
    pub(super) fn of(
        j: usize,
        op: &Operand,
        offset: usize,
        z_stride: usize,
        strides: [usize; 2],
    ) -> Option<Self> {
        let width = op.unit()?;
        let whole = |x: usize| x.is_multiple_of(width);
        let aligned = whole(offset)
            && whole(z_stride)
            && match strides {
                [1, other] | [other, 1] => whole(other),
                _ => false,
            };
        aligned.then_some(Vector {
            at: UnitAt::View {
                input: j,
                offset,
                z_stride,
                strides,
            },
            width,
        })
    }

    /// The unit runs along the operand's columns (A: depth; B: output
    /// columns), else along its rows.
    pub(super) fn along_cols(&self) -> bool {
        match self.at {
            UnitAt::View { strides, .. } => strides[1] == 1,
            UnitAt::ChannelsLast(_) => false,
        }
    }

    /// WGSL setting `v` to the unit whose first element is the operand's
    /// (`row`, `col`) in batch entry `z` (in range).
    pub(super) fn load(&self, row: &str, col: &str) -> String {
        let w = self.width;
        match self.at {
            UnitAt::View {
                input,
                offset,
                z_stride,
                strides,
            } => {
                let term = |x: &str, s: usize| match s {
                    1 => format!(" + {x}"),
                    s => format!(" + ({x}) * {s}u"),
                };
                format!(
                    "v = vld{input}(({offset}u + z * {z_stride}u{}{}) / {w}u);",
                    term(row, strides[0]),
                    term(col, strides[1])
                )
            }
            UnitAt::ChannelsLast(cl) => {
                let c = cl.channels;
                format!(
                    "let dd = {row}; let tap = dd / {c}u; let p = {col}; {} \
                     if (iy >= 0 && ix >= 0 && iy < {h} && ix < {wd}) {{ \
                     v = part[((z * {h}u + u32(iy)) * {wd}u + u32(ix)) * {cu}u + (dd % {c}u) / {w}u]; }}",
                    input_pixel(&cl.params, cl.out_w, cl.kw, "p", "tap"),
                    h = cl.h,
                    wd = cl.w,
                    cu = c / w,
                )
            }
        }
    }
}

/// WGSL writing a 16-byte unit `x` (`vec4<u32>` of 8 f16, or
/// `vec4<f32>`) into the workgroup array `array`: element i, converted by
/// `cast` (`f16`, or empty for f32), at `slot + i·step`.
pub(super) fn unit_writes(
    array: &str,
    slot: &str,
    x: &str,
    cast: &str,
    width: usize,
    step: usize,
) -> String {
    let mut out = format!("{{ let w = {x}; let s = {slot};");
    if width == 8 {
        for (p, l) in ["x", "y", "z", "w"].iter().enumerate() {
            let _ = write!(out, " let h{p} = unpack2x16float(w.{l});");
        }
    }
    for i in 0..width {
        let value = match width {
            8 => format!("{cast}(h{}[{}])", i / 2, i % 2),
            _ => format!("{cast}(w[{i}])"),
        };
        let _ = write!(out, " {array}[s + {}u] = {value};", i * step);
    }
    out.push_str(" }");
    out
}

/// The zero of a 16-byte unit of `width` elements.
pub(super) fn unit_zero(width: usize) -> &'static str {
    if width == 8 {
        "vec4<u32>()"
    } else {
        "vec4<f32>()"
    }
}
