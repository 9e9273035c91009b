"""Reproduce the built-in model: corpus -> tokenizer -> MoE training -> HF checkpoint.

Seeded and resumable (a state file every `save_every` steps); prints one progress line
per `log_every` steps. Never run from tests or CI: it takes about an hour on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer

from .. import atomic
from . import corpus
from .model import TrainableQwen3Moe, TrainConfig
from .tokenizer import train_tokenizer


@dataclass(frozen=True)
class Schedule:
    """The training run: token budget, batch, warm-up and cosine learning rate, balance loss, logging and saving."""
    tokens: int = 6_600_000
    batch: int = 16
    seq_len: int = 256
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup: int = 100
    weight_decay: float = 0.1
    balance_coef: float = 0.02
    seed: int = 0
    log_every: int = 10
    save_every: int = 50

    @property
    def steps(self) -> int:
        """Optimizer steps in the run."""
        return self.tokens // (self.batch * self.seq_len)

    def lr_at(self, step: int) -> float:
        """Learning rate at `step`: linear warm-up, then cosine decay to `min_lr`."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        t = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * t))


def tokenize(tok: Tokenizer, path: Path, out: Path) -> np.ndarray:
    """The training text's token ids as uint16, encoded once and cached in `out` (.npy)."""
    if not out.exists():
        docs = path.read_text(encoding="utf-8").split(corpus.EOT)
        eot = tok.token_to_id(corpus.EOT)
        ids: list[int] = []
        for enc in tok.encode_batch(docs):
            ids += enc.ids + [eot]
        with atomic.replaced(out) as tmp, open(tmp, "wb") as f:  # whole or not at all: a later run reuses it
            np.save(f, np.array(ids, dtype=np.uint16))
    return np.load(out)


@torch.no_grad()
def evaluate(model: TrainableQwen3Moe, ids: np.ndarray, seq_len: int, max_windows: int = 64) -> float:
    """Mean next-token loss over non-overlapping windows of the evaluation text."""
    n = min(max_windows, (len(ids) - 1) // seq_len)
    x = torch.from_numpy(ids[: n * seq_len + 1].astype(np.int64))
    inputs, targets = x[:-1].view(n, seq_len), x[1:].view(n, seq_len)
    total = 0.0
    for i in range(0, n, 16):
        logits, _, _ = model(inputs[i:i + 16])
        total += F.cross_entropy(logits.flatten(0, 1), targets[i:i + 16].flatten(), reduction="sum").item()
    return total / (n * seq_len)


def export(model: TrainableQwen3Moe, tok_dir: Path, out: Path) -> None:
    """Write an HF checkpoint (fp16 safetensors) that Qwen3MoeForCausalLM loads unchanged."""
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.to(torch.float16).contiguous() for k, v in model.hf_state_dict().items()}
    with atomic.replaced(out / "model.safetensors") as tmp:
        save_file(sd, str(tmp), metadata={"format": "pt"})
    atomic.write_text(out / "config.json", json.dumps(model.hf_config(), indent=1))
    for name in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(tok_dir / name, out / name)


def train(work: Path, out: Path, cfg: TrainConfig, sched: Schedule) -> dict:
    """Build the corpus and tokenizer, train (resuming from the state file in `work`), evaluate and export
    the HF checkpoint to `out`; returns the run's report."""
    meta = corpus.build(work / "corpus", work / "cache")
    tok_dir = work / "tokenizer"
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json")) if (tok_dir / "tokenizer.json").exists() \
        else train_tokenizer(work / "corpus" / "train.txt", tok_dir, cfg.vocab_size)
    data = tokenize(tok, work / "corpus" / "train.txt", work / "train_tokens.npy")
    eval_ids = np.array(tok.encode((work / "corpus" / "eval.txt").read_text(encoding="utf-8")).ids, dtype=np.uint16)
    torch.manual_seed(sched.seed)
    model = TrainableQwen3Moe(cfg)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": sched.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=sched.lr, betas=(0.9, 0.95))
    state_path, step = work / "train_state.pt", 0
    rng = np.random.default_rng(sched.seed)
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, rng = state["step"], state["rng"]
        print(f"resumed at step {step}/{sched.steps}", flush=True)
    t0, t_last, log = time.time(), time.time(), []
    while step < sched.steps:
        starts = rng.integers(0, len(data) - sched.seq_len - 1, sched.batch)
        batch = torch.from_numpy(np.stack([data[s:s + sched.seq_len + 1] for s in starts]).astype(np.int64))
        for g in opt.param_groups:
            g["lr"] = sched.lr_at(step)
        logits, balance, _ = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        (loss + sched.balance_coef * balance).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % sched.log_every == 0 or step == sched.steps:
            now = time.time()
            tps = sched.log_every * sched.batch * sched.seq_len / (now - t_last)
            t_last = now
            eta = (sched.steps - step) * sched.batch * sched.seq_len / tps
            print(f"step {step}/{sched.steps} loss {loss.item():.3f} balance {balance.item():.3f} "
                  f"lr {sched.lr_at(step):.2e} {tps:.0f} tok/s eta {eta / 60:.0f} min", flush=True)
            log.append({"step": step, "loss": loss.item(), "balance": balance.item()})
        if step % sched.save_every == 0 or step == sched.steps:
            with atomic.replaced(state_path) as tmp:  # a kill while it saves keeps the last whole state to resume
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "rng": rng}, tmp)
    val = evaluate(model, eval_ids, sched.seq_len)
    export(model, tok_dir, out)
    report = {"config": asdict(cfg), "schedule": asdict(sched), "steps": step,
              "train_tokens": step * sched.batch * sched.seq_len, "eval_loss_sampled": val,
              "seconds_this_run": time.time() - t0, "corpus": meta["train_chars"]}
    atomic.write_text(work / "train_report.json", json.dumps(report, indent=1))
    return report


def run_from_args(a: argparse.Namespace) -> None:
    """Set the threads and train with the parsed options, printing the report as JSON."""
    if a.threads:
        torch.set_num_threads(a.threads)
    print(json.dumps(train(a.work, a.out, TrainConfig(), Schedule(tokens=a.tokens)), indent=1))


if __name__ == "__main__":
    from ..commands.train import add_arguments
    parser = argparse.ArgumentParser(prog="expertcache train", description=__doc__)
    add_arguments(parser)
    run_from_args(parser.parse_args())
