"""Train the byte-level BPE tokenizer of the built-in model on the corpus."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .. import atomic
from .corpus import EOT

# the built-in model's chat format: each turn as its speaker's name in capitals, as in the plays it learnt from
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] | upper }}.\n{{ message['content'] }}\n\n"
                 "{% endfor %}{% if add_generation_prompt %}ASSISTANT.\n{% endif %}")


def train_tokenizer(train_txt: Path, out_dir: Path, vocab_size: int = 8192) -> Tokenizer:
    """Byte-level BPE (GPT-2 style) with EOT as its only special token; writes tokenizer.json and
    tokenizer_config.json (with the chat template)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = train_txt.read_text(encoding="utf-8")
    tok.train_from_iterator((d for d in text.split(EOT)), trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    # tokenizer.json last and whole: a run that finds it takes the tokenizer as made (train.train)
    atomic.write_text(out_dir / "tokenizer_config.json", json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOT, "bos_token": None,
        "pad_token": EOT, "model_max_length": 4096, "add_prefix_space": False,
        "chat_template": CHAT_TEMPLATE}, indent=1))
    with atomic.replaced(out_dir / "tokenizer.json") as tmp:
        tok.save(str(tmp))
    return tok
