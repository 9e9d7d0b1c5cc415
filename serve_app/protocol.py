"""The OpenAI request schemas, the error body, sampling-parameter checks and the chat template."""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from engine.sequence import SamplingParams


class APIError(Exception):
    """An error with its HTTP status; rendered as ``{"error": {"message", "type", "param", "code"}}``, the code a
    string or null, as OpenAI's."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# Request bodies are checked in strict mode, as OpenAI does: a value of the wrong JSON type (``true``, ``"5"`` or
# ``1.0`` for an integer, ``"0.5"`` for a number, ``"yes"`` for a boolean) is refused, never coerced; an integer
# stays a valid number (``temperature: 1``).
class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False
    continuous_usage_stats: bool = False    # extra (vLLM): with include_usage, every chunk has the usage so far


class _SamplingFields(BaseModel):
    # Unknown fields are ignored, as OpenAI does; known ones this server does not implement are declared
    # below and refused by name (``refuse_unsupported``) rather than ignored.
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """OpenAI's optional parameters take null for "not given" (its SDK sends null for an argument passed as
        None): such a field takes its default. A required field's null stays an error."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if v is not None or k not in fields or fields[k].is_required() or fields[k].default is None}

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                        # 0 or -1: no top-k cut
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False        # extra: each choice also carries its generated token ids
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0       # extra (vLLM)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0                   # extra (vLLM)
    stop_token_ids: list[int] | None = None              # extra (vLLM)
    include_stop_str_in_output: bool = False             # extra (vLLM)
    skip_special_tokens: bool = True                     # extra (vLLM)
    # vLLM's, declared to be refused by name: accepted only at its no-op value.
    prompt_logprobs: int | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    # Declared to be refused by name: accepted only at their no-op values.
    suffix: str | None = None
    best_of: int | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"] = "text"
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        # An image or audio part would otherwise be refused as "not a string; type should be 'text'".
        for i, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type", "text") if isinstance(part, dict) else None
            if kind != "text" and isinstance(kind, str):
                raise ValueError(f"part {i} has type {kind!r}: this model reads text only ('text' parts)")
        return content

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # vLLM's chat extras (``render_chat``).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # Declared to be refused by name: accepted only at their no-op values.
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    chat_template: str | None = None
    echo: bool = False


# --- responses ---------------------------------------------------------------------------------------
class _Out(BaseModel):
    """A response object; the fields in ``_omit_if_none`` are left out when None (OpenAI leaves them out;
    ``token_ids`` appears only when asked for)."""

    _omit_if_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit(self, handler):
        data = handler(self)
        for name in self._omit_if_none:
            if data.get(name) is None:
                data.pop(name, None)
        return data


class SpecDecodeUsage(_Out):
    num_drafts: int
    draft_tokens: int
    accepted_tokens: int
    mean_acceptance_length: float | None
    acceptance_lengths: list[list[int]]     # per choice, per verification step: accepted drafts + 1


class PromptTokensDetails(_Out):
    cached_tokens: int


class RunningUsage(_Out):
    """A choice's usage so far, on each of its chunks (``continuous_usage_stats``); the last chunk has ``Usage``."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    spec_decode: SpecDecodeUsage


class CompletionLogprobs(_Out):
    """The legacy completions shape: per token its text, log-probability, top alternatives and offset."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Out):
    content: list[ChatTokenLogprob]


class CompletionChoice(_Out):
    _omit_if_none = ("token_ids",)
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    token_ids: list[int] | None = None


class AssistantMessage(_Out):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Out):
    _omit_if_none = ("token_ids",)
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    token_ids: list[int] | None = None


class ChatDelta(_Out):
    _omit_if_none = ("role", "content")
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Out):
    _omit_if_none = ("token_ids",)
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    token_ids: list[int] | None = None


class CompletionResponse(_Out):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChunk(_Out):
    """One SSE event of a completion stream; ``usage`` is present (null but on the last) only when asked for."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | RunningUsage | None = None


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | RunningUsage | None = None


MAX_N = 16
INT64 = (-2 ** 63, 2 ** 63 - 1)


def check_text(value, param: str) -> None:
    """400 naming ``param`` when a string (or a string in a list) cannot be UTF-8 encoded (a lone surrogate)."""
    items = value if isinstance(value, list) else [value]
    for item in items:
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                raise APIError(400, f"{param} is not valid Unicode: an unpaired surrogate at character {e.start}",
                               param=param) from None


def refuse_unsupported(req: _SamplingFields) -> None:
    """400 naming the field for a known OpenAI parameter this server does not implement (never ignored)."""
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    common = [("prompt_logprobs", req.prompt_logprobs is not None,
               "prompt_logprobs is not supported (this server does not compute the prompt's log-probabilities)")]
    if isinstance(req, CompletionRequest):
        refused = [("suffix", bool(req.suffix), "suffix (insertion) is not supported"),
                   ("best_of", req.best_of not in (None, 1),
                    f"best_of must be 1 (choosing the best of several samples is not supported; use n), "
                    f"got {req.best_of}"),
                   ("echo", req.echo and req.logprobs is not None,
                    "echo with logprobs needs the prompt's log-probabilities, which this server does not compute")]
    else:
        kind = (req.response_format or {}).get("type", "text")
        refused = [("response_format", kind != "text", f"response_format {kind!r} is not supported (only text)"),
                   ("tools", bool(req.tools), "tools (function calling) are not supported"),
                   ("tool_choice", req.tool_choice not in (None, "none", "auto") or (req.tool_choice == "auto"
                                                                                    and bool(req.tools)),
                    "tool_choice is not supported (function calling is not)"),
                   ("functions", bool(req.functions), "functions (function calling) are not supported"),
                   ("function_call", req.function_call not in (None, "none"), "function_call is not supported"),
                   ("prediction", req.prediction is not None, "prediction (predicted outputs) is not supported"),
                   ("audio", req.audio is not None, "audio output is not supported"),
                   ("modalities", req.modalities not in (None, ["text"]), "only the text modality is supported"),
                   ("top_logprobs", req.top_logprobs is not None and not req.logprobs,
                    "top_logprobs needs logprobs: true"),
                   ("chat_template", req.chat_template is not None,
                    "a chat_template per request is not supported (the model's own template applies)"),
                   ("echo", req.echo, "echo is not supported for chat completions"),
                   ("continue_final_message", req.continue_final_message and req.add_generation_prompt,
                    "continue_final_message needs add_generation_prompt: false (an assistant message is either "
                    "continued or answered)"),
                   ("continue_final_message", req.continue_final_message and req.messages[-1].role != "assistant",
                    "continue_final_message needs the last message to be the assistant's"),
                   ("continue_final_message", req.continue_final_message and not req.messages[-1].text,
                    "continue_final_message needs the last message to have content"),
                   ("chat_template_kwargs", bool(TEMPLATE_NAMES & set(req.chat_template_kwargs or ())),
                    f"chat_template_kwargs may not set {sorted(TEMPLATE_NAMES & set(req.chat_template_kwargs or ()))}"
                    " (the request's messages and options set them)")]
    for param, bad, message in common + refused:
        if bad:
            raise APIError(400, message, param=param)


def requested_logprobs(req: _SamplingFields) -> int | None:
    """How many alternatives per token the client asked for, or None for no logprobs."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def max_tokens_field(req: _SamplingFields) -> str | None:
    """The field that set the request's max_tokens (chat's max_completion_tokens wins), or None for the default."""
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return "max_completion_tokens"
    return "max_tokens" if req.max_tokens is not None and "max_tokens" in req.model_fields_set else None


def sampling_params(req: _SamplingFields, default_max_tokens: int, vocab_size: int) -> SamplingParams:
    """The engine's SamplingParams; an invalid value raises a 400 APIError naming its field."""
    refuse_unsupported(req)
    max_field = max_tokens_field(req) or "max_tokens"
    max_tokens = getattr(req, max_field)
    if max_tokens is None:
        max_tokens = default_max_tokens
    if not 1 <= req.n <= MAX_N:
        raise APIError(400, f"n must be in [1, {MAX_N}], got {req.n}", param="n")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    check_text(list(stop), "stop")
    bias: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        # ASCII digits only: int() also reads other scripts' digits ("١٢" is 12) and str.isdigit() passes "²".
        if not (key.isascii() and key.isdigit()) or int(key) >= vocab_size:
            raise APIError(400, f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}",
                           param="logit_bias")
        bias[int(key)] = value
    stop_ids = list(req.stop_token_ids or ())
    checks = [(max_field, max_tokens >= 1, f"{max_field} must be >= 1, got {max_tokens}"),
              ("temperature", 0 <= req.temperature <= 2, f"temperature must be in [0, 2], got {req.temperature}"),
              ("top_p", 0 < req.top_p <= 1, f"top_p must be in (0, 1], got {req.top_p}"),
              ("top_k", req.top_k >= -1, f"top_k must be -1, 0 or positive, got {req.top_k}"),
              ("stop", all(stop) and len(stop) <= 4, "stop must be up to 4 non-empty strings"),
              ("seed", req.seed is None or INT64[0] <= req.seed <= INT64[1],
               f"seed must be a 64-bit signed integer, in [{INT64[0]}, {INT64[1]}]"),
              ("stop_token_ids", all(0 <= t < vocab_size for t in stop_ids),
               f"stop_token_ids must be token ids in [0, {vocab_size})"),
              ("min_tokens", req.min_tokens <= max_tokens,
               f"min_tokens ({req.min_tokens}) exceeds {max_field} ({max_tokens})")]
    for param, ok, message in checks:
        if not ok:
            raise APIError(400, message, param=param)
    logprobs = requested_logprobs(req)
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=max(req.top_k, 0),
            seed=req.seed, stop=stop, ignore_eos=req.ignore_eos, logprobs=logprobs, stop_token_ids=tuple(stop_ids),
            include_stop_str_in_output=req.include_stop_str_in_output, min_tokens=req.min_tokens,
            logit_bias=bias, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, skip_special_tokens=req.skip_special_tokens)
    except ValueError as e:        # the engine's own checks; each message begins with the field's name
        field = str(e).split()[0]
        param = {"logprobs": "top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs"}.get(
            field, field if field in type(req).model_fields else None)
        message = str(e) if param in (None, field) else param + str(e)[len(field):]     # named as the client did
        raise APIError(400, message, param=param) from None


# The names a chat template is rendered with (``render_chat``), which ``chat_template_kwargs`` may not set.
TEMPLATE_NAMES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "raise_exception"})


def render_chat(messages: list[ChatMessage], template: str | None, special: dict[str, str],
                control_tokens: Sequence[str] = (), add_generation_prompt: bool = True,
                continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
                ) -> tuple[str, list[tuple[int, int]]]:
    """The tokenizer config's Jinja chat template, or the plain default ``<role>: <content>`` lines; and the
    spans of the text where a message's content held a control token's text (``control_tokens``), which the
    tokenizer is to read as ordinary characters there. The template sees each such occurrence as a placeholder
    (private-use characters and a nonce a client cannot guess), so it cannot mistake it for its own markup,
    and whatever it does to the content around it (strip, split) is done as it would be to the original.

    ``add_generation_prompt``: end with the opening of the assistant's turn (the template's own variable).
    ``continue_final_message``: end right after the last message's content, its turn left open, so that the model
    goes on with it (a 400 if the template does not keep that content as written). ``template_kwargs``: further
    variables for the template (``TEMPLATE_NAMES`` excepted)."""
    # Digits as private-use characters too: a template's string filters (replace, upper) must not touch them.
    digits = "".join(map(chr, range(0xE010, 0xE020)))
    nonce = "".join(digits[b & 15] for b in secrets.token_bytes(12))
    found: list[str] = []

    def hide(match: re.Match) -> str:
        found.append(match.group())
        return "\ue000" + nonce + "".join(digits[int(d)] for d in str(len(found) - 1)) + "\ue001"

    pattern = re.compile("|".join(map(re.escape, sorted(control_tokens, key=len, reverse=True)))) \
        if control_tokens else None
    contents = [m.text if pattern is None else pattern.sub(hide, m.text) for m in messages]
    if not template:
        text = "".join(f"{m.role}: {c}\n" for m, c in zip(messages, contents)) + \
            ("assistant:" if add_generation_prompt else "")
    else:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        from jinja2.exceptions import TemplateError

        class Refused(TemplateError):
            """The template's own refusal of the conversation (not a fault of a client's variable)."""

        def raise_exception(message: str):      # (Hugging Face's templates call it to refuse a conversation)
            raise Refused(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        try:
            text = env.from_string(template).render(
                **(template_kwargs or {}), **special, raise_exception=raise_exception,
                messages=[{"role": m.role, "content": c} for m, c in zip(messages, contents)],
                add_generation_prompt=add_generation_prompt)
        except Exception as e:      # (a template that refuses these messages, or chokes on a client's variable)
            raise APIError(400, f"the chat template could not render this request: {type(e).__name__}: {e}",
                           param="chat_template_kwargs" if template_kwargs and not isinstance(e, Refused)
                           else "messages") from None
    if continue_final_message:
        end = text.rfind(contents[-1])
        if end < 0:
            raise APIError(400, "continue_final_message: the chat template does not keep the last message's "
                           "content as written, so it cannot be continued", param="continue_final_message")
        text = text[:end + len(contents[-1])]
    if not found:
        return text, []
    parts, spans, length, start = [], [], 0, 0
    for match in re.finditer(f"\ue000{nonce}([{digits}]+)\ue001", text):
        original = found[int("".join(str(digits.index(d)) for d in match.group(1)))]
        parts += [text[start:match.start()], original]
        length += match.start() - start
        spans.append((length, length + len(original)))
        length += len(original)
        start = match.end()
    parts.append(text[start:])
    return "".join(parts), spans
