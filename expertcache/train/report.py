"""The built-in model's report: perplexity on the evaluation text against a unigram baseline,
HF transformers' perplexity beside ours, router statistics and expert load per layer."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..engine.engine import BUILTIN_MODEL
from ..engine.perplexity import EVAL_TEXT, teacher_forced
from ..lab.calibrate import encode_text
from ..lab.prediction import record_states


def unigram_nll(train_tokens: np.ndarray, eval_ids: list[int], vocab: int) -> float:
    """Cross-entropy of the eval tokens under add-one smoothed training unigram frequencies."""
    counts = np.bincount(train_tokens, minlength=vocab).astype(np.float64) + 1
    logp = np.log(counts / counts.sum())
    return float(-logp[np.asarray(eval_ids[1:])].mean())


def hf_perplexity(model_path: Path, ids: list[int], context: int) -> float:
    """HF transformers' perplexity of `ids` in windows of `context` (the same windows as ours)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for logits, targets in teacher_forced(lambda x: model(x[None]).logits[0], ids, context):
            total += F.cross_entropy(logits, targets, reduction="sum").item()
            n += len(targets)
    return math.exp(total / n)


def router_statistics(model_path: Path, ids: list[int]) -> dict:
    """Per layer: router confidence, first-choice weights and expert load balance over `ids`."""
    model, s = record_states(model_path, ids)
    a = model.args
    layers = []
    for l, logits in enumerate(s.logits):
        probs = F.softmax(logits.float(), -1)
        top1 = probs.max(-1).values
        first = s.weights[l][:, 0]  # normalised weight of the first choice
        load = torch.bincount(s.ids[l].flatten(), minlength=a.num_experts).float()
        share = load / load.sum()
        layers.append({"mean_top1_prob": top1.mean().item(), "mean_first_choice_weight": first.mean().item(),
                       "first_choice_ge_0.15": (first >= 0.15).float().mean().item(),
                       "first_choice_ge_0.5": (first >= 0.5).float().mean().item(),
                       "starved_experts_share": (share < 0.1 / a.num_experts).float().mean().item(),
                       "max_over_uniform_load": (share.max() * a.num_experts).item()})
    return {"tokens": len(s.x[0]), "layers": layers}


def model_report(model_path: Path = BUILTIN_MODEL, train_tokens: Path | None = None, context: int = 512,
                 max_tokens: int | None = None) -> dict:
    """Perplexity (ours at a 25% cache, HF's, unigram's), and router statistics on the evaluation text."""
    from ..engine.cache import CacheConfig
    from ..engine.engine import Engine, EngineConfig
    from ..engine.perplexity import perplexity
    ids = encode_text(model_path, EVAL_TEXT.read_text(encoding="utf-8"), max_tokens)
    engine = Engine(model_path, EngineConfig(store="ram", cache=CacheConfig(fraction=0.25)))
    ours = perplexity(engine, ids, context)
    out = {"eval_tokens": len(ids), "context": context, "ppl_fetch_all_25pct": ours.ppl, "ppl_stderr": ours.stderr,
           "ppl_transformers": hf_perplexity(model_path, ids, context)}
    out["ppl_relative_difference"] = out["ppl_fetch_all_25pct"] / out["ppl_transformers"] - 1
    if train_tokens is not None and train_tokens.exists():
        out["ppl_unigram"] = math.exp(unigram_nll(np.load(train_tokens), ids, engine.args.vocab_size))
    out["router"] = router_statistics(model_path, ids)
    return out


if __name__ == "__main__":
    import argparse
    p = argparse.ArgumentParser(description="the model card's figures: perplexity, unigram baseline, router")
    p.add_argument("train_tokens", type=Path, nargs="?", help="the training tokens (.npy), for the unigram baseline")
    p.add_argument("--model", type=Path, default=BUILTIN_MODEL, help="the model folder (default: the built-in model)")
    a = p.parse_args()
    print(json.dumps(model_report(a.model, a.train_tokens), indent=1))
