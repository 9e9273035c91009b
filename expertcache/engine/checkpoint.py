"""Read an HF checkpoint folder: config.json, safetensors (single or sharded), tokenizer.json,
and the files `calibrate` writes beside the weights (routing counts, default vectors).

Block-wise fp8 checkpoints (`quantization_config.quant_method: fp8`, as DeepSeek-V3, Kimi K2 and the
Qwen3 *-FP8 releases ship) are read dequantised, as HF transformers loads them without an fp8 GPU:
each float8 weight times its `weight_scale_inv`, one scale per `weight_block_size` block, in the
config's dtype (bf16 for the releases)."""
from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from ..atomic import writable_folder
from ..errors import CheckpointError
from .tensor_file import TensorFile, TensorInfo, check_checksum

DEFAULT_VECTORS = "default_vectors.safetensors"
ESTIMATOR_FILE = "estimator.safetensors"  # the next-layer estimator (engine/predictors.py)
LOOKAHEAD_FILE = "lookahead.safetensors"  # the estimator on the next layer's attention run ahead (same place)
ROUTING_COUNTS = "routing_counts.json"  # per layer, how often each expert is routed on calibration text


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
CONFIG_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


PACKED_SUFFIXES = ("_blocks", "_scales")  # MXFP4 experts' packed codes and exponents (GPT-OSS): bytes, not numbers


@dataclass
class Checkpoint:
    """An opened HF checkpoint folder: its config.json and where each tensor is stored."""
    path: Path
    config: dict
    files: dict[str, Path]  # tensor name -> safetensors file
    fp8_block: tuple[int, int] | None = None  # an fp8 checkpoint's weight_block_size ((0, 0): a scale per tensor)
    headers: dict[Path, dict[str, TensorInfo]] = field(default_factory=dict)  # each file's tensors, parsed once

    def names(self) -> list[str]:
        """Every tensor name in the checkpoint."""
        return list(self.files)

    def info(self, name: str) -> TensorInfo:
        """Tensor `name`'s dtype, shape and place, from its file's header (no data read)."""
        if name not in self.files:
            raise CheckpointError(f"{self.path}: tensor {name!r} is missing; re-export the checkpoint")
        file = self.files[name]
        if file not in self.headers:
            with TensorFile(file) as f:
                self.headers[file] = f.tensors
        if name not in self.headers[file]:
            raise CheckpointError(f"{file} has no tensor {name!r}, where the index puts it; re-download the "
                                  "checkpoint and its model.safetensors.index.json")
        info = self.headers[file][name]
        if not info.dtype.is_floating_point and not name.endswith(PACKED_SUFFIXES):  # would be read as numbers
            raise CheckpointError(f"{file}: tensor {name!r} holds {str(info.dtype).removeprefix('torch.')}, where a "
                                  "weight is floating point; the checkpoint is corrupt or quantized in a way this "
                                  "engine does not read: export it in bf16, fp16 or fp32")
        return info

    def tensor(self, name: str, index: int | None = None) -> torch.Tensor:
        """Load one tensor by its checkpoint name (an fp8 weight dequantised); with `index`, only its [index] along
        the first dimension (one expert of a fused stack)."""
        self.info(name)
        with TensorFile(self.files[name], self.headers[self.files[name]]) as f:
            t = f.get(name, index)
        return self._dequantized(name, t, index)

    def _dequantized(self, name: str, t: torch.Tensor, index: int | None = None) -> torch.Tensor:
        """A float8 weight times its weight_scale_inv blocks, in the config's dtype; other tensors as they are."""
        if t.dtype not in FP8_DTYPES:
            return t
        if self.fp8_block is None:
            raise CheckpointError(f"{self.path}: tensor {name!r} is float8 but config.json has no fp8 "
                                  "quantization_config; restore the config from the model's release")
        scale = self.tensor(name + "_scale_inv", index if index is not None and
                            len(self.info(name + "_scale_inv").shape) == len(self.info(name).shape) else None).float()
        rows, cols = t.shape[-2:] if t.dim() >= 2 else (1, t.shape[-1] if t.dim() else 1)
        bn, bk = self.fp8_block
        if scale.numel() == 1:  # one scale for the tensor
            scale = scale.reshape(())
        elif bn and t.dim() >= 2 and scale.shape[:-2] == t.shape[:-2] and \
                scale.shape[-2:] == (-(-rows // bn), -(-cols // bk)):
            scale = scale.repeat_interleave(bn, -2)[..., :rows, :].repeat_interleave(bk, -1)[..., :cols]
        else:
            raise CheckpointError(f"{self.path}: {name}_scale_inv has shape {tuple(scale.shape)}, which does not "
                                  f"cover {name} {tuple(t.shape)} in blocks of {list(self.fp8_block)}; "
                                  "re-download the checkpoint")
        dtype = self.config.get("dtype") or self.config.get("torch_dtype")
        return (t.float() * scale).to(CONFIG_DTYPES.get(dtype, torch.bfloat16))

    def tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Load several tensors, opening each shard once."""
        by_file: dict[Path, list[str]] = {}
        for n in names:
            if n not in self.files:
                raise CheckpointError(f"{self.path}: tensor {n!r} is missing; re-export the checkpoint")
            by_file.setdefault(self.files[n], []).append(n)
        out = {}
        for file, ns in by_file.items():
            for n in ns:
                self.info(n)
            with TensorFile(file, self.headers[file]) as f:  # its header parsed once, not once an expert
                try:
                    out.update({n: f.get(n) for n in ns})
                except OSError as e:
                    raise CheckpointError(f"{file}: cannot be read ({e}); re-download or re-export it") from None
        return {n: self._dequantized(n, t) for n, t in out.items()}

    def side_json(self, name: str) -> dict:
        """A JSON file beside the weights (tokenizer_config.json, generation_config.json), or {} when there is none."""
        p = self.path / name
        if not p.exists():
            return {}
        try:
            out = json.loads(p.read_text())
        except ValueError as e:  # not JSON, not UTF-8, or an integer of thousands of digits
            raise CheckpointError(f"{p} is not valid JSON ({e}); restore it from the model's release or delete it") \
                from None
        if not isinstance(out, dict):
            raise CheckpointError(f"{p} holds a JSON {type(out).__name__}, not an object; restore it from the "
                                  "model's release or delete it")
        return out

    def eos_token_ids(self, vocab_size: int) -> set[int]:
        """The eos_token_id (an id or a list) of config.json and of generation_config.json (where releases list
        their end-of-turn ids); CheckpointError for one that is no id of the model's vocabulary, which would let
        every generation run to its max_tokens."""
        found = set()
        for name, config in (("config.json", self.config), ("generation_config.json",
                                                            self.side_json("generation_config.json"))):
            ids = config.get("eos_token_id")
            for i in ids if isinstance(ids, list) else [] if ids is None else [ids]:
                if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab_size:  # true is not token 1
                    raise CheckpointError(f"{self.path / name}: eos_token_id {ids!r} must be a token id in [0, "
                                          f"{vocab_size}) or a list of them; restore it from the model's release")
                found.add(i)
        return found

    @property
    def tokenizer_file(self) -> Path | None:
        """tokenizer.json beside the weights, or None if there is none."""
        p = self.path / "tokenizer.json"
        return p if p.exists() else None

    def tokenizer_fix(self) -> str:
        """How to give a checkpoint without tokenizer.json one: from its SentencePiece tokenizer.model where it has
        one (ERNIE 4.5's releases), else from its release."""
        if (self.path / "tokenizer.model").exists():
            return (f"write one from its tokenizer.model: pip install transformers sentencepiece; python -c \"from "
                    f"transformers import AutoTokenizer as T; T.from_pretrained('{self.path}').save_pretrained("
                    f"'{self.path}')\"")
        return "put the model's own tokenizer.json beside its weights"

    @property
    def weight_bytes(self) -> int:
        """Bytes of the safetensors files on disk."""
        return sum(f.stat().st_size for f in set(self.files.values()))


HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]  # *.jinja: the chat template transformers 5 saves
# the same weights again in a layout of another runtime (Mistral's consolidated files, GPT-OSS's original/ and metal/
# folders), which no family reads: fetched, they doubled a download of tens to hundreds of GB
HUB_SKIPPED = ["consolidated*", "original/*", "metal/*"]


def is_hub_id(name: str | Path) -> bool:
    """An `org/name` model id of the Hugging Face Hub, as opposed to a path: a string (a Path is a folder here,
    and has lost the './' that would say so)."""
    if not isinstance(name, str):
        return False
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~")) and not Path(name).exists()


def download(repo_id: str) -> Path:
    """A Hub model's config, weights and tokenizer in huggingface_hub's cache (downloaded once)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise CheckpointError(f"{repo_id} looks like a Hub id, and downloading needs huggingface_hub; "
                              "pip install huggingface_hub, or pass --model a local folder") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, ignore_patterns=HUB_SKIPPED))
    except Exception as e:  # offline, unknown repository, gated model, disk full: one line either way
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{repo_id}: no such folder here, and no Hub download of it ({type(e).__name__}: "
                              f"{reason}); check the id and the network, or pass --model a local folder") from None


CUT_MARGIN = 16  # tokens by where a prefix is cut that may differ from the whole text's


def read_tokenizer(file: Path):
    """The `tokenizers` Tokenizer in `file`, read once while the file is unchanged: `generate` counts its prompt's
    tokens before the engine loads (29 ms for the built-in model's, more for a large vocabulary), and the engine
    then takes the same one. Nothing changes a tokenizer's settings once read, so the two may share it."""
    stat = file.stat()
    return _read_tokenizer(str(file), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _read_tokenizer(file: str, mtime_ns: int, size: int):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(file)


def encode_prefix(encode: Callable[[str], list[int]], text: str, max_tokens: int | None) -> list[int]:
    """The first `max_tokens` ids of encode(text) (every id without a limit), tokenizing only as much of the text as
    they need: prefixes of doubling length, until one gives CUT_MARGIN tokens more than asked and a prefix twice as
    long gives the same first ids (tokens near a cut may differ from the whole text's). A run over the first
    tokens of a large file tokenized all of it: 79 s and 10 GB for 60 MB of text."""
    if max_tokens is None:
        return encode(text)
    n = max(4096, 8 * max_tokens)
    ids = encode(text[:n])
    while n < len(text):
        n *= 2
        longer = encode(text[:n])
        if len(ids) >= max_tokens + CUT_MARGIN and longer[:max_tokens] == ids[:max_tokens]:
            break
        ids = longer
    return ids[:max_tokens]


def check_token_ids(ids: list[int], vocab_size: int, path: str | Path) -> list[int]:
    """`ids` as the checkpoint at `path` tokenized a text; CheckpointError when one is beyond the model's
    `vocab_size` embeddings (a tokenizer.json of another model), which would otherwise fail inside a forward."""
    top = max(ids, default=-1)
    if top >= vocab_size:
        raise CheckpointError(f"{path}: its tokenizer gives token id {top}, but the model has {vocab_size} "
                              "embeddings: tokenizer.json is another model's; put this model's own beside it")
    return ids


def model_folder(path: str | Path) -> Path:
    """The local folder of a checkpoint given as a folder (`~` expanded) or a Hub id (downloaded into
    huggingface_hub's cache): where its weights are read, and the files `calibrate` writes beside them."""
    return download(path) if is_hub_id(path) else Path(path).expanduser()


def model_name(folder: Path) -> str:
    """A checkpoint's name: its folder's, or a Hub snapshot's (models--org--name/snapshots/<commit>) repository's."""
    folder = Path(folder).resolve()
    hub = folder.parent.parent.name
    return hub.split("--")[-1] if folder.parent.name == "snapshots" and hub.startswith("models--") else folder.name


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open a checkpoint folder (single or sharded safetensors), or a Hub id (`org/name`, downloaded
    into huggingface_hub's cache); raises CheckpointError naming the fix."""
    path = model_folder(path)
    if not path.is_dir():
        what = "is a file, not a checkpoint folder" if path.exists() else "no such checkpoint folder"
        raise CheckpointError(f"{path}: {what}; pass --model the folder that holds config.json and *.safetensors")
    try:
        config = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: config.json is missing; copy it from the model's release") from None
    except ValueError as e:  # not JSON, not UTF-8 (it named no file), or an integer of thousands of digits
        raise CheckpointError(f"{path}/config.json is not valid JSON ({e}); restore it from the release") from None
    if not isinstance(config, dict):  # valid JSON of another shape: every reader below takes keys from it
        raise CheckpointError(f"{path}/config.json is a JSON {type(config).__name__}, not an object; restore it from "
                              "the release")
    fp8_block = quantization(path, config)
    index = path / "model.safetensors.index.json"
    files: dict[str, Path] = {}
    # HF transformers reads a single model.safetensors before an index beside it; the same file runs here
    if index.exists() and not (path / "model.safetensors").is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("its weight_map is no object of tensor names to shard files")
        except (ValueError, KeyError, TypeError) as e:  # TypeError: an index that is no object; ValueError: not
            # JSON, not UTF-8, or an integer of thousands of digits
            raise CheckpointError(f"{index}: not a safetensors index ({e}); restore it from the release") from None
        for name, shard in weight_map.items():
            if not (path / shard).exists():
                raise CheckpointError(f"{path}: shard {shard} named by the index is missing; download it")
            files[name] = path / shard
        # HF transformers loads every tensor of the shards the index lists, also one its weight_map omits (an
        # index edited by hand or by a merge tool): read here, where such a model was refused as missing a tensor
        headers = shard_headers(sorted(set(files.values())))
        for shard, names in headers.items():
            files.update({k: shard for k in names if k not in files})
    else:
        # the model's weights, not the files `calibrate` and `predict --train` write beside them
        beside = (DEFAULT_VECTORS, ESTIMATOR_FILE, LOOKAHEAD_FILE)
        single = path / "model.safetensors"
        shards = [single] if single.is_file() else sorted(f for f in path.glob("*.safetensors") if f.name not in beside)
        if not shards:
            if any(path.glob("*.bin")):  # "convert" alone read as `expertcache convert`, which needs safetensors too
                raise CheckpointError(f"{path}: its weights are PyTorch *.bin files, which expertcache does not read; "
                                      "write them as safetensors beside them: python -c \"from transformers import "
                                      "AutoModelForCausalLM as M; M.from_pretrained('"
                                      f"{path}', dtype='auto').save_pretrained('{path}')\"")
            raise CheckpointError(f"{path}: no *.safetensors weights; pass --model the folder that holds the model's "
                                  "config.json and its *.safetensors files")
        headers = shard_headers(shards)
        for shard, names in headers.items():
            files.update(dict.fromkeys(names, shard))
    return Checkpoint(path, config, files, fp8_block, headers)


def shard_headers(shards: list[Path]) -> dict[Path, dict]:
    """Each weight file's safetensors header (its tensors' names, dtypes, shapes and offsets), read once."""
    headers = {}
    for shard in shards:
        with TensorFile(shard) as f:
            headers[shard] = f.tensors
    return headers


def quantization(path: Path, config: dict) -> tuple[int, int] | None:
    """An fp8 checkpoint's weight_block_size ((0, 0) for a scale per tensor); None for float weights.
    GPT-OSS's MXFP4 experts are its family's to read (models/gpt_oss.py); other quantizations are refused."""
    q = config.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method == "mxfp4" and config.get("model_type") == "gpt_oss":
        return None
    if method != "fp8":  # one without a quant_method (MLX's group_size and bits) named by what it gives
        how = repr(method) if method is not None else f"quantization_config {json.dumps(q)[:200]}"
        raise CheckpointError(f"{path}: weights quantized with {how} cannot be read; expertcache reads float "
                              "(bf16, fp16, fp32), block-wise fp8 and GPT-OSS's MXFP4 checkpoints: use the model's "
                              "unquantized release (then --store-dtype int8/int4 quantizes its experts)")
    block = q.get("weight_block_size")
    if block is None:
        return (0, 0)
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise CheckpointError(f"{path}: quantization_config.weight_block_size {block!r} is not two positive whole "
                              "numbers; restore config.json from the model's release")
    return tuple(block)


def check_writable(path: Path, names: tuple[str, ...]) -> None:
    """CheckpointError, before a verb's work, when the checkpoint folder `path` cannot take the files `names` the
    verb writes beside its weights (a read-only mount, another user's folder): found as they were written, it ended
    minutes of work with a fix naming flags the verb does not have."""
    if not writable_folder(Path(path)):
        # the links to the files it writes go, or the writes follow them into the read-only folder
        raise CheckpointError(f"{path} cannot be written (read-only, or not yours), and {' and '.join(names)} go "
                              "beside the weights; give --model a writable folder of links to its files: mkdir MODEL "
                              f"&& ln -s {Path(path).resolve()}/* MODEL && rm -f "
                              f"{' '.join(f'MODEL/{n}' for n in names)}")


def load_routing_counts(model_path: Path, shape: tuple[int, int] | None = None) -> np.ndarray | None:
    """counts [L, E] from routing_counts.json beside the model, or None if there is none."""
    p = Path(model_path) / ROUTING_COUNTS
    if not p.exists():
        return None
    try:
        counts = np.array(json.loads(p.read_text())["counts"], dtype=np.int64)
        if counts.size and counts.min() < 0:  # a warm start ranks by them: a negative one is no count
            raise ValueError(f"a negative count, {counts.min()}")
    except (KeyError, TypeError, ValueError, OverflowError, OSError) as e:  # not a table of whole numbers >= 0
        raise CheckpointError(f"{p}: not a routing-counts file ({type(e).__name__}: {e}); rerun `expertcache "
                              f"calibrate --model {model_path}` or delete the file") from None
    if shape is not None and counts.shape != shape:
        raise CheckpointError(f"{p}: counts of shape {counts.shape} do not fit the model; "
                              f"rerun `expertcache calibrate --model {model_path}` or delete the file")
    return counts


def load_default_vectors(model_path: Path) -> torch.Tensor:
    """default vectors [L, E, H] from default_vectors.safetensors beside the model (written by `calibrate`)."""
    p = Path(model_path) / DEFAULT_VECTORS
    if not p.exists():
        raise CheckpointError(f"{p} is missing; run `expertcache calibrate --model {model_path}`")
    again = f"run `expertcache calibrate --model {model_path}` again"
    try:
        with safe_open(str(p), "pt") as f:
            meta = f.metadata()
        tensors = load_file(str(p))
        vectors = tensors["default_vectors"]
    except (SafetensorError, OSError, KeyError) as e:
        raise CheckpointError(f"{p} is unreadable ({str(e).splitlines()[0][:200]}); {again}") from None
    check_checksum(p, tensors, meta, again)
    bad = f"of {str(vectors.dtype).removeprefix('torch.')}, not floats" if not vectors.dtype.is_floating_point \
        else "with NaN or infinite values" if not torch.isfinite(vectors).all() else None
    if bad:  # predictions from them were silently worse
        raise CheckpointError(f"{p} holds default vectors {bad}; run `expertcache calibrate --model {model_path}` "
                              "again")
    return vectors
