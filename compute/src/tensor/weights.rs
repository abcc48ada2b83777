//! The one way model builders name their weights: a [`Scope`] is a key
//! prefix within a graph (`model.diffusion_model.input_blocks.1.0.`), and
//! the layer helpers read a layer's `weight` and `bias` under it, so a
//! builder says `vb.pp("in_layers.2").conv2d(x, cin, cout, 3, 1)` and the
//! checkpoint's key layout is visible in one place. Shapes are the
//! checkpoint's (PyTorch's `[out, in, kh, kw]` for convs, `[out, in]` for
//! linears); a file whose tensor differs is reported by the binder.

use super::{Conv2dParams, GraphBuilder, ShapeError, T};
use std::fmt::Display;

type R<'a> = Result<T<'a>, ShapeError>;

/// A weight-name prefix within a graph (candle's `VarBuilder::pp`).
#[derive(Clone)]
pub struct Scope<'a> {
    g: &'a GraphBuilder,
    prefix: String,
}

impl<'a> Scope<'a> {
    /// Weights named `{prefix}{name}`; `prefix` is used as given (with its
    /// trailing `.`, or empty).
    pub fn new(g: &'a GraphBuilder, prefix: &str) -> Self {
        Scope {
            g,
            prefix: prefix.to_string(),
        }
    }

    /// The scope `{prefix}{name}.`.
    pub fn pp(&self, name: impl Display) -> Self {
        Scope {
            g: self.g,
            prefix: format!("{}{name}.", self.prefix),
        }
    }

    pub fn graph(&self) -> &'a GraphBuilder {
        self.g
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The weight `{prefix}{name}` of `shape`.
    pub fn get(&self, name: &str, shape: &[usize]) -> R<'a> {
        self.g.weight(&format!("{}{name}", self.prefix), shape)
    }

    /// A `k`×`k` convolution with bias, padding `k / 2` (every conv of the
    /// SD family): `weight` `[cout, cin, k, k]`, `bias` `[cout]`.
    pub fn conv2d(&self, x: T<'a>, cin: usize, cout: usize, k: usize, stride: usize) -> R<'a> {
        let p = Conv2dParams {
            stride: [stride; 2],
            padding: [k / 2; 2],
            dilation: [1; 2],
            groups: 1,
        };
        self.conv2d_with(x, cin, cout, k, p)
    }

    /// A `k`×`k` convolution with bias and explicit stride/padding.
    pub fn conv2d_with(
        &self,
        x: T<'a>,
        cin: usize,
        cout: usize,
        k: usize,
        p: Conv2dParams,
    ) -> R<'a> {
        let w = self.get("weight", &[cout, cin, k, k])?;
        let b = self.get("bias", &[cout])?;
        x.conv2d(w, Some(b), p)
    }

    /// `x · weightᵀ + bias`: `weight` `[cout, cin]`, `bias` `[cout]`.
    pub fn linear(&self, x: T<'a>, cin: usize, cout: usize) -> R<'a> {
        let w = self.get("weight", &[cout, cin])?;
        let b = self.get("bias", &[cout])?;
        x.linear(w, Some(b))
    }

    /// `x · weightᵀ`, for layers stored without a bias.
    pub fn linear_no_bias(&self, x: T<'a>, cin: usize, cout: usize) -> R<'a> {
        x.linear(self.get("weight", &[cout, cin])?, None)
    }

    /// GroupNorm with affine `weight`/`bias` `[c]`.
    pub fn group_norm(&self, x: T<'a>, groups: usize, c: usize, eps: f32) -> R<'a> {
        let w = self.get("weight", &[c])?;
        let b = self.get("bias", &[c])?;
        x.group_norm(groups, Some(w), Some(b), eps)
    }

    /// LayerNorm over the last dimension with affine `weight`/`bias` `[c]`.
    pub fn layer_norm(&self, x: T<'a>, c: usize, eps: f32) -> R<'a> {
        let w = self.get("weight", &[c])?;
        let b = self.get("bias", &[c])?;
        x.layer_norm(Some(w), Some(b), eps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_compose_key_names() {
        let g = GraphBuilder::new();
        let root = Scope::new(&g, "model.diffusion_model.");
        let s = root.pp("input_blocks").pp(1).pp("0.in_layers.2");
        assert_eq!(
            s.prefix(),
            "model.diffusion_model.input_blocks.1.0.in_layers.2."
        );
        let x = g.input("x", &[1, 4, 8, 8]).expect("input");
        let y = s.conv2d(x, 4, 8, 3, 2).expect("conv");
        assert_eq!(y.shape(), vec![1, 8, 4, 4]);
        let graph = g.finish(&[y]);
        let names: Vec<&str> = graph
            .inputs(crate::tensor::InputKind::Weight)
            .into_iter()
            .map(|(_, n, _)| n)
            .collect();
        assert_eq!(
            names,
            [
                "model.diffusion_model.input_blocks.1.0.in_layers.2.weight",
                "model.diffusion_model.input_blocks.1.0.in_layers.2.bias"
            ]
        );
    }
}
