//! Model families: detection from checkpoint keys and shapes now; model
//! builders (CLIP, UNet, VAE as tensor graphs) join here.

pub mod clip;
pub mod detect;
pub mod family;
pub mod open_clip;
pub mod unet;
pub mod vae;
