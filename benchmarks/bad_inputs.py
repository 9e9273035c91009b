"""Every bad input and fault we know of, tried through the CLI as a user would: the exit code
and the one line each ends with. Writes a markdown table (stdout) and JSON.

    python benchmarks/bad_inputs.py --json build/results/bad_inputs.json
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from expertcache.choices import CALIB_TEXT
from expertcache.cli import run_script
from expertcache.engine.engine import BUILTIN_MODEL
from expertcache.engine.tensor_file import CHECKSUM, tensors_checksum
from expertcache.progress import progress_bar


def cases(tmp: Path) -> list[tuple]:
    """(what, argv) pairs, or (what, argv, what stdin reads[, soft resource limits]); files they need are made
    under tmp."""
    bad_text = tmp / "latin1.txt"
    bad_text.write_bytes("caf\xe9 na\xefve".encode("latin-1"))
    bom_only = tmp / "bom.txt"
    bom_only.write_bytes(b"\xef\xbb\xbf")
    utf16 = tmp / "utf16.txt"  # its ASCII decodes as UTF-8, a NUL after each character
    utf16.write_text("ROMEO.\nWhat light\n", encoding="utf-16-le")
    short = tmp / "short.txt"
    short.write_text("a")
    five_tokens = tmp / "five_tokens.txt"
    five_tokens.write_text("hello world. ")
    one_word = tmp / "one_word.txt"
    one_word.write_text("ha " * 2000)
    no_config = tmp / "no_config"
    no_config.mkdir()
    bad_json = tmp / "bad_json"
    shutil.copytree(BUILTIN_MODEL, bad_json)
    (bad_json / "config.json").write_text("{not json")
    foreign = tmp / "foreign"
    shutil.copytree(BUILTIN_MODEL, foreign)
    cfg = json.loads((foreign / "config.json").read_text())
    (foreign / "config.json").write_text(json.dumps({**cfg, "model_type": "llama",
                                                     "architectures": ["LlamaForCausalLM"]}))
    torn = tmp / "torn"
    shutil.copytree(BUILTIN_MODEL, torn)
    with open(torn / "model.safetensors", "r+b") as f:
        f.truncate(1 << 20)
    no_counts = tmp / "no_counts"
    shutil.copytree(BUILTIN_MODEL, no_counts)
    (no_counts / "routing_counts.json").unlink()
    store = tmp / "store"
    subprocess.run([sys.executable, "-m", "expertcache.cli", "convert", "--out", str(store)], check=True,
                   capture_output=True)
    corrupt = tmp / "corrupt"
    shutil.copytree(store, corrupt)
    with open(corrupt / "experts.bin", "r+b") as f:
        f.seek(200 * 61440 + 4096)
        f.write(os.urandom(4096))
    truncated = tmp / "truncated"
    shutil.copytree(store, truncated)
    os.truncate(truncated / "experts.bin", 10 * 61440)
    old = tmp / "old"
    shutil.copytree(store, old)
    meta = json.loads((old / "experts.json").read_text())
    (old / "experts.json").write_text(json.dumps({**meta, "format_version": 1}))
    gelu = tmp / "gelu"
    shutil.copytree(BUILTIN_MODEL, gelu)
    (gelu / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu"}))
    odd_kv = tmp / "odd_kv"
    shutil.copytree(BUILTIN_MODEL, odd_kv)
    (odd_kv / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 3}))
    zero_k = tmp / "zero_k"
    shutil.copytree(BUILTIN_MODEL, zero_k)
    (zero_k / "config.json").write_text(json.dumps({**cfg, "num_experts_per_tok": 0}))
    bad_estimator = tmp / "bad_estimator"
    shutil.copytree(BUILTIN_MODEL, bad_estimator)
    (bad_estimator / "estimator.safetensors").write_bytes(b"\0" * 100)
    (bad_estimator / "lookahead.safetensors").unlink()  # a model trained before the lookahead predictor
    old_lookahead = tmp / "old_lookahead"
    shutil.copytree(BUILTIN_MODEL, old_lookahead)
    with safe_open(str(old_lookahead / "lookahead.safetensors"), "pt") as f:  # the net alone, as version 2 held it
        save_file({k: f.get_tensor(k) for k in f.keys() if not k.startswith("sketch.")},
                  str(old_lookahead / "lookahead.safetensors"), metadata={**f.metadata(), "version": "2"})
    bad_tokenizer = tmp / "bad_tokenizer"
    shutil.copytree(BUILTIN_MODEL, bad_tokenizer)
    (bad_tokenizer / "tokenizer.json").write_text("not a tokenizer")
    other_tokenizer = tmp / "other_tokenizer"  # half the vocabulary: the tokenizer is another model's
    shutil.copytree(BUILTIN_MODEL, other_tokenizer)
    with safe_open(str(BUILTIN_MODEL / "model.safetensors"), "pt") as f:
        save_file({k: f.get_tensor(k)[:cfg["vocab_size"] // 2] if "embed_tokens" in k else f.get_tensor(k)
                   for k in f.keys()}, str(other_tokenizer / "model.safetensors"))
    (other_tokenizer / "config.json").write_text(json.dumps({**cfg, "vocab_size": cfg["vocab_size"] // 2}))
    int_weights = tmp / "int_weights"  # a norm exported as integers
    shutil.copytree(BUILTIN_MODEL, int_weights)
    with safe_open(str(BUILTIN_MODEL / "model.safetensors"), "pt") as f:
        save_file({k: f.get_tensor(k).to(torch.int32) if k == "model.norm.weight" else f.get_tensor(k)
                   for k in f.keys()}, str(int_weights / "model.safetensors"))
    tuned = tmp / "tuned"  # a fine-tune of the same shape: the store converted from the original is not its
    shutil.copytree(BUILTIN_MODEL, tuned)
    with safe_open(str(BUILTIN_MODEL / "model.safetensors"), "pt") as f:
        up = "model.layers.0.mlp.experts.0.up_proj.weight"
        save_file({k: f.get_tensor(k) + 0.5 if k == up else f.get_tensor(k) for k in f.keys()},
                  str(tuned / "model.safetensors"))
    gptq = tmp / "gptq"
    shutil.copytree(BUILTIN_MODEL, gptq)
    config = json.loads((gptq / "config.json").read_text())
    (gptq / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))
    bad_tok_config = tmp / "bad_tok_config"
    shutil.copytree(BUILTIN_MODEL, bad_tok_config)
    (bad_tok_config / "tokenizer_config.json").write_text('{"eos_token": ')
    from expertcache.lab.costmodel import DATASHEET
    bad_profile = tmp / "negative_profile.json"
    DATASHEET["a6000-qwen3-30b"].save(bad_profile)
    bad_profile.write_text(json.dumps({**json.loads(bad_profile.read_text()), "fetch_latency_s": -1}))
    from dataclasses import replace
    other_model_profile = tmp / "measured_profile.json"  # measured on a 48-layer, top-8 model
    replace(DATASHEET["a6000-qwen3-30b"], calibration=({"cache": 0.25, "policy": "fetch-all"},)).save(
        other_model_profile)
    from expertcache.engine.checkpoint import open_checkpoint
    from expertcache.models import model_args
    builtin = model_args(open_checkpoint(BUILTIN_MODEL).config)
    other_size_profile = tmp / "measured_profile_9mib.json"  # the built-in model's depth and top-k, 9 MiB experts
    replace(DATASHEET["a6000-qwen3-30b"], layers=builtin.num_moe_layers, top_k=builtin.top_k,
            calibration=({"cache": 0.25, "policy": "fetch-all"},)).save(other_size_profile)
    writable = tmp / "writable"  # a copy the verbs that write beside the weights may write in
    shutil.copytree(BUILTIN_MODEL, writable)
    trace = tmp / "short.ectrace"
    subprocess.run([sys.executable, "-m", "expertcache.cli", "trace", "--max-tokens", "128", "--context", "64",
                    "--out", str(trace)], check=True, capture_output=True)
    flipped_trace = tmp / "flipped.ectrace"  # a byte of its last logit: another finite number
    raw = bytearray(trace.read_bytes())
    raw[-1] ^= 0x01
    flipped_trace.write_bytes(bytes(raw))
    flipped_lookahead = tmp / "flipped_lookahead"  # written with its checksum (the shipped one has none), then flipped
    shutil.copytree(BUILTIN_MODEL, flipped_lookahead)
    with safe_open(str(flipped_lookahead / "lookahead.safetensors"), "pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    save_file(tensors, str(flipped_lookahead / "lookahead.safetensors"),
              metadata={**meta, CHECKSUM: tensors_checksum(tensors)})
    raw = bytearray((flipped_lookahead / "lookahead.safetensors").read_bytes())
    raw[-3] ^= 0x10
    (flipped_lookahead / "lookahead.safetensors").write_bytes(bytes(raw))
    looping_template = tmp / "looping_template"  # loops within loops, each within the sandbox's bound
    shutil.copytree(BUILTIN_MODEL, looping_template)
    (looping_template / "chat_template.jinja").write_text(
        "{% set r = range(100000) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}")
    negative_counts = tmp / "negative_counts"
    shutil.copytree(BUILTIN_MODEL, negative_counts)
    counts = json.loads((negative_counts / "routing_counts.json").read_text())
    counts["counts"][0][0] = -3
    (negative_counts / "routing_counts.json").write_text(json.dumps(counts))
    nan_vectors = tmp / "nan_vectors"
    shutil.copytree(BUILTIN_MODEL, nan_vectors)
    dv = load_file(str(nan_vectors / "default_vectors.safetensors"))
    dv["default_vectors"][1, 2, 3] = float("nan")
    save_file(dv, str(nan_vectors / "default_vectors.safetensors"))
    rope_list = tmp / "rope_list"  # RoPE parameters that are no object
    shutil.copytree(BUILTIN_MODEL, rope_list)
    (rope_list / "config.json").write_text(json.dumps({**cfg, "rope_parameters": ["default"]}))
    rope_zero = tmp / "rope_zero"
    shutil.copytree(BUILTIN_MODEL, rope_zero)
    (rope_zero / "config.json").write_text(json.dumps({**cfg, "rope_theta": 0, "rope_parameters": None}))
    many_k = tmp / "many_k"
    shutil.copytree(BUILTIN_MODEL, many_k)
    (many_k / "config.json").write_text(json.dumps({**cfg, "num_experts_per_tok": cfg["num_experts"] + 1}))
    few_experts = tmp / "few_experts"  # another model's config over these weights (routing counts beside them)
    shutil.copytree(BUILTIN_MODEL, few_experts)
    (few_experts / "config.json").write_text(json.dumps({**cfg, "num_experts": cfg["num_experts"] // 2}))
    huge_experts = tmp / "huge_experts"
    shutil.copytree(BUILTIN_MODEL, huge_experts)
    (huge_experts / "config.json").write_text(json.dumps({**cfg, "num_experts": 10**9}))
    many_layers, dense_type = tmp / "many_layers.json", tmp / "dense_type.json"  # configs alone, for info --config
    many_layers.write_text(json.dumps({**cfg, "num_hidden_layers": 3 * 10**6}))
    dense_type.write_text(json.dumps({**cfg, "model_type": "llama"}))
    expert = "model.layers.1.mlp.experts.5.up_proj.weight"
    no_expert = tmp / "no_expert"  # one expert's tensor left out of the export
    shutil.copytree(BUILTIN_MODEL, no_expert)
    with safe_open(str(BUILTIN_MODEL / "model.safetensors"), "pt") as f:
        save_file({k: f.get_tensor(k) for k in f.keys() if k != expert}, str(no_expert / "model.safetensors"))
    short_expert = tmp / "short_expert"  # one expert's tensor a row short
    shutil.copytree(BUILTIN_MODEL, short_expert)
    with safe_open(str(BUILTIN_MODEL / "model.safetensors"), "pt") as f:
        save_file({k: f.get_tensor(k)[:-1].contiguous() if k == expert else f.get_tensor(k) for k in f.keys()},
                  str(short_expert / "model.safetensors"))
    lost_shard = tmp / "lost_shard"  # two shards and their index, the second not downloaded
    shutil.copytree(BUILTIN_MODEL, lost_shard, ignore=shutil.ignore_patterns("model.safetensors"))
    with safe_open(str(BUILTIN_MODEL / "model.safetensors"), "pt") as f:
        names = sorted(f.keys())
        shards = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
        save_file({k: f.get_tensor(k) for k in shards["model-00001-of-00002.safetensors"]},
                  str(lost_shard / "model-00001-of-00002.safetensors"))
    (lost_shard / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: shard for shard, ks in shards.items() for k in ks}}))
    png = tmp / "plot.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)
    ppl = ["ppl", "--store", "ram", "--max-tokens", "64"]
    fifo = tmp / "fifo"
    os.mkfifo(fifo)
    return [
        ("--context 0", [*ppl, "--context", "0"]),
        ("--context -5", [*ppl, "--context", "-5"]),
        ("--max-tokens 0", ["ppl", "--store", "ram", "--max-tokens", "0"]),
        ("--cache 0", [*ppl, "--cache", "0"]),
        ("--cache 1.5", [*ppl, "--cache", "1.5"]),
        ("--cache abc", [*ppl, "--cache", "abc"]),
        ("--cache 0.01 (fewer slots than top-k)", [*ppl, "--cache", "0.01"]),
        ("--cache-bytes 10", [*ppl, "--cache-bytes", "10"]),
        ("--memory-budget 1M", [*ppl, "--memory-budget", "1M"]),
        ("--memory-budget lots", [*ppl, "--memory-budget", "lots"]),
        ("--memory-budget -1G", [*ppl, "--memory-budget", "-1G"]),
        ("--memory-budget 128M with --cache 0.5", [*ppl, "--memory-budget", "128M", "--cache", "0.5"]),
        ("--context 5000 (past the model's positions)", [*ppl, "--context", "5000"]),
        ("eviction=lfu in the spec and --eviction lru", [*ppl, "--policy", "threshold:tau=0.15,eviction=lfu",
                                                          "--eviction", "lru"]),
        ("trace --out /dev/null", ["trace", "--out", "/dev/null", "--max-tokens", "64"]),
        ("--max-seq 0", [*ppl, "--max-seq", "0"]),
        ("--max-seq 16 with a 64-token window", [*ppl, "--max-seq", "16"]),
        ("--quota nope", [*ppl, "--quota", "nope"]),
        ("--initial hot", [*ppl, "--initial", "hot"]),
        ("--store tape", [*ppl[:1], "--store", "tape", "--max-tokens", "64"]),
        ("--store pinned with a lowbit policy", [*ppl[:1], "--store", "pinned", "--policy", "lowbit:tau=0.15",
                                                 "--max-tokens", "64"]),
        ("--eviction random", [*ppl, "--eviction", "random"]),
        ("--device cuda without a GPU", [*ppl, "--device", "cuda"]),
        ("--policy nope", [*ppl, "--policy", "nope"]),
        ("--policy conditional:j=20,m=4", [*ppl, "--policy", "conditional:j=20,m=4"]),
        ("--policy threshold:tau=2", [*ppl, "--policy", "threshold:tau=2"]),
        ("--policy threshold:tau=nan", [*ppl, "--policy", "threshold:tau=nan"]),
        ("--policy threshold:tau=0.1,tau=0.2", [*ppl, "--policy", "threshold:tau=0.1,tau=0.2"]),
        ("--policy band:lo=0.5,hi=0.2", [*ppl, "--policy", "band:lo=0.5,hi=0.2"]),
        ("--policy first-choice:sub=odd", [*ppl, "--policy", "first-choice:sub=odd"]),
        ("--policy substitute-all:sub=window,window=200", [*ppl, "--policy", "substitute-all:sub=window,window=200"]),
        ("--policy threshold:beta=-1", [*ppl, "--policy", "threshold:beta=-1"]),
        ("text not UTF-8", [*ppl, "--text", str(bad_text)]),
        ("text of one token", [*ppl, "--text", str(short)]),
        ("text file missing", [*ppl, "--text", str(tmp / "nope.txt")]),
        ("model folder missing", [*ppl, "--model", str(tmp / "nope")]),
        ("model without config.json", [*ppl, "--model", str(no_config)]),
        ("config.json not JSON", [*ppl, "--model", str(bad_json)]),
        ("unsupported model_type", [*ppl, "--model", str(foreign)]),
        ("truncated safetensors", [*ppl, "--model", str(torn)]),
        ("--initial warm without routing counts", [*ppl, "--model", str(no_counts), "--initial", "warm"]),
        ("disk store with corrupt bytes", ["ppl", "--store", "disk", "--store-dir", str(corrupt), "--max-tokens",
                                           "512", "--cache", "0.25", "--initial", "cold"]),
        ("disk store truncated", ["ppl", "--store", "disk", "--store-dir", str(truncated), "--max-tokens", "64"]),
        ("disk store of an old format", ["ppl", "--store", "disk", "--store-dir", str(old), "--max-tokens", "64"]),
        ("simulate a file that is not a trace", ["simulate", str(png)]),
        ("simulate a missing trace", ["simulate", str(tmp / "nope.ectrace")]),
        ("simulate --jobs 0", ["simulate", str(png), "--jobs", "0"]),
        ("simulate --window 0", ["simulate", str(png), "--window", "0"]),
        ("predict --epochs 0", ["predict", "--train", "--epochs", "0"]),
        ("generate -n -1", ["generate", "--store", "ram", "-n", "-1", "hi"]),
        ("generate --temperature -1", ["generate", "--store", "ram", "--temperature", "-1", "hi"]),
        ("generate --top-p 2", ["generate", "--store", "ram", "--top-p", "2", "hi"]),
        ("generate --presence-penalty 3", ["generate", "--store", "ram", "--presence-penalty", "3", "hi"]),
        ("generate --min-new-tokens over -n", ["generate", "--store", "ram", "-n", "4", "--min-new-tokens", "5", "hi"]),
        ("generate --logit-bias without a bias", ["generate", "--store", "ram", "--logit-bias", "42", "hi"]),
        ("generate --logit-bias on no token", ["generate", "--store", "ram", "--logit-bias", "99999999=1", "hi"]),
        ("generate --json-schema of no type", ["generate", "--store", "ram", "--json-schema", '{"type": "bogus"}']),
        ("generate --json-schema no file", ["generate", "--store", "ram", "--json-schema", "/nonexistent.json"]),
        ("generate --json-schema with --min-new-tokens", ["generate", "--store", "ram", "--json-schema",
                                                          '{"type": "object"}', "--min-new-tokens", "2"]),
        ("generate --grammar of a rule never defined", ["generate", "--store", "ram", "--grammar", "root ::= x"]),
        ("generate --grammar with --json-schema", ["generate", "--store", "ram", "--grammar", 'root ::= "a"',
                                                   "--json-schema", "{}"]),
        ("convert --out under a file", ["convert", "--out", str(png / "store")]),
        ("convert --group-size 1", ["convert", "--dtype", "int4", "--group-size", "1"]),
        ("config with top-k 0", [*ppl, "--model", str(zero_k)]),
        ("config with hidden_act gelu", [*ppl, "--model", str(gelu)]),
        ("config with key-value heads that do not divide the heads", [*ppl, "--model", str(odd_kv)]),
        ("tokenizer.json not a tokenizer", [*ppl, "--model", str(bad_tokenizer)]),
        ("tokenizer.json of a model with more tokens", [*ppl, "--model", str(other_tokenizer)]),
        ("generate --device tpu", ["generate", "--store", "ram", "--device", "tpu", "hi"]),
        ("generate a prompt that is not UTF-8", ["generate", "--store", "ram", "caf\udce9"]),
        ("generate a stop string that is not UTF-8", ["generate", "--store", "ram", "--stop", "\udcff"]),
        ("generate two prompts", ["generate", "--store", "ram", "-p", "a", "b"]),
        ("generate --temperature inf", ["generate", "--store", "ram", "--temperature", "inf", "hi"]),
        ("serve --port 70000", ["serve", "--port", "70000"]),
        ("ppl --json into a folder under a file", [*ppl, "--json", str(png / "out.json")]),
        ("simulate --policies with none", ["simulate", str(png), "--policies"]),
        ("generate --device mps", ["generate", "--store", "ram", "--device", "mps", "hi"]),
        ("generate --max-seq 1000000000", ["generate", "--store", "ram", "--max-seq", "1000000000", "hi"]),
        ("generate an empty prompt", ["generate", "--store", "ram", "-p", ""]),
        ("--read-mode direct with the ram store", [*ppl, "--read-mode", "direct"]),
        ("study --out a file", ["study", "--out", str(png)]),
        ("bench prefetch drop=2", ["bench", "--policies", "fetch-all+prefetch/quasi-hidden:drop=2"]),
        ("generate prefetch confidence=2", ["generate", "--policy", "fetch-all+prefetch/lookahead:confidence=2"]),
        ("tune --profile with a negative term", ["tune", "--profile", str(bad_profile)]),
        ("tune --cache-bytes 1 (fewer slots than top-k)", ["tune", "--cache-bytes", "1"]),
        ("tune --text the calibration text", ["tune", "--text", str(CALIB_TEXT)]),
        ("--json onto a full disk (/dev/full)", ["info", "--json", "/dev/full"]),
        ("config quantized with GPTQ", [*ppl, "--model", str(gptq)]),
        ("a weight stored as integers", [*ppl, "--model", str(int_weights)]),
        ("--store-dir of another checkpoint of the same shape", ["ppl", "--model", str(tuned), "--store", "disk",
                                                                 "--store-dir", str(store), "--max-tokens", "64"]),
        ("tokenizer_config.json not JSON", ["generate", "--model", str(bad_tok_config), "--store", "ram", "hi"]),
        ("estimator.safetensors corrupt", ["predict", "--model", str(bad_estimator), "--max-tokens", "64",
                                           "--predictors", "estimator"]),
        ("lookahead.safetensors missing", ["generate", "--model", str(bad_estimator), "--store", "ram",
                                           "--policy", "fetch-all+prefetch/lookahead", "hi"]),
        ("lookahead.safetensors without sketches", ["generate", "--model", str(old_lookahead), "--store", "ram",
                                                    "--policy", "fetch-all+prefetch/lookahead", "hi"]),
        ("predict --sketch-rank -1", ["predict", "--train", "--sketch-rank", "-1"]),
        ("predict --lookahead-width 0", ["predict", "--train", "--lookahead-width", "0"]),
        ("serve --prefill-policy conditional:j=16,m=16 (top-8 model)",
         ["serve", "--store", "ram", "--port", "0", "--prefill-policy", "conditional:j=16,m=16"]),
        ("serve --prefill-policy nope", ["serve", "--store", "ram", "--port", "0", "--prefill-policy", "nope"]),
        ("serve --max-waiting 0", ["serve", "--store", "ram", "--port", "0", "--max-waiting", "0"]),
        ("serve --prefill-chunk -1", ["serve", "--store", "ram", "--port", "0", "--prefill-chunk", "-1"]),
        ("generate --prompt-order words", ["generate", "-p", "hi", "--prompt-order", "words"]),
        ("serve --shutdown-timeout -1", ["serve", "--store", "ram", "--port", "0", "--shutdown-timeout", "-1"]),
        ("serve --api-key with a space", ["serve", "--store", "ram", "--port", "0", "--api-key", "my key"]),
        ("info --budget in bytes without a unit (a plain number is MiB)", ["info", "--budget", "16000000000"]),
        ("an unknown verb", ["nope"]),
        ("a flag of another verb (chat --max-tokens)", ["chat", "--max-tokens", "16"]),
        ("study --tokens-per-domain below --context", ["study", "--tokens-per-domain", "256", "--out",
                                                       str(tmp / "study")]),
        ("a text file of a byte-order mark alone", ["ppl", "--text", str(bom_only)]),
        ("a text file in UTF-16 without a byte-order mark", [*ppl, "--text", str(utf16)]),
        ("ppl --context past the model's context", ["ppl", "--store", "ram", "--context", "4096", "--max-tokens",
                                                    "4096"]),
        ("simulate with a profile measured on another model", ["simulate", str(trace), "--policies", "fetch-all",
                                                               "--profile", str(other_model_profile)]),
        ("routing_counts.json with a negative count", [*ppl, "--model", str(negative_counts)]),
        ("default_vectors.safetensors with a NaN", ["predict", "--model", str(nan_vectors), "--max-tokens", "64",
                                                    "--predictors", "quasi-hidden"]),
        ("trace --context past the model's context", ["trace", "--context", "4096", "--max-tokens", "4096", "--out",
                                                      str(tmp / "long.ectrace")]),
        ("--cache nan", [*ppl, "--cache", "nan"]),
        ("--cache -1", [*ppl, "--cache", "-1"]),
        ("--policy threshold:tau (no value)", [*ppl, "--policy", "threshold:tau"]),
        ("--policy fetch-all+fetch-all", [*ppl, "--policy", "fetch-all+fetch-all"]),
        ("config with RoPE parameters that are no object", [*ppl, "--model", str(rope_list)]),
        ("config with rope_theta 0", [*ppl, "--model", str(rope_zero)]),
        ("config with more experts per token than experts", [*ppl, "--model", str(many_k)]),
        ("config of half the experts the router routes", [*ppl, "--model", str(few_experts)]),
        ("info on a config of half the experts the router routes", ["info", "--model", str(few_experts)]),
        ("info on a config of 10^9 experts", ["info", "--model", str(huge_experts)]),
        ("text from /dev/zero", [*ppl, "--text", "/dev/zero"]),
        ("checkpoint without one expert's tensor", [*ppl, "--model", str(no_expert)]),
        ("checkpoint with one expert's tensor a row short", [*ppl, "--model", str(short_expert)]),
        ("sharded checkpoint without a shard its index names", [*ppl, "--model", str(lost_shard)]),
        ("generate a prompt past the model's context", ["generate", "--store", "ram", "-p", "word " * 3000]),
        ("--model ./org/name that is no folder (no Hub lookup)", [*ppl, "--model", "./org/name"]),
        ("--store-dir a file", [*ppl, "--store", "disk", "--store-dir", str(bad_text)]),
        ("--store-dir under a file", [*ppl, "--store", "disk", "--store-dir", str(bad_text / "store")]),
        ("--store-dtype other than the store's", ["ppl", "--store", "disk", "--store-dir", str(store),
                                                  "--store-dtype", "int8", "--max-tokens", "64"]),
        ("simulate a FIFO (its open waited for a writer)", ["simulate", str(fifo), "--policies", "fetch-all"]),
        ("info on a config of 3,000,000 layers (ran for minutes)", ["info", "--config", str(many_layers)]),
        ("info on a config of a dense family's model_type", ["info", "--config", str(dense_type)]),
        ("info --config and --model at once (--model was ignored)", ["info", "--config", str(many_layers), "--model",
                                                                     str(few_experts)]),
        ("generate --logit-bias past [-100, 100]", ["generate", "-n", "1", "--logit-bias", "42=1000"]),
        ("simulate with a profile measured on experts of another size", ["simulate", str(trace), "--policies",
                                                                         "fetch-all", "--profile",
                                                                         str(other_size_profile)]),
        ("calibrate on a text of 5 tokens", ["calibrate", "--model", str(writable), "--text", str(five_tokens)]),
        ("predict --train on a text of 5 tokens", ["predict", "--train", "--model", str(writable), "--text",
                                                   str(five_tokens)]),
        ("predict --train on a word repeated 2,000 times", ["predict", "--train", "--model", str(writable),
                                                            "--text", str(one_word)]),
        ("simulate a trace with a flipped byte in its logits", ["simulate", str(flipped_trace), "--policies",
                                                                "fetch-all"]),
        ("generate with a flipped byte in lookahead.safetensors", ["generate", "--model", str(flipped_lookahead),
                                                                   "--store", "ram", "--policy",
                                                                   "fetch-all+prefetch/lookahead", "hi"]),
        ("chat with a template that loops for ever (a message on stdin)", ["chat", "--model", str(looping_template),
                                                                           "-n", "4"], "hi\n"),
        ("generate under an address-space limit of 1 GB (ulimit -v)", ["generate", "-n", "2", "hi"], None,
         {resource.RLIMIT_AS: 10**9}),
    ]


def run(argv: list[str], home: Path, stdin: str | None = None, limits: dict | None = None) -> tuple[int, str]:
    """The exit code and last line of `expertcache ARGV`, fed `stdin`, under `limits` (soft resource limits)."""
    env = {**os.environ, "EXPERTCACHE_HOME": str(home)}
    out = subprocess.run([sys.executable, "-m", "expertcache.cli", *argv], capture_output=True, text=True,
                         timeout=600, env=env, input=stdin, stdin=subprocess.DEVNULL if stdin is None else None,
                         preexec_fn=(lambda: [resource.setrlimit(k, (v, resource.getrlimit(k)[1]))
                                              for k, v in limits.items()]) if limits else None)
    lines = [line for line in out.stderr.splitlines() if line.strip() and "it/s]" not in line and "tok/s]" not in line]
    return out.returncode, lines[-1] if lines else ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        with progress_bar(None, unit="input") as bar:  # where stderr is a terminal
            for what, argv, *more in cases(tmp):  # a case may give what its stdin reads, and limits
                bar.set_description(what[:60])
                code, line = run(argv, tmp / "home", *more)
                rows.append({"input": what, "exit": code, "message": line.replace(str(tmp), "TMP")})
                bar.update()
    print("| bad input or fault | exit | what the user sees |\n|---|---:|---|")
    for r in rows:
        print(f"| {r['input']} | {r['exit']} | {r['message'].replace('|', '/')} |")
    bad = [r for r in rows if r["exit"] != 2]
    print(f"\n{len(rows)} inputs, {len(rows) - len(bad)} ended with exit 2 and one line; others: "
          + (", ".join(f"{r['input']} ({r['exit']})" for r in bad) or "none"))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    run_script(main)
