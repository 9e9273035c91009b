"""The fast tier: a fixed number of expert slots on the compute device, the bookkeeping
that maps (layer, expert) to slots (`cache_state.CacheState`), and the transfers that fill
them. Slots of one weight kind are one stacked tensor (w13 [S, 2F, H], w2 [S, H, F], and the
biases b13 [S, 2F], b2 [S, H] of families that have them), so the
expert kernel indexes them like any expert stack; in fp32, fp16 or bf16. Quantized slots (int8, int4, MXFP4)
hold each expert's encoded blob as the disk store keeps it instead (`blobs` uint8 [S, bytes])."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..choices import IO_BACKENDS
from ..errors import BadInput, CacheTooSmall, UnknownName, real_number, whole_number
from ..kernel import decisions as kernel
from ..kernel.cache_state import LOGGING, N_LOG, PREFETCHES, CacheState
from ..kernel.eviction import eviction_code
from ..kernel.policy import Scratch
from ..kernel.routing import Router, Routing, route_logits
from ..policies import MissPolicy
from .quant import FLOAT_DTYPES, ExpertFormat
from .slots import page_aligned_zeros, release_pages, slot_bytes
from .stores import ExpertShape, ExpertStore
from .transfer import InstantTransfers, Transfer, TransferEngine

F32, I64 = np.dtype(np.float32), np.dtype(np.int64)  # the kernel's argument types
BACKGROUND_KINDS = ("prefetch", "admit", "upgrade")  # reads no token waits for when they start
MAX_IO_WORKERS = 1024  # transfer worker threads: each holds a staging buffer, and reads gain nothing past a few


@dataclass(frozen=True)
class CacheConfig:
    """The expert cache's size (a fraction of each layer's experts, or bytes), how layers share
    slots (quota), the eviction order and the number of transfer workers."""
    fraction: float | None = None  # of each layer's experts; None: DEFAULT_FRACTION, at least a token's top-k
    bytes: int | None = None  # overrides fraction when given
    quota: str = "layer"  # "layer": each layer owns its slots; "global": any layer may take any slot
    eviction: str | None = None  # None: EngineConfig.eviction, else the order the policy prefers (lru by itself)
    io_workers: int = 4
    io: str = "auto"  # auto: io_uring for O_DIRECT reads where the system has it; uring (or an error); threads
    caller_reads: bool = True  # a token's only synchronous fetch of a layer is read by the waiting thread

    def __post_init__(self):
        # the types, which every road checks nowhere else (a float or a string failed inside torch, a negative
        # io_workers in the reads); the sizes' ranges where the model is known (`slots_per_layer`)
        if self.fraction is not None:
            real_number(self.fraction, "cache fraction")
        if self.bytes is not None:
            object.__setattr__(self, "bytes", whole_number(self.bytes, "cache bytes"))
        if self.eviction is not None:
            eviction_code(str(self.eviction))
        if not 0 <= whole_number(self.io_workers, "io_workers") <= MAX_IO_WORKERS:  # past it, threads failed to
            # start mid-forward (a RuntimeError), and the engine's close with them
            raise BadInput(f"io_workers={self.io_workers} must be 0 to {MAX_IO_WORKERS} transfer worker threads, "
                           "e.g. 4")
        if not isinstance(self.caller_reads, bool):  # "no" would read as true
            raise BadInput(f"caller_reads={self.caller_reads!r} must be True or False")
        # names, before a store is converted and the weights load for them (minutes at real size)
        if self.quota not in QUOTAS:
            raise UnknownName(f"unknown quota {self.quota!r}; choose 'layer' or 'global'")
        if self.io not in IO_BACKENDS:
            raise BadInput(f"unknown I/O backend {self.io!r}; choose one of {', '.join(IO_BACKENDS)}")
        if self.bytes is not None and self.bytes <= 0:
            raise BadInput(f"cache bytes={self.bytes} must be a positive number of bytes, e.g. 512 * 2**20")


QUOTAS = ("layer", "global")
DEFAULT_FRACTION = 0.25  # a model with few experts (a tiny test model's 4, top-2) is given its top-k instead


def least_slots_per_layer(quota: str, top_k: int, num_layers: int) -> int:
    """The fewest slots a layer may have: a token's top-k, each layer its own (quota 'layer'); or, where the layers
    share every slot (quota 'global'), enough that all of them together hold one layer's top-k."""
    return top_k if quota == "layer" else -(-top_k // num_layers)


def slots_per_layer(cfg: CacheConfig, shape: ExpertShape, fast_expert_bytes: int, top_k: int,
                    quota_hint: bool = True, bytes_hint: bool = True) -> int:
    """Expert slots per layer under `cfg`, at most the layer's experts; CacheTooSmall when fewer than a token needs
    (`least_slots_per_layer`) or the fraction is out of range (`quota_hint`, `bytes_hint`: its fix may name
    --quota global, a size in bytes: where the verb takes them)."""
    least = least_slots_per_layer(cfg.quota, top_k, shape.num_layers)
    if cfg.bytes is not None:
        per_layer = cfg.bytes // fast_expert_bytes // shape.num_layers
        what = f"{cfg.bytes} bytes"
    elif cfg.fraction is None:  # the default size, not one asked for: never too small to run
        return min(max(int(round(DEFAULT_FRACTION * shape.num_experts)), least), shape.num_experts)
    else:
        if not 0 < cfg.fraction <= 1:
            raise CacheTooSmall(f"cache fraction {cfg.fraction} must be in (0, 1]; e.g. --cache 0.25")
        per_layer = int(round(cfg.fraction * shape.num_experts))
        what = f"a fraction of {cfg.fraction}"
    if per_layer < least:
        layer_bytes = fast_expert_bytes * shape.num_layers  # one slot a layer
        fraction = math.ceil(least / shape.num_experts * 1000) / 1000  # rounded up: a rounded-down one is short
        fix = f"give at least {fraction:.3f} of the experts (--cache {fraction:.3f})" + \
            (f" or {least * layer_bytes} bytes" if bytes_hint else "")
        if cfg.quota == "layer" and quota_hint and bytes_hint:
            shared = least_slots_per_layer("global", top_k, shape.num_layers)
            fix += (f"; in bytes, --quota global lets the layers share their slots (--cache-bytes "
                    f"{shared * layer_bytes} --quota global)")
        slots = per_layer if cfg.quota == "layer" else per_layer * shape.num_layers
        held = f"{slots} expert slot{'s' * (slots != 1)} " + ("per layer" if cfg.quota == "layer" else
                                                               "shared by the layers")
        raise CacheTooSmall(f"{what} gives {held}, fewer than top-k={top_k}; {fix}")
    return min(per_layer, shape.num_experts)


class ExpertCache:
    """Slots, their bookkeeping and their transfers. With a store, slots are real tensors
    filled by real transfers; without one (`shape` given instead) the cache is virtual: the
    same bookkeeping, no weights, and transfers that complete at once (the simulator's)."""

    def __init__(self, cfg: CacheConfig, store: ExpertStore | None, top_k: int, device: torch.device | None,
                 dtype: torch.dtype | ExpertFormat, shape: ExpertShape | None = None, fetch_bytes: int | None = None,
                 lowbit_bytes: int = 0):
        shape = store.shape if store is not None else shape
        self.shape, self.store, self.cfg, self.top_k = shape, store, cfg, top_k
        # dtype: a float dtype, or a slot format (`slot_format`): float, or quantized (encoded blobs)
        self.format = dtype if isinstance(dtype, ExpertFormat) else ExpertFormat.of_dtype(dtype)
        encoded = self.format.quantized
        dtype = None if encoded else FLOAT_DTYPES[self.format.dtype]
        self.expert_bytes = slot_bytes(shape, self.format)  # in the fast tier
        self.fetch_bytes = store.expert_bytes if store is not None else fetch_bytes  # moved per fetch
        self.lowbit_bytes = lowbit_bytes  # moved per fetch of a low-precision copy (`attach_small`)
        self.small: ExpertStore | None = None
        self.failed_background = 0  # background reads that failed, repaired (`wait`); the engine counts them
        self.per_layer = slots_per_layer(cfg, shape, self.expert_bytes, top_k)
        S = self.per_layer * shape.num_layers
        self.num_slots = S
        # the slots a layer may use now (`use_slots`): fewer while a long forward pass's workspace takes their
        # memory; the rest stay allocated as untouched pages, which cost nothing
        self.active = self.per_layer
        virtual = store is None
        floats = not (virtual or encoded)

        def zeros(*dims, dtype=dtype):
            if device is None or torch.device(device).type == "cpu":
                return page_aligned_zeros((S, *dims), dtype)
            return torch.zeros((S, *dims), device=device, dtype=dtype)
        self.w13 = zeros(*shape.w13) if floats else None
        self.w2 = zeros(*shape.w2) if floats else None
        biased = shape.bias and floats  # families with expert biases: b13 [S, 2F], b2 [S, H]
        self.b13 = zeros(shape.w13[0]) if biased else None
        self.b2 = zeros(shape.w2[0]) if biased else None
        self.blobs = zeros(self.expert_bytes, dtype=torch.uint8) if encoded and not virtual else None
        self.state = self._new_state()
        self.scratch = Scratch.make(top_k, shape.num_experts)
        self.pending: dict[int, Transfer] = {}  # slot -> transfer in flight
        self.interrupted = False  # an interrupt cut an engine's call short: `recover` before the next
        if virtual:
            self.transfers = InstantTransfers()
        elif encoded:
            self.transfers = TransferEngine(store, self.blobs, None, cfg.io_workers, encoded=True, io=cfg.io)
        else:
            self.transfers = TransferEngine(store, self.w13, self.w2, cfg.io_workers, self.b13, self.b2, io=cfg.io)
        if not virtual:
            self._compile()

    def compile_prefetch(self) -> None:
        """Compile the prefetch decision as `_compile` compiles the others, once a predictor is attached (a first run
        without one is spared its ~12 s of compiling)."""
        E, k, sc = self.shape.num_experts, self.top_k, self.scratch
        kernel.prefetch_predicted(self._new_state(), MissPolicy().params(), 0, np.zeros(E, np.float32), True, 0,
                                  False, 0.0, 0, np.empty(k, np.int64), np.empty(k, np.float32), sc.order_v, sc.comp,
                                  sc.block_max, sc.fetch)

    def attach_small(self, store: ExpertStore) -> None:
        """The slow tier's low-precision copies, which `lowbit` transfers read (into the same float slots)."""
        self.small, self.lowbit_bytes = store, store.expert_bytes
        if isinstance(self.transfers, TransferEngine):
            self.transfers.small = store

    def _compile(self) -> None:
        """Compile routing and the decision kernel for the engine's argument types now, on a
        throwaway state (numba caches the machine code on disk: only the first run compiles),
        so that no forward pass is timed with a compilation in it."""
        L, E, k = self.shape.num_layers, self.shape.num_experts, self.top_k
        route_logits(np.zeros((1, E), np.float32), k, True)
        Router(k, True, "sigmoid").route(np.zeros((1, E), np.float32), 0)
        ids = np.arange(k, dtype=np.int64)[None]
        for logits in (True, False):
            kernel.decide_layer(self._new_state(), MissPolicy().params(), np.zeros((L, E)), self.scratch, 0,
                                np.zeros((1, E), np.float32), np.zeros((1, E), np.float32), logits, ids,
                                np.full((1, k), 1 / k, np.float32), 0, np.zeros((1, k), np.int64),
                                np.zeros((1, k), np.int64), np.zeros((1, k), np.float32))

    def _new_state(self) -> CacheState:
        st = CacheState.make(self.shape.num_layers, self.shape.num_experts, self.per_layer, self.cfg.quota,
                             self.cfg.eviction or "lru", self.top_k, self.active)
        st.misc[LOGGING] = 1
        return st.with_log(kernel.log_capacity(1, self.top_k, self.shape.num_experts))

    @property
    def bytes(self) -> int:
        """Fast-tier bytes of all slots."""
        return self.num_slots * self.expert_bytes

    @property
    def bytes_in_use(self) -> int:
        """Fast-tier bytes of the slots the layers may use now (`use_slots`)."""
        return self.active * self.shape.num_layers * self.expert_bytes

    @property
    def usable(self) -> int:
        """The slots a layer may use now: its own, or under a global quota all of them."""
        return self.active * (self.shape.num_layers if self.cfg.quota == "global" else 1)

    def use_slots(self, per_layer: int) -> None:
        """Let each layer use `per_layer` of its slots from now on (at least a top-k set, at most those allocated),
        between forwards. Slots taken away are emptied (their reads in flight land first) and their
        pages given back to the system: a memory budget lends them to a long pass's workspace and back to decode."""
        least = least_slots_per_layer(self.cfg.quota, self.top_k, self.shape.num_layers)
        per_layer = min(max(int(per_layer), least), self.per_layer)
        if per_layer == self.active:
            return
        st, L = self.state, self.shape.num_layers
        cut = [(lo + per_layer, hi) for lo, hi in zip(st.slot_lo.tolist(), st.slot_hi.tolist())] \
            if self.cfg.quota == "layer" else [(per_layer * L, self.active * L)]
        if per_layer < self.active:
            gone = [s for a, b in cut for s in range(a, b)]
            self._wait_each([s for s in gone if s in self.pending], needed=False)
            for s in gone:
                if st.owner[s] >= 0:
                    self._unmap(s, int(st.owner[s]))
                st.owes[s], st.owed[s] = -1, 0
            for tensor in (self.w13, self.w2, self.b13, self.b2, self.blobs):
                if tensor is not None and tensor.device.type == "cpu":
                    for a, b in cut:
                        release_pages(tensor[a:b])
        self.active = per_layer
        if self.cfg.quota == "layer":
            st.slot_hi[:] = st.slot_lo + per_layer
        else:
            st.slot_hi[:] = per_layer * L

    @property
    def slot_of(self) -> np.ndarray:
        """[L, E] slot of each (layer, expert), resident or in flight; -1 if absent."""
        return self.state.slot_of

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.shape.num_layers:
            raise BadInput(f"layer {layer} is out of range; the model has {self.shape.num_layers} MoE layers")

    def _check_experts(self, what: str, ids: np.ndarray) -> None:
        E = self.shape.num_experts
        if ids.size and ids.view(np.uint64).max() >= E:  # one reduction: negative ids wrap to huge ones
            raise BadInput(f"{what} holds expert ids outside [0, {E}): {ids.min()}..{ids.max()}")

    def too_small(self, layer: int) -> CacheTooSmall:
        """The error for a layer whose current token needs every slot, for the caller to raise."""
        return CacheTooSmall(f"layer {layer}: every cache slot is needed by the current token; "
                             "give the cache more slots")

    # -- deciding ------------------------------------------------------------------------
    def decide(self, policy, layer: int, routing: Routing, token_base: int, slots: np.ndarray, experts: np.ndarray,
               gates: np.ndarray) -> None:
        """Decide one layer's tokens (the compiled loop) and log the actions to carry out;
        the expert work that no logged flush runs is the caller's. routing: the routes (rows, and
        a sigmoid router's scores, [T, E] float32; weights [T, k] float32; ids [T, k] int64);
        slots, experts [T, k] int64 and gates [T, k] float32 receive the plan. Sizes, types and
        ids are checked here: the compiled loop checks no bounds."""
        E, k = self.shape.num_experts, self.top_k
        ids = routing.ids
        T = ids.shape[0] if isinstance(ids, np.ndarray) and ids.ndim == 2 else -1
        logits = routing.scores is routing.rows  # softmax: one row ranks and weighs
        rows = [("logits", routing.rows)] if logits else [("selection rows", routing.rows), ("scores", routing.scores)]
        checks = [(name, a, "E", F32) for name, a in rows] + [
            ("weights", routing.weights, "k", F32), ("ids", ids, "k", I64), ("slots", slots, "k", I64),
            ("experts", experts, "k", I64), ("gates", gates, "k", F32)]
        for name, a, width, dtype in checks:
            shape = (T, E if width == "E" else k)
            if not isinstance(a, np.ndarray) or a.shape != shape or a.dtype != dtype:
                got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
                raise BadInput(f"decide: {name} must be a {dtype} array of shape [T, {width}] = {shape} "
                               f"(T tokens, E={E} experts, top-k={k}); got {got}")
        self._check_layer(layer)
        self._check_experts("decide: ids", ids)
        policy.fit(k, E, policy.norm_topk)
        self.decide_routed(policy, layer, routing, token_base, slots, experts, gates)

    def decide_routed(self, policy, layer: int, routing: Routing, token_base: int, slots: np.ndarray,
                      experts: np.ndarray, gates: np.ndarray) -> None:
        """`decide` without its checks, for routes that the router made (the right types and
        shapes, ids in range) and a policy already fitted to the model: the engine's per-layer call."""
        L, E, k = self.shape.num_layers, self.shape.num_experts, self.top_k
        if policy.fitted != (k, E) or (policy.fetches_small and self.small is None):  # the kernel trusts both
            raise BadInput(f"policy {policy.spec or policy!r} was not bound to this engine (its parameters checked "
                           f"against top-{k} of {E} experts, its small copies attached); pass it through "
                           "Engine.bind_policy or set_policy")
        T = routing.ids.shape[0]
        if len(self.state.log) < kernel.log_capacity(T, k, E):
            self.state = self.state.with_log(kernel.log_capacity(T, k, E))
        logits = routing.scores is routing.rows  # softmax: one row ranks and weighs
        if kernel.decide_layer(self.state, policy.params(), policy.bind(L, E), self.scratch, layer, routing.rows,
                               routing.scores, logits, routing.ids, routing.weights, token_base, slots, experts,
                               gates) < 0:
            self._abandon(self._take_log())  # the tokens before the failing one logged loads
            raise self.too_small(layer)

    def prefetch(self, layer: int, experts: np.ndarray, clock: int) -> float:
        """Start transfers of `experts` of `layer` that are not mapped yet."""
        experts = np.asarray(experts, np.int64)
        if experts.ndim != 1:
            raise BadInput(f"prefetch: experts must be a list of expert ids; got an array of shape {experts.shape}")
        self._check_layer(layer)
        self._check_experts("prefetch: experts", experts)
        return self.prefetch_routed(layer, experts, clock)

    def prefetch_routed(self, layer: int, experts: np.ndarray, clock: int, hold: np.ndarray | None = None) -> float:
        """`prefetch` without its checks, for ids that a router made (int64 [n], in range): the engine's call;
        the resident experts of `hold` (the other predictions) are not evicted for them."""
        if not kernel.prefetch(self.state, layer, experts, experts if hold is None else hold, clock):
            self._abandon(self._take_log())
            raise self.too_small(layer)
        return self.carry_out()

    def prefetch_predicted(self, policy: np.ndarray, layer: int, row: np.ndarray, norm: bool, budget: int,
                           fetched: bool, confidence: float, clock: int) -> tuple[np.ndarray, np.ndarray, float]:
        """A decode token's predicted router logits row [E] (float32) for `layer`, from a softmax router without
        bias, routed and prefetched in one compiled call (kernel.prefetch_predicted, with the policy's
        parameter vector); returns its routed ids [k], their gate weights [k] and the seconds stalled."""
        ids, w = np.empty(self.top_k, np.int64), np.empty(self.top_k, np.float32)
        sc = self.scratch
        started = kernel.prefetch_predicted(self.state, policy, layer, row, norm, budget, fetched, confidence, clock,
                                            ids, w, sc.order_v, sc.comp, sc.block_max, sc.fetch)
        return ids, w, self._carry_out_prefetch(started, layer)

    def prefetch_ranked(self, policy: np.ndarray, layer: int, ids: np.ndarray, w: np.ndarray, budget: int,
                        fetched: bool, confidence: float, clock: int) -> float:
        """A decode token's predicted experts of `layer`, ids [k] (int64) in rank order with their gate weights w [k]
        (float32), already routed: prefetched through the compiled path's filter (kernel.prefetch_ranked). Returns
        the seconds stalled."""
        started = kernel.prefetch_ranked(self.state, policy, layer, ids, w, budget, fetched, confidence, clock,
                                         self.scratch.fetch)
        return self._carry_out_prefetch(started, layer)

    def _carry_out_prefetch(self, started: int, layer: int) -> float:
        """The transfers a compiled prefetch logged (`started` of them; -1: the cache had no slot to give)."""
        if started < 0:
            self._abandon(self._take_log())
            raise self.too_small(layer)
        return self.carry_out() if started else 0.0

    def carry_out(self, compute=None, started=None, landed=None) -> float:
        """Carry out the logged actions in order: start transfers, wait for them, run the
        expert work owed before a slot is overwritten (`compute(slot, end)`: the slot's work for
        tokens [0, end) of the call). `started()`, if given, runs once the transfers logged before
        the first wait are under way (before that wait), so that work it starts overlaps them;
        `landed(later)`, if given, after it and after each wait, so that the experts resident by then run while
        the reads still in flight go on; `later`: the slots of loads logged after that point, which are the
        kernel's already but may still hold the experts they replace.
        An admission or upgrade that this call does not wait for (decode: nothing waits for it before
        the next token) starts once the reads of the wait after it have landed: issued with those
        synchronous fetches, it would share the slow tier with them and lengthen the wait. One that a
        later token of a window waits for starts with the fetches logged beside it, as before.
        Returns the seconds stalled. If an action raises, the cache is left consistent before the
        error propagates: transfers not started or failed leave their experts absent and their
        slots free, and no transfer is left in flight."""
        rows, stall = self._take_log(), 0.0
        E = self.shape.num_experts
        # a lone fetch is read by the waiting thread, unless `started` or `landed` has work to overlap with it
        here = self._read_here(rows) if self.cfg.caller_reads and started is None and landed is None else set()
        waited = {r[1]: i for i, r in enumerate(rows) if r[0] == kernel.WAIT}  # slot -> its last wait's row
        last_wait = max(waited.values(), default=-1)
        held: list[list[int]] = []  # background loads not started yet
        loads = [] if landed is None else [(i, r[1]) for i, r in enumerate(rows) if r[0] == kernel.LOAD]  # row, slot
        first_wait = True

        def start_held():
            while held:
                a, b, c = held[0][1:]
                self.pending[a] = self.transfers.submit(b // E, b % E, a, kernel.KINDS[c])
                held.pop(0)

        i = 0
        try:
            for i, (op, a, b, c) in enumerate(rows):
                if op == kernel.LOAD:
                    if c in (kernel.ADMIT, kernel.UPGRADE) and i < last_wait and waited.get(a, -1) < i:
                        held.append(rows[i])
                    else:
                        self.pending[a] = self.transfers.submit(b // E, b % E, a, kernel.KINDS[c], i in here)
                    continue
                if op == kernel.FLUSH:  # one slot's few entries: not worth a submission of their own
                    compute(a, b)
                    continue
                if op == kernel.FINISH_ALL:
                    start_held()
                self.transfers.flush()  # the loads logged so far start together
                if started is not None:
                    started, run = None, started
                    run()
                later = None if landed is None else {slot for row, slot in loads if row > i}
                if landed is not None and first_wait:
                    first_wait = False
                    landed(later)
                if op == kernel.WAIT:
                    stall += self.wait(a)
                else:
                    stall += self.finish_all()
                if landed is not None:
                    landed(later)
                if i + 1 == len(rows) or rows[i + 1][0] != kernel.WAIT:  # the wait's reads have landed
                    start_held()
            self.transfers.flush()
            if started is not None:
                started()
        except BaseException:
            self._abandon(held + rows[i:])  # loads not started, the failed action, and those decided after it
            raise
        return stall

    @staticmethod
    def _read_here(rows: list[list[int]]) -> set[int]:
        """The rows of the synchronous fetches that are their token's only one: the calling thread
        would hand the read to a worker and wait, so it reads it itself (the kernel logs a token's
        loads before its waits)."""
        here, last, n = set(), -1, 0
        for i, (op, _, _, c) in enumerate(rows):
            if op == kernel.LOAD and c in (kernel.FETCH, kernel.LOWBIT):
                last, n = i, n + 1
            elif op == kernel.WAIT and n:
                if n == 1:
                    here.add(last)
                n = 0
        return here

    def _take_log(self) -> list[list[int]]:
        """The logged actions (op, a, b, c), removed from the log."""
        n = self.state.misc[N_LOG]
        self.state.misc[N_LOG] = 0
        return self.state.log[:n].tolist()

    def _abandon(self, rows: list[list[int]]) -> None:
        """Logged actions that will not be carried out: their loads leave the experts absent and
        the slots free, and every transfer already in flight lands (failures unmapped too)."""
        for op, a, b, _ in rows:
            if op == kernel.LOAD:
                self._unmap(a, b)
        self._drain()

    # -- transfers -----------------------------------------------------------------------
    def _unmap(self, slot: int, flat: int) -> None:
        """The transfer of expert `flat` (layer * E + expert) into `slot` failed or never started:
        the expert is absent and the slot free, the first victim of its range."""
        st = self.state
        if st.owner[slot] == flat:
            st.owner[slot] = -1
            st.slot_of.reshape(-1)[flat] = -1
            st.last_use[slot], st.score[slot] = -1, 0.0
            st.low[slot] = False
        st.pending[slot] = False

    def wait(self, slot: int, needed: bool = True) -> float:
        """Block until `slot` holds its expert; returns the stall in seconds. If the transfer failed, its
        expert is unmapped before the error propagates. A failed background read (a prefetch, an admission,
        an upgrade) is no request's error: counted in `failed_background`, it is read again as a fetch where
        a token waits for it (`needed`), else the expert is left absent and the slot free."""
        t = self.pending.pop(slot, None)
        self.state.pending[slot] = False
        if t is None:
            return 0.0
        try:
            return self.transfers.wait(t)
        except Exception:
            background = t.kind in BACKGROUND_KINDS
            self.failed_background += background
            if background and needed:
                self.pending[slot] = self.transfers.submit(t.layer, t.expert, slot, "fetch", here=True)
                self.transfers.flush()
                return self.wait(slot)
            self._unmap(slot, t.layer * self.shape.num_experts + t.expert)
            if not background:
                raise
            return 0.0

    def _drain(self) -> None:
        """Wait for every transfer in flight, unmapping those that fail. Their errors are dropped:
        the caller is already raising one, or discarding the state."""
        for slot in list(self.pending):
            try:
                self.wait(slot, needed=False)
            except Exception:  # noqa: BLE001 -- every transfer must land before the caller's error propagates
                pass

    def _wait_each(self, slots: list[int], needed: bool = True) -> float:
        """Wait for the transfers into `slots`; returns the stall. On a failure every other
        transfer in flight lands too (failed experts unmapped) before the first error is raised."""
        stall = 0.0
        for slot in slots:
            try:
                stall += self.wait(slot, needed)
            except BaseException:
                self._drain()
                raise
        return stall

    def poll(self) -> None:
        """Retire finished transfers so that decisions see them as resident (a failed background read
        is repaired, not raised: the forward that polls did not ask for it)."""
        self._wait_each([s for s, t in self.pending.items() if t.done()], needed=False)

    def drop_prefetches(self, layer: int, needed: np.ndarray) -> int:
        """Drop the prefetches of `layer` that no worker has started and whose expert is not in
        `needed` (the layer's routed ids, now known): the read is never made and the slot is free
        again. Returns how many were dropped; they no longer count as prefetches."""
        E, dropped, needed = self.shape.num_experts, 0, set(needed.ravel().tolist())
        for slot, t in list(self.pending.items()):
            if t.kind == "prefetch" and t.layer == layer and t.expert not in needed and t.cancel():
                del self.pending[slot]
                self._unmap(slot, layer * E + t.expert)
                dropped += 1
        self.state.counts[PREFETCHES] -= dropped
        return dropped

    def finish_all(self) -> float:
        """Wait for every transfer in flight; returns the stall in seconds."""
        return self._wait_each(list(self.pending))

    # -- residency -----------------------------------------------------------------------
    def fill(self, layer: int, experts) -> None:
        """Initial residency: load `experts` of `layer` synchronously, outside any statistics."""
        if not kernel.fill(self.state, layer, np.asarray(experts, np.int64)):
            self._abandon(self._take_log())
            raise self.too_small(layer)
        self.carry_out()
        self.finish_all()

    def warm(self, counts: np.ndarray) -> None:
        """Warm start: each layer's most-routed experts (counts [L, E]) fill its share of slots."""
        n = self.active
        for layer in range(self.shape.num_layers):
            self.fill(layer, np.argsort(-counts[layer], kind="stable")[:n])

    def clear(self) -> None:
        """Empty the cache; takes up a changed eviction order."""
        self._drain()  # a transfer that fails now is dropped with the rest of the state
        self.state = self._new_state()

    def recover(self) -> None:
        """After an interrupt anywhere in a forward or a fill: its decisions may have mapped experts whose reads
        never started (their slots holding other bytes), and the transfers' bookkeeping may be cut midway. Every
        read started lands, and the cache starts empty; `interrupted` stays set until this has run in full."""
        self.interrupted = True
        self.transfers.settle()
        self.pending.clear()
        self.state = self._new_state()
        self.interrupted = False

    def close(self) -> None:
        """Land the transfers in flight, stop the transfer workers and close the low-precision
        store, if any (the engine closes the main store)."""
        self._drain()
        self.transfers.close()
        if self.small is not None:
            self.small.close()
