//! The T5 tokenizer, behaving like ComfyUI's `T5XXLTokenizer`.
//!
//! ComfyUI tokenizes T5 prompts with `transformers`' `T5TokenizerFast`
//! over `comfy/text_encoders/t5_tokenizer/tokenizer.json`. transformers 5
//! rebuilds that file's pipeline: a SentencePiece Unigram model behind the
//! precompiled NFKC-style normalizer, text split at white space, and `▁`
//! prepended to every word (the file's own pre-tokenizer prepends it only
//! at the start of the text, so a word after a special token such as
//! `<extra_id_0>` would differ). `nodes/data/t5_tokenizer/tokenizer.json`
//! is that rebuilt pipeline as transformers serialises it; the
//! `tokenizers` crate runs it, so the ids are the library's own, special
//! tokens (`</s>`, `<extra_id_N>`, ...) included.
//!
//! Around it, `SDTokenizer.tokenize_with_weights` with T5's arguments: the
//! prompt's weights and `embedding:` words are parsed as for CLIP
//! ([`crate::clip_tokenizer::weighted_groups`]), each word is tokenized
//! alone with its `</s>` cut off, and everything goes in one batch (T5 has
//! no position limit): the tokens, `</s>` (1), then padding with `<pad>`
//! (0) up to the family's minimum length (Flux 256, SD3 77).

use std::sync::OnceLock;

use crate::clip_tokenizer::{chunk_with, weighted_groups, ChunkRules, WeightedChunk};

/// `</s>`: the end token.
pub const END: u32 = 1;
/// `<pad>`.
pub const PAD: u32 = 0;

const TOKENIZER_JSON: &[u8] = include_bytes!("../data/t5_tokenizer/tokenizer.json");

/// T5's SentencePiece tokenizer; see the [module docs](self).
pub struct T5Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl std::fmt::Debug for T5Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("T5Tokenizer")
    }
}

impl T5Tokenizer {
    /// The tokenizer ComfyUI ships, parsed once per process.
    pub fn shared() -> Result<&'static T5Tokenizer, String> {
        static TOK: OnceLock<Result<T5Tokenizer, String>> = OnceLock::new();
        TOK.get_or_init(|| {
            tokenizers::Tokenizer::from_bytes(TOKENIZER_JSON)
                .map(|inner| T5Tokenizer { inner })
                .map_err(|e| format!("the bundled T5 tokenizer.json does not load: {e}"))
        })
        .as_ref()
        .map_err(Clone::clone)
    }

    /// A word's ids as `tokenizer(word)["input_ids"][:-1]`: the library's
    /// encoding with its `</s>` cut off.
    pub fn encode(&self, word: &str) -> Vec<u32> {
        match self.inner.encode(word, true) {
            Ok(enc) => {
                let ids = enc.get_ids();
                ids[..ids.len().saturating_sub(1)].to_vec()
            }
            // The pipeline has no failing step for text (no truncation,
            // no padding); an error would be a library bug.
            Err(e) => {
                tracing::warn!("T5 tokenizer failed on {word:?}: {e}");
                Vec::new()
            }
        }
    }

    fn rules(padding: Padding) -> ChunkRules {
        ChunkRules {
            // ComfyUI's max_length=99999999: one batch whatever the length.
            max_length: usize::MAX / 2,
            start: None,
            end: Some(END),
            pad: PAD,
            pad_to_max: false,
            min_padding: padding.min_padding,
            min_length: Some(padding.min_length),
        }
    }

    /// `tokenize_with_weights` without an embedding folder: one batch of
    /// (id, weight), at least `min_length` long.
    pub fn tokenize_with_weights(&self, text: &str, min_length: usize) -> Vec<WeightedChunk> {
        let (groups, _) = weighted_groups(text, &|w| self.encode(w), None);
        chunk_with(groups, &Self::rules(Padding::min_length(min_length)))
    }

    /// The same with `embedding:NAME` words resolved (see
    /// [`crate::clip_tokenizer::ClipTokenizer::tokenize_with_embeddings`]).
    pub fn tokenize_with_embeddings(
        &self,
        text: &str,
        padding: Padding,
        resolve: &mut dyn FnMut(&str) -> Option<Vec<Vec<f32>>>,
    ) -> (Vec<WeightedChunk>, Vec<Vec<f32>>) {
        let (groups, table) = weighted_groups(text, &|w| self.encode(w), Some(resolve));
        (chunk_with(groups, &Self::rules(padding)), table)
    }
}

/// How a T5 batch is padded: `min_padding` pad tokens after `</s>`
/// (T5TokenizerOptions), then up to `min_length`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Padding {
    pub min_padding: Option<usize>,
    pub min_length: usize,
}

impl Padding {
    pub fn min_length(min_length: usize) -> Self {
        Padding {
            min_padding: None,
            min_length,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_as_the_library_gives_them() {
        let t = T5Tokenizer::shared().expect("tokenizer");
        // Ids from transformers' T5TokenizerFast on the same file.
        assert_eq!(t.encode("a cat"), vec![3, 9, 1712]);
        assert_eq!(t.encode("  a   cat "), vec![3, 9, 1712]);
        assert_eq!(
            t.encode("café naïve 東京"),
            vec![11949, 3, 29, 9, 2, 162, 3, 2]
        );
        assert_eq!(t.encode("hello<extra_id_0>x"), vec![21820, 32099, 3, 226]);
        assert_eq!(t.encode("A\n\nB"), vec![71, 272]);
        assert_eq!(
            t.encode("hello<extra_id_0>x  a   b "),
            vec![21820, 32099, 3, 226, 3, 9, 3, 115]
        );
        assert_eq!(t.encode(""), Vec::<u32>::new());
    }

    #[test]
    fn one_padded_batch() {
        let t = T5Tokenizer::shared().expect("tokenizer");
        let b = t.tokenize_with_weights("a (cat:1.5)", 8);
        assert_eq!(b.len(), 1);
        let ids: Vec<u32> = b[0].iter().map(|p| p.0).collect();
        assert_eq!(ids, vec![3, 9, 1712, END, PAD, PAD, PAD, PAD]);
        assert_eq!(b[0][2].1, 1.5);
        // Longer than the minimum: no padding, no cut.
        let long = "word ".repeat(300);
        let b = t.tokenize_with_weights(&long, 256);
        assert_eq!(b.len(), 1);
        assert_eq!(b[0].last().map(|p| p.0), Some(END));
        assert!(b[0].len() > 300);
    }
}
