"""End-to-end references for textual-inversion embeddings (`embedding:NAME`
in CLIPTextEncode prompts).

Three embedding files are written to the `embeddings` model folder, and the
workflows graphs/tiny_sd1_embeddings.json (the tiny SD1 checkpoint of
sd1_pipeline.py) and graphs/tiny_sdxl_embeddings.json (tiny_sdxl of
families_pipeline.py) are run through ComfyUI's own node classes
(CheckpointLoaderSimple, CLIPTextEncode, KSampler, VAEDecode) on the CPU in
f32. tests/reference/embeddings/expected.json gets, for each embedding file,
its sorted key list with shapes, its scale factors and a checksum of its f16
tensors; for each workflow the latent SaveLatent gets and the image
SaveImage gets (f32) with the f32-vs-f64 and UNet-rounding spreads the SD1
script measures; and, for each CLIPTextEncode of the workflow, the token
layout ComfyUI's tokenizer produced per encoder (every chunk, every entry
an integer token id or "file:key:row" for an embedding vector, with its
weight), each chunk's first end token (num_tokens - 1, where the CLIP
pooled output is read; ComfyUI returns chunk 0's), and the conditioning
and pooled tensors the workflow's CLIPTextEncode nodes return (f32).

Embedding files (all tensors f16; values are sd1_pipeline's
`values(key, shape)` of the key as spelled in the file, i.e. u / sqrt(width)
like the tiny models' token_embedding.weight rows, times the factor under
"scaled", in f32 before the f16 cast; checksum as for the checkpoints, over
the file's keys in sorted order):
  tiny_sd1_style.safetensors: emb_params [3, 64]            factor 1.0
  tiny_sd1_one.safetensors:   emb_params [1, 64]            factor -1.5
      (the same key name as tiny_sd1_style, so without a different factor
      its one row would equal tiny_sd1_style's row 0)
  tiny_sdxl_style.safetensors: clip_l [2, 64], clip_g [2, 128]  factor 1.0
      (the SDXL format: ComfyUI's clip_l tokenizer takes `clip_l`, clip_g's
      takes `clip_g`, by the tokenizers' embedding_key)

How ComfyUI handles `embedding:` (comfy/sd1_clip.py, SDTokenizer):
  * tokenize_with_weights first splits the prompt into weighted segments
    ((text:w) parsing); each segment is split with
    re.split(' embedding:|\\nembedding:'); every piece after the first gets
    "embedding:" put back, and a piece that starts with "embedding:" (also
    the first piece, e.g. a segment "(embedding:x:1.3)" or a prompt that
    starts with it) is an embedding word. "foo,embedding:x" is plain text.
  * _try_get_embedding: the name is the first whitespace-separated word of
    the rest of the piece; everything after it (up to the next
    " embedding:") is `leftover`, tokenized as ordinary text with the same
    weight. load_embed(name) tries <dir>/<name>, then name + ".safetensors",
    ".pt", ".bin", in every embeddings folder and its subfolders; if that
    fails and the name has leading/trailing commas, the comma-stripped name
    is tried and the stripped commas go back in front of the leftover
    ("name," -> embedding, then the text ", <leftover>"). Only commas:
    "name." is looked up as "name." and missing.
  * A missing embedding logs "warning, embedding:<rest of piece> does not
    exist, ignoring" and its name is dropped; the leftover is still
    tokenized.
  * A found embedding adds one token group of its rows ([n, width] -> n
    entries, each the row tensor, with the segment's weight). Groups under
    8 entries are never split across chunks: if a group does not fit in the
    75 free slots, the chunk is closed with the end token and padded, and
    the group starts the next chunk.
  * SDClipModel.process_tokens: the integer tokens of a chunk go through the
    token embedding; each embedding row (f16 cast to f32) is inserted at its
    position in the chunk, attention-mask 1; rows whose width differs from
    the encoder's are dropped with a warning and the chunk padded at the end.
    num_tokens = the number of mask-1 positions (up to and including the
    first end token), and the pooled output is the final-layer-normed
    hidden state at num_tokens - 1: the first end token's position, which
    embedding rows before it push along like any token.
  * Weights apply to embedding positions as to tokens (the output
    interpolated from an empty prompt's output at that position).

Checks (asserted): the base checkpoints match the sd1/families fixture
checksums; every embedding in the prompts is found except does_not_exist,
whose warning ComfyUI logs (and no other warning); each embedding row sits
in process_tokens' output at its position, equal to the file's f16 value,
every other position the token embedding of its id; the pooled output is
read at the first end token; the SDXL encoders got clip_l resp. clip_g rows;
the negative with the missing embedding tokenizes exactly as the same text
with the embedding word removed; each workflow's latent differs clearly
from the same graph with every embedding word removed from its prompts.

    COMFY_DIR=/path/to/ComfyUI python tools/reference/embeddings_pipeline.py
(media-only imports are stubbed as in sd1_pipeline.py; the base fixtures
are not rewritten.)
"""
import base64
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sd1_pipeline as sd1  # noqa: E402
import families_pipeline as fam  # noqa: E402

ROOT = sd1.ROOT
COMFY = sd1.COMFY
WORKFLOWS = ["tiny_sd1_embeddings", "tiny_sdxl_embeddings"]
SD1_W = sd1.CLIP["hidden_size"]
G_W = fam.CLIP_G["hidden_size"]
# (file, base, [(key, shape)], factor)
EMBEDDINGS = [
    ("tiny_sd1_style.safetensors", "sd1", [("emb_params", [3, SD1_W])], 1.0),
    ("tiny_sd1_one.safetensors", "sd1", [("emb_params", [1, SD1_W])], -1.5),
    ("tiny_sdxl_style.safetensors", "sdxl", [("clip_g", [2, G_W]), ("clip_l", [2, SD1_W])], 1.0),
]
MISSING = "does_not_exist"
END = 49407


class LogCapture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append((record.levelno, record.getMessage()))

    def warnings(self):
        return [m for lvl, m in self.records if lvl >= logging.WARNING]


def embedding_value(key, shape, factor):
    v = sd1.values(key, shape)
    if factor != 1.0:
        v = v * np.float32(factor)
    return v.astype(np.float16)


def write_embedding(path, keys, factor, torch):
    from safetensors.torch import save_file
    tensors, total = {}, 0
    for i, (k, shape) in enumerate(keys):
        v = embedding_value(k, shape, factor)
        total = (total + sd1.checksum(v.view(np.uint16), i)) % (1 << 64)
        tensors[k] = torch.from_numpy(np.ascontiguousarray(v))
    save_file(tensors, path)
    return total


def row_labels():
    """f16 bytes of each embedding row -> "file:key:row"."""
    out = {}
    for name, _, keys, factor in EMBEDDINGS:
        for k, shape in keys:
            v = embedding_value(k, shape, factor)
            for r in range(shape[0]):
                b = v[r].tobytes()
                assert b not in out, (name, k, r, out.get(b))
                out[b] = "{}:{}:{}".format(name, k, r)
    return out


def strip_embeddings(text):
    """The prompt with every embedding word removed: weighted groups holding
    only an embedding go whole, other `embedding:NAME` words leave their
    trailing punctuation."""
    text = re.sub(r"\(embedding:[A-Za-z0-9_.]+:[0-9.]+\)", "", text)
    text = re.sub(r"embedding:[A-Za-z0-9_.]+?(?=[,\s]|$)", "", text)
    return re.sub(r" +", " ", text).strip()


def without_embeddings(prompt):
    return {nid: dict(n, inputs={k: strip_embeddings(v) if k == "text" else v
                                 for k, v in n["inputs"].items()})
            for nid, n in prompt.items()}


def layout(tokens, labels, torch):
    """ComfyUI's token-weight chunks -> [[[token or label, weight], ...]]."""
    out = []
    for chunk in tokens:
        c = []
        for t, w in chunk:
            if torch.is_tensor(t):
                assert t.dtype == torch.float16 and t.dim() == 1, (t.dtype, t.shape)
                c.append([labels[t.numpy().tobytes()], w])
            else:
                c.append([int(t), w])
        out.append(c)
    return out


def summary(chunks, pad):
    """Per chunk: embedding positions, first end token, padding, weights."""
    out = []
    for c in chunks:
        emb = {}
        for i, (t, _) in enumerate(c):
            if isinstance(t, str):
                emb.setdefault(t, []).append(i)
        end = [i for i, (t, _) in enumerate(c) if t == END][0]
        n_pad = len(c) - end - 1
        assert all(t == pad for t, _ in c[end + 1:]), c[end + 1:]
        weights = {}
        for i, (t, w) in enumerate(c):
            if w != 1.0:
                weights.setdefault(round(w, 6), []).append(i)
        out.append({"len": len(c), "embedding_positions": emb, "first_end": end,
                    "pad_after_end": n_pad, "pad_token": pad,
                    "weighted": {str(w): [p[0], p[-1], len(p)] for w, p in weights.items()}})
    return out


class ProcessLog:
    """Records every SDClipModel.process_tokens call: (width, tokens,
    embeds, attention mask, num_tokens), and the token embedding rows."""
    def __init__(self, torch):
        import comfy.sd1_clip
        self.calls = []
        orig = comfy.sd1_clip.SDClipModel.process_tokens
        log = self

        def process_tokens(model, tokens, device):
            out = orig(model, tokens, device)
            emb = model.transformer.get_input_embeddings()
            log.calls.append({"width": out[0].shape[-1], "tokens": tokens, "embeds": out[0],
                              "mask": out[1], "num_tokens": out[2],
                              "token_embedding": emb.weight})
            return out
        comfy.sd1_clip.SDClipModel.process_tokens = process_tokens


def check_process(call, labels, torch):
    """Embedding rows at their positions (f16 values as f32), every integer
    token its token-embedding row; num_tokens = first end token + 1."""
    table = call["token_embedding"].float()
    for b, chunk in enumerate(call["tokens"]):
        row = call["embeds"][b]
        assert row.shape[0] == len(chunk), (row.shape, len(chunk))
        first_end = None
        for i, t in enumerate(chunk):
            if isinstance(t, int):
                assert torch.equal(row[i], table[t]), (b, i, t)
                if t == END and first_end is None:
                    first_end = i
            else:
                assert t.numpy().tobytes() in labels
                assert torch.equal(row[i], t.float()), (b, i)
        assert call["num_tokens"][b] == first_end + 1, (call["num_tokens"][b], first_end)
        mask = call["mask"][b].tolist()
        assert mask == [1] * (first_end + 1) + [0] * (len(chunk) - first_end - 1), mask


def parsing_cases(clip, labels, log, torch):
    """Side cases of the `embedding:` parser (SD1 tokenizer), asserted and
    recorded: [(text, chunk-1 entries up to the end token, warnings)]."""
    cases = [
        "embedding:tiny_sd1_one at the start",
        "embedding:tiny_sd1_style,red roses",
        "leftover text embedding:tiny_sd1_one after the name",
        "two commas embedding:tiny_sd1_one,, end",
        "trailing period embedding:tiny_sd1_one. end",
        "no space before,embedding:tiny_sd1_one end",
        "newline\nembedding:tiny_sd1_one end",
        "(embedding:tiny_sd1_one) default weight",
        "(red embedding:tiny_sd1_style:0.5) inside a group",
        "embedding:tiny_sd1_one.safetensors, with extension",
        "embedding:does_not_exist leftover kept",
    ]
    out = []
    for text in cases:
        del log.records[:]
        (chunk,) = layout(clip.tokenize(text)["l"], labels, torch)
        end = [i for i, (t, _) in enumerate(chunk) if t == END][0]
        out.append({"text": text, "entries": chunk[:end + 1], "warnings": log.warnings()})
    return out


def main():
    fp64, perturb, torch = sd1.start_comfy()
    sub = fp64 or perturb
    import folder_paths
    import nodes

    log = LogCapture()
    logging.getLogger().addHandler(log)
    tmp = tempfile.mkdtemp()
    try:
        fam.patch_comfy(tmp, torch)
        ckpt_dir = os.path.join(tmp, "checkpoints")
        xl_name = fam.write_base_checkpoints(ckpt_dir, torch)
        folder_paths.add_model_folder_path("checkpoints", ckpt_dir, is_default=True)
        folder_paths.set_input_directory(os.path.join(ROOT, "graphs", "input"))

        emb_dir = os.path.join(tmp, "embeddings")
        os.makedirs(emb_dir)
        folder_paths.add_model_folder_path("embeddings", emb_dir, is_default=True)
        # ComfyUI's own models/embeddings must not shadow (or supply) a name.
        for d in folder_paths.get_folder_paths("embeddings"):
            if d != emb_dir and os.path.isdir(d):
                for _, _, files in os.walk(d):
                    assert not [f for f in files if f.startswith(("tiny_", MISSING))], (d, files)
        out = {"base": {"sd1": "sd1/expected.json", "sdxl": "families/expected.json"},
               "embeddings": [], "workflows": {}}
        for name, base, keys, factor in EMBEDDINGS:
            keys = sorted(keys)
            digest = write_embedding(os.path.join(emb_dir, name), keys, factor, torch)
            out["embeddings"].append({"name": name, "base": base, "keys": keys,
                                      "scaled": {k: factor for k, _ in keys},
                                      "checksum_f16": str(digest)})
            if not sub:
                print("embedding", name, "on", base, "keys", keys, "factor", factor,
                      "checksum", digest)
        labels = row_labels()

        if not sub:
            # The tiny models' token embeddings, which the files resemble.
            sd1_clip = nodes.CheckpointLoaderSimple().load_checkpoint(sd1.CKPT)[1]
            xl_clip = nodes.CheckpointLoaderSimple().load_checkpoint(xl_name)[1]
            for what, clip, part in [("sd1 clip_l", sd1_clip, "clip_l"),
                                     ("sdxl clip_l", xl_clip, "clip_l"),
                                     ("sdxl clip_g", xl_clip, "clip_g")]:
                w = getattr(clip.cond_stage_model, part).transformer.get_input_embeddings().weight
                print("token_embedding", what, list(w.shape), "std", float(w.float().std()),
                      "mean row norm", float(w.float().norm(dim=-1).mean()))
            for name, _, keys, factor in EMBEDDINGS:
                for k, shape in keys:
                    v = embedding_value(k, shape, factor).astype(np.float32)
                    print("   ", name, k, "std", float(v.std()),
                          "row norms", [round(float(x), 4) for x in np.linalg.norm(v, axis=-1)])
            cases = parsing_cases(sd1_clip, labels, log, torch)
            for c in cases:
                print("parse", repr(c["text"]), [t for t in c["entries"]], c["warnings"])
            out["parsing_sd1"] = cases

            f64_latents, perturbed_latents = sd1.spread_runs(__file__)

        node_ns = types.SimpleNamespace(NODE_CLASS_MAPPINGS=nodes.NODE_CLASS_MAPPINGS)
        plog = ProcessLog(torch)
        for name in WORKFLOWS:
            with open(os.path.join(ROOT, "graphs", name + ".json")) as f:
                prompt = json.load(f)
            del log.records[:]
            del plog.calls[:]
            saved, latents = sd1.run_workflow(prompt, node_ns, torch)
            warnings = log.warnings()
            texts = [n["inputs"]["text"] for n in prompt.values() if n["class_type"] == "CLIPTextEncode"]
            missing = [t for t in texts if "embedding:" + MISSING in t]
            want = []
            for t in missing:
                rest = t.split(" embedding:" + MISSING)[1].split(" embedding:")[0]
                want.append("warning, embedding:{}{} does not exist, ignoring".format(MISSING, rest))
            assert warnings == want, (warnings, want)
            (image,) = saved
            img = image.float().numpy()
            (latent,) = latents
            lat = latent.float().numpy()
            assert np.isfinite(lat).all() and np.isfinite(img).all(), name
            for call in plog.calls:
                check_process(call, labels, torch)
            if sub:
                out["workflows"][name] = sd1.b64(lat.astype("<f4"))
                continue

            # The token layouts (re-tokenized with the workflow's CLIP; the
            # conditionings are the workflow's own CLIPTextEncode outputs).
            ckpt = prompt["1"]["inputs"]["ckpt_name"]
            clip = nodes.CheckpointLoaderSimple().load_checkpoint(ckpt)[1]
            encodes = {}
            for nid, n in prompt.items():
                if n["class_type"] != "CLIPTextEncode":
                    continue
                text = n["inputs"]["text"]
                toks = clip.tokenize(text)
                per = {}
                for enc, chunks in sorted(toks.items()):
                    pad = 0 if enc == "g" else END
                    lay = layout(chunks, labels, torch)
                    summ = summary(lay, pad)
                    # num_tokens - 1 of each chunk; the pooled output ComfyUI
                    # returns is chunk 0's (first_pooled = pooled[0:1]).
                    per[enc] = {"chunks": lay, "summary": summ,
                                "first_end": [x["first_end"] for x in summ],
                                "pooled_index": summ[0]["first_end"]}
                # SDXL: each encoder got its own key of the file.
                for enc, p in per.items():
                    for c in p["chunks"]:
                        for t, _ in c:
                            if isinstance(t, str) and t.startswith("tiny_sdxl_style"):
                                assert t.split(":")[1] == "clip_" + enc, (enc, t)
                cond = nodes.CLIPTextEncode().encode(clip, text)[0]
                ((c, extra),) = cond
                encodes[nid] = {"text": text, "tokens": per,
                                "cond_shape": list(c.shape), "cond_f32": sd1.b64(c.float().numpy().astype("<f4")),
                                "pooled_shape": list(extra["pooled_output"].shape),
                                "pooled_f32": sd1.b64(extra["pooled_output"].float().numpy().astype("<f4"))}
                print(name, "node", nid, repr(text))
                for enc, p in per.items():
                    print("   encoder", enc, "chunks", len(p["chunks"]), "first end per chunk",
                          p["first_end"], "pooled from chunk 0 position", p["pooled_index"])
                    for i, s in enumerate(p["summary"]):
                        print("      chunk", i, s)
                    for i, ch in enumerate(p["chunks"]):
                        print("      ids", i, [t for t, _ in ch])
                print("   cond", list(c.shape), "abs mean", float(c.abs().mean()),
                      "pooled", list(extra["pooled_output"].shape))
                if MISSING in text:
                    plain = clip.tokenize(strip_embeddings(text))
                    assert layout(plain["l"], labels, torch) == per["l"]["chunks"]
                    print("   missing embedding: same tokens as", repr(strip_embeddings(text)))
            # Every embedding in the prompts (but the missing one) was used.
            used = {t for e in encodes.values() for p in e["tokens"].values()
                    for ch in p["chunks"] for t, _ in ch if isinstance(t, str)}
            named = {m for t in texts for m in re.findall(r"embedding:([A-Za-z0-9_]+)", t)} - {MISSING}
            assert {u.split(".")[0] for u in used} == named, (used, named)

            stripped = without_embeddings(prompt)
            _, plain = sd1.run_workflow(stripped, node_ns, torch)
            plain = plain[0].float().numpy()
            emb_rel = float(np.abs(lat - plain).max() / np.abs(plain).max())
            assert emb_rel > 0.05, (name, emb_rel)

            def spread_to(latents):
                other = np.frombuffer(base64.b64decode(latents[name]), "<f4")
                return float(np.abs(lat.reshape(-1) - other).max() / np.abs(other).max())
            out["workflows"][name] = {
                "f32_vs_f64_unet_rel": spread_to(f64_latents),
                "unet_rounding_rel": spread_to(perturbed_latents),
                "embeddings_vs_none_rel": emb_rel,
                "texts_without_embeddings": {nid: n["inputs"]["text"] for nid, n in stripped.items()
                                             if n["class_type"] == "CLIPTextEncode"},
                "warnings": warnings,
                "encodes": encodes,
                "latent_shape": list(lat.shape), "latent_f32": sd1.b64(lat.astype("<f4")),
                "image_shape": list(img.shape), "image_f32": sd1.b64(img.astype("<f4")),
            }
            w = out["workflows"][name]
            print(name, "latent", lat.shape, "abs mean", float(np.abs(lat).mean()),
                  "std", float(lat.std()), "image", img.shape, "mean", float(img.mean()),
                  "f32 vs f64 UNet", w["f32_vs_f64_unet_rel"],
                  "UNet rounding", w["unet_rounding_rel"], "vs no embeddings", emb_rel,
                  "warnings", warnings)
        if sub:
            print(json.dumps(out["workflows"]))
            return
        sd1.write_expected("embeddings", out)
    finally:
        logging.getLogger().removeHandler(log)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
