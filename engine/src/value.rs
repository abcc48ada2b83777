//! Values that flow along workflow links.

use sdkit_schema::SocketType;
use std::any::Any;
use std::fmt;
use std::sync::Arc;

/// A dense f32 host tensor, row-major.
///
/// Layouts follow ComfyUI so node maths can be checked against it directly:
/// IMAGE is `[batch, height, width, channels]` with values in 0..1, MASK is
/// `[batch, height, width]`, LATENT samples are `[batch, channels, h, w]`.
#[derive(Clone, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl Tensor {
    /// Builds a tensor; fails when the data length does not match the shape.
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Result<Self, String> {
        let n: usize = shape.iter().product();
        if n != data.len() {
            return Err(format!(
                "tensor shape {shape:?} needs {n} values, got {}",
                data.len()
            ));
        }
        Ok(Tensor { shape, data })
    }

    pub fn zeros(shape: Vec<usize>) -> Self {
        let n = shape.iter().product();
        Tensor {
            shape,
            data: vec![0.0; n],
        }
    }

    pub fn full(shape: Vec<usize>, v: f32) -> Self {
        let n = shape.iter().product();
        Tensor {
            shape,
            data: vec![v; n],
        }
    }

    /// Zeros of `shape`, or a node error naming the tensor as `kind`
    /// ("latent", "image") when the memory is not there.
    pub fn try_zeros(shape: Vec<usize>, kind: &str) -> Result<Self, crate::NodeError> {
        Self::try_full(shape, 0.0, kind)
    }

    /// `shape` filled with `v`, or a node error naming the tensor as `kind`
    /// when the memory is not there (see [`crate::memory`]).
    pub fn try_full(shape: Vec<usize>, v: f32, kind: &str) -> Result<Self, crate::NodeError> {
        Self::filled(shape, v, kind, None)
    }

    /// [`Tensor::try_zeros`] that stops with `Interrupted` when `cancel` is
    /// set: filling gigabytes takes seconds, and an interrupt should not
    /// wait for it.
    pub fn try_zeros_until(
        shape: Vec<usize>,
        kind: &str,
        cancel: &crate::CancelToken,
    ) -> Result<Self, crate::NodeError> {
        Self::filled(shape, 0.0, kind, Some(cancel))
    }

    fn filled(
        shape: Vec<usize>,
        v: f32,
        kind: &str,
        cancel: Option<&crate::CancelToken>,
    ) -> Result<Self, crate::NodeError> {
        /// Elements filled between two looks at the cancel flag (16 MB).
        const CHUNK: usize = 1 << 22;
        let oom = |bytes| crate::memory::AllocError { bytes }.for_tensor(kind, &shape);
        let n = shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .ok_or_else(|| oom(crate::memory::f32_bytes(&shape)))?;
        let mut data = crate::memory::try_with_capacity(n).map_err(|e| oom(e.bytes))?;
        while data.len() < n {
            if cancel.is_some_and(crate::CancelToken::is_cancelled) {
                return Err(crate::NodeError::Interrupted);
            }
            let end = (data.len() + CHUNK).min(n);
            data.resize(end, v);
        }
        Ok(Tensor { shape, data })
    }

    pub fn numel(&self) -> usize {
        self.data.len()
    }

    /// The size of a dimension, or 1 past the rank (so a MASK reads as a
    /// one-channel image).
    pub fn dim(&self, i: usize) -> usize {
        self.shape.get(i).copied().unwrap_or(1)
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor{:?}", self.shape)
    }
}

/// ComfyUI's LATENT dict: samples plus optional batch index and noise mask.
#[derive(Clone, Debug, PartialEq)]
pub struct Latent {
    pub samples: Tensor,
    pub batch_index: Option<Vec<i64>>,
    pub noise_mask: Option<Tensor>,
}

/// A value on a link. Cheap to clone: large payloads are shared.
#[derive(Clone)]
pub enum Value {
    Int(i128),
    Float(f64),
    String(String),
    Bool(bool),
    Image(Arc<Tensor>),
    Mask(Arc<Tensor>),
    Latent(Arc<Latent>),
    /// Model-side values (MODEL, CLIP, VAE, CONDITIONING, ...) owned by the
    /// node crates; the engine only passes them along.
    Opaque {
        ty: SocketType,
        value: Arc<dyn Any + Send + Sync>,
    },
}

impl Value {
    pub fn socket_type(&self) -> SocketType {
        match self {
            Value::Int(_) => SocketType::Int,
            Value::Float(_) => SocketType::Float,
            Value::String(_) => SocketType::String,
            Value::Bool(_) => SocketType::Boolean,
            Value::Image(_) => SocketType::Image,
            Value::Mask(_) => SocketType::Mask,
            Value::Latent(_) => SocketType::Latent,
            Value::Opaque { ty, .. } => ty.clone(),
        }
    }

    pub fn image(t: Tensor) -> Self {
        Value::Image(Arc::new(t))
    }

    pub fn mask(t: Tensor) -> Self {
        Value::Mask(Arc::new(t))
    }
}

impl fmt::Debug for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Int(v) => write!(f, "Int({v})"),
            Value::Float(v) => write!(f, "Float({v})"),
            Value::String(v) => write!(f, "String({v:?})"),
            Value::Bool(v) => write!(f, "Bool({v})"),
            Value::Image(t) => write!(f, "Image({:?})", t.shape),
            Value::Mask(t) => write!(f, "Mask({:?})", t.shape),
            Value::Latent(l) => write!(f, "Latent({:?})", l.samples.shape),
            Value::Opaque { ty, .. } => write!(f, "{ty}"),
        }
    }
}
