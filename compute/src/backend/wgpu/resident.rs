//! Weights kept on the device between prepares: the cache of resident
//! buffers, their keys, and the bytes a weight is stored as.

use super::*;

/// Weight buffers kept across prepares (the next sampler run, the next
/// model use, the next prompt), keyed by name and host data (see
/// [`resident_key`]) and holding that data alive, so the same data is
/// never uploaded twice; a key whose data nobody else holds any more (its
/// model is gone) is dropped.
/// `state` mirrors them for the residency policy
/// ([`schedule::DeviceWeights::step`]), which decides what to evict
/// using the run's use schedule.
#[derive(Default)]
pub(super) struct Resident {
    pub(super) buffers: HashMap<String, ResidentWeight>,
    pub(super) state: schedule::DeviceWeights,
    pub(super) schedule: schedule::UseSchedule,
    /// The schedule position of the model use now running.
    pub(super) at: Option<usize>,
}

impl Resident {
    pub(super) fn remove(&mut self, name: &str) {
        self.buffers.remove(name);
        self.state.forget(name);
    }

    /// Drops every kept weight `drop` picks.
    pub(super) fn remove_where(&mut self, drop: impl Fn(&ResidentWeight) -> bool) {
        let keys: Vec<String> = self
            .buffers
            .iter()
            .filter(|(_, r)| drop(r))
            .map(|(k, _)| k.clone())
            .collect();
        for k in keys {
            self.remove(&k);
        }
    }
}

pub(super) struct ResidentWeight {
    pub(super) source: Source,
    pub(super) buffer: Arc<wgpu::Buffer>,
}

/// Where a resident weight's host data lives, to tell when its model is
/// gone: an f32 vector nobody else holds, or a file no store maps any more.
pub(super) enum Source {
    Host(Arc<Vec<f32>>),
    File(std::sync::Weak<crate::weights::SafeTensors>),
}

impl Source {
    pub(super) fn of(bind: &Bindings, name: &str) -> Result<Self, BindError> {
        if let Some(d) = bind.weights.get(name) {
            return Ok(Source::Host(Arc::clone(d)));
        }
        let w = bind
            .stored
            .get(name)
            .ok_or_else(|| BindError::MissingWeight(name.to_string()))?;
        Ok(Source::File(Arc::downgrade(w.file())))
    }

    pub(super) fn orphaned(&self) -> bool {
        match self {
            Source::Host(d) => Arc::strong_count(d) == 1,
            Source::File(f) => f.strong_count() == 0,
        }
    }
}

/// A weight's bytes as the device stores it (f16 or f32, in `layout`'s
/// order; a quantized one's blocks as the file holds them, padded to
/// words): from the bound vector, or from the file. A stored weight in
/// its natural order is decoded a chunk at a time (whole storage units:
/// a GGUF weight's quant blocks), so no f32 copy of it exists on the
/// host; a relaid-out one is read whole, encoded and dropped.
pub(super) fn device_bytes(
    bind: &Bindings,
    name: &str,
    layout: Option<&(usize, usize)>,
    half: bool,
    quantized: bool,
) -> Result<Vec<u8>, WgpuError> {
    if let Some(d) = bind.weights.get(name) {
        return Ok(encode(&device_order(d, layout), half));
    }
    let w = bind
        .stored
        .get(name)
        .ok_or_else(|| BindError::MissingWeight(name.to_string()))?;
    let err = |e: crate::weights::WeightError| WgpuError::Weight(format!("weight \"{name}\": {e}"));
    if quantized {
        let mut bytes = w.file().raw(w.key()).map_err(err)?.to_vec();
        bytes.resize(bytes.len().div_ceil(4) * 4, 0);
        return Ok(bytes);
    }
    if layout.is_some() {
        let data = w.to_f32().map_err(err)?;
        return Ok(encode(&device_order(&data, layout), half));
    }
    // About a million elements per chunk, in whole storage units.
    let (per, _) = w.dtype().block();
    let chunk = ((1 << 20) / per).max(1) * per;
    let mut bytes = Vec::with_capacity(w.len() * if half { 2 } else { 4 } + 2);
    let mut start = 0;
    while start < w.len() {
        let len = chunk.min(w.len() - start);
        let part = w.range_f32(start, len).map_err(err)?;
        bytes.extend(encode(&part, half));
        // encode pads an odd count of halves; only the last chunk can be odd.
        start += len;
    }
    bytes.resize(bytes.len().div_ceil(4) * 4, 0);
    Ok(bytes)
}

/// Elements bound for `name`.
pub(super) fn bound_len(bind: &Bindings, name: &str) -> Result<usize, BindError> {
    match (bind.weights.get(name), bind.stored.get(name)) {
        (Some(d), _) => Ok(d.len()),
        (None, Some(w)) => Ok(w.len()),
        (None, None) => Err(BindError::MissingWeight(name.to_string())),
    }
}

/// A resident weight's identity: its name and where its data comes from
/// (the bound vector, or the file and tensor), so two checkpoints with the
/// same tensor names stay apart, and the form the device holds it in
/// (tap-major for a conv weight, see [`codegen::conv_taps_first`]; a
/// GGUF weight's blocks).
pub(super) fn resident_key(
    name: &str,
    bind: &Bindings,
    taps_first: bool,
    quantized: bool,
) -> Result<String, BindError> {
    let layout = match (taps_first, quantized) {
        (true, _) => "/taps",
        (false, true) => "/quant",
        (false, false) => "",
    };
    if let Some(d) = bind.weights.get(name) {
        return Ok(format!("{name}#{:x}{layout}", Arc::as_ptr(d) as usize));
    }
    let w = bind
        .stored
        .get(name)
        .ok_or_else(|| BindError::MissingWeight(name.to_string()))?;
    let cast = w.cast().map_or("", |d| d.name());
    Ok(format!(
        "{name}#{:x}:{}{cast}{layout}",
        Arc::as_ptr(w.file()) as usize,
        w.key()
    ))
}

/// Weight name → (elements per output channel, taps) of the tap-major
/// conv weights.
pub(super) type TapsFirst = HashMap<String, (usize, usize)>;

/// `data` in the order the device stores it: tap-major where `layout`
/// says so.
pub(super) fn device_order<'d>(
    data: &'d [f32],
    layout: Option<&(usize, usize)>,
) -> std::borrow::Cow<'d, [f32]> {
    match layout {
        Some(&(per_out, taps)) => codegen::taps_first_layout(data, per_out, taps).into(),
        None => data.into(),
    }
}
