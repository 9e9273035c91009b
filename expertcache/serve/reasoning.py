"""A chat reply's parts: the model's reasoning, its answer and its tool calls, read out of the text it writes, whole
and streamed. Where the chat template writes reasoning in <think> tags (Qwen3, GLM-4.5, DeepSeek-R1), the text up to
</think> is reasoning (also where the template opened the tag in the prompt); where it writes GPT-OSS's harmony
format, the analysis channel is reasoning, the final channel (and commentary to no one) the answer, and a commentary
message to=functions.NAME a call. The calls in the answer's text are read by tools.py."""
from __future__ import annotations

from .tools import OPEN, SYNTAXES, CallStream, CallSyntax, cut_call, held_tail, tool_call

THINK, UNTHINK = "<think>", "</think>"
START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")  # a harmony message's own ends (the next <|start|> ends it too)
FORMS = ("plain", "think", "harmony")


def reply_form(template_source: str) -> str:
    """How a template's model writes its replies: "harmony" (GPT-OSS), "think" (reasoning in <think> tags), or
    "plain" (all of it answer)."""
    if CHANNEL in template_source and MESSAGE in template_source:
        return "harmony"
    return "think" if UNTHINK in template_source else "plain"


def opens_thinking(prompt: str) -> bool | str:
    """Whether a rendered prompt ends inside an opened <think> (a thinking model's generation prompt), so that the
    reply starts with reasoning and no tag of its own; for a harmony prompt that ends with a message's header
    (`<|start|>assistant<|channel|>analysis<|message|>`), that header, whose message the reply continues."""
    prompt = prompt.rstrip()
    if prompt.endswith(MESSAGE):
        return prompt[prompt.rfind(START) + len(START) if START in prompt else 0:-len(MESSAGE)]
    return prompt.endswith(THINK)


class _Trimmed:
    """A part's text without its leading and trailing whitespace, streamed: trailing whitespace waits for more."""

    def __init__(self):
        self.started, self.held = False, ""

    def feed(self, piece: str) -> str:
        if not self.started:
            piece = piece.lstrip()
            self.started = bool(piece)
        piece = self.held + piece
        body = piece.rstrip()
        self.held = piece[len(body):]
        return body


class _Think:
    """Splits text into ("reasoning" | "content", piece) at <think>...</think>."""

    def __init__(self, opened: bool):
        self.state, self.buf, self.opened = "start", "", opened

    def feed(self, piece: str, final: bool = False) -> list[tuple[str, str]]:
        self.buf += piece
        out = []
        while self.buf:
            if self.state == "start":  # a reply that opens with <think>, after any whitespace
                head = self.buf.lstrip()
                if head.startswith(THINK):
                    self.state, self.buf = "reasoning", head[len(THINK):]
                elif not final and THINK.startswith(head):
                    break  # whitespace, or the start of the tag
                else:
                    self.state = "reasoning" if self.opened else "content"
            elif self.state == "reasoning":
                end = self.buf.find(UNTHINK)
                if end >= 0:
                    out.append(("reasoning", self.buf[:end]))
                    self.state, self.buf = "after", self.buf[end + len(UNTHINK):]
                    continue
                keep = 0 if final else held_tail(self.buf, (UNTHINK,))
                out.append(("reasoning", self.buf[:len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep:]
                break
            else:  # the answer, from its first character that is not whitespace after </think>
                if self.state == "after":
                    self.buf = self.buf.lstrip()
                    self.state = "content" if self.buf else "after"
                out.append(("content", self.buf))
                self.buf = ""
        return [(part, text) for part, text in out if text]


class _Harmony:
    """Splits GPT-OSS's harmony messages into ("reasoning" | "content" | "call", piece); a call's name is in
    `self.calls` as its arguments arrive."""

    def __init__(self, calling: bool, header: str | None = None):
        self.calling, self.state, self.buf, self.target = calling, "first", "", None
        self.calls: list[list[str]] = []  # [name, arguments so far] of each call
        if header is not None:  # the prompt opened a message: the reply continues its body
            self.target, self.state = self._target(header), "body"

    def _target(self, header: str) -> str | None:
        """A message's part by its header (role, <|channel|>NAME, to=RECIPIENT, <|constrain|>FORMAT)."""
        words = header.replace(CHANNEL, " <channel> ").replace(CONSTRAIN, " ").replace(START, " ").split()
        channel = next((words[i + 1] for i, w in enumerate(words[:-1]) if w == "<channel>"), None)
        recipient = next((w[3:] for w in words if w.startswith("to=")), None)
        if recipient and recipient.startswith("functions.") and self.calling:
            self.calls.append([recipient.removeprefix("functions."), ""])
            return "call"
        return "reasoning" if channel == "analysis" else "content"

    def feed(self, piece: str, final: bool = False) -> list[tuple[str, str]]:
        self.buf += piece
        out = []
        while self.buf:
            if self.state == "first":  # a reply in harmony opens with its header; other text is all answer
                head = self.buf.lstrip()
                marks = ("<|", "to=")
                if any(head.startswith(m) for m in marks):
                    self.state = "header"
                elif not final and any(m.startswith(head) for m in marks):
                    break
                else:
                    self.state = "plain"
            elif self.state == "plain":
                out.append(("content", self.buf))
                self.buf = ""
            elif self.state == "header":
                at = self.buf.find(MESSAGE)
                if at < 0:
                    if final:
                        self.buf = ""  # a header cut off: no message
                    break
                self.target, self.buf, self.state = self._target(self.buf[:at]), self.buf[at + len(MESSAGE):], "body"
            else:  # a message's body, to its end or the next message's start
                ends = [(i, mark) for mark in (*ENDS, START) if (i := self.buf.find(mark)) >= 0]
                if ends:
                    at, mark = min(ends)
                    out.append((self.target, self.buf[:at]))
                    self.state = "header"
                    self.buf = self.buf[at + len(mark) * (mark != START):]
                    continue
                keep = 0 if final else held_tail(self.buf, (*ENDS, START))
                out.append((self.target, self.buf[:len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep:]
                break
        for part, text in out:
            if part == "call":
                self.calls[-1][1] += text
        return [(part, text) for part, text in out if text and part != "call"]


class Reply:
    """One chat choice's text as it arrives, split into reasoning and answer (`feed` gives the delta that can be sent
    now, {"reasoning_content": ..., "content": ...} without empty parts), then `end` the rest and the tool calls.
    form: reply_form's; tools: the request's, whose calls are read out of the text (None: no calls are read), as
    `calls` writes them (tools.call_syntaxes'); opened: opens_thinking's (the prompt ended inside <think>, or
    with a harmony message's header); reasoning: False leaves the reasoning out (vLLM's include_reasoning);
    forced: where the text is one call (tool_choice required or a named function), the names it may call, so that
    one cut short gives the call so far (its arguments cut), not content; parallel: False keeps the first call only
    (OpenAI's parallel_tool_calls)."""

    def __init__(self, form: str = "plain", tools: list | None = None, opened: bool | str = False,
                 reasoning: bool = True, calls: tuple[CallSyntax, ...] = (SYNTAXES[OPEN],),
                 forced: tuple[str, ...] = (), parallel: bool = True):
        if form not in FORMS:
            raise ValueError(f"reply form {form!r} is not one of {', '.join(FORMS)}")
        self.parts = None if form == "plain" else _Think(opened is True) if form == "think" else \
            _Harmony(tools is not None, opened if isinstance(opened, str) else None)
        self.answer = CallStream(tools, calls) if tools is not None else None
        self.forced = forced  # the text is one call to one of these: one cut short is no answer
        self.parallel = parallel
        self.thought, self.reasoning = _Trimmed(), reasoning
        # the answer's trailing whitespace waits for more text: a whole reply with reasoning or calls ends its answer
        # without it (split_reply), so a stream must not have sent it
        self.thought_sent, self.edge = False, ""

    def _delta(self, pieces: list[tuple[str, str]]) -> dict:
        delta: dict[str, str] = {}
        for part, text in pieces:
            if part == "reasoning":
                key, text = "reasoning_content", self.thought.feed(text) if self.reasoning else ""
                self.thought_sent = self.thought_sent or bool(text)
            else:
                key, text = "content", self.answer.feed(text) if self.answer is not None else text
                if self.answer is not None or self.parts is not None:
                    text = self.edge + text
                    self.edge = text[len(text.rstrip()):]
                    text = text[:len(text) - len(self.edge)]
            if text:
                delta[key] = delta.get(key, "") + text
        return delta

    def feed(self, piece: str) -> dict:
        return self._delta([("content", piece)] if self.parts is None else self.parts.feed(piece))

    def end(self) -> tuple[dict, list[dict]]:
        """What is left to send, and the calls (OpenAI's tool_calls entries)."""
        delta = self._delta([] if self.parts is None else self.parts.feed("", final=True))
        calls = []
        if self.answer is not None:
            rest, calls = self.answer.end()
            if rest:  # after the whitespace held before it
                delta["content"], self.edge = delta.get("content", "") + self.edge + rest, ""
        if isinstance(self.parts, _Harmony):
            calls += [tool_call(name, arguments.strip()) for name, arguments in self.parts.calls]
        if not self.parallel:  # a client that runs one call a turn
            calls = calls[:1]
        if self.forced and not calls:  # a call that max_tokens cut: its name and arguments so far, not its markup
            cut = cut_call(self.answer.text, self.forced) if self.answer is not None else None
            calls = [cut] if cut is not None else []
            delta.pop("content", None)
            self.edge = ""
        if not (self.thought_sent or calls):  # the answer as written: its held whitespace too
            delta["content"] = delta.get("content", "") + self.edge
        else:
            delta["content"] = delta.get("content", "").rstrip()
        if not delta["content"]:
            del delta["content"]
        return delta, calls


def split_reply(text: str, form: str = "plain", tools: list | None = None, opened: bool | str = False,
                reasoning: bool = True, calls: tuple[CallSyntax, ...] = (SYNTAXES[OPEN],),
                forced: tuple[str, ...] = (), parallel: bool = True) -> tuple[str | None, str | None, list[dict]]:
    """A whole reply's (reasoning, content, tool calls); None for a part that is not there. The content is the text
    as written where there is neither reasoning nor a call; else without surrounding whitespace."""
    reply = Reply(form, tools, opened, reasoning, calls, forced, parallel)
    first = reply.feed(text)
    rest, calls = reply.end()
    thought = first.get("reasoning_content", "") + rest.get("reasoning_content", "")
    content = first.get("content", "") + rest.get("content", "")
    if forced and not calls:  # its text is all held by the call's reading, but none of it is an answer
        content = ""
    return thought or None, (content.strip() or None) if thought or calls or forced else content, calls
