"""One worker thread owns the engine; requests wait in a FIFO queue and are admitted in order.

batch: up to `max_active` requests run at once; each round prefills the newly admitted ones
(one at a time, under the prefill policy; while others decode, a long prompt runs `prefill_chunk`
tokens a round, so that their tokens keep coming) and then runs one decode step of every other active
request as ONE batched forward (each request keeps its own KV cache; attention runs per request,
everything else on the batch, and the MoE layer decides the batch's tokens in order).
interleave: the same rounds, but each request's decode step is its own forward (its KV cache
swapped into the transformer for its step). serial: one request at a time, to completion.
Under batch and interleave a short request is not stuck behind a long one. Under every schedule
the expert cache sees tokens in order and persists across requests (it is never reset).

A failure inside a request's step ends that request. A failure outside any step (bookkeeping, a
repair) ends the active requests with it, the cache is repaired, and the worker goes on; one the
worker cannot recover from (the repair fails, or a BaseException) ends every waiting request and
every later one with it, sets `failure` and calls `on_fatal`, so that the process can exit
non-zero and a supervisor restart it."""
from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..engine.engine import Engine
from ..engine.generate import StepOutput, TextGeneration, batch_logits
from ..engine.sampling import SamplingParams
from ..errors import BadInput, ExpertCacheError, FetchError, UnknownName, whole_number
from ..policies import MissPolicy

SCHEDULES = ("batch", "interleave", "serial")


class ShuttingDown(ExpertCacheError):
    """What ends the requests the worker will not run: the server is stopping."""

    def __init__(self):
        super().__init__("the server is shutting down; send the request again")


@dataclass
class Request:
    """One generation request. `emit(item)` is called from the worker thread with a
    StepOutput per token, then None at the end, or an Exception that ended the request."""
    prompt: list[int]
    params: SamplingParams
    emit: Callable[[StepOutput | Exception | None], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    finished: float | None = None
    generation: TextGeneration | None = None
    completion_tokens: int = 0  # tokens sampled, an end token that ended it included
    group: object = None  # the client's call it belongs to (its n choices, its prompts): they share its slots

    def cancel(self) -> None:
        """Stop generating (the client went away); the worker drops it at its next step."""
        self.cancelled.set()


@dataclass(frozen=True)
class SchedulerConfig:
    """How requests are admitted: the schedule (batch, interleave or serial), how many decode at
    once under batch or interleave, and the miss policy for prompt tokens."""
    schedule: str = "batch"
    max_active: int = 16
    prefill_policy: MissPolicy | None = None  # None: prompts use the engine's policy
    max_per_group: int | None = None  # active slots one call's requests may hold; None: half of max_active
    # prompt tokens a round runs of one request while others decode (0: a prompt whole): a long prompt run whole
    # held every other stream for its whole prefill (seconds at real size); alone, a prompt runs whole, since each
    # part reads its experts again
    prefill_chunk: int = 512


class Scheduler:
    """Owns the engine on one worker thread: admits submitted requests in order and runs their
    steps under the configured schedule; `on_finish(request, outcome)` is called as each ends."""
    def __init__(self, engine: Engine, config: SchedulerConfig = SchedulerConfig(),
                 on_finish: Callable[[Request, str], None] | None = None):
        if config.schedule not in SCHEDULES:
            raise UnknownName(f"unknown schedule {config.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if config.max_active < 1:
            raise BadInput(f"max_active={config.max_active} must be >= 1")
        if whole_number(config.prefill_chunk, "prefill_chunk") < 0:
            raise BadInput(f"prefill_chunk={config.prefill_chunk} must be >= 0 (0: each prompt whole)")
        if config.prefill_policy is not None:  # refused at start-up, not on the first prompt
            engine.bind_policy(config.prefill_policy)
        self.engine, self.config, self.on_finish = engine, config, on_finish
        # told of each step that fails, with its exception whole: a client's answer names files without their
        # folders, and the server's own log had only the status (`serve` prints it)
        self.on_error: Callable[[Request, Exception], None] | None = None
        # a sequence brings only its keys and values to its step (swapped in, or batched): a model that
        # keeps other per-sequence state (MLA's latent cache, DeltaNet's recurrent state) runs one at a time
        m = engine.model
        self.interleaves = config.schedule != "serial" and not m.state_beyond_kv
        self.batches = self.interleaves and config.schedule == "batch"
        self.max_active = config.max_active if self.interleaves else 1
        # the keys and values of the active requests, reserved at admission (prompt + max_tokens positions each),
        # never past what the engine's memory plan counted; a request that does not fit waits its turn
        self.kv_capacity = engine.config.kv_positions or engine.model.max_seq
        # one call's n choices must not take every slot while other clients wait
        self.max_per_group = config.max_per_group or max(1, self.max_active // 2)
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []
        self.lock = threading.Condition()
        self.stopping = False
        self.failure: BaseException | None = None  # what stopped the worker for good (`state`)
        self.on_fatal: Callable[[BaseException], None] | None = None  # called once, from the worker thread
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.thread = threading.Thread(target=self._loop, name="expertcache-engine", daemon=True)

    def start(self) -> None:
        """Start the worker thread."""
        self.thread.start()

    def warm_up(self) -> None:
        """Before the worker starts: the steps requests take (a prompt, a decode step and, where this schedule
        batches, a batched one) on short sequences, then fresh statistics and policy state. A first run's kernels
        compile here, minutes on a new machine, before the server says it serves, and not inside a client's first
        request; the few experts the steps fetched stay resident."""
        if self.engine.model.max_seq < 4:  # a prompt token and three more: a context too short to warm up in
            return
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        gens = [TextGeneration(self.engine, [0], params, own_kv=True, prefill_policy=self.config.prefill_policy)
                for _ in range(2 if self.batches else 1)]
        for g in gens:
            g.step()
        gens[0].step()
        if self.batches:
            for g, row in zip(gens, batch_logits(self.engine, gens)):
                g.advance(row)
        self.engine.restart_counts()

    def stop(self, wait: bool = True) -> None:
        """Stop the worker after its current round of steps (every request it has not finished then ends with
        ShuttingDown) and, with `wait`, wait for it to exit."""
        with self.lock:
            self.stopping = True
            self.lock.notify()
        if wait and self.thread.is_alive():
            self.thread.join()

    @property
    def state(self) -> str:
        """'serving', 'failed: REASON' (the worker stopped on an error it cannot recover from), or 'stopped'."""
        if self.failure is not None:
            return f"failed: {type(self.failure).__name__}: {self.failure}"
        return "serving" if self.thread.is_alive() and not self.stopping else "stopped"

    def submit(self, request: Request) -> None:
        """Queue a request for admission (FIFO); its outputs arrive through `request.emit` (at once, the
        failure, when the worker has stopped on one). BadInput for one whose keys and values could never fit
        (it would wait forever)."""
        if kv_need(request) > self.kv_capacity:
            raise BadInput(f"a {len(request.prompt)}-token prompt with max_tokens={request.params.max_tokens} needs "
                           f"{kv_need(request)} KV positions; the server holds {self.kv_capacity} (--kv-positions)")
        with self.lock:
            if self.failure is None and not self.stopping:
                self.waiting.append(request)
                self.lock.notify()
                return
        self._end(request, self.failure or ShuttingDown())  # stopping: it would wait for a worker that has left

    @property
    def kv_reserved(self) -> int:
        """KV positions the active requests hold at most."""
        return sum(kv_need(r) for r in self.active)

    @property
    def queue_length(self) -> int:
        """Requests waiting for admission."""
        return len(self.waiting)

    def backlog(self, more: int = 0) -> int:
        """Requests that would wait with `more` submitted, past those the free active slots take at the worker's
        next round: what --max-waiting bounds (a burst the slots had room for got 429s while the worker had not
        yet admitted its first requests)."""
        return max(0, len(self.waiting) + more - max(0, self.max_active - len(self.active)))

    def _admit(self) -> bool:
        """Move waiting requests (FIFO) into the active set; False when stopping."""
        with self.lock:
            while not self.stopping and not self.active and not self.waiting:
                self.lock.wait()
            if self.stopping:
                return False
            # their clients left while they waited: they take no slot and end at their first step, not hold the
            # queue (and its 429s for live clients) until slots free
            gone = [r for r in self.waiting if r.cancelled.is_set()]
            for request in gone:
                self.waiting.remove(request)
            held = Counter(r.group for r in self.active if r.group is not None)
            for request in list(self.waiting):  # in order, past a call that holds its share
                if len(self.active) == self.max_active:
                    break
                if request.group is not None and held[request.group] >= self.max_per_group:
                    continue
                if self.kv_reserved + kv_need(request) > self.kv_capacity:
                    break  # it waits for keys and values to be freed, and nothing after it passes it
                self.waiting.remove(request)
                self.active.append(request)
                held[request.group] += 1
            self.active.extend(gone)
        return True

    def _finish(self, request: Request, outcome: StepOutput | Exception | None, reason: str) -> None:
        request.finished = time.perf_counter()
        self.active.remove(request)
        if request.generation is not None:
            request.completion_tokens = request.generation.completion_tokens
        request.generation = None  # frees its KV buffers
        if outcome is not None:
            request.emit(outcome)
        request.emit(None)
        if self.on_finish is not None:
            self.on_finish(request, reason)

    def _step(self, request: Request) -> None:
        if request.cancelled.is_set():
            return self._finish(request, None, "cancelled")
        try:
            if request.generation is None:
                request.generation = TextGeneration(self.engine, request.prompt, request.params,
                                                    own_kv=True, prefill_policy=self.config.prefill_policy)
                self.prompt_tokens += len(request.prompt)
            if self._runs_part(request):
                return request.generation.prefill_part(self.config.prefill_chunk)
            out = request.generation.step()
        except Exception as e:  # the request ends with an error; the server keeps serving
            if isinstance(e, FetchError):
                repair_cache(self.engine)
            if self.on_error is not None and not isinstance(e, BadInput):
                self.on_error(request, e)
            return self._finish(request, e, "error")
        self._deliver(request, out)

    def _runs_part(self, request: Request) -> bool:
        """Whether this step runs only the next `prefill_chunk` of the request's prompt: one longer than that is
        left, and another request is decoding."""
        g, chunk = request.generation, self.config.prefill_chunk
        return bool(chunk) and g.can_prefill_part(chunk) and \
            any(r is not request and r.generation is not None and r.generation.decoding for r in self.active)

    def _deliver(self, request: Request, out: StepOutput) -> None:
        self.generated_tokens += out.token is not None  # a step that only scored the prompt sampled none
        if request.first_token is None:
            request.first_token = time.perf_counter()
        if out.finish_reason is not None:
            return self._finish(request, out, out.finish_reason)
        request.emit(out)

    def _batch_step(self, requests: list[Request]) -> None:
        """One decode step of `requests` as one batched forward. If it fails, each request retries its step
        alone, so only the requests whose own step fails end with the error (a retried step rewrites the same
        keys and values at the same positions, so the others continue exactly)."""
        live = []
        for request in requests:
            if request.cancelled.is_set():
                self._finish(request, None, "cancelled")
            else:
                live.append(request)
        if len(live) < 2:
            return self._step(live[0]) if live else None
        try:
            logits = batch_logits(self.engine, [r.generation for r in live])
        except Exception as e:
            if isinstance(e, FetchError):
                repair_cache(self.engine)
            for request in live:
                self._step(request)
            return
        for request, row in zip(live, logits):
            try:
                out = request.generation.advance(row)
            except Exception as e:  # sampling failed: this request ends, the others go on
                self._finish(request, e, "error")
                continue
            self._deliver(request, out)

    def _round(self) -> None:
        """One step of every active request under the schedule."""
        if not self.batches:
            for request in list(self.active):  # one step each, in admission order
                self._step(request)
            return
        decoding = [r for r in self.active if r.generation is not None and r.generation.decoding]
        for request in [r for r in self.active if r.generation is None or not r.generation.decoding]:  # prompts
            self._step(request)
        self._batch_step(decoding)

    def _loop(self) -> None:
        try:
            while self._admit():
                try:
                    self._round()
                except Exception as e:  # outside any request's step: the requests it was running end with it
                    for request in list(self.active):
                        self._end(request, e)
                    self.active.clear()
                    repair_cache(self.engine)  # their steps may have left the cache half-updated
            for request in [*self.active, *self.waiting]:  # stopped: nobody will run them
                self._end(request, ShuttingDown())
        except BaseException as e:  # the repair failed, or the thread is being torn down: stop for good
            with self.lock:
                self.failure, ended = e, [*self.active, *self.waiting]
                self.active.clear()
                self.waiting.clear()
            for request in ended:
                self._end(request, e)
            if self.on_fatal is not None:
                self.on_fatal(e)

    def _end(self, request: Request, error: BaseException) -> None:
        """End a request with `error` unless it has ended already; a client that is gone is no error here."""
        if request.finished is not None:
            return
        request.finished = time.perf_counter()
        request.generation = None
        try:
            request.emit(error if isinstance(error, Exception) else RuntimeError(str(error) or type(error).__name__))
            request.emit(None)
        except Exception:  # noqa: BLE001 -- its event loop is closed: nobody waits for the answer
            pass
        if self.on_finish is not None:
            try:
                self.on_finish(request, "error")
            except Exception:  # noqa: BLE001 -- the metrics' failure must not end the worker's recovery
                pass


def kv_need(request: Request) -> int:
    """Positions of keys and values a request holds at most: its prompt and every token it may generate."""
    return len(request.prompt) + request.params.max_tokens


def repair_cache(engine: Engine) -> None:
    """After a failed fetch a slot may be mapped to an expert whose copy never landed: empty
    the cache (waiting out the other transfers) and warm it again, so later requests compute
    with the right weights."""
    for _ in range(engine.cache.num_slots + 1):
        try:
            engine.cache.clear()
            break
        except FetchError:
            continue
    engine.runner.predicted = None
    if engine.warm:
        try:
            engine.cache.warm(engine.routing_counts)
        except FetchError:  # the slow tier is still failing: stay cold, fetch on demand later
            engine.cache.clear()
