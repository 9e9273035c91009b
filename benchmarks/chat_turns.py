"""Time to the first token of a chat's turns, with the conversation's keys and values reused (what `expertcache chat`
does: a turn's prefill runs only what its prompt adds) against the whole prompt prefilled each turn.

    python benchmarks/chat_turns.py [--model DIR] [--store disk] [--turns 8] [--tokens 48] [--rounds 4] [--json FILE]

Each round holds one conversation a way, the two ways alternated (which goes first swaps each round), after one
warm-up conversation; greedy replies of `--tokens` tokens through the model's chat template. The table gives the
medians over the second half of the turns (the longer prompts) and over the rounds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from expertcache.cli import run_script
from expertcache.commands.chat import reusable
from expertcache.engine.chat import ChatTemplate, encode_chat
from expertcache.engine.engine import Engine, EngineConfig
from expertcache.engine.generate import TextGeneration
from expertcache.engine.sampling import SamplingParams

LINES = ["Who goes there?", "Nay, answer me: stand, and unfold yourself.", "Long live the king!", "Bernardo?",
         "You come most carefully upon your hour.", "'Tis now struck twelve; get thee to bed, Francisco.",
         "For this relief much thanks: 'tis bitter cold, and I am sick at heart.", "Have you had quiet guard?",
         "Not a mouse stirring.", "Well, good night."]


def conversation(engine: Engine, template: ChatTemplate, turns: int, tokens: int, reuse: bool) -> list[tuple]:
    """One conversation: (prompt tokens, tokens reused, seconds to the first token) of each turn."""
    messages, held, out = [], [], []
    for turn in range(turns):
        messages.append({"role": "user", "content": LINES[turn % len(LINES)]})
        prompt = encode_chat(engine, template, messages)
        cached = reusable(engine, held, prompt) if reuse else 0
        gen = TextGeneration(engine, prompt, SamplingParams(max_tokens=tokens, ignore_eos=True), cached=cached)
        start = time.perf_counter()
        gen.step()
        out.append((len(prompt), cached, time.perf_counter() - start))
        for _ in gen:
            pass
        messages.append({"role": "assistant", "content": engine.decode(gen.tokens)})
        held = (prompt + gen.tokens)[:gen.kv_end]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a checkpoint folder with a chat template (default: built-in)")
    p.add_argument("--store", default="disk")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--tokens", type=int, default=48, help="tokens a reply")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    engine = Engine(a.model, EngineConfig(store=a.store, max_seq=2048))
    template = ChatTemplate.of(engine)
    conversation(engine, template, 2, a.tokens, True)  # warm-up: compiles, fills the cache
    rows: dict[str, list[tuple]] = {"reused": [], "whole": []}
    for r in range(a.rounds):
        for way in (("reused", "whole") if r % 2 == 0 else ("whole", "reused")):
            rows[way] += conversation(engine, template, a.turns, a.tokens, way == "reused")[a.turns // 2:]
    engine.close()
    result = {way: {"prompt_tokens": statistics.median(t[0] for t in r),
                    "reused_tokens": statistics.median(t[1] for t in r),
                    "first_token_ms": 1e3 * statistics.median(t[2] for t in r)} for way, r in rows.items()}
    print("| prefill | prompt tokens | of them reused | time to the first token |\n|---|---:|---:|---:|")
    for way, r in result.items():
        ratio = f" ({result['whole']['first_token_ms'] / r['first_token_ms']:.1f}x)" if way == "reused" else ""
        print(f"| {way} | {r['prompt_tokens']:.0f} | {r['reused_tokens']:.0f} | {r['first_token_ms']:,.0f} ms{ratio} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "result": result}, f, indent=1)


if __name__ == "__main__":
    run_script(main)
