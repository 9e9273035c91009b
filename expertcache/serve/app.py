"""The OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/chat/completions (SSE
streaming or not), /v1/responses (over the chat's path: responses.py), /v1/models, /health and
/metrics (Prometheus). Requests go to the one Scheduler that owns the engine; errors are
OpenAI-style bodies {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from ..engine.chat import ChatTemplate, ChatTemplateError
from ..engine.generate import StepOutput
from ..engine.sampling import SamplingError, SamplingParams
from ..errors import BadInput, CheckpointError
from .metrics import ServerMetrics
from .limits import BodyLimits, ConnectionLimit, OpenConnections, RequireApiKey, ServerLimits
from .schemas import (MAX_CHOICES, MAX_GENERATIONS, APIError, ChatBody, CompletionBody, DetokenizeBody, SamplingFields,
                      StreamOptions, TokenizeBody, checked_stop, logit_bias_pairs, logprobs_count, message_text,
                      refuse_unsupported, structure)
from . import responses
from .responses import ResponsesBody
from .scheduler import Request, Scheduler, ShuttingDown
from .reasoning import Reply, opens_thinking, reply_form, split_reply
from .tools import call_syntaxes, forced_names

BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback: a byte no piece spells
DISCONNECT_CHECK_S = 0.5  # how often a whole (not streamed) request checks that its client is still there


def byte_level_alphabet() -> dict[str, int]:
    """The character a byte-level BPE vocabulary (GPT-2's, Qwen's) writes for each byte, inverted: printable
    bytes stand for themselves, the others for code points from 256 on, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)}
    shifted = iter(range(256, 512))
    return {chr(b if b in printable else next(shifted)): b for b in range(256)}


class _Offsets:
    """Each token's start in the text that tokens decode to, one call after another: a token within a character
    split over tokens starts where that character does, one after bytes that form no character (each its own
    U+FFFD) after them, and a special token's text counts where the text keeps it (skip_special false). Tokens
    are placed once the text of those since it last ended on a whole character ends on one again (or at the end
    of a call), against that text; decoded after a few tokens of context, as IncrementalDetokenizer does."""
    CONTEXT, OPEN = 4, 64  # tokens of context; tokens of U+FFFD after which they are taken as final

    def __init__(self, tokenizer, context: list[int], skip_special: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special
        self.open, self.placed, self.at = [], 0, 0
        self._context(list(context[-self.CONTEXT:]))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip) if self.tokenizer is not None else ""

    def _context(self, ids: list[int]) -> None:
        """Decode after `ids`, whose own text is decoded once here, not at every token."""
        self.context, self.context_chars = ids, len(self._decode(ids))

    def _text(self, ids: list[int]) -> str:
        """The text of `ids` after the context's."""
        return self._decode(self.context + ids)[self.context_chars:]

    def _place(self, text: str) -> list[int]:
        """The offsets of the open tokens not yet placed, in `text` (theirs): each where the text before it first
        departs from `text` (a split character's U+FFFD), or where it ends."""
        out = []
        for k in range(self.placed, len(self.open)):
            before = self._text(self.open[:k])
            out.append(self.at + next((i for i, (a, b) in enumerate(zip(before, text)) if a != b), len(before)))
        self.placed = len(self.open)
        return out

    def of(self, tokens: list[int]) -> list[int]:
        """The offsets of the next `tokens`."""
        out = []
        if self.tokenizer is None:  # ids joined by spaces
            for t in tokens:
                out.append(self.at)
                self.at += len(str(t)) + 1
            return out
        for t in tokens:
            self.open.append(t)
            text = self._text(self.open)
            if not text.endswith("\ufffd") or len(self.open) > self.OPEN:
                out += self._place(text)
                self.at += len(text)
                self._context((self.context + self.open)[-self.CONTEXT:])
                self.open, self.placed = [], 0
        return out + self._place(self._text(self.open)) if self.open else out


class Server:
    """Turns HTTP bodies into scheduler requests and their outputs into OpenAI responses."""

    def __init__(self, scheduler: Scheduler, model_name: str, metrics: ServerMetrics,
                 limits: ServerLimits = ServerLimits(), reasoning_format: str = "auto"):
        self.scheduler, self.engine, self.model_name, self.metrics = scheduler, scheduler.engine, model_name, metrics
        self.limits, self.reasoning_format = limits, reasoning_format  # a request's own default (create_app)
        self.kept = responses.KeptResponses(limits.responses_kept)
        self.template: ChatTemplate | None = None
        self.no_template = ""  # why chat is refused: no template, or one that does not parse
        try:
            self.template = ChatTemplate.of(self.engine)
        except CheckpointError as e:
            self.no_template = str(e)
        # how the model writes its reasoning and calls (reasoning.py, tools.py): a template that writes calls (in
        # <tool_call> tags, DeepSeek's or Kimi K2's markers, GPT-OSS's harmony format) has them read out of its text
        source = self.template.source if self.template is not None else ""
        self.form, self.calls = reply_form(source), call_syntaxes(source)
        self.reads_calls = self.form == "harmony" or any(syntax.begin in source for syntax in self.calls)
        tokenizer = self.engine.tokenizer
        byte_level = tokenizer is not None and type(tokenizer.decoder).__name__ == "ByteLevel"
        self.byte_of = byte_level_alphabet() if byte_level else None  # a token's exact bytes, for logprobs
        # no token spells more characters than its vocabulary entry has UTF-8 bytes (a normaliser may drop some):
        # a prompt beyond max_seq times that many characters cannot fit, and is refused before tokenizing it
        vocab = tokenizer.get_vocab(with_added_tokens=True) if tokenizer is not None else {}
        self.max_token_chars = 4 * max((len(t.encode()) for t in vocab), default=1)
        self.created = int(time.time())

    def params(self, body: SamplingFields, prompt_len: int, default_max: int | None, chat: bool) -> SamplingParams:
        """The SamplingParams of a request body; APIError for an unknown model, n out of range, a field not
        implemented, or a prompt plus max_tokens beyond the context. default_max caps max_tokens when the body
        gives none."""
        self.check_model(body.model)
        if not 1 <= body.n <= MAX_CHOICES:
            raise APIError(400, f"n={body.n} must be in [1, {MAX_CHOICES}]", "n")
        refuse_unsupported(body)
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options needs stream: true", "stream_options")
        logprobs = logprobs_count(body, chat)
        room = self.engine.model.max_seq - prompt_len
        asked = [m for m in (body.max_completion_tokens, body.max_tokens) if m is not None]
        echo = isinstance(body, CompletionBody) and body.echo  # chat's (vLLM's) was refused above
        if room < (0 if echo and asked[:1] == [0] else 1):  # scoring a prompt needs no position after it
            raise APIError(400, f"the prompt has {prompt_len} tokens, the context is {self.engine.model.max_seq}; "
                           "shorten the prompt", "messages" if chat else "prompt", "context_length_exceeded")
        max_tokens = asked[0] if asked else min(default_max or room, room)
        sent = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"  # as named
        if max_tokens < 0 or max_tokens == 0 and not echo:
            fix = "send echo: true to score the prompt, or max_tokens >= 1" if not chat else f"send {sent} >= 1"
            raise APIError(400, f"{sent}=0 generates nothing; {fix}" if max_tokens == 0 else
                           f"{sent}={max_tokens} must be >= 1", sent)
        if max_tokens > room:
            raise APIError(400, f"{sent}={max_tokens} with a {prompt_len}-token prompt exceeds the context of "
                           f"{self.engine.model.max_seq} tokens; ask for at most {room}", sent,
                           "context_length_exceeded")
        stop = checked_stop(body.stop)
        field, constraint = structure(body)
        vocab = self.engine.args.vocab_size
        if any(not 0 <= t < vocab for t in body.stop_token_ids or ()):  # never generated: a client's mistake
            raise APIError(400, f"stop_token_ids must be token ids in [0, {vocab})", "stop_token_ids")
        try:
            return SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                  min_p=body.min_p, repetition_penalty=body.repetition_penalty,
                                  presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                                  logit_bias=logit_bias_pairs(body, vocab), seed=body.seed,
                                  max_tokens=max_tokens, min_tokens=body.min_tokens, stop=stop,
                                  include_stop_str_in_output=body.include_stop_str_in_output,
                                  stop_token_ids=tuple(body.stop_token_ids or ()),
                                  ignore_eos=body.ignore_eos, logprobs=logprobs,
                                  skip_special_tokens=body.skip_special_tokens,
                                  prompt_logprobs=(logprobs or 0) if echo else None, **constraint)
        except SamplingError as e:
            raise APIError(400, str(e), field if e.param in constraint else e.param) from None

    def check_model(self, model: str | None) -> None:
        """APIError 404 unless `model` is the one served (or left out, as vLLM and llama-server take it)."""
        if model not in (None, self.model_name):
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found")

    def completion_prompts(self, body: CompletionBody) -> list[tuple[list[int], str]]:
        """Each prompt's token ids and text: a text encoded, or ids as sent (checked against the vocabulary) and
        decoded. A list of texts or of id lists is several prompts, one choice each."""
        prompt = body.prompt
        many = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
        if many and len(prompt) * max(body.n, 1) > MAX_GENERATIONS:
            raise APIError(400, f"{len(prompt)} prompts x n={body.n} ask for more than {MAX_GENERATIONS} "
                           "generations in one request; send them in several", "prompt")
        prompts = []
        for p in (prompt if many else [prompt]):
            ids = self.encode(p, "prompt", body.add_special_tokens) if isinstance(p, str) else list(p)
            if not ids:
                raise APIError(400, "the prompt is empty; send at least one token", "prompt")
            if any(not 0 <= t < self.engine.args.vocab_size for t in ids):
                raise APIError(400, f"prompt token ids must be in [0, {self.engine.args.vocab_size})", "prompt")
            prompts.append((ids, p if isinstance(p, str) else self.engine.decode(ids)))
        return prompts

    def chat_prompt(self, body: ChatBody) -> tuple[list[int], str]:
        """The conversation's token ids through the chat template, and its text; APIError when the model has
        none."""
        if self.template is None:
            raise APIError(400, self.no_template, "messages")  # it names the fix, and plain completions
        if not body.messages:
            raise APIError(400, "messages is empty; send at least one message", "messages")
        try:
            text = self.template.render([message_text(m, i) for i, m in enumerate(body.messages)],
                                        body.add_generation_prompt, body.tools, body.template_kwargs())
        except ChatTemplateError as e:
            raise APIError(400, str(e), "messages") from None
        ids = self.encode(text, "messages", special=body.add_special_tokens)
        if not ids:  # a template may render nothing (a conversation of empty messages, no generation prompt)
            raise APIError(400, "the chat template renders these messages as an empty prompt; send some text",
                           "messages")
        return ids, text

    def encode(self, text: str, param: str, special: bool = True) -> list[int]:
        """A prompt's token ids; APIError for text that is not Unicode (a lone surrogate escape) or so long that
        it cannot fit the context whatever its tokens, found before tokenizing it."""
        if len(text) > self.engine.model.max_seq * self.max_token_chars:
            raise APIError(400, f"the prompt has {len(text)} characters, more than {self.engine.model.max_seq} "
                           f"tokens can hold; shorten it", param, "context_length_exceeded")
        try:
            return self.engine.encode(text, special)
        except CheckpointError:
            what = "has no tokenizer" if self.engine.tokenizer is None else \
                "has a tokenizer whose token ids go beyond its vocabulary (another model's)"
            raise APIError(400, f"this model {what}; send the prompt as token ids", param) from None
        except BadInput:
            raise APIError(400, f"the {param} is not Unicode text (it holds a lone surrogate escape such as "
                           "\\ud800); send valid UTF-8", param) from None

    async def run(self, http: HTTPRequest, prompts: list[list[int]], params: list[SamplingParams], chat: bool,
                  stream: bool, n: int = 1, options: StreamOptions | None = None,
                  echo: list[str] | None = None, reply: dict | None = None) -> Response:
        """Submit one scheduler request per choice (n per prompt, the i-th with seed + i when the body gives a
        seed); returns an SSE stream of chunks, each of one choice by its index (`options`: the body's
        stream_options), or the whole response once every generation has ended; choice prompt * n + i.
        `params`: each prompt's (their max_tokens may differ); `echo`: the prompts' texts, to put before their
        completions; `reply`: a chat's Reply arguments (its form, the tools whose calls are read out of its text,
        ...)."""
        if self.scheduler.failure is not None:
            raise APIError(503, f"the engine has stopped ({self.scheduler.state}); the server must be restarted",
                           code="engine_failed", kind="server_error")
        if len(prompts) * n > self.limits.max_waiting:  # a 429 would have the client retry forever
            raise APIError(400, f"{len(prompts)} prompts x n={n} ask for more generations than the server queues "
                           f"({self.limits.max_waiting}, its --max-waiting); send them in several requests",
                           "n" if len(prompts) == 1 else "prompt")
        if self.scheduler.backlog(len(prompts) * n) > self.limits.max_waiting:
            raise APIError(429, f"the server has {self.scheduler.backlog()} requests waiting (at most "
                           f"{self.limits.max_waiting}); retry shortly", None, "queue_full", "server_error",
                           {"Retry-After": str(self.limits.retry_after_s)})
        loop = asyncio.get_running_loop()
        submitted, group = [], object()  # the call's generations share its slots (Scheduler.max_per_group)
        merged: asyncio.Queue = asyncio.Queue()  # a stream's items of every choice, as (choice, item)
        try:
            for prompt, own in zip(prompts, params, strict=True):
                for i in range(n):
                    queue: asyncio.Queue = asyncio.Queue()
                    seed = None if own.seed is None else own.seed + i
                    seeded = own if not i or seed is None else \
                        replace(own, seed=seed if seed < 2**64 else seed - 2**64)  # wrapped, as torch takes seeds
                    put = (lambda item, c=len(submitted): merged.put_nowait((c, item))) if stream else queue.put_nowait
                    request = Request(prompt, seeded, lambda item, f=put: loop.call_soon_threadsafe(f, item),
                                      group=group)
                    self.scheduler.submit(request)
                    submitted.append((request, queue))
        except BaseException:  # what was already submitted would run for nobody
            for request, _ in submitted:
                request.cancel()
            raise
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if stream:
            return StreamingResponse(self._stream([r for r, _ in submitted], merged, rid, chat,
                                                  options or StreamOptions(), sum(len(p) for p in prompts),
                                                  reply or {}, http.state,
                                                  echo and [echo[c // n] for c in range(len(submitted))]),
                                     media_type="text/event-stream")
        try:
            outcomes = await asyncio.gather(*(self._collect(http, *s) for s in submitted))
        except asyncio.CancelledError:  # uvicorn's shutdown ended its grace: an OpenAI 503, not its bare 500
            raise APIError(503, "the server is shutting down; send the request again", None, "shutting_down",
                           "server_error") from None
        finally:
            for request, _ in submitted:
                request.cancel()
        failed = [o for o in outcomes if isinstance(o, Response)]
        if failed:
            return failed[0]
        choices = []
        for i, (text, finish, scored, prompt_scored) in enumerate(outcomes):
            if echo:  # without a tokenizer the texts are ids joined by spaces (Engine.decode): one between them
                joint = " " if self.engine.tokenizer is None and echo[i // n] and text else ""
                text, scored = echo[i // n] + joint + text, [*(prompt_scored or ()), *scored]
            logprobs = None
            if params[0].logprobs is not None:
                context = [] if echo else prompts[i // n]
                where = None if chat else \
                    self.offsets(context, params[i // n].skip_special_tokens).of([s.token for s in scored])
                logprobs = self._logprobs(scored, chat, where)
            if chat:
                thought, content, called = split_reply(text, **(reply or {}))
                message = {"role": "assistant", "content": content}
                for key, value in (("reasoning_content", thought), ("tool_calls", called)):
                    if value:
                        message[key] = value
                finish = "tool_calls" if called and finish == "stop" else finish
                choices.append({"index": i, "message": message, "finish_reason": finish, "logprobs": logprobs})
            else:
                choices.append({"index": i, "text": text, "finish_reason": finish, "logprobs": logprobs})
        usage = self._usage(sum(len(p) for p in prompts),  # a prompt counts once, whatever n
                            sum(r.completion_tokens for r, _ in submitted))
        return JSONResponse({**self._envelope(rid, chat, False), "choices": choices, "usage": usage})

    async def chat(self, http: HTTPRequest, body: ChatBody) -> Response:
        """A chat completion's answer (Server.run's)."""
        prompt, text = await asyncio.to_thread(self.chat_prompt, body)  # a long prompt would stall the loop
        params = self.params(body, len(prompt), default_max=None, chat=True)
        # calls are read out of the text where the template writes them in tags, and a forced call always is
        calling = bool(body.tools) and body.tool_choice != "none" and \
            (self.reads_calls or body.tool_choice not in (None, "auto"))
        form = "plain" if (body.reasoning_format or self.reasoning_format) == "none" else self.form
        # harmony's parts, and DeepSeek's and Kimi K2's calls, are marked by special tokens the text leaves out
        if form == "harmony" or calling and len(self.calls) > 1:
            params = replace(params, skip_special_tokens=False)
        # a constrained output is the answer from its first token, even after a prompt that opened <think>
        reply = {"form": form, "tools": body.tools if calling else None, "reasoning": body.include_reasoning,
                 "opened": False if params.constrained else opens_thinking(text), "calls": self.calls,
                 "forced": forced_names(body.tools, body.tool_choice) if calling else (),
                 "parallel": body.parallel_tool_calls is not False}
        return await self.run(http, [prompt], [params], chat=True, stream=body.stream, n=body.n,
                              options=body.stream_options, reply=reply)

    async def respond(self, http: HTTPRequest, body: ResponsesBody) -> Response:
        """A /v1/responses answer: the chat that answers it (responses.py), its answer as a response object or
        the Responses stream's events; its errors as the Responses fields name them."""
        before = self.kept.conversation(body.previous_response_id) if body.previous_response_id is not None else []
        try:
            chat = ChatBody(**responses.chat_fields(body, before))
        except ValidationError as e:  # a message or a field passed on, as the chat checks it
            first = e.errors()[0] if e.errors() else {}
            loc = [str(x) for x in first.get("loc", ())][:1] or ["input"]
            param = responses.PARAMS.get(loc[0], loc[0])
            raise APIError(400, f"{param}: {first.get('msg', 'invalid').removeprefix('Value error, ')}", param) \
                from None
        while True:
            try:
                answer = await self.chat(http, chat)
                break
            except APIError as e:  # truncation auto: the conversation's oldest items dropped until it fits
                shorter = responses.without_oldest(chat.messages) if body.truncation == "auto" and \
                    e.code == "context_length_exceeded" else None
                if shorter is None:
                    raise responses.renamed(e) from None
                chat = chat.model_copy(update={"messages": shorter})
        tokens = (lambda text: len(self.engine.encode(text, special=False))) if self.engine.tokenizer else None
        envelope = responses.Envelope(body, self.model_name, tokens, self.kept.stores(body))
        keep = lambda response: self.kept.keep(response, before, body)  # noqa: E731
        if isinstance(answer, StreamingResponse):
            return StreamingResponse(responses.stream(answer.body_iterator, envelope, keep),
                                     media_type="text/event-stream")
        if not answer.body:  # a client that left (499)
            return answer
        whole = json.loads(answer.body)
        if answer.status_code != 200:
            e = whole.get("error", {})
            failed = responses.renamed(APIError(answer.status_code, e.get("message", ""), e.get("param"),
                                                e.get("code"), e.get("type", "server_error")))
            return JSONResponse(failed.body(), status_code=answer.status_code)
        http.state.usage = (whole["usage"]["prompt_tokens"], whole["usage"]["completion_tokens"])  # the access log's
        response = responses.whole(whole, envelope)
        keep(response)
        return JSONResponse(response)

    def offsets(self, context: list[int], skip_special: bool = True) -> _Offsets:
        """Where tokens decoded after `context` start in their text (completions' text_offset)."""
        return _Offsets(self.engine.tokenizer, context, skip_special)

    def _envelope(self, rid: str, chat: bool, stream: bool) -> dict:
        kind = ("chat.completion" if chat else "text_completion") + (".chunk" if stream and chat else "")
        return {"id": rid, "object": kind, "created": int(time.time()), "model": self.model_name}

    @staticmethod
    def _error(e: Exception) -> APIError:
        """A failed generation's 500, its 400 where the request was at fault (BadInput: a JSON schema too large to
        follow), or a 503 where the server stopped before it ended: the failure by its type and message, files named
        without their folders."""
        message = without_folders(str(e))
        if isinstance(e, ShuttingDown):
            return APIError(503, message, None, "shutting_down", "server_error")
        if isinstance(e, BadInput):
            return APIError(400, message, None, type(e).__name__)
        return APIError(500, f"generation failed: {message}", None, type(e).__name__, "server_error")

    @staticmethod
    def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def _token(self, token: int) -> str:
        """A token's text in logprobs: a special token's too (an EOS, a BOS), as vLLM shows them, so that its entry
        names it and its bytes are its text's."""
        tokenizer = self.engine.tokenizer
        return tokenizer.decode([token], skip_special_tokens=False) if tokenizer is not None else str(token)

    def _bytes(self, token: int, text: str) -> list[int]:
        """A token's bytes: exact for a byte-level vocabulary and for SentencePiece's byte tokens (<0xE2>), where a
        token may hold part of a character that its text shows as U+FFFD; else its text's UTF-8."""
        tokenizer = self.engine.tokenizer
        piece = tokenizer.id_to_token(token) if tokenizer is not None else None
        if piece is not None and self.byte_of is not None and all(c in self.byte_of for c in piece):
            return [self.byte_of[c] for c in piece]
        if piece is not None and (byte := BYTE_PIECE.fullmatch(piece)):
            return [int(byte[1], 16)]
        return list(text.encode())

    def _completion_token(self, token: int) -> str:
        """A token as completions' logprobs name it: its text, or where that is part of a character, its bytes
        as OpenAI writes them ("bytes:\\xe2\\x80"), so that such tokens do not all read U+FFFD and fall onto one
        key of top_logprobs."""
        text = self._token(token)
        if "\ufffd" not in text:
            return text
        raw = bytes(self._bytes(token, text))
        try:
            return raw.decode()  # a whole U+FFFD of its own
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def _logprobs(self, items: list[StepOutput], chat: bool, offsets: list[int] | None = None) -> dict:
        """The logprobs of `items` (tokens that carry them) as OpenAI writes them: chat's content list, or
        completions' parallel lists with each token's offset in the text (`offsets`, which completions give)."""
        if chat:
            entry = lambda t, lp: {"token": (s := self._token(t)), "logprob": lp, "bytes": self._bytes(t, s)}  # noqa: E731
            return {"content": [{**entry(i.token, i.logprob), "top_logprobs": [entry(t, lp) for t, lp in i.top]}
                                for i in items], "refusal": None}
        tokens = [self._completion_token(i.token) for i in items]
        # OpenAI's completions list the chosen token among the alternatives, up to logprobs + 1 of them
        tops = [None if i.logprob is None else {self._completion_token(t): lp for t, lp in (
            i.top if any(t == i.token for t, _ in i.top) else (*i.top, (i.token, i.logprob)))} for i in items]
        return {"tokens": tokens, "token_logprobs": [i.logprob for i in items],  # None: a prompt's first token
                "top_logprobs": tops, "text_offset": offsets}

    async def _stream(self, requests: list[Request], merged: asyncio.Queue, rid: str, chat: bool,
                      options: StreamOptions, prompt_tokens: int, reply: dict | None = None, state=None,
                      echo: list[str] | None = None):
        """The SSE chunks of `requests` (choice i is requests[i]) as their tokens arrive on `merged`; a chat choice's
        text goes through a Reply of `reply`'s arguments: its reasoning and content apart, its text held back from
        where a call may begin, and its calls last. `state` (the HTTP request's) gets the usage at the end, for the
        access log. `echo`: each choice's prompt text, sent as its first chunk (its tokens' logprobs with it)."""
        logprobs = requests[0].params.logprobs is not None
        include_usage = bool(options.include_usage)
        continuous = include_usage and bool(options.continuous_usage_stats)  # vLLM's: only with include_usage
        head = self._envelope(rid, chat, True)  # one `created` for every chunk, as OpenAI's and vLLM's streams
        made = [0] * len(requests)  # each choice's output tokens so far

        def chunk(choice: dict) -> str:
            i = choice["index"]
            usage = {"usage": self._usage(len(requests[i].prompt), made[i]) if continuous else None} \
                if include_usage else {}
            return f"data: {json.dumps({**head, 'choices': [choice], **usage})}\n\n"
        try:
            if chat:
                for i in range(len(requests)):
                    yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                                 **({"logprobs": None} if logprobs else {})})
            held = [[] for _ in requests]  # tokens whose logprobs wait for a chunk (their text may come later)
            replies = [Reply(**(reply or {})) if chat else None for _ in requests]
            # echoed, a choice's text and offsets begin at its prompt's
            offsets = [self.offsets([] if echo else r.prompt, r.params.skip_special_tokens) for r in requests]
            joint = [""] * len(requests)  # without a tokenizer, a space between the ids of the prompt and the rest
            running = len(requests)
            while running:
                i, item = await merged.get()
                if item is None:
                    running -= 1
                    continue
                if isinstance(item, Exception):  # [DONE] still ends it, as vLLM ends a stream that failed
                    yield f"data: {json.dumps(self._error(item).body())}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                if echo and echo[i] is not None:  # the choice's first item: its prompt goes first
                    scored = list(item.prompt or ()) if logprobs else []
                    where = offsets[i].of([h.token for h in scored]) if logprobs else None
                    yield chunk({"index": i, "text": echo[i], "finish_reason": None,
                                 "logprobs": self._logprobs(scored, chat, where) if logprobs else None})
                    joint[i] = " " if self.engine.tokenizer is None and echo[i] else ""
                    echo[i] = None
                text = item.text
                if text and joint[i]:
                    text, joint[i] = joint[i] + text, ""
                if item.logprob is not None:
                    held[i].append(item)
                if item.token is not None:
                    made[i] = requests[i].completion_tokens if item.finish_reason else made[i] + 1
                delta, called = {}, []
                if chat:
                    delta = replies[i].feed(item.text)
                    if item.finish_reason:
                        rest, called = replies[i].end()
                        delta = {k: delta.get(k, "") + rest.get(k, "") for k in {**delta, **rest}}
                if not (delta if chat else text) and item.finish_reason is None:
                    continue
                choice: dict[str, Any] = {"index": i, "finish_reason": item.finish_reason}
                if called:  # the text before the calls in a chunk of its own, then the calls
                    if delta:
                        yield chunk({"index": i, "finish_reason": None, "delta": delta})
                    choice["delta"] = {"tool_calls": [{"index": j, **c} for j, c in enumerate(called)]}
                    choice["finish_reason"] = "tool_calls" if item.finish_reason == "stop" else item.finish_reason
                elif chat:
                    choice["delta"] = delta
                else:
                    where = offsets[i].of([h.token for h in held[i]]) if logprobs else None
                    choice.update(text=text, logprobs=self._logprobs(held[i], chat, where) if logprobs else None)
                if chat and logprobs:
                    choice["logprobs"] = self._logprobs(held[i], chat)
                held[i] = []
                yield chunk(choice)
            if include_usage:
                last = {**head, "choices": [],
                        "usage": self._usage(prompt_tokens, sum(r.completion_tokens for r in requests))}
                yield f"data: {json.dumps(last)}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # a client that went away ends its generations at the worker's next step
            for request in requests:
                request.cancel()
            if state is not None:  # a stream cut short ended before the worker counted its tokens: as many as it sent
                state.usage = (prompt_tokens, sum(max(r.completion_tokens, m) for r, m in zip(requests, made)))

    async def _collect(self, http: HTTPRequest, request: Request, queue: asyncio.Queue) -> tuple | Response:
        """One request's whole output: (text, finish reason, its tokens with logprobs, the prompt's scored tokens
        or None), or the Response that ends the call (an error, or 499 when the client went away)."""
        parts, finish, scored, prompt_scored = [], None, [], None
        loop = asyncio.get_running_loop()
        checked = loop.time()
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), timeout=DISCONNECT_CHECK_S)
            except asyncio.TimeoutError:
                item = ...
            if loop.time() - checked >= DISCONNECT_CHECK_S:  # also while tokens arrive: a whole answer takes long
                checked = loop.time()
                if await http.is_disconnected():
                    return Response(status_code=499)
            if item is ...:
                continue
            if item is None:
                return "".join(parts), finish, scored, prompt_scored
            if isinstance(item, Exception):
                err = self._error(item)
                return JSONResponse(err.body(), status_code=err.status)
            parts.append(item.text)
            finish = item.finish_reason or finish
            prompt_scored = item.prompt if item.prompt is not None else prompt_scored
            if item.logprob is not None:
                scored.append(item)


def without_folders(text: str) -> str:
    """`text` with its files named without their folders: what a client is told of the server's disk."""
    return re.sub(r"(?:/[^/\s'\"]+)+/", "", text)


def create_app(scheduler: Scheduler, model_name: str, limits: ServerLimits = ServerLimits(),
               reasoning_format: str = "auto") -> FastAPI:
    """The ASGI app; its lifespan starts and stops the scheduler's worker thread. reasoning_format: a chat's
    reasoning_format where the request sets none ("none": the text as the model wrote it)."""
    metrics = ServerMetrics(scheduler)
    server = Server(scheduler, model_name, metrics, limits, reasoning_format)

    @asynccontextmanager
    async def lifespan(app):
        if not scheduler.thread.is_alive():
            scheduler.start()
        try:
            yield
        finally:  # the worker ends its round and exits with the app, not with the process
            scheduler.stop()

    app = FastAPI(title="expertcache", lifespan=lifespan)
    app.state.server, app.state.connections = server, OpenConnections()  # counted by the protocol (http_protocol)
    app.add_middleware(BodyLimits, limits=limits)
    if limits.api_key is not None:  # outside the body's limits: a caller without the key is refused unparsed
        app.add_middleware(RequireApiKey, key=limits.api_key, limits=limits)
    app.add_middleware(ConnectionLimit, limits=limits, connections=app.state.connections)
    if limits.allowed_origins:  # a chat page in a browser calls the API from another origin: its preflight answered
        app.add_middleware(CORSMiddleware, allow_origins=list(limits.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            message, param = f"the body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')})", None
        elif not loc and first.get("type") == "value_error":  # a check of the whole body (TokenizeBody's)
            message, param = first.get("msg", "invalid").removeprefix("Value error, "), None
        elif not loc:  # not an object: a JSON list or a number (every body is read as JSON: BodyLimits)
            message, param = f"the body must be a JSON object ({first.get('msg', 'invalid')})", None
        else:  # a field's own check (a role, a bool for a number) words its message itself
            message, param = f"{'.'.join(loc)}: {first.get('msg', 'invalid').removeprefix('Value error, ')}", loc[0]
        return JSONResponse(APIError(400, message, param).body(), status_code=400)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, http: HTTPRequest):
        prompts = await asyncio.to_thread(server.completion_prompts, body)  # a long prompt would stall the loop
        # each prompt's own: without max_tokens, OpenAI's 16 capped by that prompt's room, as vLLM caps it
        params = [server.params(body, len(ids), default_max=16, chat=False) for ids, _ in prompts]
        return await server.run(http, [ids for ids, _ in prompts], params, chat=False, stream=body.stream, n=body.n,
                                options=body.stream_options, echo=[text for _, text in prompts] if body.echo else None)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, http: HTTPRequest):
        return await server.chat(http, body)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesBody, http: HTTPRequest):
        return await server.respond(http, body)

    @app.get("/v1/responses/{response_id}")
    async def kept_response(response_id: str):
        return JSONResponse(server.kept.response(response_id))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        return JSONResponse(server.kept.delete(response_id))

    card = lambda: {"id": model_name, "object": "model", "created": server.created,  # noqa: E731
                    "owned_by": "expertcache"}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        return {"object": "list", "data": [card()]}

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(model_id: str):
        if model_id != model_name:
            raise APIError(404, f"model {model_id!r} does not exist; this server serves {model_name!r}", "model",
                           "model_not_found")
        return card()

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody):
        server.check_model(body.model)
        if body.messages is not None:
            # the chat's own fields for its template, whichever they are (add_special_tokens is the prompt's)
            chat = ChatBody(**body.model_dump(exclude={"model", "prompt", "add_special_tokens"}))
            ids, _ = await asyncio.to_thread(server.chat_prompt, chat)
        else:
            ids = await asyncio.to_thread(server.encode, body.prompt, "prompt", body.add_special_tokens)
        return {"count": len(ids), "max_model_len": server.engine.model.max_seq, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody):
        server.check_model(body.model)
        vocab = server.engine.args.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"tokens must be token ids in [0, {vocab})", "tokens")
        if server.engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer to turn token ids into text", "tokens")
        return {"prompt": server.engine.decode(body.tokens)}

    @app.exception_handler(StarletteHTTPException)
    async def http_error(http: HTTPRequest, e: StarletteHTTPException):  # an unknown path or method, an unreadable body
        message = str(e.detail)
        where = f"{http.method} {http.url.path}"[:200]
        if e.status_code == 404 and message == "Not Found":  # OpenAI's words: the request named
            message = (f"Invalid URL ({where}); this server answers /v1/completions, /v1/chat/completions, "
                       "/v1/responses (and GET or DELETE /v1/responses/ID), /v1/models, /tokenize, /detokenize, "
                       "/health and /metrics")
        elif e.status_code == 405:
            allowed = next((v for k, v in (e.headers or {}).items() if k.lower() == "allow"), "another method")
            message = f"{where} is not allowed; this path takes {allowed}"
        # FastAPI's, for what json cannot decode: bytes not UTF-8, or an integer of more digits than int() reads
        if e.status_code == 400 and message == "There was an error parsing the body":
            cause = e.__cause__
            message = ("the body is not UTF-8 text (JSON is sent as UTF-8); send valid UTF-8 JSON"
                       if isinstance(cause, UnicodeDecodeError) else
                       f"the body cannot be read as JSON ({str(cause).split(';')[0]})")
        # with its headers: a 405 must name the methods the path takes (Allow), as HTTP requires
        return JSONResponse(APIError(e.status_code, message).body(), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def server_error(_, e: Exception):  # a fault of the server's own: still an OpenAI body, not a text/plain
        # "Internal Server Error"; Starlette re-raises it after this answer, so the log keeps its traceback
        return JSONResponse(APIError(500, f"the server failed on this request ({type(e).__name__}); its log has the "
                                     "details", None, type(e).__name__, "server_error").body(), status_code=500)

    @app.api_route("/health", methods=["GET", "HEAD"])  # probes that ask with HEAD
    async def health():  # 'ok', or what stopped the worker ('failed: ...', 'stopped'), with a 503; or the store's
        state = scheduler.state  # file cut short or replaced (requests failed while /health said ok)
        store = getattr(scheduler.engine, "store", None)  # None once the engine is closed
        if state == "serving" and store is not None and (problem := store.problem()) is not None:
            state = without_folders(f"store damaged: {problem}")
        return JSONResponse({"status": "ok" if state == "serving" else state},
                            status_code=200 if state == "serving" else 503)

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    return app
