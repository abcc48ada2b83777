//! Initial noise as ComfyUI makes it: `torch.randn` on the CPU generator
//! after `torch.manual_seed(seed)` (comfy.sample.prepare_noise), so the same
//! seed starts sampling from the same latent.
//!
//! A port of PyTorch's CPU generator: MT19937 seeded with the low 32 bits of
//! the seed, 24-bit uniforms for float tensors, and Box-Muller in blocks of
//! 16 (`normal_fill`) for tensors of 16 or more elements; smaller tensors
//! use the double-precision scalar path with its cached second sample.
//! PyTorch's vectorised build evaluates log/sin/cos with SLEEF, so values
//! can differ from it by an ulp or two (about 1e-7); the sequence and
//! layout are the same.

use sdkit_engine::memory::try_with_capacity;
use sdkit_engine::{CancelToken, NodeError};

/// MT19937, as PyTorch's `at::mt19937`.
pub struct Mt19937 {
    state: [u32; 624],
    index: usize,
    /// PyTorch caches the second Box-Muller sample of the double path.
    next_double_normal: Option<f64>,
}

impl Mt19937 {
    /// `torch.manual_seed(seed)`: only the low 32 bits are used.
    pub fn new(seed: u64) -> Self {
        let mut state = [0u32; 624];
        state[0] = seed as u32;
        for i in 1..624 {
            let prev = state[i - 1];
            state[i] = 1_812_433_253u32
                .wrapping_mul(prev ^ (prev >> 30))
                .wrapping_add(i as u32);
        }
        Mt19937 {
            state,
            index: 624,
            next_double_normal: None,
        }
    }

    fn twist(&mut self) {
        for i in 0..624 {
            let y = (self.state[i] & 0x8000_0000) | (self.state[(i + 1) % 624] & 0x7fff_ffff);
            let mut v = self.state[(i + 397) % 624] ^ (y >> 1);
            if y & 1 != 0 {
                v ^= 0x9908_b0df;
            }
            self.state[i] = v;
        }
        self.index = 0;
    }

    pub fn next_u32(&mut self) -> u32 {
        if self.index >= 624 {
            self.twist();
        }
        let mut y = self.state[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// PyTorch's `random64`: first draw in the high half.
    fn next_u64(&mut self) -> u64 {
        let hi = u64::from(self.next_u32());
        let lo = u64::from(self.next_u32());
        (hi << 32) | lo
    }

    /// `uniform_real_distribution<float>(0, 1)`: 24 random bits.
    fn uniform_f32(&mut self) -> f32 {
        (self.next_u32() & ((1 << 24) - 1)) as f32 * (1.0 / (1u32 << 24) as f32)
    }

    /// `uniform_real_distribution<double>(0, 1)`: 53 random bits.
    fn uniform_f64(&mut self) -> f64 {
        (self.next_u64() & ((1u64 << 53) - 1)) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// `normal_distribution<double>` with PyTorch's sample caching.
    fn normal_f64(&mut self) -> f64 {
        if let Some(v) = self.next_double_normal.take() {
            return v;
        }
        let u1 = self.uniform_f64();
        let u2 = self.uniform_f64();
        let r = (-2.0 * (-u2).ln_1p()).sqrt();
        let theta = 2.0 * std::f64::consts::PI * u1;
        self.next_double_normal = Some(r * theta.sin());
        r * theta.cos()
    }

    /// `torch.randn(n)` (float32) from this generator.
    pub fn randn(&mut self, n: usize) -> Vec<f32> {
        let mut data = Vec::with_capacity(n);
        self.fill_normal(&mut data, n, &|| false);
        data
    }

    /// [`Self::randn`] for sizes that come from a workflow: allocation
    /// failure and cancellation (checked every million values, so an
    /// interrupt is seen within milliseconds) become node errors.
    pub fn try_randn(&mut self, n: usize, cancel: &CancelToken) -> Result<Vec<f32>, NodeError> {
        let mut data = try_with_capacity(n).map_err(|e| NodeError::OutOfMemory {
            what: format!("noise of {n} values"),
            bytes: e.bytes,
            available: None,
        })?;
        if self.fill_normal(&mut data, n, &|| cancel.is_cancelled()) {
            Ok(data)
        } else {
            Err(NodeError::Interrupted)
        }
    }

    /// Appends `torch.randn(n)` to the empty `data`, which has room for
    /// it; false when `stop` said so before the end (the generator is then
    /// left mid-sequence).
    fn fill_normal(&mut self, data: &mut Vec<f32>, n: usize, stop: &dyn Fn() -> bool) -> bool {
        const CHUNK: usize = 1 << 20;
        if n < 16 {
            data.extend((0..n).map(|_| self.normal_f64() as f32));
            return true;
        }
        // Uniforms first, a chunk at a time (pages are touched only as
        // they are filled), then Box-Muller over whole blocks of 16.
        while data.len() < n {
            if stop() {
                return false;
            }
            let len = CHUNK.min(n - data.len());
            data.extend((0..len).map(|_| self.uniform_f32()));
        }
        // CHUNK is a multiple of 16, so blocks never straddle chunks.
        for (c, chunk) in data[..n - n % 16].chunks_mut(CHUNK).enumerate() {
            if c > 0 && stop() {
                return false;
            }
            for block in chunk.chunks_exact_mut(16) {
                box_muller_16(block);
            }
        }
        if !n.is_multiple_of(16) {
            // The tail is redrawn as a whole block of the last 16.
            let start = n - 16;
            for v in &mut data[start..] {
                *v = self.uniform_f32();
            }
            box_muller_16(&mut data[start..]);
        }
        true
    }
}

/// PyTorch's `normal_fill_16`, in f32.
fn box_muller_16(d: &mut [f32]) {
    for j in 0..8 {
        let u1 = 1.0 - d[j];
        let u2 = d[j + 8];
        let radius = (-2.0 * u1.ln()).sqrt();
        let theta = 2.0 * std::f32::consts::PI * u2;
        d[j] = radius * theta.cos();
        d[j + 8] = radius * theta.sin();
    }
}

/// ComfyUI's `prepare_noise` for a latent of `shape` without batch
/// indices: one `torch.randn(shape)` after seeding.
pub fn prepare_noise(
    seed: u64,
    shape: &[usize],
    cancel: &CancelToken,
) -> Result<Vec<f32>, NodeError> {
    Mt19937::new(seed).try_randn(shape.iter().product(), cancel)
}

/// ComfyUI's `prepare_noise` with batch indices (a latent from
/// LatentFromBatch/RepeatLatentBatch): one `torch.randn([1, ...])` per index
/// from 0 to the largest, in order from one generator, each sample taking
/// the noise of its index.
pub fn prepare_noise_indexed(
    seed: u64,
    shape: &[usize],
    indices: &[i64],
    cancel: &CancelToken,
) -> Result<Vec<f32>, NodeError> {
    let per: usize = shape.iter().skip(1).product();
    let max = indices.iter().copied().max().unwrap_or(-1);
    let mut gen = Mt19937::new(seed);
    let draws = (0..=max)
        .map(|_| gen.try_randn(per, cancel))
        .collect::<Result<Vec<_>, _>>()?;
    let mut out = try_with_capacity(per.saturating_mul(indices.len())).map_err(|e| {
        NodeError::OutOfMemory {
            what: format!("noise for {} latents", indices.len()),
            bytes: e.bytes,
            available: None,
        }
    })?;
    for &i in indices {
        match usize::try_from(i).ok().and_then(|i| draws.get(i)) {
            Some(d) => out.extend_from_slice(d),
            None => out.resize(out.len() + per, 0.0),
        }
    }
    Ok(out)
}
