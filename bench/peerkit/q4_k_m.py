"""A random Llama checkpoint (checkpoints.py) written as a Q4_K_M GGUF without llama.cpp, for a
machine that has none (a GPU's: bench/gpu_decode.py --gguf q4_k_m).

    .venv/bin/python bench/peerkit/q4_k_m.py [--shape issue|1b|small] [--dtype float32|bfloat16]

The tests' GGUF writer and Q4_K / Q6_K quantizers (tests/tiny_gguf.py, tests/k_quants.py: each
block's scale and min from its range, not llama.cpp's search for the best ones; a random model's
speed does not care) with llama.cpp's Q4_K_M choice of a type per matrix (type_rule), so the file
holds what a Q4_K_M made by llama.cpp's quantizer holds, byte count for byte count; its vocabulary
the checkpoint's (SentencePiece pieces, scores and types). Written once beside the checkpoint.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import gguf
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from peerkit.checkpoints import DEFAULT_CACHE, ISSUE_SHAPE, ONE_B_SHAPE, ModelShape, checkpoint, load_vocab  # noqa: E402

TESTS = Path(__file__).resolve().parents[2] / "tests"
SUPER_BLOCK = 256   # a K-quant's columns a super-block: a matrix with other widths falls back
SMALL_SHAPE = ModelShape(layers=2, hidden=256, heads=4, kv_heads=2, intermediate=768)   # whole super-blocks
SHAPES = {"issue": ISSUE_SHAPE, "1b": ONE_B_SHAPE, "small": SMALL_SHAPE}


def type_rule(layers: int):
    """llama.cpp's Q4_K_M for a Llama (llama_tensor_get_type): Q6_K for the output head and for
    attn_v and ffn_down of the layers use_more_bits picks, Q4_K for the rest; a matrix whose
    inputs are not whole super-blocks falls back as llama.cpp's does, Q6_K to Q8_0, Q4_K to Q5_0.
    Returns type(GGUF name, columns)."""
    def more_bits(layer: int) -> bool:
        return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2

    def chosen(name: str, columns: int) -> str:
        parts = name.split(".")
        wide = name == "output.weight" or (parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down")
                                           and more_bits(int(parts[1])))
        if columns % SUPER_BLOCK:
            return "Q8_0" if wide else "Q5_0"
        return "Q6_K" if wide else "Q4_K"
    return chosen


def written(checkpoint_dir: Path, cache_dir: Path = DEFAULT_CACHE) -> Path:
    """checkpoint_dir's model as a Q4_K_M GGUF beside it (written once, then cached)."""
    target = checkpoint_dir.with_name(checkpoint_dir.name + ".Q4_K_M.gguf")
    if target.exists():
        return target
    sys.path.insert(0, str(TESTS))
    import tiny_gguf
    config = SimpleNamespace(**json.loads((checkpoint_dir / "config.json").read_text()))
    vocab, _ = load_vocab(cache_dir)
    partial = target.with_name(target.name + ".partial")
    writer = gguf.GGUFWriter(str(partial), "llama")
    tiny_gguf.add_hyperparameters(writer, config)
    tiny_gguf.add_sentencepiece(writer, "default", vocab.tokens, vocab.scores, vocab.types)
    tensors = {name: t.float().numpy() for name, t in load_file(str(checkpoint_dir / "model.safetensors")).items()}
    tiny_gguf.add_tensors(writer, tensors, "llama", config, type_rule(config.num_hidden_layers))
    tiny_gguf.finish(writer)
    os.replace(partial, target)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="small", choices=tuple(SHAPES))
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    directory, source = checkpoint(dtype=getattr(torch, args.dtype), shape=SHAPES[args.shape])
    path = written(directory)
    print(f"{path}: {path.stat().st_size / 1e6:.1f} MB; {source}")


if __name__ == "__main__":
    main()
