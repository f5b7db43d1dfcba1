"""A briefly trained checkpoint of the bench model's shape: where quantization's quality means
something.

Random Normal(0, 0.02) weights give next-token distributions that are nearly flat (the most
likely token ~2e-4, its lead over the second ~2e-5), so the top-1 agreement of a quantized model
with them counts near-ties that any rounding flips. This one starts from the random checkpoint
(checkpoints.checkpoint, same shape and vocabulary) and takes Recipe.steps AdamW steps of
next-token loss on the repo's docs/*.md, tokenized with the checkpoint's own tokenizer, in
transformers' LlamaForCausalLM (whose forward mcpd matches token for token: tests/test_models_vs_hf.py),
float32 on the CPU. Fixed seed, fixed order of windows: the same recipe, corpus and machine give
the same weights (another CPU or thread count may round differently).

The result is cached beside the random checkpoint, named by a hash of everything that shaped it
(the recipe, the corpus's bytes, the base checkpoint's name): a second run loads it; a changed
doc or recipe trains afresh (minutes: about 6-10 on the project's 2 vCPUs for the default recipe).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from peerkit import checkpoints

DOCS = Path(__file__).resolve().parents[2] / "docs"


@dataclass(frozen=True)
class Recipe:
    steps: int = 240
    batch: int = 4            # windows per step
    window: int = 64          # tokens per window (+1 for the last target)
    peak_lr: float = 2e-3     # after `warmup` steps, then linear decay to a tenth
    warmup: int = 20
    weight_decay: float = 0.01
    clip: float = 1.0
    seed: int = 0


def corpus(tokenizer: Tokenizer, docs: Path = DOCS) -> torch.Tensor:
    """The docs' token ids, file after file in name order (each with its BOS)."""
    ids = []
    for path in sorted(docs.glob("*.md")):
        ids += tokenizer.encode(path.read_text()).ids
    return torch.tensor(ids)


def recipe_key(recipe: Recipe, base: Path, tokens: torch.Tensor) -> str:
    spec = json.dumps({"recipe": asdict(recipe), "base": base.name}, sort_keys=True).encode()
    return hashlib.sha256(spec + tokens.numpy().tobytes()).hexdigest()[:12]


def hf_model(base: Path, shape: checkpoints.ModelShape):
    from transformers import LlamaConfig, LlamaForCausalLM   # the test extra; only this bench trains
    config = {k: v for k, v in checkpoints.hf_config(shape, torch.float32).items()
              if k not in ("architectures", "torch_dtype")}
    model = LlamaForCausalLM(LlamaConfig(**config))
    model.load_state_dict(load_file(str(base / "model.safetensors")), strict=True)
    return model


def learning_rate(recipe: Recipe, step: int) -> float:
    if step < recipe.warmup:
        return recipe.peak_lr * (step + 1) / recipe.warmup
    remaining = (recipe.steps - step) / max(1, recipe.steps - recipe.warmup)
    return recipe.peak_lr * (0.1 + 0.9 * remaining)


def train(model, tokens: torch.Tensor, recipe: Recipe, log=sys.stderr) -> float:
    """Recipe.steps steps on random windows of tokens; the last step's loss."""
    generator = torch.Generator().manual_seed(recipe.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.peak_lr, weight_decay=recipe.weight_decay)
    model.train()
    started, loss = time.monotonic(), float("nan")
    for step in range(recipe.steps):
        starts = torch.randint(0, len(tokens) - recipe.window - 1, (recipe.batch,), generator=generator)
        batch = torch.stack([tokens[s:s + recipe.window + 1] for s in starts.tolist()])
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(recipe, step)
        loss_tensor = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        loss_tensor.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_tensor.item()
        if step % 40 == 0 or step == recipe.steps - 1:
            print(f"  training: step {step + 1}/{recipe.steps}, loss {loss:.3f} nats/token, "
                  f"{time.monotonic() - started:.0f} s", file=log, flush=True)
    return loss


def checkpoint(recipe: Recipe = Recipe(), cache_dir: Path = checkpoints.DEFAULT_CACHE,
               shape: checkpoints.ModelShape = checkpoints.ISSUE_SHAPE, docs: Path = DOCS,
               may_train: bool = True) -> Path | None:
    """The trained checkpoint's directory (float32, the base's config and tokenizer), trained on
    first use; None when it is not cached and may_train is False (a --quick run: under a minute)."""
    base, _ = checkpoints.checkpoint(cache_dir, torch.float32, shape)
    tokens = corpus(Tokenizer.from_file(str(base / "tokenizer.json")), docs)
    directory = base.with_name(f"{base.name}-trained-{recipe_key(recipe, base, tokens)}")
    if (directory / "model.safetensors").exists():
        return directory
    if not may_train:
        return None
    model = hf_model(base, shape)
    threads = torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)))   # every core: the engine may have picked fewer
    try:
        loss = train(model, tokens, recipe)
    finally:
        torch.set_num_threads(threads)
    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(base, partial, ignore=shutil.ignore_patterns("model.safetensors"))
    weights = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    save_file(weights, str(partial / "model.safetensors"), metadata={"format": "pt"})
    (partial / "training.json").write_text(json.dumps({"recipe": asdict(recipe), "final_loss": loss,
                                                       "corpus_tokens": len(tokens)}, indent=1))
    shutil.rmtree(directory, ignore_errors=True)
    partial.rename(directory)
    return directory
