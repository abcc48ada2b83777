#!/usr/bin/env python3
"""Reference fixtures for sdkit's SD1 CLIP tokenizer (nodes/src/clip_tokenizer.rs).

Runs ComfyUI's own `comfy/sd1_clip.py` (SD1Tokenizer -> SDTokenizer.tokenize_with_weights,
token_weights, parse_parentheses, escape_important/unescape_important) taken verbatim from the
ComfyUI git mirror, on top of the installed `transformers` CLIPTokenizer loading ComfyUI's
`comfy/sd1_tokenizer` folder.  The heavy modules sd1_clip imports at module level
(comfy.ops, comfy.model_management, comfy.clip_model) are stubbed: the tokenizer code does not
use them.  `embedding_directory` is None (SD1Tokenizer default), so `embedding:name` words are
tokenized as plain text.  ftfy is not installed (and transformers 5's CLIPTokenizer, the
tokenizers-backed one, never uses it).

Usage:
    /work/pyenv/bin/python tools/reference/clip_tokenizer.py \
        [--mirror /work/.mirror/Comfy-Org+ComfyUI/repo] \
        [--out nodes/tests/fixtures/clip_tokenizer/expected.json]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import types

LONG = (
    "masterpiece, best quality, ultra detailed, 8k wallpaper, a beautiful landscape painting of a "
    "misty mountain valley at sunrise, golden light, volumetric fog, towering pine trees, a winding "
    "river reflecting the sky, snow capped peaks, dramatic clouds, highly detailed, sharp focus, "
    "intricate, elegant, digital painting, artstation, concept art, smooth, illustration, art by "
    "greg rutkowski and alphonse mucha and thomas kinkade, trending on artstation, octane render, "
    "unreal engine 5, cinematic lighting, depth of field, bokeh, hdr, 4k, award winning photograph"
)

PROMPTS = [
    "",
    " ",
    "a photo of a cat",
    "A Photo Of A CAT",
    "hello, world!",
    "it's, don't, they're, we've, I'm, you'll, he'd",
    "IT'S DON'T",
    "rock'n'roll !'s ''s",
    "numbers 1234 3.14159 -42 1e10 ２０２４",
    "multiple    spaces\tand\ttabs\nnew\nlines\r\nwindows",
    "  leading and trailing  ",
    "café naïve résumé Ærøskøbing straße",
    "日本語のテキスト 中文 한국어",
    "emoji 😀🎨🔥 and ❤️ hearts 👩‍👩‍👧",
    "Ⓐb ①② ⅷ",
    "नमस्ते दुनिया",
    "Ελληνικά Кириллица",
    "<|startoftext|>a<|endoftext|> <|ENDOFTEXT|>",
    "hello<|endoftext|>world",
    "<|ENDOFTEXT|>!! x<|StartOfText|>'s ,<|endoftext|>",
    "punctuation!!! ??? ... --- *** @#$%^&*",
    "a \x00 control \u200b zero width \ufeff bom",
    "(red:1.3) apple",
    "((nested)) emphasis",
    "(((triple nested)))",
    "[b] square brackets are literal",
    "\\(x\\) escaped parens \\(y",
    "(a:0.5) (b:1.5)",
    "(a:0.5)(b:1.5)c",
    "unbalanced (open paren",
    "unbalanced close) paren ) (",
    "))((weird",
    "(text with: colon inside)",
    "(weight:not_a_number)",
    "(w: 1.25 ) (x:1e-1) (y:+2) (z:-.5) (v:1_0)",
    "(outer (inner:1.5) rest:0.8)",
    "(:1.2) () (x:)",
    "a embedding:foo b, embedding:bar\nembedding:baz",
    LONG,
    LONG + ", " + LONG,
    "(" + LONG + ":1.1), small, (another:0.9)",
    ", ".join(["word%d" % i for i in range(60)]),
    "supercalifragilisticexpialidocious " * 12,
    "x" * 300,
    "a " * 75,
    "a " * 76,
    "a " * 151,
    "(a b c d e f g:1.1) " * 12,
    "(x:1.2)" * 80,
    "(one two three four five six seven eight:1.3), " * 10,
    "short, " + "(" + "loooooooooooooooong weighted segment that is large " * 4 + ":1.2)",
]


def load_comfy(mirror, tmp):
    """Extract comfy/sd1_clip.py and comfy/sd1_tokenizer from the git mirror and import it."""
    pkg = os.path.join(tmp, "comfy")
    os.makedirs(os.path.join(pkg, "sd1_tokenizer"))

    def show(path):
        return subprocess.run(["git", "-C", mirror, "show", "HEAD:" + path], check=True,
                              capture_output=True).stdout

    with open(os.path.join(pkg, "sd1_clip.py"), "wb") as f:
        f.write(show("comfy/sd1_clip.py"))
    for name in ["vocab.json", "merges.txt", "special_tokens_map.json", "tokenizer_config.json"]:
        with open(os.path.join(pkg, "sd1_tokenizer", name), "wb") as f:
            f.write(show("comfy/sd1_tokenizer/" + name))
    open(os.path.join(pkg, "__init__.py"), "w").close()
    commit = subprocess.run(["git", "-C", mirror, "rev-parse", "HEAD"], check=True,
                            capture_output=True, text=True).stdout.strip()

    sys.path.insert(0, tmp)
    import comfy  # noqa: E402
    for name in ["ops", "model_management", "clip_model"]:
        mod = types.ModuleType("comfy." + name)
        mod.__getattr__ = lambda _attr: None
        sys.modules["comfy." + name] = mod
        setattr(comfy, name, mod)
    import comfy.sd1_clip as sd1_clip  # noqa: E402
    return sd1_clip, commit


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mirror", default="/work/.mirror/Comfy-Org+ComfyUI/repo")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "..", "nodes",
                                                  "tests", "fixtures", "clip_tokenizer",
                                                  "expected.json"))
    args = ap.parse_args()
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        sd1_clip, commit = load_comfy(args.mirror, tmp)
        tok = sd1_clip.SD1Tokenizer()
        hf = tok.clip_l.tokenizer
        cases = []
        for prompt in PROMPTS:
            ids = hf(prompt)["input_ids"]
            assert ids[0] == 49406 and ids[-1] == 49407
            chunks = tok.tokenize_with_weights(prompt)["l"]
            cases.append({
                "prompt": prompt,
                "encode": ids[1:-1],
                "chunk_ids": [[t for t, _ in c] for c in chunks],
                "chunk_weights": [[w for _, w in c] for c in chunks],
            })
    out = {
        "comfyui_commit": commit,
        "transformers": transformers.__version__,
        "tokenizer_class": type(hf).__name__,
        "cases": cases,
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=True, separators=(",", ":"))
        f.write("\n")
    print("wrote", len(cases), "cases to", os.path.normpath(args.out))


if __name__ == "__main__":
    main()
