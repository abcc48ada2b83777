//! Inpainting as ComfyUI does it.
//!
//! - **Nodes** (nodes.py): SetLatentNoiseMask attaches a mask to a latent;
//!   VAEEncodeForInpaint resizes the mask to the image (bilinear), crops
//!   both to the VAE cell, greys the masked pixels (`(p − 0.5)·(1 −
//!   round(m)) + 0.5`), encodes, and grows the rounded mask by a box
//!   kernel for the noise mask; InpaintModelConditioning does the same
//!   without growing, encodes the original pixels for the latent, and puts
//!   the greyed latent and the mask on every conditioning entry
//!   (`concat_latent_image`, `concat_mask`).
//! - **Sampling** (`KSamplerX0Inpaint`): the latent's mask is resized to
//!   the latent (bilinear, no crop), repeated over channels and batch
//!   ([`denoise_mask`]); every model call sees `x·m + (noise·σ + latent)·(1 −
//!   m)` and returns `out·m + latent·(1 − m)`, where `noise` is the
//!   initial unscaled noise ([`Blend`]).
//! - **Inpainting models** (9-channel UNets, `BaseModel.concat_cond`): the
//!   model input is `x / c_in` followed by `c_concat` = the mask (the
//!   entry's `concat_mask`, else the sampler's mask; resized with
//!   `common_upscale` bilinear/center, rounded) and the masked image
//!   (the entry's `concat_latent_image` in model space, else the sampler's
//!   latent); without any mask, ones and the "blank" latent
//!   ([`concat_cond`]).

use super::{input, opaque, CondEntry, Conditioning, Model, Vae};
use crate::imageops::{self, repeat_to_batch, Crop};
use crate::models::detect::Net;
use sdkit_engine::{Inputs, Latent, NodeContext, NodeError, NodeImpl, NodeOutput, Tensor, Value};
use sdkit_schema::SocketType;
use std::sync::Arc;

/// [`imageops::resize_planes`] for masks, its error naming what it resized.
fn resize_planes(
    data: &[f32],
    n: usize,
    from: (usize, usize),
    to: (usize, usize),
    crop: Crop,
) -> Result<Vec<f32>, NodeError> {
    imageops::resize_planes(data, n, from, to, crop)
        .map_err(|e| NodeError::invalid(format!("resizing a mask: {e}")))
}

/// `(batch, h, w)` of a MASK `[b, h, w]` or a noise mask `[b, 1, h, w]`.
fn mask_dims(m: &Tensor) -> Result<(usize, usize, usize), NodeError> {
    match m.shape.as_slice() {
        [b, h, w] | [b, 1, h, w] => Ok((*b, *h, *w)),
        [h, w] => Ok((1, *h, *w)),
        s => Err(NodeError::invalid(format!(
            "a mask of shape {s:?}: expected [batch, height, width]"
        ))),
    }
}

/// `resize_to_batch_size`: items picked by nearest index.
fn resize_to_batch(data: &[f32], per: usize, b: usize) -> Vec<f32> {
    let n = data.len() / per.max(1);
    if n == b || n == 0 {
        return data.to_vec();
    }
    let pick = |i: usize| -> usize {
        if b <= 1 {
            i
        } else if b < n {
            let scale = (n - 1) as f64 / (b - 1) as f64;
            ((i as f64 * scale).round_ties_even() as usize).min(n - 1)
        } else {
            let scale = n as f64 / b as f64;
            (((i as f64 + 0.5) * scale).floor() as usize).min(n - 1)
        }
    };
    (0..b)
        .flat_map(|i| {
            let j = pick(i);
            data[j * per..(j + 1) * per].iter().copied()
        })
        .collect()
}

/// `comfy.utils.reshape_mask` for a latent `[b, c, h, w]`: bilinear to
/// the latent size (no crop), repeated over channels, tiled over the batch.
pub fn denoise_mask(mask: &Tensor, [b, c, h, w]: [usize; 4]) -> Result<Vec<f32>, NodeError> {
    let (mb, mh, mw) = mask_dims(mask)?;
    let plane = resize_planes(&mask.data, mb, (mh, mw), (h, w), Crop::Disabled)?;
    let per = c * h * w;
    let mut full = Vec::with_capacity(mb * per);
    for i in 0..mb {
        for _ in 0..c {
            full.extend_from_slice(&plane[i * h * w..(i + 1) * h * w]);
        }
    }
    Ok(repeat_to_batch(&full, per, b))
}

/// The per-call blend of `KSamplerX0Inpaint`.
pub struct Blend<'a> {
    /// The prepared denoise mask `[b, c, h, w]`.
    pub mask: &'a [f32],
    /// The initial noise, unscaled.
    pub noise: &'a [f32],
    /// The latent in model space.
    pub latent: &'a [f32],
    /// Rectified flow scales noise as `σ·n + (1 − σ)·l`.
    pub flow: bool,
    /// DifferentialDiffusion: the mask each call uses, from σ.
    pub differential: Option<Differential<'a>>,
}

impl Blend<'_> {
    /// The mask of the call at `sigma`: the prepared one, or
    /// DifferentialDiffusion's.
    pub fn mask_at(&self, sigma: f32) -> std::borrow::Cow<'_, [f32]> {
        match &self.differential {
            Some(d) => std::borrow::Cow::Owned(d.mask(self.mask, sigma)),
            None => std::borrow::Cow::Borrowed(self.mask),
        }
    }

    /// `x·m + scale_latent_inpaint(σ)·(1 − m)`.
    pub fn input(&self, x: &[f32], sigma: f32, mask: &[f32]) -> Vec<f32> {
        x.iter()
            .zip(mask)
            .zip(self.noise.iter().zip(self.latent))
            .map(|((&x, &m), (&n, &l))| {
                let scaled = if self.flow {
                    sigma * n + (1.0 - sigma) * l
                } else {
                    n * sigma + l
                };
                x * m + scaled * (1.0 - m)
            })
            .collect()
    }

    /// `out·m + latent·(1 − m)`.
    pub fn output(&self, out: &mut [f32], mask: &[f32]) {
        for ((o, &m), &l) in out.iter_mut().zip(mask).zip(self.latent) {
            *o = *o * m + l * (1.0 - m);
        }
    }
}

/// DifferentialDiffusion's denoise-mask function
/// (comfy_extras/nodes_differential_diffusion.py): at each call the mask
/// becomes `m ≥ threshold`, the threshold falling from 1 to 0 with the
/// model's timestep over the sampling call's sigmas, blended with the
/// mask itself by `strength` below 1. Soft masks thus grow their painted
/// area step by step.
pub struct Differential<'a> {
    pub strength: f64,
    pub schedule: &'a crate::sampling::discrete::DiscreteSchedule,
    /// The sampling call's first sigma and its last, or the model's
    /// smallest where that is larger.
    pub sigma_from: f32,
    pub sigma_to: f32,
}

impl<'a> Differential<'a> {
    /// For a sampling call over `sigmas` (ComfyUI's `extra_options["sigmas"]`).
    pub fn new(
        strength: f64,
        schedule: &'a crate::sampling::discrete::DiscreteSchedule,
        sigmas: &[f32],
    ) -> Self {
        let last = sigmas.last().copied().unwrap_or(0.0);
        let min = schedule.sigma_min();
        Differential {
            strength,
            schedule,
            sigma_from: sigmas.first().copied().unwrap_or(0.0),
            sigma_to: if last > min { last } else { min },
        }
    }

    /// The mask for the call at `sigma`, in f32 as torch computes it.
    pub fn mask(&self, mask: &[f32], sigma: f32) -> Vec<f32> {
        let ts = |s: f32| self.schedule.timestep(s);
        let (from, to) = (ts(self.sigma_from), ts(self.sigma_to));
        let threshold = (ts(sigma) - to) / (from - to);
        let binary = mask
            .iter()
            .map(|&m| if m >= threshold { 1.0f32 } else { 0.0 });
        if self.strength != 0.0 && self.strength < 1.0 {
            let (s, rest) = (self.strength as f32, (1.0 - self.strength) as f32);
            binary.zip(mask).map(|(b, &m)| s * b + rest * m).collect()
        } else {
            binary.collect()
        }
    }
}

/// ComfyUI's DifferentialDiffusion: the model, sampled with
/// [`Differential`]'s per-step mask wherever a latent has a noise mask.
pub struct DifferentialDiffusion;

impl NodeImpl for DifferentialDiffusion {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let model: Arc<Model> = input(inputs, "model", "MODEL")?;
        let strength = match inputs.get("strength") {
            Some(_) => inputs.float("strength")?,
            None => 1.0,
        };
        if !(0.0..=1.0).contains(&strength) {
            return Err(NodeError::invalid(format!(
                "strength {strength} is outside 0..1"
            )));
        }
        let mut m = (*model).clone();
        m.differential = Some(strength);
        Ok(NodeOutput::values(vec![opaque(SocketType::Model, m)]))
    }
}

/// The `c_concat` channels of an inpainting model (`concat_cond`) for one
/// entry, `[b, 1 + c, h, w]` (mask, then masked image), or None when the
/// model takes only the latent.
pub fn concat_cond(
    model: &Model,
    entry: &CondEntry,
    denoise_mask: Option<&[f32]>,
    latent_in: &[f32],
    [b, c, h, w]: [usize; 4],
) -> Result<Option<Vec<f32>>, NodeError> {
    if let Net::Flux(_) = model.net {
        return flux_concat(model, entry, denoise_mask, [b, c, h, w]);
    }
    let extra = model.in_channels().saturating_sub(c);
    if extra == 0 {
        return Ok(None);
    }
    if extra != 1 + c {
        return Err(NodeError::invalid(format!(
            "the model takes {} input channels; sdkit knows {c}-channel latents plus a mask and \
             a masked image ({}) for inpainting models",
            model.in_channels(),
            1 + 2 * c
        )));
    }
    let plane = h * w;
    let image: Vec<f32> = match &entry.concat_latent_image {
        Some(img) => {
            let [ib, ic, ih, iw] = concat_image_dims(img, c)?;
            let scaled: Vec<f32> = img
                .data
                .iter()
                .map(|&v| model.latent.process_in(v))
                .collect();
            let resized = resize_planes(&scaled, ib * ic, (ih, iw), (h, w), Crop::Center)?;
            resize_to_batch(&resized, c * plane, b)
        }
        None => latent_in.to_vec(),
    };
    let mask: Option<Vec<f32>> = match (&entry.concat_mask, denoise_mask) {
        (Some(m), _) => {
            let (mb, mh, mw) = mask_dims(m)?;
            let r = resize_planes(&m.data, mb, (mh, mw), (h, w), Crop::Center)?;
            Some(resize_to_batch(&r, plane, b))
        }
        (None, Some(dm)) => {
            // Channel 0 of the prepared mask, already [b, c, h, w].
            Some(
                (0..b)
                    .flat_map(|i| dm[i * c * plane..i * c * plane + plane].iter().copied())
                    .collect(),
            )
        }
        (None, None) => None,
    };
    let (mask, image) = match mask {
        Some(m) => (m.iter().map(|&v| v.round_ties_even()).collect(), image),
        None => {
            // No mask anywhere: all of it is to be painted, over the latent
            // of a blank image.
            const BLANK: [f32; 4] = [0.8223, -0.6876, 0.6364, 0.1380];
            let blank = (0..b * c * plane)
                .map(|i| BLANK.get((i / plane) % c).copied().unwrap_or(1.0))
                .collect();
            (vec![1.0; b * plane], blank)
        }
    };
    let mut out = Vec::with_capacity(b * (1 + c) * plane);
    for i in 0..b {
        out.extend_from_slice(&mask[i * plane..(i + 1) * plane]);
        out.extend_from_slice(&image[i * c * plane..(i + 1) * c * plane]);
    }
    Ok(Some(out))
}

/// `[b, c, h, w]` of an entry's `concat_latent_image`, which must have the
/// latent's `c` channels.
fn concat_image_dims(img: &Tensor, c: usize) -> Result<[usize; 4], NodeError> {
    match img.shape[..] {
        [ib, ic, ih, iw] if ic == c => Ok([ib, ic, ih, iw]),
        [_, ic, _, _] => Err(NodeError::invalid(format!(
            "concat_latent_image has {ic} channels; the latent has {c}"
        ))),
        _ => Err(NodeError::invalid(
            "concat_latent_image is not [b, c, h, w]",
        )),
    }
}

/// `Flux.concat_cond`: the extra input channels of Flux Fill (the image
/// latent and the mask folded 8×8 into 64 channels) and of the
/// Canny/Depth models (the image latent alone), `[b, extra, h, w]`.
/// The image is the entry's `concat_latent_image` (zeros without one),
/// resized to the latent and then taken into model space; the mask is the
/// entry's `concat_mask`, else the sampler's, else ones, averaged over
/// channels and resized to 8× the latent (bilinear, centre), unrounded.
fn flux_concat(
    model: &Model,
    entry: &CondEntry,
    denoise_mask: Option<&[f32]>,
    [b, c, h, w]: [usize; 4],
) -> Result<Option<Vec<f32>>, NodeError> {
    let channels = model.in_channels();
    if channels <= c {
        return Ok(None);
    }
    let plane = h * w;
    let image: Vec<f32> = match &entry.concat_latent_image {
        Some(img) => {
            let [ib, ic, ih, iw] = concat_image_dims(img, c)?;
            let resized = resize_planes(&img.data, ib * ic, (ih, iw), (h, w), Crop::Center)?;
            resize_to_batch(&resized, c * plane, b)
        }
        None => vec![0.0; b * c * plane],
    };
    let image: Vec<f32> = image.iter().map(|&v| model.latent.process_in(v)).collect();
    if channels == 2 * c {
        return Ok(Some(image));
    }
    const FOLD: usize = 8;
    if channels != c + FOLD * FOLD + c {
        return Err(NodeError::invalid(format!(
            "the Flux model takes {} input channels; sdkit knows {c} (the latent), {} (plus an \
             image: Canny/Depth) and {} (plus an image and a mask: Fill)",
            channels,
            2 * c,
            2 * c + FOLD * FOLD
        )));
    }
    // The mask at full resolution [mb, 8h, 8w].
    let (mb, (mh, mw), data) = match (&entry.concat_mask, denoise_mask) {
        (Some(m), _) => {
            let (mb, mh, mw) = mask_dims(m)?;
            (mb, (mh, mw), m.data.clone())
        }
        (None, Some(dm)) => {
            // Mean over the prepared mask's channels.
            let mean = (0..b * plane)
                .map(|i| {
                    let (bi, p) = (i / plane, i % plane);
                    let sum: f32 = (0..c).map(|ch| dm[(bi * c + ch) * plane + p]).sum();
                    sum / c as f32
                })
                .collect();
            (b, (h, w), mean)
        }
        (None, None) => (b, (h, w), vec![1.0; b * plane]),
    };
    let (fh, fw) = (h * FOLD, w * FOLD);
    let full = resize_planes(&data, mb, (mh, mw), (fh, fw), Crop::Center)?;
    let mut folded = vec![0f32; mb * FOLD * FOLD * plane];
    for i in 0..mb {
        for y in 0..fh {
            for x in 0..fw {
                let ch = (y % FOLD) * FOLD + x % FOLD;
                folded[((i * FOLD * FOLD + ch) * h + y / FOLD) * w + x / FOLD] =
                    full[(i * fh + y) * fw + x];
            }
        }
    }
    let mask = resize_to_batch(&folded, FOLD * FOLD * plane, b);
    let mut out = Vec::with_capacity(b * (c + FOLD * FOLD) * plane);
    for i in 0..b {
        out.extend_from_slice(&image[i * c * plane..(i + 1) * c * plane]);
        out.extend_from_slice(&mask[i * FOLD * FOLD * plane..(i + 1) * FOLD * FOLD * plane]);
    }
    Ok(Some(out))
}

/// ComfyUI's SetLatentNoiseMask.
pub struct SetLatentNoiseMask;

impl NodeImpl for SetLatentNoiseMask {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let latent = inputs.latent("samples")?;
        let mask = inputs.mask("mask")?;
        let (mb, mh, mw) = mask_dims(mask)?;
        let noise_mask =
            Tensor::new(vec![mb, 1, mh, mw], mask.data.clone()).map_err(NodeError::invalid)?;
        Ok(NodeOutput::values(vec![Value::Latent(Arc::new(Latent {
            samples: latent.samples.clone(),
            batch_index: latent.batch_index.clone(),
            noise_mask: Some(noise_mask),
        }))]))
    }
}

/// The mask resized to the image `[mb, H, W]` and both cropped to the
/// `cell` (centred), with the greyed pixels: what both inpaint nodes
/// start from. Returns (pixels, mask, mask batch, h, w).
fn mask_and_grey(
    pixels: &Tensor,
    mask: &Tensor,
    cell: usize,
) -> Result<(Tensor, Vec<f32>, usize, usize, usize), NodeError> {
    let [b, ph, pw, pc] = pixels.shape[..] else {
        return Err(NodeError::invalid(format!(
            "pixels of shape {:?}: expected [batch, height, width, channels]",
            pixels.shape
        )));
    };
    if pc < 3 {
        return Err(NodeError::invalid("pixels need three colour channels"));
    }
    let (mb, mh, mw) = mask_dims(mask)?;
    if mb != 1 && mb != b {
        return Err(NodeError::invalid(format!(
            "a batch of {mb} masks for {b} images: give one mask, or one per image"
        )));
    }
    let full = resize_planes(&mask.data, mb, (mh, mw), (ph, pw), Crop::Disabled)?;
    let (h, w) = ((ph / cell) * cell, (pw / cell) * cell);
    if h == 0 || w == 0 {
        return Err(NodeError::invalid(format!(
            "a {pw}x{ph} image is smaller than the VAE's {cell}-pixel cell"
        )));
    }
    let (y0, x0) = ((ph % cell) / 2, (pw % cell) / 2);
    let mut m = Vec::with_capacity(mb * h * w);
    for i in 0..mb {
        for y in y0..y0 + h {
            let row = (i * ph + y) * pw;
            m.extend_from_slice(&full[row + x0..row + x0 + w]);
        }
    }
    let mut px = Vec::with_capacity(b * h * w * pc);
    for i in 0..b {
        let mi = if mb == 1 { 0 } else { i };
        for y in 0..h {
            for x in 0..w {
                let keep = 1.0 - m[(mi * h + y) * w + x].round_ties_even();
                let at = ((i * ph + y + y0) * pw + x + x0) * pc;
                for ch in 0..pc {
                    let v = pixels.data[at + ch];
                    px.push(if ch < 3 { (v - 0.5) * keep + 0.5 } else { v });
                }
            }
        }
    }
    let px = Tensor::new(vec![b, h, w, pc], px).map_err(NodeError::invalid)?;
    Ok((px, m, mb, h, w))
}

/// `clamp(conv2d(mask, ones(g, g), padding=ceil((g − 1)/2)), 0, 1)`, cut
/// to the mask's size and rounded: output (y, x) sums input rows
/// `y − p ..= y − p + g − 1` (for even g one more row after than before).
/// The rounded mask holds integers, so box sums from a summed-area table
/// (f64) are exact, as the convolution's are.
fn grow_mask(mask: &[f32], n: usize, h: usize, w: usize, g: usize) -> Vec<f32> {
    let pad = g / 2; // ceil((g − 1) / 2)
    let mut out = Vec::with_capacity(mask.len());
    let mut sat = vec![0f64; (h + 1) * (w + 1)];
    for i in 0..n {
        let plane = &mask[i * h * w..(i + 1) * h * w];
        for y in 0..h {
            let mut row = 0f64;
            for x in 0..w {
                row += f64::from(plane[y * w + x]);
                sat[(y + 1) * (w + 1) + x + 1] = sat[y * (w + 1) + x + 1] + row;
            }
        }
        for y in 0..h {
            let (y0, y1) = (y.saturating_sub(pad), (y + g - pad).min(h));
            for x in 0..w {
                let (x0, x1) = (x.saturating_sub(pad), (x + g - pad).min(w));
                let s = sat[y1 * (w + 1) + x1] - sat[y0 * (w + 1) + x1] - sat[y1 * (w + 1) + x0]
                    + sat[y0 * (w + 1) + x0];
                out.push(s.clamp(0.0, 1.0).round_ties_even() as f32);
            }
        }
    }
    out
}

/// ComfyUI's VAEEncodeForInpaint.
pub struct VaeEncodeForInpaint;

impl NodeImpl for VaeEncodeForInpaint {
    fn device_inputs(&self) -> &'static [&'static str] {
        &["vae"]
    }

    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let vae: Arc<Vae> = input(inputs, "vae", "VAE")?;
        let pixels = inputs.image("pixels")?;
        let mask = inputs.mask("mask")?;
        let grow = usize::try_from(inputs.int("grow_mask_by")?).unwrap_or(0);
        let (grey, m, mb, h, w) = mask_and_grey(pixels, mask, vae.downscale())?;
        let samples = vae.encode(ctx, &grey)?;
        // The rounded mask grown by a g×g box (conv2d with padding
        // ceil((g − 1)/2), cut to the image: for even g the window is
        // rows y − g/2 .. y + g/2 − 1), clamped to 1 and rounded.
        let rounded: Vec<f32> = m.iter().map(|&v| v.round_ties_even()).collect();
        let grown = if grow == 0 {
            rounded
        } else {
            grow_mask(&rounded, mb, h, w, grow)
        };
        let noise_mask = Tensor::new(vec![mb, 1, h, w], grown).map_err(NodeError::invalid)?;
        Ok(NodeOutput::values(vec![Value::Latent(Arc::new(Latent {
            samples,
            batch_index: None,
            noise_mask: Some(noise_mask),
        }))]))
    }
}

/// ComfyUI's InpaintModelConditioning.
pub struct InpaintModelConditioning;

impl NodeImpl for InpaintModelConditioning {
    fn device_inputs(&self) -> &'static [&'static str] {
        &["vae"]
    }

    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let vae: Arc<Vae> = input(inputs, "vae", "VAE")?;
        let pixels = inputs.image("pixels")?;
        let mask = inputs.mask("mask")?;
        // ComfyUI crops to 8 here whatever the VAE's cell.
        let (grey, m, mb, h, w) = mask_and_grey(pixels, mask, 8)?;
        let concat = Arc::new(vae.encode(ctx, &grey)?);
        let samples = vae.encode(ctx, pixels)?;
        let m = Arc::new(Tensor::new(vec![mb, 1, h, w], m).map_err(NodeError::invalid)?);
        let with = |name: &str| -> Result<Value, NodeError> {
            let c: Arc<Conditioning> = input(inputs, name, "CONDITIONING")?;
            let mut c = (*c).clone();
            for e in &mut c.0 {
                e.concat_latent_image = Some(Arc::clone(&concat));
                e.concat_mask = Some(Arc::clone(&m));
            }
            Ok(opaque(SocketType::Conditioning, c))
        };
        let noise_mask = if inputs.bool("noise_mask")? {
            Some((*m).clone())
        } else {
            None
        };
        Ok(NodeOutput::values(vec![
            with("positive")?,
            with("negative")?,
            Value::Latent(Arc::new(Latent {
                samples,
                batch_index: None,
                noise_mask,
            })),
        ]))
    }
}

/// ComfyUI's InstructPixToPixConditioning: the image's latent on every
/// entry of both conditionings as `concat_latent_image` (what Flux's
/// Canny/Depth models and InstructPix2Pix take as extra channels), and an
/// empty latent of its size to sample.
pub struct InstructPixToPixConditioning;

impl NodeImpl for InstructPixToPixConditioning {
    fn device_inputs(&self) -> &'static [&'static str] {
        &["vae"]
    }

    fn execute(&self, ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let vae: Arc<Vae> = input(inputs, "vae", "VAE")?;
        // ComfyUI crops to a multiple of 8, centred, before encoding; the
        // encoder crops to its cell the same way.
        let concat = Arc::new(vae.encode(ctx, inputs.image("pixels")?)?);
        let with = |name: &str| -> Result<Value, NodeError> {
            let c: Arc<Conditioning> = input(inputs, name, "CONDITIONING")?;
            let mut c = (*c).clone();
            for e in &mut c.0 {
                e.concat_latent_image = Some(Arc::clone(&concat));
            }
            Ok(opaque(SocketType::Conditioning, c))
        };
        let zeros = Tensor::new(concat.shape.clone(), vec![0.0; concat.numel()])
            .map_err(NodeError::invalid)?;
        Ok(NodeOutput::values(vec![
            with("positive")?,
            with("negative")?,
            Value::Latent(Arc::new(Latent {
                samples: zeros,
                batch_index: None,
                noise_mask: None,
            })),
        ]))
    }
}
