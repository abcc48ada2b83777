//! Latent nodes that need no model.

use sdkit_engine::{Inputs, Latent, NodeContext, NodeError, NodeImpl, NodeOutput, Tensor, Value};
use std::sync::Arc;

/// ComfyUI's EmptyLatentImage: zeros of shape [batch, 4, height/8, width/8].
pub struct EmptyLatentImage;

impl NodeImpl for EmptyLatentImage {
    fn execute(&self, _ctx: &NodeContext, inputs: &Inputs) -> Result<NodeOutput, NodeError> {
        let w = inputs.usize("width")?;
        let h = inputs.usize("height")?;
        let b = inputs.usize("batch_size")?;
        let samples = Tensor::zeros(vec![b, 4, h / 8, w / 8]);
        Ok(NodeOutput::values(vec![Value::Latent(Arc::new(Latent {
            samples,
            batch_index: None,
            noise_mask: None,
        }))]))
    }
}
