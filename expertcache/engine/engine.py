"""Load a checkpoint into the engine: dense weights on the compute device, experts in a slow
tier, a fast-tier expert cache between them, and a miss policy deciding on every miss."""
from __future__ import annotations

import functools
import math
import os
import resource
import shlex
import sys
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..choices import BUILTIN_MODEL, INITIAL, PROMPT_ORDERS  # noqa: F401 (BUILTIN_MODEL re-exported)
from ..errors import (
    BadInput,
    CacheTooSmall,
    CheckpointError,
    NonFiniteOutput,
    NotEnoughMemory,
    UnknownName,
    size_text,
    truth,
    whole_number,
)
from ..kernel.compiled import kernels_cached
from ..kernel.eviction import eviction_code
from ..models import model_args
from ..models.args import ModelArgs
from ..policies import MissPolicy, as_policy, eviction_order, make_policy
from .cache import CacheConfig, ExpertCache, least_slots_per_layer, slots_per_layer
from .compile_clock import compile_seconds
from .slots import slot_bytes, slot_format
from .checkpoint import (ROUTING_COUNTS, check_token_ids, encode_prefix, load_routing_counts, open_checkpoint,
                         read_tokenizer)
from . import threads
from ..address_space import address_space_room
from .budget import (
    DECODE_PASS,
    FORWARD_CHUNK,
    SMALLER_PASSES,
    MemoryPlan,
    available_memory,
    dense_bytes,
    kv_bytes,
    map_large_blocks,
    workspace_bytes,
)
from .linear import dense_format, float_dtype
from .moe import MoELayerRunner, PrefetchConfig
from .predictors import Predictor, make_predictor, predictor_bytes
from .quant import FLOAT_DTYPES, SMALL_FORMAT, ExpertFormat, checked_format
from .stats import RunStats
from .stores import ExpertShape, ExpertStore, check_store, open_store, staging_bytes
from .stores.ram import held_dtype
from .transformer import Transformer
from .weights import check_config_fits_weights, dense_names, dense_weights, expert_dtype


@dataclass(frozen=True)
class EngineConfig:
    """How an Engine runs a checkpoint: compute device, slow-tier store, cache size, miss policy,
    eviction order, initial residency, expert formats, prefetching and an optional memory budget."""
    device: str = "cpu"
    store: str = "ram"  # ram | disk | pinned
    cache: CacheConfig = field(default_factory=CacheConfig)
    policy: str = "fetch-all"
    eviction: str | None = None  # None: CacheConfig's, else the policy's preferred order (lru; freq for the presets)
    initial: str = "auto"  # warm: most-routed experts first; cold: empty; auto: warm if counts exist
    store_dir: Path | None = None
    read_mode: str = "auto"  # disk store: direct (O_DIRECT or an error), buffered, auto (direct where allowed)
    verify: bool = True  # disk store: check each fetched blob's CRC32C
    store_format: ExpertFormat | None = None  # the experts' format in the slow tier; None: the checkpoint's
    small_format: ExpertFormat = SMALL_FORMAT  # the low-precision copies `lowbit` policies fetch
    max_seq: int = 2048
    # positions of keys and values the fast tier holds: a server's active requests together (serve/scheduler.py
    # admits a request only while its prompt + max_tokens fit); None: max_seq, one sequence
    kv_positions: int | None = None
    prefetch: PrefetchConfig | None = None  # predict the next layer's experts and prefetch them
    memory_budget: int | None = None  # bytes of the whole fast tier; sizes the expert cache (no cache size beside it)
    # the most tokens a prompt of the run has, where known (generate's): a memory budget then plans forward passes
    # no longer, and gives the slots what longer ones would take; a longer prompt still runs, in more passes.
    # None: a prompt as long as its reply
    longest_prompt: int | None = None
    slot_dtype: str = "auto"  # the fast tier's expert format: auto, fp32, fp16, bf16, int8, int4 (slots.slot_format)
    dense_dtype: str = "auto"  # the dense weights' format: auto (the checkpoint's 16 bits), fp32, fp16, bf16, int8, int4
    # how a prompt's prefill meets the cache (generate, chat, serve; a scored window always runs in token order):
    # experts: each routed expert resident or read once a layer, and run on all its tokens, at full precision;
    # tokens: decided token by token as decode would, under the policy (the emulation's order)
    prompt_order: str = "experts"

    def __post_init__(self):
        # the types, which every road checks nowhere else (a float max_seq or a string budget failed inside torch);
        # the ranges where the model is known (Engine._load)
        for name in ("max_seq", "kv_positions", "memory_budget", "longest_prompt"):
            if getattr(self, name) is not None or name == "max_seq":
                object.__setattr__(self, name, whole_number(getattr(self, name), name))
        for name in ("store_format", "small_format"):  # None: the checkpoint's format, for the store only
            if getattr(self, name) is not None or name == "small_format":
                object.__setattr__(self, name, checked_format(getattr(self, name), name))
        if self.store_dir is not None and (not isinstance(self.store_dir, (str, os.PathLike)) or
                                           not os.fspath(self.store_dir)):  # '' is the working directory to Path
            raise BadInput(f"store_dir={self.store_dir!r} must be a folder (a str or Path), or None for the default "
                           "one under ~/.cache")
        if self.store_dir is not None:  # '~/x' made a folder named '~' where the run started
            store_dir = Path(self.store_dir).expanduser()
            if store_dir.exists() and not store_dir.is_dir():
                raise BadInput(f"the store folder {store_dir} is a file; give a folder (made where missing) to "
                               "store_dir (--store-dir), or leave it out for the default one under ~/.cache")
            object.__setattr__(self, "store_dir", store_dir)
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise BadInput(f"memory_budget={self.memory_budget} must be a positive number of bytes, e.g. 8 * 2**30")
        if self.longest_prompt is not None and self.longest_prompt <= 0:
            raise BadInput(f"longest_prompt={self.longest_prompt} must be a positive number of tokens, or None for "
                           "a prompt as long as its reply")
        # names, before a store is converted and the weights load for them (minutes at real size)
        if self.initial not in INITIAL:
            raise UnknownName(f"unknown initial residency {self.initial!r}; choose warm, cold or auto")
        if self.prompt_order not in PROMPT_ORDERS:
            raise UnknownName(f"unknown prompt_order {self.prompt_order!r}; choose one of {', '.join(PROMPT_ORDERS)}")
        if not isinstance(self.verify, bool):  # "no" would read as true
            raise BadInput(f"verify={self.verify!r} must be True or False")
        if not isinstance(self.cache, CacheConfig):
            raise BadInput(f"cache must be a CacheConfig, e.g. CacheConfig(fraction=0.25), not "
                           f"{type(self.cache).__name__}")
        if self.memory_budget is not None and (self.cache.fraction is not None or self.cache.bytes is not None):
            # a size asked for would be silently replaced by what the budget leaves
            raise BadInput("a memory budget sizes the expert cache from what it leaves; give it or a cache size "
                           "(--cache or --cache-bytes; CacheConfig's fraction or bytes), not both")
        if self.prefetch is not None and not isinstance(self.prefetch, PrefetchConfig):
            raise BadInput(f"prefetch must be a PrefetchConfig, e.g. PrefetchConfig('lookahead'), not "
                           f"{type(self.prefetch).__name__}")


def checked_device(name: object) -> torch.device:
    """The device `name` names, where this engine can run on it (cpu, cuda or cuda:N, with CUDA present)."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):  # an unknown name; None or another type
        device = None
    if device is None or device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index not in (None, 0)):
        raise UnknownName(f"unknown device {name!r}; use cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UnknownName("device 'cuda' asked for but torch sees no CUDA device; use --device cpu")
    return device


def checked_options(config: EngineConfig, policy: MissPolicy | str | None = None) -> MissPolicy:
    """The run's policy (`policy`, else the config's), and the store and the options it must agree with: what needs
    no model. The command line runs this and checked_device before a Hub model downloads."""
    policy = make_policy(config.policy) if policy is None else as_policy(policy)
    if config.read_mode != "auto" and config.store != "disk":
        raise BadInput(f"--read-mode {config.read_mode} is how the disk store reads; the {config.store} store "
                       "reads none: drop it, or use --store disk")
    if policy.fetches_small and config.store == "pinned":
        raise BadInput(f"policy {policy.name!r} fetches {config.small_format.tag} copies of the experts, which "
                       "the pinned store does not hold (it keeps float experts only); use --store disk or "
                       "--store ram, or a policy that fetches no low-precision copies")
    check_store(config.store)
    return policy


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process on `device`: the CUDA allocator's maximum, or the
    maximum resident set size on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def non_finite_cause(held: dict[str, torch.dtype | None], checkpoint: torch.dtype) -> str:
    """Why a run's logits were not finite: fp16 overflow where a part is held in fp16 (`held`: compute,
    dense, slot dtypes) although the checkpoint's values are bf16 or fp32 (a wider range: 65504 is fp16's
    largest); else corrupt weights."""
    narrowed = [part for part, d in held.items() if d == torch.float16]
    if narrowed and checkpoint in (torch.bfloat16, torch.float32):
        ckpt = {torch.bfloat16: "bf16", torch.float32: "fp32"}[checkpoint]
        return (f"an overflow of fp16 (largest value 65504): the {ckpt} checkpoint runs with its "
                f"{' and '.join(narrowed)} {'dtype' if len(narrowed) == 1 else 'dtypes'} in fp16; keep its own "
                f"dtype (--dense-dtype auto --slot-dtype auto{', or bf16' if ckpt == 'bf16' else ''}) or fp32")
    return "corrupt weights; check the checkpoint, or rerun `expertcache convert` for a disk store"


def max_seq_limit(args: ModelArgs) -> int:
    """The longest sequence an engine takes: the model's context (max_position_embeddings), or the default
    max_seq if that is longer (small test models). RoPE tables are built to max_seq at load."""
    return max(args.max_position_embeddings, EngineConfig.max_seq)


def check_context(context: int, args: ModelArgs) -> None:
    """BadInput where windows of `context` tokens reach past the positions the model was made for (whatever the
    text's length: a trace recorded its context as given), where its routing was never learned."""
    if context > (limit := max_seq_limit(args)):
        raise BadInput(f"--context {context} is longer than the model's context of {limit} positions; lower "
                       "--context")


COMPILE_BYTES = 2**30  # what compiling the kernels adds to a first run's peak (1.07 GB on the built-in model, AVX-512)


def refuse_unless_fits(parts: dict[str, int], free: int, where: str, free_where: str, fixes: str) -> None:
    """NotEnoughMemory naming the parts (bytes by name) a run would hold `where` and the fixes, when together they
    are clearly more than `free` bytes: past the budget's own tolerance (a run the plan puts just past what is free
    may fit)."""
    need = sum(parts.values())
    if need > 1.05 * free:
        held = ", ".join(f"{k} {size_text(v)}" for k, v in parts.items() if v >= 2**20)
        raise NotEnoughMemory(f"this run would hold {size_text(need)}{where} ({held}), more than the "
                              f"{size_text(free)} {free_where}; use {fixes}")


def _most(lo: int, hi: int, ok) -> int:
    """The largest n in [lo, hi] with ok(n), ok falling from true to false as n grows; lo where none is."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def held_in_memory(what: str, each: int, shape: ExpertShape) -> dict[str, int]:
    """What a ram or pinned store holds of every expert (`each` bytes apiece), named `what`, and the layer read from
    the checkpoint while it fills them: the parts refuse_unless_fits weighs."""
    return {what: each * shape.num_layers * shape.num_experts, "a layer read while they load": each * shape.num_experts}


# what a closed engine lets go at once: the slots, the weights, the KV cache, the stores and the predictors
HELD_UNTIL_CLOSED = ("model", "cache", "runner", "store", "small_store", "_predictors")


class Engine:
    """A checkpoint run with its experts in a slow tier and an expert cache in the fast tier, under one
    miss policy; `forward(ids [T], pos) -> logits [T, V]`."""
    def __init__(self, model_path: str | Path | None = None, config: EngineConfig = EngineConfig(),
                 policy: MissPolicy | str | None = None):
        # one call at a time: two threads' forwards at once freed the same buffers twice (the process aborted); a
        # reentrant lock, as set_policy's reset runs within set_policy
        self._calls = threading.RLock()
        map_large_blocks()
        try:
            self._load(model_path, config, policy)
        except BaseException:  # what was opened before the failing step: the stores' files, the ring, threads
            self.closed = True  # nor does it hold the policy it bound
            for part in ("cache", "small_store", "store"):
                if getattr(self, part, None) is not None:
                    getattr(self, part).close()
            raise

    def _load(self, model_path: str | Path | None, config: EngineConfig, policy: MissPolicy | str | None) -> None:
        self.closed = False
        if not isinstance(config, EngineConfig):
            raise BadInput(f"config must be an EngineConfig, e.g. EngineConfig(store='disk'), not "
                           f"{type(config).__name__}")
        if model_path is not None and not isinstance(model_path, (str, Path)):
            raise BadInput(f"model_path must be a checkpoint folder or a Hub id (a str or Path), not "
                           f"{type(model_path).__name__}")
        if model_path == "":  # an unset variable's value: the built-in model ran in the checkpoint's place, silently
            raise BadInput("model_path='' names no checkpoint; give its folder or Hub id, or None for the built-in "
                           "model")
        self.config = config
        self.device = checked_device(config.device)
        policy = checked_options(config, policy)
        # as given: Path() drops the './' that says './org/name' is a folder here, not a Hub id
        ckpt = open_checkpoint(model_path if model_path is not None else BUILTIN_MODEL)
        self.path = ckpt.path  # a Hub id's snapshot folder: routing counts and predictors are read beside its weights
        self.args = model_args(ckpt.config)
        ckpt.eos_token_ids(self.args.vocab_size)  # refused at open: a server would fail every request
        limit = max_seq_limit(self.args)
        if not 1 <= config.max_seq <= limit:
            context = "max_position_embeddings" if limit == self.args.max_position_embeddings else \
                f"at least the default {limit}, past the config's {self.args.max_position_embeddings}"
            raise BadInput(f"--max-seq {config.max_seq} (or a study's or tune's --context) is outside the model's "
                           f"context of {limit} positions ({context}); give 1 to {limit}")
        if config.kv_positions is not None and config.kv_positions < config.max_seq:
            raise BadInput(f"--kv-positions {config.kv_positions} holds less than one --max-seq {config.max_seq} "
                           f"sequence; give at least {config.max_seq}")
        self.policy = self._fit(policy)  # refused before any weight is read; bound in full below
        # before the files beside the weights, which a config of another fits no better
        check_config_fits_weights(ckpt, self.args)
        self.routing_counts = load_routing_counts(self.path, (self.args.num_moe_layers, self.args.num_experts))
        self.checkpoint = ckpt
        self.dense_format = dense_format(config.dense_dtype, self.device)
        embed = ckpt.info(dense_names(ckpt, self.args)["embed"]).dtype
        held_dense = float_dtype(config.dense_dtype, self.device, embed)
        # the compute dtype: fp32 on the CPU (16-bit weights widened exactly); on CUDA the dense weights' own
        # (a bf16 checkpoint stays bf16: fp16 would overflow where bf16 does not)
        self.dtype = dtype = torch.float32 if self.device.type == "cpu" else held_dense
        self.checkpoint_dtype = embed
        self.dense_dtype = held_dense if self.device.type == "cpu" else dtype  # the float dense matrices' dtype
        # a ram store on the CPU holds the experts in the slots' float dtype (plain copies), or for auto as stored
        explicit = config.slot_dtype in ("fp32", "fp16", "bf16")
        held = ExpertFormat.parse(config.slot_dtype) if explicit else None
        store_dtype = dtype if self.device.type != "cpu" else held and FLOAT_DTYPES[held.dtype]
        # the fast tier's fixed parts, and a budget too small refused, before any weight is read
        # (a disk store holds the checkpoint's dtype unless told otherwise, whatever the slots' dtype)
        held_as = store_dtype if config.store != "disk" else None
        stored = config.store_format or ExpertFormat.of_dtype(held_as or expert_dtype(ckpt, self.args))
        self.slot_format = slot_format(config.slot_dtype, self.device, stored, config.store)
        self.forward_tokens = FORWARD_CHUNK  # tokens of one forward pass (a window runs in passes of this many)
        self.plan = self._memory_plan(stored, dtype, held_dense)
        cache_cfg = replace(config.cache, eviction=self._eviction())
        # under a budget, the slots a layer uses in a long pass where a short one has more (every slot allocated:
        # `_fit_slots`), and a short pass's workspace
        self._long_pass_slots: int | None = None
        self._short_workspace = self.plan.workspace
        allocated = cache_cfg
        if config.memory_budget is not None:
            self.forward_tokens, self.plan, slots, decode, self._short_workspace = self._budget_passes(
                config.memory_budget, stored, dtype, held_dense)
            cache_cfg = replace(cache_cfg, bytes=min(self._expert_budget(config.memory_budget), slots))
            allocated = replace(cache_cfg, bytes=max(cache_cfg.bytes, decode))
        # the checks count the long pass's workspace beside its slots: a short pass's slots take no more
        as_held = held_dtype(ckpt, self.args, store_dtype, config.store_format)
        try:
            self._check_memory(cache_cfg, stored, as_held, allocated)
        except NotEnoughMemory:
            if allocated is cache_cfg:
                raise
            allocated = cache_cfg  # an address-space limit (ulimit -v) counts every slot mapped: a decode lends none
            self._check_memory(cache_cfg, stored, as_held, allocated)
        if allocated.bytes is not None and allocated.bytes > cache_cfg.bytes:
            shape = ExpertShape.of(self.args)
            self._long_pass_slots = slots_per_layer(cache_cfg, shape, slot_bytes(shape, self.slot_format),
                                                    self.args.top_k)
        self._check_device_memory(cache_cfg)
        self.store = open_store(config.store, ckpt, self.args, config.store_dir, store_dtype, config.store_format,
                                config.read_mode, config.verify)
        self.slot_format = slot_format(config.slot_dtype, self.device, self.store.stored_format, config.store)
        weights = dense_weights(ckpt, self.args, dtype, None if self.device.type == "cpu" else dtype)
        self.model = Transformer(self.args, weights, None, self.device, config.max_seq, dtype, self.dense_format,
                                 held_dense)
        del weights
        self.small_store: ExpertStore | None = None
        self._open_small(self.policy)
        self.cache = ExpertCache(allocated, self.store, self.args.top_k, self.device, self.slot_format)
        if self._long_pass_slots is not None:
            self.cache.use_slots(self._long_pass_slots)  # a first forward is a prompt's, as likely as not
        self.bind_policy(self.policy)
        self.stats = RunStats()
        # forwards run over the model's KV cache: a generation continuing it checks that none ran since its own
        self.kv_writes = 0
        # the token ids whose keys and values the engine's own cache holds from position 0, which a generation that
        # says it continues them checks (TextGeneration's `cached`), and past which no forward starts; not while a
        # sequence's own cache is swapped in (`kv_swapped`)
        self.kv_ids: list[int] = []
        self.kv_swapped = False
        # the positions linear attention's recurrent state holds (-1: unknown, after a forward that failed); it
        # cannot be cut back, swapped out or skipped ahead: a forward goes on from there or starts again at 0
        self.linear_end = 0
        self.runner = MoELayerRunner(self.args, self.model.router, self.cache, self.policy, self.stats)
        self.runner.exact = self.bind_policy(make_policy("fetch-all"))
        self.model.moe = self.runner
        self._predictors: dict[str, Predictor] = {}  # made once each, as attached: see set_prefetch
        if config.prefetch is not None:
            self.set_prefetch(config.prefetch)
        self.tokenizer = None
        if ckpt.tokenizer_file is not None:
            try:
                self.tokenizer = read_tokenizer(ckpt.tokenizer_file)
            except Exception as e:  # noqa: BLE001 -- the tokenizers binding raises a bare Exception
                raise CheckpointError(f"{ckpt.tokenizer_file}: not a readable tokenizer ({e}); re-export the "
                                      "model's tokenizer.json") from None
        self.reset()

    @property
    def warm_start(self) -> bool:
        """Whether a run starts from the most-routed experts (initial warm, or auto with routing counts beside the
        model), not from an empty cache."""
        return self.config.initial in ("warm", "auto") and self.routing_counts is not None

    def _budget_passes(self, budget: int, stored: ExpertFormat, dtype: torch.dtype, held_dense: torch.dtype | None
                       ) -> tuple[int, MemoryPlan, int, int, int]:
        """The forward pass (its tokens), plan and expert slots' bytes a memory budget takes, and the slots' bytes and
        workspace of a short pass (`DECODE_PASS`: a decode step), which on the CPU takes back a long one's workspace as
        slots (`_fit_slots`). The pass is the one that reads fewest experts for a prompt token and a decoded token
        together (`_pass_reads`), or the largest that leaves a top-k set of slots; the slots take the rest, in whole
        slots, up to every expert, and past that the pass grows. Slots never fewer for more budget: a budget just past a
        full pass's workspace had left them a top-k set (110M: 13 slots a layer where 105M had 43). Slots past a top-k
        set before the pass halved a prompt's passes: 24 slots in all and passes of 67 tokens prefilled at half the
        speed of 12 and 128 (real shape at a tenth of the experts). Nor the largest pass always: teacher-forced windows
        of the built-in model at 90M read 18% more experts a token in passes of 512 beside 8 slots a layer than in the
        rule's beside 19. A run whose prompts are known to be short (`longest_prompt`) takes passes no longer than they
        are."""
        # each size's plan once: the searches below ask for some several times, each read from the headers
        plan = functools.cache(lambda tokens: self._memory_plan(stored, dtype, held_dense, tokens))
        one, a = slot_bytes(ExpertShape.of(self.args), self.slot_format), self.args
        longest = min(FORWARD_CHUNK, self.config.longest_prompt or FORWARD_CHUNK)
        sizes = sorted({min(n, longest) for n in SMALLER_PASSES + (FORWARD_CHUNK,)})
        least, smallest = self._least_slots_bytes(), sizes[0]
        target = min(sizes, key=lambda n: self._pass_reads(n, plan(n).total, one))
        fits = lambda tokens, slots: plan(tokens).total + slots <= budget  # noqa: E731
        tokens = _most(smallest, target, lambda n: fits(n, least))
        whole = one * (a.num_moe_layers if self.config.cache.quota == "layer" else 1)  # what one more slot takes
        every = one * a.num_moe_layers * a.num_experts

        def slots_beside(parts: MemoryPlan) -> int:
            return min((budget - parts.total) // whole * whole, every)
        # short of a top-k set: refused later
        slots = min(max(slots_beside(plan(tokens)), least), max(budget - plan(smallest).total, 0))
        tokens = _most(tokens, longest, lambda n: fits(n, slots))  # every expert held: the rest to the pass
        # on the CPU slots past the pages written cost nothing: a short pass's all there
        short = self._memory_plan(stored, dtype, held_dense, min(tokens, DECODE_PASS), short=True)
        decode = max(slots, slots_beside(short)) if self.device.type == "cpu" else slots
        return tokens, plan(tokens), slots, decode, short.workspace

    def _pass_reads(self, tokens: int, plan_bytes: int, slot: int) -> float:
        """Experts read for a prompt token and a decoded token, less a constant, where forward passes of `tokens`
        take `plan_bytes` of the budget and the slots the rest (`slot` bytes each): a pass reads each expert its
        tokens route to once (top-k of E uniformly, every layer), and each slot's bytes the plan takes are a slot
        that a decoded token's k experts a layer would have hit one time in E. A prompt counts as long as its
        reply, as a chat's are; a long reply to a short prompt would rather have every slot the smallest pass
        leaves."""
        a = self.args
        E, k = a.num_experts, a.top_k
        return E * a.num_moe_layers * (1 - (1 - k / E) ** tokens) / tokens + k * plan_bytes / (E * slot)

    def _memory_plan(self, stored: ExpertFormat, dtype: torch.dtype, held_dense: torch.dtype | None,
                     passes: int = FORWARD_CHUNK, short: bool = False) -> MemoryPlan:
        """The fast tier's fixed parts (engine/budget.py) for experts stored as `stored`: the dense weights as
        held, the KV cache at max_seq, the stores' staging buffers (the small copies' too where the policy
        fetches them), the workspace of forward passes of `passes` tokens and the prefetch predictor it is made
        with. A `short` pass's workspace (`_fit_slots`: at most DECODE_PASS tokens) holds only those tokens' logits,
        not a scored window's. Loading's transient stays counted: once loaded, a run holds more than the parts
        name (at real shape ~27 MiB: the allocator's kept blocks, the engine's state), which it covers."""
        a, c = self.args, self.config
        shape = ExpertShape.of(a)
        dense, largest = dense_bytes(self.checkpoint, a, dtype, held_dense if self.device.type == "cpu" else dtype,
                                     self.dense_format)
        formats = [stored] + ([c.small_format] if self.policy.fetches_small else [])
        slots = self.slot_format if self.device.type == "cpu" else None  # on CPU, reads may land in the slots
        buffers = sum(staging_bytes(c.store, shape, f, c.cache.io_workers, slots if f is stored else None)
                      for f in formats)
        predictor = predictor_bytes(c.prefetch.predictor, self.path, dtype) if c.prefetch is not None else 0
        return MemoryPlan(dense, kv_bytes(a, c.kv_positions or c.max_seq, dtype), buffers,
                          workspace_bytes(a, c.max_seq, largest, passes, DECODE_PASS if short else None), predictor)

    def _check_memory(self, cache: CacheConfig, stored: ExpertFormat, store_dtype: torch.dtype,
                      allocated: CacheConfig) -> None:
        """NotEnoughMemory, before any weight is read, where what the run holds in host memory (on the CPU the plan's
        parts and the expert slots in use, `cache`; a ram or pinned store's experts) is clearly more than the machine
        has free: the OOM killer would end it while loading, with nothing said. An address-space limit counts every
        slot mapped (`allocated`), touched or not."""
        free = available_memory()
        if free is None:
            return
        shape, c = ExpertShape.of(self.args), self.config
        parts = {**self.plan.parts(), "expert slots": self._slots_bytes(cache)} if self.device.type == "cpu" else {}
        first_run = not kernels_cached()
        if first_run:  # LLVM's, for the minutes it compiles: a first run under a cap was killed with nothing said
            parts["compiling the kernels (a first run's, once)"] = COMPILE_BYTES
        if c.store in ("ram", "pinned"):  # every expert, as the store holds them (quantized slots: encoded)
            each = slot_bytes(shape, stored) if self.slot_format.quantized else \
                shape.numel * store_dtype.itemsize
            parts |= held_in_memory(f"the {c.store} store's experts", each, shape)
        positions = parts.get("KV cache", 0) + parts.get("workspace", 0)  # they grow with --max-seq, not the cache
        fixes = (["a smaller --max-seq (serve: --kv-positions)"] if positions > free // 2 else []) + \
            (["--store disk (the experts stay on the disk)"] if c.store in ("ram", "pinned") else []) + \
            ["a smaller --cache", "--memory-budget"] + \
            (["a first run where more memory is free (the kernels are cached for later runs)"] if first_run else [])
        bound = "this machine has free"
        if (room := address_space_room()) is not None and room <= free:  # ulimit -v, not the machine, sets it
            bound, fixes = "its address-space limit leaves (ulimit -v)", ["ulimit -v unlimited", *fixes]
            if "expert slots" in parts:
                parts["expert slots"] = self._slots_bytes(allocated)
        refuse_unless_fits(parts, free, "", bound, f"{', '.join(fixes[:-1])} or {fixes[-1]}")

    def _check_device_memory(self, cache: CacheConfig) -> None:
        """On CUDA, NotEnoughMemory before any weight is read where what the device holds (the dense weights, the KV
        cache, the workspace, a predictor and the expert slots; staging buffers are host memory) is clearly more than
        it has free: the load would otherwise end in an out-of-memory error after reading the dense weights."""
        if self.device.type != "cuda":
            return
        try:
            free = torch.cuda.mem_get_info(self.device)[0]
        except (RuntimeError, AssertionError):  # a driver that cannot say: the allocator's own error stands
            return
        parts = {k: v for k, v in self.plan.parts().items() if k != "transfer buffers"} | \
            {"expert slots": self._slots_bytes(cache)}
        refuse_unless_fits(parts, free, f" on {self.device}", "free there",
                           "a smaller --cache, --memory-budget, a smaller --max-seq, or --device cpu")

    def _slots_bytes(self, cache: CacheConfig) -> int:
        """The expert slots' bytes in the fast tier under `cache`."""
        shape = ExpertShape.of(self.args)
        one = slot_bytes(shape, self.slot_format)
        return one * shape.num_layers * slots_per_layer(cache, shape, one, self.args.top_k)

    def _least_slots_bytes(self) -> int:
        """The fewest expert slots' bytes a run takes: a top-k set a layer, or in all under --quota global."""
        shape = ExpertShape.of(self.args)
        L = shape.num_layers
        return slot_bytes(shape, self.slot_format) * L * least_slots_per_layer(self.config.cache.quota,
                                                                              self.args.top_k, L)

    def _expert_budget(self, budget: int) -> int:
        """Bytes left for expert slots when the fast tier holds `budget` bytes in all: the plan's parts first;
        CacheTooSmall naming the minimum when that leaves fewer than a top-k set of slots per layer."""
        left = budget - self.plan.total
        quota, k, one = self.config.cache.quota, self.args.top_k, self._least_slots_bytes()
        if left < one:
            parts = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in self.plan.parts().items())
            need = "per layer" if quota == "layer" else "shared by the layers (--quota global)"
            shared = "" if quota == "global" else " or --quota global (the layers share their slots)"
            given = f"{budget / 2**20:.1f} MiB" if budget >= 2**20 else \
                f"{budget} bytes (a number without a unit is bytes; MiB are written e.g. 512M)"
            raise CacheTooSmall(f"--memory-budget {given} leaves {max(left, 0) / 2**20:.1f} MiB for "
                                f"experts after {parts}; top-{k} experts {need} need {one / 2**20:.1f} MiB: raise it "
                                f"to at least {math.ceil((budget - left + one) / 2**20 * 10) / 10:.1f}M; or, where "
                                f"the verb takes them, lower --max-seq (serve: --kv-positions){shared}")
        return left

    # -- residency -----------------------------------------------------------------------
    def reset(self) -> None:
        """Start of a run: empty or warm cache, fresh statistics and policy state."""
        with self._one_call():
            self._reset()

    def _reset(self) -> None:
        counts = self.routing_counts if self.warm_start else None
        if self.config.initial == "warm" and counts is None:
            model = "" if self.path == BUILTIN_MODEL else f" --model {shlex.quote(str(self.path))}"
            raise CheckpointError(f"{self.path}: no {ROUTING_COUNTS} for a warm cache; run `expertcache calibrate"
                                  f"{model}` first (a verb that takes --initial can also start cold)")
        self.cache.clear()
        if counts is not None:
            self.cache.warm(counts)
        self.restart_counts()
        self.warm = counts is not None

    def restart_counts(self) -> None:
        """Fresh statistics and policy state, the cache left as it is (Scheduler.warm_up's steps are no run)."""
        self.policy.reset()
        self.runner.predicted, self.runner.sequence = None, None
        ring = getattr(self.cache.transfers, "ring", None) is not None
        self.stats.__init__(read_mode=self.store.read_mode + ("+io_uring" if ring else ""),
                            kernels=threads.describe() if self.device.type == "cpu" else "")

    def set_policy(self, policy: MissPolicy | str, eviction: str | None = None) -> None:
        """Switch the miss policy (and the eviction it prefers, unless the config names one);
        starts a new run."""
        if eviction is not None:
            eviction_code(eviction)  # refused before anything changes: the engine keeps its policy and cache
        with self._one_call():
            self._set_policy(policy, eviction)

    def _set_policy(self, policy: MissPolicy | str, eviction: str | None) -> None:
        policy = self.bind_policy(policy)
        order = self._eviction(eviction, policy)  # refused before anything changes
        self.policy = self.runner.policy = policy
        self.cache.cfg = replace(self.cache.cfg, eviction=order)
        self.reset()

    def _eviction(self, eviction: str | None = None, policy: MissPolicy | None = None) -> str:
        """The eviction order the cache runs: the call's, else EngineConfig's, else CacheConfig's, else the one the
        policy (the engine's, or `policy`) prefers; BadInput where its spec names another."""
        return eviction_order(policy or self.policy, eviction, self.config.eviction, self.config.cache.eviction)

    def _open_small(self, policy: MissPolicy) -> None:
        """Open the slow tier's low-precision copies (a second store, converted once) the first
        time a policy fetches them."""
        if policy.fetches_small and self.small_store is None:
            if self.slot_format.quantized:
                raise BadInput(f"policy {policy.name!r} fetches int4 copies into float slots; slots kept as "
                               f"{self.slot_format.dtype} cannot take them: use --slot-dtype auto or another policy")
            main = self.config.store_dir  # a store of the user's: the small copies go beside it
            beside = None if main is None else Path(main).with_name(f"{Path(main).name}-{self.config.small_format.tag}")
            small = open_store(self.config.store, self.checkpoint, self.args, beside,
                               FLOAT_DTYPES[self.slot_format.dtype], self.config.small_format,
                               self.config.read_mode, self.config.verify)
            if self.config.store in ("ram", "pinned"):  # held in memory too, beside the experts: refused, not killed
                free, shape = available_memory(), ExpertShape.of(self.args)
                if free is not None:
                    parts = held_in_memory(f"the {self.config.store} store's low-precision copies",
                                           shape.numel * small.dtype.itemsize, shape)
                    refuse_unless_fits(parts, free,
                                       f" more for policy {policy.name!r}", "this machine has free",
                                       "--store disk or a policy without low-precision copies")
            self.small_store = small

    def _attach_small(self, policy: MissPolicy) -> None:
        """Give the cache the low-precision copies when `policy` fetches them."""
        self._open_small(policy)
        if self.small_store is not None and self.cache.small is None:
            self.cache.attach_small(self.small_store)

    def buffer_bytes(self) -> int:
        """Fast-tier memory the reads need besides the slots: the stores' staging buffers (none for a store
        whose reads land in the slots themselves)."""
        workers = self.config.cache.io_workers
        direct = getattr(self.cache.transfers, "direct", None) is not None
        return sum(s.buffer_bytes(workers) for s in (self.store, self.small_store)
                   if s is not None and not (direct and s is self.store))

    def bind_policy(self, policy: MissPolicy | str) -> MissPolicy:
        """`policy` (or its spec) made ready to decide this engine's misses: its parameters checked against the
        model's router and depth, and the low-precision copies it fetches opened and attached. The one check on
        every road to the compiled kernel (which trusts its parameters): the engine's policy, set_policy, a
        prefill policy; the cache refuses a policy that did not come through here (ExpertCache.decide_routed)."""
        self._check_open()  # before a lowbit policy opens its small copies' store
        policy = self._fit(as_policy(policy))
        self._attach_small(policy)
        return policy

    def _fit(self, policy: MissPolicy) -> MissPolicy:
        """`policy` checked against the model's router and depth, with its gate normalisation, and bound to this
        engine: BadInput while another open engine has it (each would count the other's substitutions towards its
        admissions, and its resets clear them)."""
        other = policy.engine and policy.engine()
        if other is not None and other is not self and not other.closed:
            raise BadInput(f"policy {policy!r} is bound to another open Engine, whose run state it carries; give "
                           "each engine its own policy (make_policy(spec) again)")
        policy.fit(self.args.top_k, self.args.num_experts, self.args.norm_topk_prob)
        policy.bind(self.args.num_moe_layers, self.args.num_experts)  # per-layer parameters fit the depth
        policy.engine = weakref.ref(self)
        return policy

    @property
    def variant(self) -> str:
        """The miss policy and, with a predictor attached, what it does, as `--policy` spells them
        (e.g. fetch-all+prefetch/lookahead)."""
        if self.closed:  # what it ran, still there to report
            return self._variant
        return str(self.policy) + (f"+{self.runner.prefetch}" if self.runner.predictor is not None else "")

    def set_prefetch(self, prefetch: PrefetchConfig | None) -> None:
        """Attach a predictor (or detach with None); starts a new run."""
        if prefetch is not None and not isinstance(prefetch, PrefetchConfig):
            raise BadInput(f"prefetch must be a PrefetchConfig, e.g. PrefetchConfig('lookahead'), or None, not "
                           f"{type(prefetch).__name__}")
        if prefetch is not None and prefetch.budget is not None and not 1 <= prefetch.budget <= self.args.top_k:
            raise BadInput(f"prefetch budget {prefetch.budget}: a predictor ranks the model's top-{self.args.top_k} "
                           f"experts of the next layer; give budget=1..{self.args.top_k}")
        if prefetch is not None and self.config.memory_budget is not None:
            need = predictor_bytes(prefetch.predictor, self.path, self.dtype)
            if need > self.plan.predictor:  # the cache was sized without it: attached, the run would break its budget
                raise CacheTooSmall(f"the {prefetch.predictor} predictor takes {need / 2**20:.1f} MiB that "
                                    f"--memory-budget's plan left no room for ({self.plan.predictor / 2**20:.1f} MiB "
                                    "planned); make the engine with that prefetch (--policy POLICY+prefetch/"
                                    f"{prefetch.predictor}) so that the cache is sized around it")
        with self._one_call():
            self._set_prefetch(prefetch)

    def _set_prefetch(self, prefetch: PrefetchConfig | None) -> None:
        self.runner.predictor = self._predictor(prefetch.predictor) if prefetch else None
        if prefetch is not None:
            self.cache.compile_prefetch()
        self.runner.prefetch = prefetch or PrefetchConfig()
        self.model.prefetch = self.runner.observe_residual if prefetch else None
        self.reset()

    def _predictor(self, name: str) -> Predictor:
        """The predictor `name`, made on its first attach and kept: a variant attached again (bench's and tune's
        repetitions) runs the predictor a run of its own would, not a fresh copy whose arrays land elsewhere in
        memory each time. Under a memory budget only the one attached is kept, as the plan counts one."""
        made = self._predictors.get(name) or make_predictor(name, self.model, self.path)
        self._predictors = ({} if self.config.memory_budget is not None else self._predictors) | {name: made}
        return made

    # -- running -------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, pos: int, last: bool = False, prompt: bool = False) -> torch.Tensor:
        """ids [T] -> logits [T, V] (fp32; with `last`, [1, V]: the last position's only, as a prefill
        needs), counting tokens and wall time. `prompt`: a prompt's prefill, whose MoE layers run in the config's
        `prompt_order`. Raises NonFiniteOutput rather than return a NaN or infinite logit."""
        self._check_open()
        ids, pos = self.token_ids(ids), whole_number(pos, "position")
        last, prompt = truth(last, "last"), truth(prompt, "prompt")
        if pos < 0:  # the rotary angles and the cache's slice would silently take it
            raise BadInput(f"position {pos} is negative; a sequence's first token is at position 0")
        T = ids.shape[0]
        if pos + T > self.model.max_seq:  # refused whole, not after the passes before the one that crosses it ran
            raise BadInput(f"sequence of {pos + T} tokens exceeds max_seq={self.model.max_seq}; raise --max-seq")
        with self._one_call():
            return self._forward(ids, pos, T, last, prompt)

    def _forward(self, ids: torch.Tensor, pos: int, T: int, last: bool, prompt: bool) -> torch.Tensor:
        linear = bool(self.model.linear)
        if linear and pos not in (0, self.linear_end):  # it ran on from the state of other tokens, in silence
            held = "an unknown number of" if self.linear_end < 0 else f"the first {self.linear_end}"
            raise BadInput(f"position {pos}: this model's linear attention keeps one recurrent state of {held} "
                           f"positions, which cannot be cut back or skipped; run position "
                           f"{max(self.linear_end, 0)} next, or start again at 0")
        if not self.kv_swapped and pos > len(self.kv_ids):  # its attention read keys no forward wrote (zeros, or
            # a run's before): a silent wrong answer
            raise BadInput(f"position {pos}: the KV cache holds the first {len(self.kv_ids)} positions; run position "
                           f"{len(self.kv_ids)} next (or one before it, rewriting from there), or start again at 0")
        self.kv_writes += 1  # before it runs: a forward that fails may have written some positions
        self.linear_end = -1 if linear else 0
        if not self.kv_swapped:
            del self.kv_ids[pos:]  # rewritten from here, or unknown if it fails
        self._fit_slots(T)
        self.runner.start_forward(id(self.model.k_cache), pos, T)  # a swapped-in sequence has other keys
        self.runner.by_expert = prompt and self.config.prompt_order == "experts"
        try:
            logits = self._timed(lambda: self._passes(ids.to(self.device), pos, last), T)
        finally:
            self.runner.by_expert = False
        self.runner.end_forward(id(self.model.k_cache), pos + T)  # the keys as they may have grown
        if not self.kv_swapped:
            self.kv_ids += ids.tolist()
        if linear:
            self.linear_end = pos + T
        self._check_finite(logits, lambda t: f"at position {pos + (T - 1 if last else t)}")
        return logits

    def token_ids(self, ids: torch.Tensor | list[int], empty: bool = False) -> torch.Tensor:
        """`ids` (a 1-D tensor, array, list or tuple of token ids; with `empty`, maybe none) as an int64 tensor [T];
        BadInput unless they are integers in the vocabulary: a negative id would index the embeddings from their end
        (another token's output), one past them fail inside the forward, a float id be truncated, uint8 ids read as
        a mask."""
        if isinstance(ids, (list, tuple)) and any(isinstance(t, bool) for t in ids):  # True would read as id 1
            raise BadInput("token ids must be ints, not bools; text becomes ids through Engine.encode")
        if not isinstance(ids, torch.Tensor):
            try:
                ids = torch.as_tensor(ids) if not isinstance(ids, (str, bytes)) else None
            except (TypeError, ValueError, RuntimeError, OverflowError):
                if isinstance(ids, (list, tuple)) and ids and all(isinstance(t, int) for t in ids):  # past int64
                    raise BadInput(f"token id {max(ids, key=abs)} is outside the model's vocabulary [0, "
                                   f"{self.args.vocab_size}); give ids its tokenizer made") from None
                ids = None
            if ids is None:  # text, None, ragged lists, mixed types
                raise BadInput("token ids must be a non-empty 1-D integer tensor or list of ints; text becomes ids "
                               "through Engine.encode")
            if not ids.numel():  # [] is float32 to torch
                ids = ids.long()
        if ids.is_meta:  # no values to read: torch's own error named .item()
            raise BadInput("token ids on the meta device hold no values; give ids on the CPU or the engine's device")
        if ids.dim() != 1 or not (ids.numel() or empty) or ids.dtype.is_floating_point or ids.dtype.is_complex or \
                ids.dtype == torch.bool:
            raise BadInput(f"token ids must be a {'' if empty else 'non-empty '}1-D integer tensor, not {ids.dtype} "
                           f"of shape {tuple(ids.shape)}")
        if ids.dtype in (torch.uint16, torch.uint32, torch.uint64):  # torch has no min or max of them (a NumPy
            ids = ids.long()  # array's): as int64, where a uint64 id past its range wraps to a negative one, refused
        if ids.numel():
            lo, hi = (int(ids[0]),) * 2 if ids.numel() == 1 else (int(ids.min()), int(ids.max()))  # decode: one id
            if lo < 0 or hi >= self.args.vocab_size:
                raise BadInput(f"token id {lo if lo < 0 else hi} is outside the model's vocabulary [0, "
                               f"{self.args.vocab_size}); give ids its tokenizer made")
        return ids.long()

    def _passes(self, ids: torch.Tensor, pos: int, last: bool) -> torch.Tensor:
        """The model over ids [T] in passes of at most `forward_tokens` tokens (the workspace the budget counts; the
        decisions are the same, tokens being decided in order either way), their logits joined."""
        T, n = ids.shape[0], self.forward_tokens
        if T <= n:
            return self.model.forward(ids, pos, last)
        out = []
        for t0 in range(0, T, n):
            t1 = min(T, t0 + n)
            logits = self.model.forward(ids[t0:t1], pos + t0, last)
            if not last or t1 == T:
                out.append(logits)
        return torch.cat(out) if len(out) > 1 else out[0]

    def _fit_slots(self, tokens: int) -> None:
        """Under a memory budget on the CPU, the slots a forward of `tokens` leaves room for: a long one's passes
        take the workspace the budget plans for them, a short one's (at most DECODE_PASS tokens) give it back as
        slots. A long prompt's decode then has every slot the budget holds: at a tenth of the real-shape experts,
        --quota global, 30 slots in all where 12 are left beside 218-token passes (the 0.15 rule 1.82x faster)."""
        if self._long_pass_slots is not None:
            self.cache.use_slots(self.cache.per_layer if tokens <= DECODE_PASS else self._long_pass_slots)

    def forward_batch(self, ids: torch.Tensor, positions: list[int],
                      kv: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Decode B sequences one token each (Transformer.forward_batch): ids [B] at `positions`, keys and
        values in kv[b] -> logits [B, V] (fp32); the B tokens count as B decode tokens."""
        self._check_open()
        ids = self.token_ids(ids)
        with self._one_call():
            return self._forward_batch(ids, positions, kv)

    def _forward_batch(self, ids: torch.Tensor, positions: list[int],
                       kv: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        n = self.forward_tokens
        if ids.shape[0] > n:  # more sequences than a pass's workspace holds tokens (a budget's): in passes of n
            return torch.cat([self._forward_batch(ids[i:i + n], positions[i:i + n], kv[i:i + n])
                              for i in range(0, ids.shape[0], n)])
        self._fit_slots(ids.shape[0])
        self.runner.decoding = True
        self.runner.start_forward(None, 0, ids.shape[0])
        try:
            logits = self._timed(lambda: self.model.forward_batch(ids.to(self.device), positions, kv), ids.shape[0])
        finally:
            self.runner.decoding = False
        self._check_finite(logits, lambda b: f"in sequence {b} of the batch (position {positions[b]})")
        return logits

    def _timed(self, run, tokens: int) -> torch.Tensor:
        start, compiled = time.perf_counter(), compile_seconds()
        self.runner.token_base = self.stats.tokens
        self.cache.transfers.take_buffer_wait()  # a warm start's fill waited outside any forward: no token's stall
        try:
            if self.device.type == "cpu":
                with threads.kernels_own_the_cores():
                    logits = run().float()
            else:
                logits = run().float()
        finally:  # the decision kernel's counters of every layer decided, also when a fetch failed
            self.stats.absorb(self.cache.state, self.cache.fetch_bytes, self.cache.lowbit_bytes)
            self.stats.stall_s += self.cache.transfers.take_buffer_wait()
            self.stats.failed_background_reads += self.cache.failed_background
            self.cache.failed_background = 0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        compiling = compile_seconds() - compiled  # a first run's kernels: the compiler's time, not the model's
        self.stats.compile_s += compiling
        self.stats.wall_s += time.perf_counter() - start - compiling
        self.stats.tokens += tokens
        self.stats.peak_memory_bytes = peak_memory_bytes(self.device)
        return logits

    def _check_finite(self, logits: torch.Tensor, where) -> None:
        # a finite sum means every logit is finite: one reduction, the full check only when it is not
        if not math.isfinite(float(logits.sum())) and not bool((finite := torch.isfinite(logits).all(-1)).all()):
            t = int((~finite).nonzero()[0, 0])
            held = {"compute": self.dtype, "dense": self.dense_dtype,
                    "slot": FLOAT_DTYPES.get(self.slot_format.dtype)}
            raise NonFiniteOutput(f"the model produced non-finite logits {where(t)}: "
                                  f"{non_finite_cause(held, self.checkpoint_dtype)}")

    def encode(self, text: str, special: bool = True, max_tokens: int | None = None) -> list[int]:
        """The token ids of `text` by the checkpoint's tokenizer (with `special`, the tokens its post-processor
        adds, such as a BOS), its first `max_tokens` when given (encode_prefix: without tokenizing the rest);
        CheckpointError when it has none, BadInput for text that is not UTF-8."""
        if not isinstance(text, str):
            raise BadInput(f"encode takes text (a str), not {type(text).__name__}" +
                           ("; decode bytes first (data.decode('utf-8'))" if isinstance(text, bytes) else ""))
        if not isinstance(special, bool):  # the tokenizer's own TypeError named no argument
            raise BadInput(f"special={special!r} must be True or False")
        if max_tokens is not None and whole_number(max_tokens, "max_tokens") < 0:  # -1 would drop the last token
            raise BadInput(f"max_tokens={max_tokens} must be >= 0, or None for every token")
        if self.tokenizer is None:
            raise CheckpointError(f"{self.path}: no tokenizer.json, which text input needs; "
                                  f"{self.checkpoint.tokenizer_fix()}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # bytes that were not UTF-8 reach Python as lone surrogates
            raise BadInput("the text is not valid UTF-8; give UTF-8 text (e.g. convert it with iconv)") from None
        ids = encode_prefix(lambda t: self.tokenizer.encode(t, add_special_tokens=special).ids, text, max_tokens)
        return check_token_ids(ids, self.args.vocab_size, self.path)

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, or the ids joined by spaces when the checkpoint has no tokenizer."""
        # a list of ids in the vocabulary is taken as it is: the server decodes every token of a stream and each of
        # its alternatives, and token_ids' tensor costs ~20 us a call against the tokenizer's 1
        vocab = self.args.vocab_size
        if not (type(ids) is list and all(type(t) is int and 0 <= t < vocab for t in ids)):
            ids = self.token_ids(ids, empty=True).tolist()
        return self.tokenizer.decode(ids) if self.tokenizer is not None else " ".join(map(str, ids))

    def budget(self) -> dict:
        """Bytes of the fast tier: non-expert weights, the expert slots in use and the workspace of the passes
        that use them (a long pass's, or a short one's: `_fit_slots`), the KV cache (as allocated now, and at
        max_seq), the transfer buffers, the attached predictor; and the budget they were sized to, if any."""
        kv = self.model.kv_bytes(self.model.kv_positions)
        long, short = self._long_pass_slots or self.cache.per_layer, self.cache.per_layer
        lent = self._long_pass_slots is not None and self.cache.active == short  # a short pass's slots in use now
        return {"memory_budget": self.config.memory_budget, "dense_bytes": self.model.dense_bytes,
                "cache_bytes": self.cache.bytes_in_use, "kv_bytes": kv,
                "kv_bytes_max": self.model.kv_bytes(self.model.max_seq),
                "buffer_bytes": self.buffer_bytes(),
                "workspace_bytes": self._short_workspace if lent else self.plan.workspace,
                "planned_dense_bytes": self.plan.dense,
                "predictor_bytes": predictor_bytes(self.runner.prefetch.predictor, self.path, self.dtype)
                if self.runner.predictor is not None else 0,
                "slots_per_layer": self.cache.active, "slots_per_layer_long_pass": long,
                "slots_per_layer_short_pass": short, "slot_dtype": self.slot_format.tag,
                "expert_bytes_slow": self.store.expert_bytes,
                "expert_bytes_fast": self.cache.expert_bytes}

    def close(self) -> None:
        """Land the transfers in flight, stop the transfer workers and close the stores; once (a second call does
        nothing). A call running in another thread finishes first."""
        with self._calls:
            self._close()

    def _close(self) -> None:
        if not self.closed:
            self._variant = self.variant
            self.closed = True
            if self.cache.interrupted:
                self.cache.recover()
            self.cache.close()
            for store in (self.store, self.small_store):  # a lowbit policy's small copies have their own files
                if store is not None:
                    store.close()
            # a predictor holds the model, whose MoE runner holds it: without this cycle, the slots, weights and KV
            # cache go as soon as the engine does, not at the garbage collector's next pass
            self.runner.predictor, self.model.prefetch, self._predictors = None, None, {}
            # and they go now, not when the engine object does: `with Engine(...) as e` in a loop held two engines'
            # memory while the next one loaded (4.6 GB against 2.4 at real shape)
            for part in HELD_UNTIL_CLOSED:
                del self.__dict__[part]

    def __getattr__(self, name: str):
        """Only for what a closed engine let go (HELD_UNTIL_CLOSED): the one-line error, not an AttributeError."""
        if name in HELD_UNTIL_CLOSED and "_variant" in self.__dict__:  # let go by close(), not a failed load
            self._check_open()
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextmanager
    def _one_call(self):
        """The engine's calls that run the model or change its state, one at a time: BadInput for one from another
        thread while one runs (the cache, its transfers and the KV cache are not shared between threads)."""
        if not self._calls.acquire(blocking=False):
            raise BadInput("this Engine is running a call in another thread; an Engine runs one call at a time: give "
                           "each thread its own Engine, or serialize the calls (as the server's scheduler does)")
        try:
            self._check_open()  # closed by the call that held the lock
            if self.cache.interrupted:  # a second interrupt cut the recovery short
                self.cache.recover()
            yield
        except Exception:  # a failed read, a refused input: the cache is left consistent where they are raised
            raise
        except BaseException:  # an interrupt, between any two statements: the cache and its reads set right
            self.cache.recover()
            raise
        finally:
            self._calls.release()

    def _check_open(self) -> None:
        """BadInput once the engine is closed: its stores' files and its reads are gone (a TypeError inside them)."""
        if self.closed:
            raise BadInput("this engine is closed (Engine.close); make a new Engine to run the model again")
