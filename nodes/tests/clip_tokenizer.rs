//! The SD1 CLIP tokenizer against fixtures made by ComfyUI's own code
//! (`tools/reference/clip_tokenizer.py`: `comfy/sd1_clip.py` on transformers'
//! `CLIPTokenizer`), plus robustness checks.

use sdkit_nodes::clip_tokenizer::{ClipTokenizer, BOS, EOS, MAX_LENGTH};
use serde_json::Value;

const FIXTURE: &str = include_str!("fixtures/clip_tokenizer/expected.json");

fn tokenizer() -> ClipTokenizer {
    ClipTokenizer::sd1().expect("shipped tokenizer data loads")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| u32::try_from(x.as_u64().expect("id")).expect("u32 id"))
        .collect()
}

#[test]
fn matches_comfyui_fixtures() {
    let tok = tokenizer();
    let fixture: Value = serde_json::from_str(FIXTURE).expect("fixture json");
    let cases = fixture["cases"].as_array().expect("cases");
    assert!(cases.len() >= 40);
    let mut failures = Vec::new();
    for case in cases {
        let prompt = case["prompt"].as_str().expect("prompt");
        let want_encode = ids(&case["encode"]);
        let got_encode = tok.encode(prompt);
        if got_encode != want_encode {
            failures.push(format!(
                "encode {prompt:?}:\n  want {want_encode:?}\n  got  {got_encode:?}"
            ));
        }
        let want: Vec<Vec<(u32, f32)>> = case["chunk_ids"]
            .as_array()
            .expect("chunk_ids")
            .iter()
            .zip(case["chunk_weights"].as_array().expect("chunk_weights"))
            .map(|(i, w)| {
                ids(i)
                    .into_iter()
                    .zip(
                        w.as_array()
                            .expect("weights")
                            .iter()
                            .map(|x| x.as_f64().expect("weight") as f32),
                    )
                    .collect()
            })
            .collect();
        let got = tok.tokenize_with_weights(prompt);
        if got != want {
            failures.push(format!(
                "tokenize_with_weights {prompt:?}:\n  want {want:?}\n  got  {got:?}"
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn known_tokens() {
    let tok = tokenizer();
    assert_eq!(
        tok.encode("a photo of a cat"),
        vec![320, 1125, 539, 320, 2368]
    );
    assert_eq!(tok.token_id("cat</w>"), Some(2368));
    let chunks = tok.tokenize_with_weights("(cat:1.5)");
    assert_eq!(chunks.len(), 1);
    assert_eq!(chunks[0][0], (BOS, 1.0));
    assert_eq!(chunks[0][1], (2368, 1.5));
    assert_eq!(chunks[0][2], (EOS, 1.0));
    assert!(chunks[0][2..].iter().all(|&p| p == (EOS, 1.0)));
}

/// Deterministic xorshift so the fuzz loop needs no extra crate.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn fuzz_never_panics_and_chunks_are_well_formed() {
    let tok = tokenizer();
    let alphabet: Vec<char> = "abcXYZ 019 \t\n()()::..,\\\\[]'s'll<|>é日😀\u{0}\u{301}\u{200d}_-+e"
        .chars()
        .chain(['\u{10FFFF}', '\u{FFFD}', 'ß', 'İ', '\u{2028}'])
        .collect();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for round in 0..2000u32 {
        let len = (rng.next() % 200) as usize;
        let mut s = String::new();
        for _ in 0..len {
            if rng.next().is_multiple_of(10) {
                // Any scalar value.
                if let Some(c) = char::from_u32((rng.next() % 0x11_0000) as u32) {
                    s.push(c);
                }
            } else {
                s.push(alphabet[(rng.next() % alphabet.len() as u64) as usize]);
            }
        }
        if round.is_multiple_of(100) {
            s.push_str("<|endoftext|>(x:1.2)<|startoftext|>embedding:y");
        }
        let _ = tok.encode(&s);
        let chunks = tok.tokenize_with_weights(&s);
        assert!(!chunks.is_empty(), "{s:?}");
        for chunk in &chunks {
            assert_eq!(chunk.len(), MAX_LENGTH, "{s:?}");
            assert_eq!(chunk[0], (BOS, 1.0), "{s:?}");
        }
    }
    // Deep nesting and long inputs.
    let deep = format!("{}x{}", "(".repeat(3000), ")".repeat(3000));
    assert!(!tok.tokenize_with_weights(&deep).is_empty());
    let long = "word ".repeat(5000);
    assert_eq!(
        tok.tokenize_with_weights(&long).len(),
        5000usize.div_ceil(75)
    );
}
