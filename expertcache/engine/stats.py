"""Run statistics, counted by the engine and returned as data."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..kernel.cache_state import BACKGROUND, COUNTERS, LOWBIT_FETCHES, PREFETCHES, SYNC_FETCHES


@dataclass
class RunStats:
    """Counters and timings of one run (reset by `Engine.reset`) and the rates derived from them;
    `to_dict` for JSON, `line` for a one-line summary."""
    tokens: int = 0  # tokens through the model (prompt, decode or teacher-forced)
    moe_calls: int = 0  # one token at one MoE layer
    routed: int = 0  # routed (token, expert) selections
    hits: int = 0  # routed selections resident at decision time
    misses: int = 0
    sync_fetches: int = 0  # misses fetched on the critical path
    fetch_waits: int = 0  # MoE calls that waited for synchronous fetches (a call's fetches overlap)
    sync_fetch_bytes: int = 0
    lowbit_fetches: int = 0  # misses fetched on the critical path as their low-precision copy
    lowbit_bytes: int = 0
    substitutions: int = 0  # routed experts replaced or dropped
    substituted_calls: int = 0  # calls with at least one substitution
    substituted_mass: float = 0.0  # summed gate weight of substituted experts
    background_fetches: int = 0  # admissions and upgrades started off the critical path
    failed_background_reads: int = 0  # background reads that failed: repaired (read again, or left absent)
    prefetch_fetches: int = 0  # prefetch reads made (dropped ones not counted)
    exposed_prefetches: int = 0  # of those, issued by a call with no fetch of its own to wait for (nothing hides them)
    prefetch_dropped: int = 0  # prefetches dropped before a worker read them: the layer's routes did not need them
    prefetch_bytes: int = 0
    predictions: int = 0  # (token, layer) next-layer predictions a prefetch predictor made
    predict_s: float = 0.0  # wall time of those predictions (the predictor's compute, to its logits)
    background_bytes: int = 0
    segments: int = 0  # expert-compute passes: a slot's flush before it changes hands mid-call, and each call's last
    expert_runs: int = 0  # (batch, expert) pairs: one expert applied to one batch of tokens
    flushed: int = 0  # (token, expert) entries of a window run early, each before its slot changed hands
    upgrades: int = 0  # slots holding a small copy given the full one in the background (also background_fetches)
    lowbit_uses: int = 0  # experts a token ran from a low-precision copy: fetched for it, or a hit on one
    stall_s: float = 0.0  # time blocked waiting on transfers
    wall_s: float = 0.0  # time in model forward calls, less compile_s
    compile_s: float = 0.0  # time those calls spent compiling or loading kernels (a first run's): no figure counts it
    peak_memory_bytes: int = 0
    read_mode: str = ""  # how fetches reached the slow tier: o_direct, buffered-dontneed, ram, ...
    kernels: str = ""  # the CPU kernels' instruction set and threads (engine/threads.py), e.g. "avx512-vnni, 2 threads"

    def absorb(self, state, fetch_bytes: int, lowbit_bytes: int = 0) -> None:
        """Add and zero the decision kernel's counters (cache_state.CacheState); a fetch moves
        `fetch_bytes`, one of a low-precision copy `lowbit_bytes`."""
        counts = state.counts
        if not counts.any() and not state.mass[0]:
            return
        for name, n in zip(COUNTERS, counts.tolist()):
            setattr(self, name, getattr(self, name) + n)
        self.sync_fetch_bytes += int(counts[SYNC_FETCHES]) * fetch_bytes
        self.lowbit_bytes += int(counts[LOWBIT_FETCHES]) * lowbit_bytes
        self.background_bytes += int(counts[BACKGROUND]) * fetch_bytes
        self.prefetch_bytes += int(counts[PREFETCHES]) * fetch_bytes
        self.substituted_mass += float(state.mass[0])
        counts[:] = 0
        state.mass[0] = 0.0

    @property
    def hit_rate(self) -> float:
        """Routed selections resident at decision time, as a fraction of all routed selections."""
        return self.hits / self.routed if self.routed else 0.0

    @property
    def ms_per_token(self) -> float:
        """Wall time in the model's forward calls per token, in milliseconds."""
        return 1000 * self.wall_s / self.tokens if self.tokens else 0.0

    @property
    def fetches_per_token(self) -> float:
        """Misses fetched on the critical path per token."""
        return self.sync_fetches / self.tokens if self.tokens else 0.0

    @property
    def fetched_bytes_per_token(self) -> float:
        """Bytes moved through the slow tier per token, every kind of transfer and precision."""
        moved = self.sync_fetch_bytes + self.lowbit_bytes + self.background_bytes + self.prefetch_bytes
        return moved / self.tokens if self.tokens else 0.0

    @property
    def mass_per_call(self) -> float:
        """Substituted gate weight per MoE call."""
        return self.substituted_mass / self.moe_calls if self.moe_calls else 0.0

    def to_dict(self) -> dict:
        """Every field and every derived rate, for JSON output."""
        d = asdict(self)
        d.update(hit_rate=self.hit_rate, ms_per_token=self.ms_per_token,
                 fetches_per_token=self.fetches_per_token, substituted_mass_per_call=self.mass_per_call,
                 fetched_bytes_per_token=self.fetched_bytes_per_token)
        return d

    def line(self, speed: bool = True) -> str:
        """A one-line summary: speed (unless `speed` is False: a caller that times prefill and decode apart),
        hit rate, fetches and their bytes, stall, substitutions, peak memory and the read mode."""
        return ((f"{self.tokens} token{'' if self.tokens == 1 else 's'}, {self.ms_per_token:.2f} ms/token, "
                 if speed else "") +
                f"hit rate {self.hit_rate:.1%}, "
                f"{self.fetches_per_token:.2f} fetches/token ({self.sync_fetch_bytes / 2**20:.1f} MiB), "
                + (f"{self.lowbit_fetches / max(self.tokens, 1):.2f} low-precision fetches/token "
                   f"({self.lowbit_bytes / 2**20:.1f} MiB), " if self.lowbit_fetches else "") +
                (f"{self.upgrades / max(self.tokens, 1):.2f} upgrades/token, " if self.upgrades else "") +
                f"stall {self.stall_s:.2f} s, {self.substitutions} substitutions "
                f"(mass {self.mass_per_call:.4f}/call), peak memory {self.peak_memory_bytes / 2**20:.0f} MiB"
                + (f", reads: {self.read_mode}" if self.read_mode else "")
                + (f", kernels: {self.kernels}" if self.kernels else "")
                + (f" (compiling or loading them took {self.compile_s:.3g} s, not counted)" if self.compile_s else ""))
