//! T2I-Adapter (ComfyUI's `comfy/t2i_adapter/adapter.py`, the full
//! `Adapter`): the hint pixel-unshuffled to the latent's size, `conv_in`,
//! then four levels of two ResnetBlocks each (`body.N`); a level's first
//! block moves to the level's width (`in_conv`, when the widths differ)
//! and, after level 0, halves the size (a strided `down_opt.op`
//! convolution, or 2×2 average pooling with ComfyUI's odd-size padding).
//! Each level's output is one feature; ComfyUI adds feature `i` after
//! UNet input block `3i + 2` (SD1/SD2), or, for SDXL adapters (input
//! channels 256 or 768, unshuffled by 16), after blocks 3, 5 and 8 and
//! after the middle block.

use super::detect::{DetectError, Shapes};
use sdkit_compute::tensor::{GraphBuilder, Scope, ShapeError, T};

/// A full T2I-Adapter's sizes, from its tensors.
#[derive(Debug, Clone, PartialEq)]
pub struct T2iConfig {
    /// `conv_in`'s input channels: hint channels × unshuffle².
    pub cin: usize,
    /// The four levels' widths.
    pub channels: [usize; 4],
    /// Kernel size of each block's second convolution (and `in_conv`).
    pub ksize: usize,
    /// Strided convolutions (rather than average pooling) downsample.
    pub use_conv: bool,
    /// The SDXL form (unshuffle 16, features for blocks 3/5/8 and middle).
    pub xl: bool,
}

impl T2iConfig {
    pub fn unshuffle(&self) -> usize {
        if self.xl {
            16
        } else {
            8
        }
    }

    /// Channels of the hint image the adapter takes (1: grey, the mean).
    pub fn hint_channels(&self) -> usize {
        self.cin / (self.unshuffle() * self.unshuffle())
    }

    /// `(feature, UNet input block)` pairs, and the feature for the middle.
    pub fn placement(&self) -> (Vec<(usize, usize)>, Option<usize>) {
        if self.xl {
            (vec![(0, 3), (1, 5), (2, 8)], Some(3))
        } else {
            ((0..4).map(|i| (i, 3 * i + 2)).collect(), None)
        }
    }
}

/// Reads a full adapter's config (`conv_in.weight`, `body.N.*`); None for
/// other layouts.
pub fn t2i_config(s: &Shapes) -> Result<Option<T2iConfig>, DetectError> {
    let Some(conv_in) = s.get("conv_in.weight") else {
        return Ok(None);
    };
    let Some(block2) = s.get("body.0.block2.weight") else {
        return Ok(None);
    };
    let (channel, cin) = match conv_in.as_slice() {
        [c, i, _, _] => (*c, *i),
        other => {
            return Err(DetectError::BadShape {
                name: "conv_in.weight".into(),
                shape: other.to_vec(),
                expected: "[channels, cin, 3, 3]",
            })
        }
    };
    let ksize = block2.get(2).copied().unwrap_or(3);
    Ok(Some(T2iConfig {
        cin,
        channels: [channel, channel * 2, channel * 4, channel * 4],
        ksize,
        use_conv: s.keys().any(|k| k.ends_with("down_opt.op.weight")),
        xl: cin == 256 || cin == 768,
    }))
}

/// The adapter's four features for `hint` `[b, hint_channels, H, W]` (H
/// and W multiples of the unshuffle factor).
pub fn t2i_adapter<'a>(
    g: &'a GraphBuilder,
    cfg: &T2iConfig,
    hint: T<'a>,
) -> Result<Vec<T<'a>>, ShapeError> {
    let vb = Scope::new(g, "");
    let s = hint.shape();
    let r = cfg.unshuffle();
    let (b, c, h, w) = (s[0], s[1], s[2] / r, s[3] / r);
    // PixelUnshuffle: channel c·r² + i·r + j holds pixel (y·r + i, x·r + j).
    // (Batch and channel merged: the IR's rank limit is 5.)
    let x = hint
        .reshape(&[b * c, h, r, w, r])?
        .permute(&[0, 2, 4, 1, 3])?
        .reshape(&[b, c * r * r, h, w])?;
    let mut x = vb.pp("conv_in").conv2d(x, cfg.cin, cfg.channels[0], 3, 1)?;
    let (down_levels, widen_levels): (&[usize], &[usize]) = if cfg.xl {
        (&[2], &[1])
    } else {
        (&[1, 2, 3], &[])
    };
    let mut feats = Vec::with_capacity(4);
    let mut ch = cfg.channels[0];
    for (i, &out) in cfg.channels.iter().enumerate() {
        for j in 0..2 {
            let blk = vb.pp("body").pp(2 * i + j);
            let first = j == 0 && (down_levels.contains(&i) || widen_levels.contains(&i));
            if first && down_levels.contains(&i) {
                x = if cfg.use_conv {
                    blk.pp("down_opt.op").conv2d(x, ch, ch, 3, 2)?
                } else {
                    avg_pool2(x)?
                };
            }
            let cin = if first { ch } else { out };
            if cin != out {
                x = blk.pp("in_conv").conv2d(x, cin, out, cfg.ksize, 1)?;
            }
            let hh = blk
                .pp("block1")
                .conv2d(x, out, out, 3, 1)?
                .clamp(0.0, f32::INFINITY);
            let hh = blk.pp("block2").conv2d(hh, out, out, cfg.ksize, 1)?;
            x = hh.add(x)?;
        }
        ch = out;
        feats.push(x);
    }
    Ok(feats)
}

/// `AvgPool2d(2, 2)` with ComfyUI's padding of `size % 2` (zeros counted).
fn avg_pool2(x: T<'_>) -> Result<T<'_>, ShapeError> {
    let s = x.shape();
    let (ph, pw) = (s[2] % 2, s[3] % 2);
    let x = if ph + pw > 0 {
        x.pad(&[(0, 0), (0, 0), (ph, 0), (pw, 0)], 0.0)?
    } else {
        x
    };
    let s = x.shape();
    x.reshape(&[s[0] * s[1], s[2] / 2, 2, s[3] / 2, 2])?
        .mean(&[2, 4], false)?
        .reshape(&[s[0], s[1], s[2] / 2, s[3] / 2])
}
