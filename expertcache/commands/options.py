"""Options shared by the verbs: one definition of each, with values checked where they are
parsed so that a bad one ends in a line naming the flag."""
from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from ..address_space import check_address_space
from ..atomic import writable_folder, written_in_place
from ..choices import DENSE_DTYPES, DTYPES, INITIAL, IO_BACKENDS, PROMPT_ORDERS, SCHEMES, SLOT_DTYPES
from ..errors import BadInput

if TYPE_CHECKING:  # the verbs import the engine when they run, so that --help starts without torch
    from ..engine.engine import Engine, EngineConfig
    from ..engine.quant import ExpertFormat


def bounded(kind, lo=None, hi=None, lo_open=False, what=""):
    """An argparse type: `kind` within [lo, hi] (lo excluded when lo_open)."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
        if v != v or (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"{text!r} is out of range: {what}")
        return v
    return parse


positive_int = bounded(int, 1, what="give a whole number >= 1")


def byte_size(text: str) -> int:
    """An argparse type: bytes, with an optional K, M, G or T suffix (powers of 1024), e.g. 64M."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = units.get(t[-1:], 1)
    try:
        n = float(t[:-1] if t[-1:] in units else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: a number of bytes, or of K, M, G or T (powers of "
                                         "1024), e.g. 64M, 2G or 1048576") from None
    if not n >= 1 or n != n or n == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is out of range: give a size of at least 1 byte")
    return int(n)


def command_text(text: str) -> str:
    """An argparse type for text given on the command line (a prompt, a stop string): its bytes read as UTF-8.
    Under a C locale without UTF-8 mode (LC_ALL=C PYTHONUTF8=0) Python hands non-ASCII arguments over as lone
    surrogates, which the tokenizer refused as not UTF-8; paths keep Python's form, which opens the file."""
    try:
        data = os.fsencode(text)
    except UnicodeEncodeError:  # characters the filesystem encoding cannot hold: text as Python read it
        return text
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise argparse.ArgumentTypeError(f"not UTF-8 text ({e.reason} at byte {e.start}); give UTF-8 text, or "
                                         "read the text from a file or stdin") from None


non_negative_int = bounded(int, 0, what="give a whole number >= 0")
fraction = bounded(float, 0.0, 1.0, lo_open=True, what="give a fraction in (0, 1], e.g. 0.25")
cache_fraction = bounded(float, 0.0, 1.0, lo_open=True,
                         what="give a fraction of each layer's experts in (0, 1], e.g. 0.25, or a size as --cache-bytes")
non_negative = bounded(float, 0.0, what="give a number >= 0")


def add_model_argument(p: argparse.ArgumentParser, default: str = "the built-in model") -> None:
    """The checkpoint to load (--model; default: the built-in model, or as `default` says where the verb writes
    beside it, which it refuses for the built-in model's shipped files: `written_model`)."""
    # a string until cli.main makes it a folder: Path() drops the './' that says './org/name' is no Hub id
    p.add_argument("--model", type=str, default=None,
                   help="a local HF checkpoint folder, or a Hub id such as Qwen/Qwen3-30B-A3B (downloaded once into "
                        f"huggingface_hub's cache) (default: {default})")


def written_model(a: argparse.Namespace, verb: str, files: str) -> Path:
    """The checkpoint folder `verb` writes `files` into: --model's. BadInput without --model, where they would
    replace the built-in model's shipped files (a first try of `calibrate` changed the package's own)."""
    if a.model is not None:
        return a.model
    from ..choices import BUILTIN_MODEL
    raise BadInput(f"{verb} writes {files} beside the model's weights, and without --model those are the built-in "
                   f"model's shipped files; give --model a copy (cp -r {BUILTIN_MODEL} build/model, then --model "
                   f"build/model), or --model {BUILTIN_MODEL} to refit its own")


def domain_offsets(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated character offsets of topic changes, e.g. 1000,52000."""
    try:
        offsets = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated character offsets; "
                                         "e.g. --domains 1000,52000") from None
    if any(o <= 0 for o in offsets):
        raise argparse.ArgumentTypeError(f"{text!r}: offsets are characters after the start, > 0")
    return offsets


def add_text_arguments(p: argparse.ArgumentParser, default: Path | None = None) -> None:
    """A user's text and where its topics change."""
    p.add_argument("--text", type=Path, default=default,
                   help="UTF-8 text file (default: the built-in evaluation text, with its domains)")
    p.add_argument("--domains", type=domain_offsets, default=None,
                   help="comma-separated character offsets where a new topic starts (default: the segments "
                        "file beside the text, TEXT.json with {\"segments\": [{\"domain\", \"start_char\", "
                        "\"chars\"}]}, else one domain)")


def output_path(text: str) -> Path:
    """A file the verb will write, checked before any work: its folder is made if missing, as another option's
    folder may be (`study --out runs --json runs/study.json`) (argparse type)."""
    path = Path(text)
    if not path.parent.is_dir():
        output_dir(str(path.parent))  # a file where it would go, or nothing writable to make it in: refused
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise argparse.ArgumentTypeError(f"{text}: folder {path.parent} cannot be made ({e.strerror}); give "
                                             "another path") from None
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file name")
    # found at the end of the run: too late. A file is written beside its path and renamed (atomic.replaced); a
    # device such as /dev/stdout in place
    if not (os.access(path, os.W_OK) if written_in_place(path) else writable_folder(path.parent)):
        raise argparse.ArgumentTypeError(f"{text} cannot be written here (permission denied or a read-only "
                                         "filesystem); give another path")
    return path


def file_output_path(text: str) -> Path:
    """A file the verb writes and reads back (a trace, memory-mapped), as `output_path`: not a device or a pipe,
    which take bytes and give none back (argparse type)."""
    path = output_path(text)
    if path.exists() and not path.is_file():
        raise argparse.ArgumentTypeError(f"{text} is not a regular file (a device or a pipe): the file written is "
                                         "read back; give a file path")
    return path


def plot_path(text: str) -> Path:
    """A PNG (or another format matplotlib writes, by its suffix) the verb will write (`output_path`), and matplotlib
    to draw it with, checked before the run (argparse type)."""
    from ..lab.plots import require  # imports nothing heavy: --help stays free of torch
    try:
        require()
    except BadInput as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    # matplotlib picks the format by the suffix: an unknown one failed in a traceback after the run, and none at all
    # wrote NAME.png beside the path given
    from matplotlib.backend_bases import FigureCanvasBase
    kinds = FigureCanvasBase.get_supported_filetypes()
    if Path(text).suffix.lower().lstrip(".") not in kinds:
        raise argparse.ArgumentTypeError(f"{text}: its suffix names no image format matplotlib writes; give a file "
                                         "name ending in .png (or .pdf, .svg)")
    return output_path(text)


def output_dir(text: str) -> Path:
    """A folder the verb will write into (made if missing): not an existing file, checked before any work
    (argparse type)."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file; give a folder")
    existing = nearest_existing(path)
    if not existing.is_dir() or not writable_folder(existing):
        raise argparse.ArgumentTypeError(f"{text} cannot be made or written here ({existing} is not a writable "
                                         "folder); give another path")
    return path


def nearest_existing(path: Path) -> Path:
    """`path`, or the nearest of its parents that exists: where a folder to be made would be made."""
    return next(p for p in (path, *path.absolute().parents) if p.exists())


def json_output(text: str) -> Path | str:
    """--json's file (output_path), or "-": the JSON on stdout, where the verb's other output goes to stderr
    (argparse type)."""
    return "-" if text == "-" else output_path(text)


def add_json_argument(p: argparse.ArgumentParser) -> None:
    """Where to write every number as JSON (--json)."""
    p.add_argument("--json", type=json_output, default=None, help="write every number as JSON to FILE (- for stdout)")


def add_store_arguments(p: argparse.ArgumentParser, store: str = "disk") -> None:
    """Where the model runs and where its experts live."""
    p.add_argument("--device", default="cpu", help="where the model runs: cpu or cuda")
    p.add_argument("--store", default=store, help="slow tier: ram, disk or pinned (default: %(default)s)")
    p.add_argument("--store-dir", type=Path, default=None, help="where the disk store lives (default: under ~/.cache/expertcache, or $EXPERTCACHE_HOME)")
    p.add_argument("--read-mode", default="auto", choices=["auto", "direct", "buffered"],
                   help="disk store reads: O_DIRECT, buffered with the page cache dropped, or auto (O_DIRECT where "
                        "the filesystem allows it; the mode used is in the statistics)")
    p.add_argument("--io", default="auto", choices=IO_BACKENDS,
                   help="how disk-store reads are issued: io_uring from the engine's thread, worker threads, or auto "
                        "(io_uring for O_DIRECT reads where Linux allows it)")
    p.add_argument("--slot-dtype", default="auto", choices=SLOT_DTYPES,
                   help="the experts' format in the fast tier: auto (on the CPU the store's fp16/bf16, else fp32; "
                        "fp16 on CUDA), fp32, fp16, bf16, or int8/int4/mxfp4 (the store's quantized blobs as they "
                        "are, computed by a compiled kernel with int8 activations; needs --store-dtype of the same "
                        "dtype)")
    p.add_argument("--dense-dtype", default="auto", choices=DENSE_DTYPES,
                   help="the dense weights' format (attention, shared and dense MLPs, output): auto (the "
                        "checkpoint's fp16/bf16 on the CPU, fp16 on CUDA: exact), fp32, fp16, bf16, or int8/int4 "
                        "(group 32, asymmetric, computed by the CPU kernel; for models whose dense part does not fit)")
    add_format_arguments(p, "--store-dtype", "the experts' format in the slow tier (default: the checkpoint's "
                                             "dtype, fp16 for the built-in model, the exact reference)")


def group_size(text: str) -> int:
    """A quantization group: a multiple of 8 (the kernel reads 8 codes at a time) (argparse type)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 8 or n % 8:
        raise argparse.ArgumentTypeError(f"group size {text!r} must be a multiple of 8; e.g. --group-size 32 or 64")
    return n


def add_format_arguments(p: argparse.ArgumentParser, flag: str, what: str) -> None:
    """An expert format: the dtype flag, --group-size and --scheme (integer dtypes)."""
    p.add_argument(flag, default=None, choices=DTYPES, help=what)
    p.add_argument("--group-size", type=group_size, default=32,
                   help="int8/int4: inputs sharing one scale (default: %(default)s)")
    p.add_argument("--scheme", default="asym", choices=SCHEMES,
                   help="int8/int4: asym (scale and minimum per group) or sym (scale only)")


def format_from_args(a: argparse.Namespace, dtype: str | None) -> ExpertFormat | None:
    """The format that add_format_arguments' options describe; None for the checkpoint's dtype."""
    from ..engine.quant import ExpertFormat
    return None if dtype is None else ExpertFormat.parse(dtype, a.group_size, a.scheme)


def add_cache_arguments(p: argparse.ArgumentParser) -> None:
    """The fast tier's size and how it is shared."""
    p.add_argument("--cache", type=cache_fraction, default=None, help="cache size as a fraction of each layer's experts "
                   "(default: 0.25, and at least a token's top-k)")
    p.add_argument("--cache-bytes", type=byte_size, default=None, help="expert cache size in bytes, e.g. 32M "
                   "(overrides --cache)")
    p.add_argument("--memory-budget", type=byte_size, default=None, help="bytes of the whole fast tier (dense "
                   "weights, KV cache at --max-seq (serve: --kv-positions), transfer buffers, expert slots), e.g. "
                   "64M; sizes the cache")
    p.add_argument("--quota", default="layer", choices=["layer", "global"], help="per-layer slots or one pool")


def add_engine_arguments(p: argparse.ArgumentParser, store: str = "disk", prompts: bool = True) -> None:
    """Every option of a verb that builds an Engine (`prompts`: one that prefills prompts)."""
    add_model_argument(p)
    add_store_arguments(p, store)
    add_cache_arguments(p)
    p.add_argument("--policy", default="fetch-all",
                   help="miss policy: fetch-all, substitute-all, threshold:tau=0.15, first-choice, "
                        "lowbit:tau=0.15, band:lo=A,hi=B, conditional:j=J,m=M; presets quality-first, speed-first; "
                        "peers' caches mixtral-offloading, moe-infinity, llama.cpp; options sub=best|drop|window, "
                        "window=M, beta=B; with +prefetch/PREDICTOR (or +speculative/PREDICTOR) a next-layer "
                        "predictor, e.g. fetch-all+prefetch/quasi-hidden (each: docs/policies.md)")
    p.add_argument("--eviction", default=None,
                   help="lru, lfu, freq, halving or demand (default: the policy's choice)")
    p.add_argument("--initial", default="auto", choices=INITIAL,
                   help="initial residency: warm, cold or auto (warm when routing counts exist)")
    p.add_argument("--max-seq", type=positive_int, default=2048, help="longest sequence the KV cache holds")
    if prompts:
        p.add_argument("--prompt-order", default="experts", choices=PROMPT_ORDERS,
                       help="a prompt's prefill: experts (each routed expert read at most once a layer and run on "
                            "all its tokens, at full precision whatever the policy) or tokens (decided token by "
                            "token under the policy, as decode would: reads an expert again each time it was evicted)")
    p.set_defaults(engine_options=True)  # engine_config(a) applies


COMPILE_MARKS: list[Path] = []  # marks to leave once the verb that announced compiling succeeds


def announce_compile(*kernels: str) -> None:
    """Say on stderr, when a first run's silent minutes begin (numba's first compile in this process, once per
    version of each set of `kernels` the verb runs: "engine" when none is named, "simulator"), that the kernels are
    being compiled; a run that ends before compiling anything (bad input) says nothing. The marks that end the
    notice are left when the verb succeeds."""
    import sys

    from numba.core import event

    from ..kernel.compiled import cache_dir, kernels_compiled
    marks = [kernels_compiled(k) for k in kernels or ("engine",)]
    new = [m for m in marks if not m.exists() and m not in COMPILE_MARKS]
    if not new:
        return
    listening = bool(COMPILE_MARKS)  # an earlier call's listener says it already
    COMPILE_MARKS.extend(new)
    if listening:
        return

    class Notice(event.Listener):
        said = False

        def on_start(self, ev):
            if not self.said:
                self.said = True
                folder = cache_dir().parent
                try:  # made now, as numba would make it: modes do not stop root, a read-only mount does
                    folder.mkdir(parents=True, exist_ok=True)
                    writable = os.access(folder, os.W_OK)
                except OSError:
                    writable = False
                where = f"cached in {folder}" if writable else (
                    f"{folder} cannot be written, so every run compiles again: set NUMBA_CACHE_DIR or "
                    "XDG_CACHE_HOME to a writable folder")
                print(f"expertcache: compiling the kernels for this CPU (once, a few minutes; {where})",
                      file=sys.stderr, flush=True)

        def on_end(self, ev):
            pass
    event.register("numba:compile", Notice())


def check_environment() -> None:
    """BadInput for an environment variable a verb would fail on far from it: NUMBA_NUM_THREADS, the compiled
    kernels' threads, which numba reads as it is first imported (0 ended in its traceback; a word was ignored with
    a warning and every core used); EXPERTCACHE_HOME, where no folder can be (found where a store was converted);
    an address-space limit too small for the libraries (check_address_space)."""
    check_address_space()
    threads = os.environ.get("NUMBA_NUM_THREADS")
    try:
        ok = threads is None or int(threads) >= 1
    except ValueError:
        ok = False
    if not ok:
        raise BadInput(f"NUMBA_NUM_THREADS={threads!r} is not a whole number >= 1; set it to the threads the compiled "
                       f"kernels use (e.g. NUMBA_NUM_THREADS={os.cpu_count() or 1}), or unset it for every core")
    home = os.environ.get("EXPERTCACHE_HOME")
    if home:  # the disk stores' folder: one that exists is used as it is (a shared read-only one serves its stores)
        from ..engine.stores.convert import expertcache_home
        folder = expertcache_home()
        existing = nearest_existing(folder)
        if not existing.is_dir() or (existing != folder and not writable_folder(existing)):
            what = "not a writable folder" if existing.is_dir() else "a file"
            raise BadInput(f"EXPERTCACHE_HOME={home!r} cannot be made ({existing} is {what}); set it to a folder for "
                           "the disk stores, or unset it for ~/.cache/expertcache")


def compiled_ok() -> None:
    """After a verb succeeded: leave the mark that ends announce_compile's notice."""
    for mark in COMPILE_MARKS:
        try:
            mark.parent.mkdir(parents=True, exist_ok=True)
            mark.touch()
        except OSError:  # a cache folder this user may not write: the notice stays, nothing else is lost
            pass
    COMPILE_MARKS.clear()


def engine_config(a: argparse.Namespace) -> EngineConfig:
    """The EngineConfig that add_engine_arguments' options describe."""
    from ..engine.cache import CacheConfig
    from ..engine.engine import EngineConfig
    from ..lab.bench import parse_variant
    cache = CacheConfig(fraction=a.cache, bytes=a.cache_bytes, quota=a.quota, io=a.io)
    policy, prefetch = parse_variant(a.policy)  # POLICY+prefetch/PREDICTOR[:budget=N,...] attaches a predictor
    return EngineConfig(device=a.device, store=a.store, cache=cache, policy=policy, prefetch=prefetch,
                        eviction=a.eviction, initial=a.initial, store_dir=a.store_dir, max_seq=a.max_seq,
                        memory_budget=a.memory_budget, read_mode=a.read_mode,
                        store_format=format_from_args(a, a.store_dtype), slot_dtype=a.slot_dtype,
                        dense_dtype=a.dense_dtype, kv_positions=getattr(a, "kv_positions", None),
                        prompt_order=getattr(a, "prompt_order", "experts"))


def engine_from_args(a: argparse.Namespace, longest_prompt: int | None = None) -> Engine:
    """The Engine that add_engine_arguments' options describe; `longest_prompt`: the most tokens a prompt of the run
    has, where the verb knows it (EngineConfig.longest_prompt)."""
    announce_compile()
    from ..engine.engine import Engine
    return Engine(a.model, dataclasses.replace(engine_config(a), longest_prompt=longest_prompt))


def check_before_download(a: argparse.Namespace) -> None:
    """The options that need no model, checked before a Hub model downloads (gigabytes, minutes), so that --device
    cuda on a machine without one, or a misspelt --policy, is said at once rather than after the download."""
    from ..engine.engine import checked_device, checked_options
    from ..engine.stores import check_store
    from ..lab.bench import parse_variant
    from ..policies import make_policy
    if hasattr(a, "device"):
        checked_device(a.device)
    if getattr(a, "engine_options", False):
        checked_options(engine_config(a))  # the store with the rest
    elif hasattr(a, "store"):  # a verb that makes its engines itself (calibrate-hw)
        check_store(a.store)
    for spec in getattr(a, "policies", None) or ():  # bench's
        make_policy(parse_variant(spec)[0])


def write_json(path: Path | TextIO | None, data: dict) -> None:
    """Write `data` to `path` (a file, or the stream cli.main gives for `--json -`) as strict JSON when one was
    given."""
    if path is not None:
        from ..jsonout import dump_json
        dump_json(path, data)
