"""lm-evaluation-harness's `local-completions` model, the client researchers score models with, against
`expertcache serve`: its loglikelihood requests (echo with logprobs, several prompts a request) must give the
log-probabilities the engine's own forward pass gives, and generate_until must answer.

    pip install "lm-eval[api]"   # not a dependency of expertcache
    python benchmarks/lm_eval_client.py [--port 8791] [--store ram] [--json out.json]

What the harness would run from the command line (its tasks download their datasets):
    lm_eval --model local-completions --model_args model=expertcache-builtin,base_url=http://127.0.0.1:8000/v1/completions,tokenizer_backend=huggingface,tokenizer=expertcache/data/model --tasks ...
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

from expertcache.cli import run_script

PAIRS = [("ROMEO.\nBut soft, what light", " through yonder window breaks?"),
         ("JULIET.\nO Romeo, Romeo,", " wherefore art thou Romeo?"),
         ("KING HENRY.\nOnce more unto the", " breach, dear friends"),
         ("HAMLET.\nTo be, or not to be,", " that is the question")]


def engine_loglikelihood(engine, context: str, continuation: str) -> tuple[float, bool]:
    """The continuation's summed log-probability after the context, and whether greedy decoding picks it. As the
    harness does, whitespace that ends the context moves to the continuation's start."""
    cut = len(context) - len(context.rstrip())
    if cut:
        context, continuation = context[:-cut], context[-cut:] + continuation
    c, w = engine.encode(context), engine.encode(context + continuation)
    engine.reset()
    with torch.no_grad():
        logp = torch.log_softmax(engine.forward(torch.tensor(w), 0), -1)
    total = sum(float(logp[j - 1, w[j]]) for j in range(len(c), len(w)))
    return total, all(int(logp[j - 1].argmax()) == w[j] for j in range(len(c), len(w)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8791)
    p.add_argument("--store", default="ram")
    p.add_argument("--json", type=Path, help="write every pair's scores and the generated answer here")
    a = p.parse_args()
    try:
        from lm_eval.api.instance import Instance
        from lm_eval.models.openai_completions import LocalCompletionsAPI
    except ImportError:
        raise SystemExit('lm-evaluation-harness is not installed; pip install "lm-eval[api]"') from None
    from expertcache.engine.engine import BUILTIN_MODEL, Engine, EngineConfig
    server = subprocess.Popen([sys.executable, "-m", "expertcache.cli", "serve", "--store", a.store, "--port",
                               str(a.port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{a.port}/health")
                break
            except OSError:
                time.sleep(0.5)
        lm = LocalCompletionsAPI(base_url=f"http://127.0.0.1:{a.port}/v1/completions", model="expertcache-builtin",
                                 tokenizer_backend="huggingface", tokenizer=str(BUILTIN_MODEL),
                                 tokenized_requests=True, num_concurrent=1, max_retries=1, batch_size=2)
        engine = Engine(None, EngineConfig(store="ram"))
        from expertcache.engine.generate import generate
        greedy_text = engine.decode(list(generate(engine, engine.encode("ROMEO.\n"), 4)))
        pairs = [*PAIRS, ("ROMEO.\n", greedy_text)]  # one the harness must find greedy
        got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])
        print("| continuation | harness logprob | engine logprob | greedy (harness / engine) |\n|---|---:|---:|---|")
        worst, rows = 0.0, []
        for (context, continuation), (lp, greedy) in zip(pairs, got):
            want, want_greedy = engine_loglikelihood(engine, context, continuation)
            worst = max(worst, abs(lp - want))
            rows.append({"context": context, "continuation": continuation, "harness_logprob": lp,
                         "engine_logprob": want, "harness_greedy": bool(greedy), "engine_greedy": want_greedy})
            print(f"| `{continuation}` | {lp:.4f} | {want:.4f} | {greedy} / {want_greedy} |")
            if abs(lp - want) > 1e-3 or greedy != want_greedy:
                raise SystemExit(f"the harness scored {continuation!r} {lp:.4f}, the engine {want:.4f}")
        text = lm.generate_until([Instance("generate_until", {}, ("ROMEO.\n", {"until": ["\n\n"], "max_gen_toks": 24}),
                                           0)])[0]
        print(f"\nlargest difference {worst:.1e}; generate_until answered {text!r}")
        if a.json:
            a.json.write_text(json.dumps({"pairs": rows, "largest_difference": worst, "generate_until": text}, indent=1))
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    run_script(main)
