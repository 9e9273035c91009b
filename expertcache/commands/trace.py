"""expertcache trace: record router logits of a text for the simulator."""
from __future__ import annotations

from ..choices import BUILTIN_MODEL, EVAL_TEXT
from .options import add_model_argument, add_text_arguments, file_output_path, positive_int

HELP = "record every token's router logits at every MoE layer into a trace file"


def add_arguments(p):
    """The verb's options."""
    add_model_argument(p)
    add_text_arguments(p, EVAL_TEXT)
    p.add_argument("--out", type=file_output_path, required=True, help="trace file to write")
    p.add_argument("--context", type=positive_int, default=512, help="window length in tokens")
    p.add_argument("--dtype", default="float16", choices=["float16", "float32"],
                   help="how the logits are stored (float32: the simulator's fetch-every-miss counts equal the "
                        "engine's; float16 rounds near-ties in routing)")
    p.add_argument("--max-tokens", type=positive_int, default=None, help="record only the first N tokens")


def run(a) -> int:
    """Run the verb; returns the exit code."""
    from ..lab.calibrate import encode_text
    from ..lab.texts import domain_texts
    from ..lab.trace import record_trace
    from ..progress import progress_bar
    path = a.model or BUILTIN_MODEL
    docs, ids = [], []
    for domain, text in domain_texts(a.text, a.domains):  # documents with known boundaries
        left = None if a.max_tokens is None else a.max_tokens - len(ids)
        if left is not None and left <= 0:
            break
        part = encode_text(path, text, left)
        docs.append([len(ids), len(ids) + len(part), domain])
        ids += part
    with progress_bar(total=len(ids), unit="tok", desc="trace") as bar:
        t = record_trace(path, ids, a.out, a.context, a.dtype, docs, bar.update)
    print(f"wrote {t.num_tokens} tokens x {t.header['num_layers']} layers x {t.header['num_experts']} experts "
          f"({a.dtype}) to {a.out}")
    return 0
