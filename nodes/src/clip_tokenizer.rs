//! The SD1 CLIP tokenizer, behaving like ComfyUI's `SD1Tokenizer`.
//!
//! ComfyUI (`comfy/sd1_clip.py`) tokenizes prompts with `transformers`'
//! `CLIPTokenizer` loaded from `comfy/sd1_tokenizer` (the OpenAI CLIP
//! vocabulary and BPE merges, shipped here under `nodes/data/sd1_tokenizer`),
//! and wraps it in `SDTokenizer.tokenize_with_weights`, which parses prompt
//! weights and cuts the result into 77-token chunks.
//!
//! [`ClipTokenizer::encode`] reproduces the byte-level BPE tokenizer
//! (transformers 5, whose `CLIPTokenizer` is backed by the `tokenizers`
//! library; ftfy is never used):
//!
//! 1. the exact, case-sensitive string `<|endoftext|>` is cut out of the raw
//!    text as the special token 49407;
//! 2. every other piece is normalized: runs of Unicode white space become one
//!    space, then the text is lowercased (Unicode lowercase). NFC
//!    normalization is **not** applied (see "Known differences");
//!    `<|startoftext|>` in the normalized text (so in any letter case) is the
//!    special token 49406;
//! 3. the pre-tokenizer splits it like the regex
//!    `<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+`
//!    (white space between matches is dropped); the byte-level step then
//!    re-splits with GPT-2's regex, which only changes the
//!    `<|startoftext|>`/`<|endoftext|>` matches (into `<|`, word, `|>`);
//! 4. each piece is mapped byte by byte through GPT-2's byte-to-unicode table,
//!    its last symbol gets the `</w>` word-end marker, and BPE merges are
//!    applied by rank.
//!
//! [`ClipTokenizer::tokenize_with_weights`] reproduces
//! `SDTokenizer.tokenize_with_weights` with SD1 defaults (max length 77,
//! padding with the end token to the max length, no minimum length):
//! `\(` / `\)` escape literal parentheses; `(text)` multiplies the weight by
//! 1.1 per nesting level, `(text:1.3)` sets it (Python `float()` syntax; an
//! unparsable number leaves the ×1.1); square brackets are plain text (ComfyUI
//! gives them no meaning). Each weighted segment is tokenized as a whole (it is
//! only split before ` embedding:` / `\nembedding:`); a segment of 8 or more
//! tokens may be cut across chunks, a shorter one is moved whole to the next
//! chunk. Every chunk is `[bos, up to 75 tokens, eos, eos padding…]`, 77 long.
//!
//! Known differences from ComfyUI:
//! - the target is ComfyUI on transformers 5 (what a fresh install gets). On
//!   transformers 4 ComfyUI gets the slow Python `CLIPTokenizer`, which
//!   without ftfy cleans text with BERT's `BasicTokenizer` (drops control
//!   characters, puts each CJK ideograph in its own word, matches
//!   `<|endoftext|>` differently): ids differ there for such inputs;
//! - no NFC normalization: decomposed input (e.g. `e` + U+0301) tokenizes
//!   differently from ComfyUI, which composes it first;
//! - [`ClipTokenizer::tokenize_with_weights`] is ComfyUI's tokenizer without
//!   an embedding folder (`embedding:name` stays plain words);
//!   [`ClipTokenizer::tokenize_with_embeddings`] is the one CLIPTextEncode
//!   uses, with the folder;
//! - prompt weights written with non-ASCII digits (which Python's `float()`
//!   accepts) are not recognized;
//! - `\p{L}` comes from a Unicode 14 table, `\p{N}` from Rust's `char`; code
//!   points whose category changed in other Unicode versions may differ.

use std::collections::HashMap;

use thiserror::Error;

/// Start-of-text token id (`<|startoftext|>`).
pub const BOS: u32 = 49406;
/// One 77-token chunk of (token id, weight).
pub type WeightedChunk = Vec<(u32, f32)>;

/// The first id of embedding vectors in a tokenized prompt: id
/// `EMBED_BASE + i` is row `i` of the prompt's embedding table (real
/// vocabularies are far smaller).
pub const EMBED_BASE: u32 = 0x8000_0000;

/// End-of-text token id (`<|endoftext|>`), also used as padding.
pub const EOS: u32 = 49407;
/// Token count of one chunk, bos and eos included.
pub const MAX_LENGTH: usize = 77;
/// A weighted segment with at least this many tokens may be split across chunks.
const MAX_WORD_LENGTH: usize = 8;

const SD1_VOCAB: &str = include_str!("../data/sd1_tokenizer/vocab.json");
const SD1_MERGES: &str = include_str!("../data/sd1_tokenizer/merges.txt");
const LETTER_RANGES: &str = include_str!("../data/sd1_tokenizer/letter_ranges.txt");

const START_TEXT: &str = "<|startoftext|>";
const END_TEXT: &str = "<|endoftext|>";
const END_OF_WORD: &str = "</w>";

/// Errors while loading tokenizer data.
#[derive(Debug, Error)]
pub enum TokenizerError {
    /// vocab.json is not a JSON object of string to id.
    #[error("invalid vocab.json: {0}")]
    Vocab(#[from] serde_json::Error),
    /// A merges.txt line is not two space-separated symbols.
    #[error("invalid merges.txt line {line}: {text:?}")]
    Merges { line: usize, text: String },
    /// The letter table is malformed.
    #[error("invalid letter table line {0:?}")]
    Letters(String),
    /// A token the tokenizer needs is not in the vocabulary.
    #[error("token {0:?} missing from vocab.json")]
    MissingToken(String),
}

/// A byte-level BPE CLIP tokenizer; see the [module docs](self).
#[derive(Debug, Clone)]
pub struct ClipTokenizer {
    vocab: HashMap<String, u32>,
    /// (left id, right id) -> (rank, merged id).
    merges: HashMap<(u32, u32), (u32, u32)>,
    /// Token id of each byte's symbol, and of the symbol with `</w>`.
    byte_ids: [u32; 256],
    byte_end_ids: [u32; 256],
    /// Sorted inclusive ranges of `\p{L}` code points.
    letters: Vec<(u32, u32)>,
}

/// GPT-2's reversible byte -> printable char table.
fn bytes_to_unicode() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut extra = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let cp = if printable {
            u32::from(b)
        } else {
            extra += 1;
            255 + extra
        };
        table[usize::from(b)] = char::from_u32(cp).unwrap_or('\u{FFFD}');
    }
    table
}

impl ClipTokenizer {
    /// The SD1 (CLIP ViT-L/14) tokenizer from the data shipped in the crate.
    pub fn sd1() -> Result<Self, TokenizerError> {
        Self::from_data(SD1_VOCAB, SD1_MERGES)
    }

    /// A tokenizer from the text of a `vocab.json` and a `merges.txt`
    /// (first line `#version...` skipped).
    pub fn from_data(vocab_json: &str, merges_txt: &str) -> Result<Self, TokenizerError> {
        let vocab: HashMap<String, u32> = serde_json::from_str(vocab_json)?;
        let byte_chars = bytes_to_unicode();
        let lookup = |s: &str| {
            vocab
                .get(s)
                .copied()
                .ok_or_else(|| TokenizerError::MissingToken(s.to_string()))
        };
        let mut byte_ids = [0u32; 256];
        let mut byte_end_ids = [0u32; 256];
        for (i, c) in byte_chars.iter().enumerate() {
            byte_ids[i] = lookup(&c.to_string())?;
            byte_end_ids[i] = lookup(&format!("{c}{END_OF_WORD}"))?;
        }
        lookup(START_TEXT)?;
        lookup(END_TEXT)?;

        let mut merges = HashMap::new();
        let mut rank = 0u32;
        for (n, line) in merges_txt.lines().enumerate() {
            if (n == 0 && line.starts_with("#version")) || line.trim().is_empty() {
                continue;
            }
            let bad = || TokenizerError::Merges {
                line: n + 1,
                text: line.to_string(),
            };
            let (a, b) = line.split_once(' ').ok_or_else(bad)?;
            if b.contains(' ') {
                return Err(bad());
            }
            if let (Some(&ia), Some(&ib), Some(&im)) =
                (vocab.get(a), vocab.get(b), vocab.get(&format!("{a}{b}")))
            {
                merges.entry((ia, ib)).or_insert((rank, im));
            }
            rank += 1;
        }

        let mut letters = Vec::new();
        for line in LETTER_RANGES.lines() {
            if line.starts_with('#') || line.trim().is_empty() {
                continue;
            }
            let bad = || TokenizerError::Letters(line.to_string());
            let (a, b) = line.split_once(' ').ok_or_else(bad)?;
            let a = u32::from_str_radix(a, 16).map_err(|_| bad())?;
            let b = u32::from_str_radix(b, 16).map_err(|_| bad())?;
            letters.push((a, b));
        }
        letters.sort_unstable();

        Ok(Self {
            vocab,
            merges,
            byte_ids,
            byte_end_ids,
            letters,
        })
    }

    /// The id of a vocabulary entry (e.g. `"cat</w>"`).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.vocab.get(token).copied()
    }

    fn is_letter(&self, c: char) -> bool {
        let cp = u32::from(c);
        let i = self.letters.partition_point(|&(start, _)| start <= cp);
        i > 0 && self.letters[i - 1].1 >= cp
    }

    /// Plain BPE token ids of `text`, without the start and end tokens
    /// (`CLIPTokenizer(text)["input_ids"][1:-1]`).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        // `<|endoftext|>` is a raw-text special token: cut out before
        // normalization, so it is case-sensitive.
        for (n, raw) in text.split(END_TEXT).enumerate() {
            if n > 0 {
                out.push(EOS);
            }
            if raw.is_empty() {
                continue;
            }
            // `<|startoftext|>` is a normalized special token: matched in
            // the normalized (lowercased) text.
            let normalized = normalize(raw);
            for (m, piece) in normalized.split(START_TEXT).enumerate() {
                if m > 0 {
                    out.push(BOS);
                }
                for word in self.pre_tokenize(piece) {
                    self.bpe(word, &mut out);
                }
            }
        }
        out
    }

    /// Split like the CLIP pre-tokenizer regex (leftmost-first alternation).
    fn pre_tokenize<'a>(&self, s: &'a str) -> Vec<&'a str> {
        let mut pieces = Vec::new();
        let mut i = 0;
        while let Some(c) = s[i..].chars().next() {
            let rest = &s[i..];
            let len = if c.is_whitespace() {
                i += c.len_utf8();
                continue;
            } else if let Some(special) = [START_TEXT, END_TEXT]
                .into_iter()
                .find(|t| rest.starts_with(t))
            {
                // Matched whole by the split regex, then re-split by the
                // byte-level pre-tokenizer's GPT-2 regex into `<|`, the word
                // and `|>`: never the special token itself.
                let n = special.len();
                pieces.extend([&rest[..2], &rest[2..n - 2], &rest[n - 2..n]]);
                i += n;
                continue;
            } else if let Some(n) = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d"]
                .iter()
                .find(|p| rest.starts_with(*p))
                .map(|p| p.len())
            {
                n
            } else if self.is_letter(c) {
                rest.char_indices()
                    .find(|&(_, ch)| !self.is_letter(ch))
                    .map_or(rest.len(), |(at, _)| at)
            } else if c.is_numeric() {
                c.len_utf8()
            } else {
                rest.char_indices()
                    .find(|&(_, ch)| ch.is_whitespace() || ch.is_numeric() || self.is_letter(ch))
                    .map_or(rest.len(), |(at, _)| at)
            };
            pieces.push(&rest[..len]);
            i += len;
        }
        pieces
    }

    /// Byte-level BPE of one pre-token, with the `</w>` marker on its end.
    fn bpe(&self, piece: &str, out: &mut Vec<u32>) {
        let bytes = piece.as_bytes();
        let Some((&last, init)) = bytes.split_last() else {
            return;
        };
        let mut symbols: Vec<u32> = init
            .iter()
            .map(|&b| self.byte_ids[usize::from(b)])
            .collect();
        symbols.push(self.byte_end_ids[usize::from(last)]);
        loop {
            let best = symbols
                .windows(2)
                .filter_map(|w| {
                    self.merges
                        .get(&(w[0], w[1]))
                        .map(|&(r, _)| (r, w[0], w[1]))
                })
                .min_by_key(|&(r, _, _)| r);
            let Some((_, a, b)) = best else {
                break;
            };
            let Some(&(_, merged)) = self.merges.get(&(a, b)) else {
                break;
            };
            let mut next = Vec::with_capacity(symbols.len());
            let mut k = 0;
            while k < symbols.len() {
                if k + 1 < symbols.len() && symbols[k] == a && symbols[k + 1] == b {
                    next.push(merged);
                    k += 2;
                } else {
                    next.push(symbols[k]);
                    k += 1;
                }
            }
            symbols = next;
        }
        out.extend_from_slice(&symbols);
    }

    /// ComfyUI's `SDTokenizer.tokenize_with_weights` for SD1: chunks of 77
    /// `(token id, weight)` pairs, each `[bos, ≤75 tokens, eos, eos…]`.
    /// There is always at least one chunk.
    pub fn tokenize_with_weights(&self, text: &str) -> Vec<Vec<(u32, f32)>> {
        self.tokenize_with_weights_padded(text, EOS)
    }

    /// [`Self::tokenize_with_weights`] padding with `pad` after each
    /// chunk's end token (OpenCLIP's tokenizers in SD 2.x and SDXL pad with
    /// 0: `pad_with_end=False`).
    pub fn tokenize_with_weights_padded(&self, text: &str, pad: u32) -> Vec<Vec<(u32, f32)>> {
        let (groups, _) = weighted_groups(text, &|w| self.encode(w), None);
        self.chunk(groups, pad)
    }

    /// [`Self::tokenize_with_weights_padded`] with textual-inversion
    /// embeddings, as ComfyUI's tokenizer with an embedding folder:
    /// a word `embedding:NAME…` (split off before ` embedding:` and
    /// `\nembedding:`) asks `resolve` for NAME's vectors (the name is the
    /// first whitespace-separated part; failing that, the same without
    /// trailing commas, which go back into the text). Found vectors take
    /// one token position each, as ids [`EMBED_BASE`] + their index in the
    /// returned table; a missing embedding is dropped (`resolve` warns);
    /// what follows the name is tokenized as text.
    pub fn tokenize_with_embeddings(
        &self,
        text: &str,
        pad: u32,
        resolve: &mut dyn FnMut(&str) -> Option<Vec<Vec<f32>>>,
    ) -> (Vec<WeightedChunk>, Vec<Vec<f32>>) {
        let (groups, table) = weighted_groups(text, &|w| self.encode(w), Some(resolve));
        (self.chunk(groups, pad), table)
    }

    /// Packs weighted token groups into 77-token chunks (the second half of
    /// `tokenize_with_weights`).
    fn chunk(&self, groups: Vec<(Vec<u32>, f64)>, pad: u32) -> Vec<Vec<(u32, f32)>> {
        let rules = ChunkRules {
            max_length: MAX_LENGTH,
            start: Some(BOS),
            end: Some(EOS),
            pad,
            pad_to_max: true,
            min_padding: None,
            min_length: None,
        };
        chunk_with(groups, &rules)
    }
}

/// The first half of ComfyUI's `SDTokenizer.tokenize_with_weights`, for
/// any word tokenizer: the prompt's weighted segments, each split before
/// ` embedding:` / `\nembedding:`, as token groups. A word
/// `embedding:NAME…` asks `resolve` for NAME's vectors (the name is the
/// first whitespace-separated part; failing that, the same without
/// trailing commas, which go back into the text). Found vectors take one
/// token position each, as ids [`EMBED_BASE`] + their index in the returned
/// table; a missing embedding is dropped (`resolve` warns); what follows
/// the name is tokenized as text. Without `resolve` (ComfyUI without an
/// embedding folder) such words stay text. `encode` gives a word's ids
/// without start or end tokens.
pub(crate) fn weighted_groups(
    text: &str,
    encode: &dyn Fn(&str) -> Vec<u32>,
    mut resolve: Option<&mut Resolver<'_>>,
) -> (Vec<TokenGroup>, Vec<Vec<f32>>) {
    const ID: &str = "embedding:";
    let escaped = escape_important(text);
    let mut groups: Vec<(Vec<u32>, f64)> = Vec::new();
    let mut table: Vec<Vec<f32>> = Vec::new();
    for (segment, weight) in token_weights(&escaped) {
        let segment = unescape_important(&segment);
        for word in split_embeddings(&segment) {
            if word.is_empty() {
                continue;
            }
            let mut word = word.to_string();
            if let (Some(rest), Some(resolve)) = (word.strip_prefix(ID), resolve.as_mut()) {
                let rest = rest.trim_matches('\n');
                let mut parts = rest.split_whitespace();
                let name = parts.next().unwrap_or("").to_string();
                let mut leftover = parts.collect::<Vec<_>>().join(" ");
                let mut found = resolve(&name);
                if found.is_none() {
                    let stripped = name.trim_matches(',');
                    if stripped.len() < name.len() {
                        found = resolve(stripped);
                        // Python's name[len(stripped):], in characters.
                        let tail: String = name.chars().skip(stripped.chars().count()).collect();
                        leftover = format!("{tail} {leftover}");
                    }
                }
                if let Some(vectors) = found {
                    let ids = vectors
                        .into_iter()
                        .map(|v| {
                            table.push(v);
                            EMBED_BASE + (table.len() - 1) as u32
                        })
                        .collect();
                    groups.push((ids, weight));
                }
                if leftover.is_empty() {
                    continue;
                }
                word = leftover;
            }
            groups.push((encode(&word), weight));
        }
    }
    (groups, table)
}

/// Looks up an embedding's vectors by name.
pub(crate) type Resolver<'a> = dyn FnMut(&str) -> Option<Vec<Vec<f32>>> + 'a;

/// A word's token ids and its prompt weight.
pub(crate) type TokenGroup = (Vec<u32>, f64);

/// How a tokenizer lays out its batches (`SDTokenizer`'s arguments).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ChunkRules {
    /// Tokens per batch, start and end included.
    pub max_length: usize,
    pub start: Option<u32>,
    pub end: Option<u32>,
    pub pad: u32,
    /// Pad every batch to `max_length` (CLIP); T5 pads only the last to
    /// `min_length`.
    pub pad_to_max: bool,
    /// Padding tokens always appended after the end token.
    pub min_padding: Option<usize>,
    pub min_length: Option<usize>,
}

/// The second half of `tokenize_with_weights`: packs weighted token
/// groups into batches. A group of [`MAX_WORD_LENGTH`] or more tokens may
/// be cut across batches, a shorter one moves whole to the next batch.
/// There is always at least one batch.
pub(crate) fn chunk_with(groups: Vec<(Vec<u32>, f64)>, r: &ChunkRules) -> Vec<WeightedChunk> {
    let has_end = usize::from(r.end.is_some());
    let fresh = || -> WeightedChunk { r.start.map(|s| (s, 1.0)).into_iter().collect() };
    let mut chunks: Vec<WeightedChunk> = Vec::new();
    let mut batch = fresh();
    for (ids, weight) in groups {
        let w = weight as f32;
        let is_large = ids.len() >= MAX_WORD_LENGTH;
        let mut group: &[u32] = &ids;
        while !group.is_empty() {
            if group.len() + batch.len() > r.max_length - has_end {
                let remaining = (r.max_length - has_end).saturating_sub(batch.len());
                if is_large {
                    let take = remaining.min(group.len());
                    batch.extend(group[..take].iter().map(|&t| (t, w)));
                    batch.extend(r.end.map(|e| (e, 1.0)));
                    group = &group[take..];
                } else {
                    batch.extend(r.end.map(|e| (e, 1.0)));
                    if r.pad_to_max {
                        batch.extend(std::iter::repeat_n((r.pad, 1.0), remaining));
                    }
                }
                chunks.push(std::mem::replace(&mut batch, fresh()));
            } else {
                batch.extend(group.iter().map(|&t| (t, w)));
                group = &[];
            }
        }
    }
    batch.extend(r.end.map(|e| (e, 1.0)));
    if let Some(n) = r.min_padding {
        batch.extend(std::iter::repeat_n((r.pad, 1.0), n));
    }
    if r.pad_to_max && batch.len() < r.max_length {
        batch.resize(r.max_length, (r.pad, 1.0));
    }
    if let Some(min) = r.min_length {
        if batch.len() < min {
            batch.resize(min, (r.pad, 1.0));
        }
    }
    chunks.push(batch);
    chunks
}

/// The normalizer: runs of white space become one space, then lowercase.
fn normalize(text: &str) -> String {
    let mut collapsed = String::with_capacity(text.len());
    let mut in_space = false;
    for c in text.chars() {
        if c.is_whitespace() {
            if !in_space {
                collapsed.push(' ');
            }
            in_space = true;
        } else {
            collapsed.push(c);
            in_space = false;
        }
    }
    collapsed.to_lowercase()
}

/// `escape_important`: `\)` and `\(` become placeholders the parser ignores.
fn escape_important(text: &str) -> String {
    text.replace("\\)", "\0\u{1}").replace("\\(", "\0\u{2}")
}

/// `unescape_important`: placeholders back to literal parentheses.
fn unescape_important(text: &str) -> String {
    text.replace("\0\u{1}", ")").replace("\0\u{2}", "(")
}

/// `parse_parentheses`: split into top-level `(...)` groups and plain text.
fn parse_parentheses(s: &str) -> Vec<String> {
    let mut result = Vec::new();
    let mut current = String::new();
    let mut nesting: i64 = 0;
    for c in s.chars() {
        match c {
            '(' => {
                if nesting == 0 {
                    if !current.is_empty() {
                        result.push(std::mem::take(&mut current));
                    }
                    current = String::from("(");
                } else {
                    current.push(c);
                }
                nesting += 1;
            }
            ')' => {
                nesting -= 1;
                if nesting == 0 {
                    current.push(')');
                    result.push(std::mem::take(&mut current));
                } else {
                    current.push(c);
                }
            }
            _ => current.push(c),
        }
    }
    if !current.is_empty() {
        result.push(current);
    }
    result
}

/// `token_weights(text, 1.0)`, iteratively (no recursion depth limit).
fn token_weights(text: &str) -> Vec<(String, f64)> {
    let mut out = Vec::new();
    // Work stack of (text, weight, is_group_to_parse); processed in order.
    let mut stack: Vec<(String, f64, bool)> = vec![(text.to_string(), 1.0, true)];
    while let Some((item, weight, parse)) = stack.pop() {
        if !parse {
            out.push((item, weight));
            continue;
        }
        let parts = parse_parentheses(&item);
        for x in parts.into_iter().rev() {
            if x.chars().count() >= 2 && x.starts_with('(') && x.ends_with(')') {
                let inner = &x[1..x.len() - 1];
                let mut w = weight * 1.1;
                let mut inner_text = inner;
                if let Some(at) = inner.rfind(':') {
                    if at > 0 {
                        if let Some(v) = py_float(&inner[at + 1..]) {
                            w = v;
                            inner_text = &inner[..at];
                        }
                    }
                }
                stack.push((inner_text.to_string(), w, true));
            } else {
                stack.push((x, weight, false));
            }
        }
    }
    out
}

/// Python's `float(str)` for ASCII numbers: surrounding white space, `_`
/// between digits, `inf`/`nan`.
fn py_float(s: &str) -> Option<f64> {
    let t = s.trim_matches(|c: char| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c));
    let bytes = t.as_bytes();
    let mut cleaned = String::with_capacity(t.len());
    for (i, &b) in bytes.iter().enumerate() {
        if b == b'_' {
            let before = i > 0 && bytes[i - 1].is_ascii_digit();
            let after = bytes.get(i + 1).is_some_and(|n| n.is_ascii_digit());
            if !(before && after) {
                return None;
            }
        } else {
            cleaned.push(char::from(b));
        }
    }
    if !t.is_ascii() {
        return None;
    }
    cleaned.parse::<f64>().ok()
}

/// `re.split(' embedding:|\nembedding:', text)` with `embedding:` put back
/// on every piece after the first.
fn split_embeddings(text: &str) -> Vec<&str> {
    const ID: &str = "embedding:";
    let mut pieces = Vec::new();
    let mut start = 0;
    let mut search = 0;
    while let Some(found) = text[search..].find(ID) {
        let at = search + found;
        // The separator (one space or newline) must lie after the last cut.
        if at > start && matches!(text.as_bytes()[at - 1], b' ' | b'\n') {
            pieces.push(&text[start..at - 1]);
            start = at;
        }
        search = at + ID.len();
    }
    pieces.push(&text[start..]);
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_float() {
        assert_eq!(py_float(" 1.25 "), Some(1.25));
        assert_eq!(py_float("1_0"), Some(10.0));
        assert_eq!(py_float("1__0"), None);
        assert_eq!(py_float("_1"), None);
        assert_eq!(py_float("-.5"), Some(-0.5));
        assert_eq!(py_float(""), None);
        assert_eq!(py_float("abc"), None);
    }

    #[test]
    fn embedding_split() {
        assert_eq!(
            split_embeddings("a embedding:foo b\nembedding:x"),
            vec!["a", "embedding:foo b", "embedding:x"]
        );
        assert_eq!(split_embeddings("embedding:x"), vec!["embedding:x"]);
        assert_eq!(split_embeddings(" embedding:x"), vec!["", "embedding:x"]);
    }
}
