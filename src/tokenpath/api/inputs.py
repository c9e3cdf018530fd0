"""A body -> what the engine is asked. Chat and completions: token ids and `SamplingParams`;
embeddings: token-id inputs. Validated once, here (the engine link's decoder checks again what
crosses it). The intake's `submit` and `embedding_request` (`api/intake.py`) wrap them in the
engine's requests, in the gateway's `Submission`.

Split in the order the handler needs it: `check_caps` is pure arithmetic on the body (run before
the rate limits are charged, so a refusal costs nothing), `prompt_ids` tokenizes (off the event
loop), `sampling_params` checks what needs the token counts (context length, the per-request
token cap).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from tokenpath.api import tools as tool_calls
from tokenpath.api.schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from tokenpath.api.settings import Caps
from tokenpath.api.state import AppState
from tokenpath.errors import ContextLengthError, InvalidRequestError
from tokenpath.protocol import SamplingParams
from tokenpath.protocol.sampling_params import StructuredOutput
from tokenpath.routing.models import Deployment

Body = ChatCompletionRequest | CompletionRequest


# -- caps and prompts --------------------------------------------------------------------------
def _as_batch(value: str | list, param: str) -> list:
    """OpenAI's one-or-many field (`prompt`, `input`) as a list of strings or token-id lists."""
    if isinstance(value, str):
        value = [value]
    if not value:
        raise InvalidRequestError(f"{param} must not be empty; send a string, a list of strings or token ids",
                                  param=param)
    if all(isinstance(t, int) for t in value):
        value = [value]
    return value


def _raw_prompts(body: CompletionRequest) -> list[str] | list[list[int]]:
    return _as_batch(body.prompt, "prompt")


def max_token_bytes(tok) -> int:  # noqa: ANN001
    """The most UTF-8 bytes one token of this tokenizer covers (its longest vocabulary entry), so
    `bytes // max_token_bytes` is a floor on a text's token count. 64 when it cannot be read."""
    cached = getattr(tok, "_tokenpath_max_token_bytes", None)
    if cached is None:
        try:
            backend = tok.backend  # one id at a time: `get_vocab()` would build a 262k-entry dict
            cached = max((len(t.encode()) for i in range(backend.get_vocab_size(with_added_tokens=True))
                          if (t := backend.id_to_token(i)) is not None), default=0) or 64
        except Exception:  # a tokenizer without a readable vocabulary: a safe, loose floor
            cached = 64
        tok._tokenpath_max_token_bytes = cached
    return cached


def warm_tokenizers(tokenizers: list) -> None:
    """Compute each tokenizer's `max_token_bytes` and compile its chat template now (at start-up,
    in a thread) rather than inside the first request, where every request behind it waits."""
    for tok in tokenizers:
        if tok is None:
            continue
        max_token_bytes(tok)
        if getattr(tok, "chat_template", None):
            with contextlib.suppress(Exception):  # (a template that cannot render this fails its requests clearly)
                tok.apply_chat_template([{"role": "user", "content": "warm-up"}])


@dataclass(frozen=True)
class Floor:
    """What a body costs at least, known before tokenizing."""

    tokens: int  # prompt floors + n x max_tokens per prompt: what the rate limits are charged first
    longest_prompt: int  # floor of the longest prompt
    completion: int  # max_tokens asked (1 when unset)
    where: str  # "messages" or "prompt"

    def check_context(self, max_model_len: int) -> None:
        """A prompt already too long by its floor (megabytes of text) is refused untokenized."""
        check_context(self.longest_prompt, self.completion, max_model_len, self.where, floor=True)


def check_context(longest: int, max_tokens: int, max_model_len: int, where: str, *, floor: bool) -> None:
    """The context length, checked on the floor before tokenizing (`floor`: the longest prompt is
    at least `longest` tokens) and on the exact count after, in one place. The completion needs
    room for one token at least; `max_tokens` is what the message names (what was asked, or what
    the context left when nothing was)."""
    if longest + max(max_tokens, 1) <= max_model_len:
        return
    if floor:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, the {where} "
            f"alone is at least {longest} tokens long, and {max_tokens} more are asked for "
            f"the completion. Please reduce the length of the {where} or completion.", param=where)
    raise ContextLengthError(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{longest + max_tokens} tokens ({longest} in the {where}, {max_tokens} in the completion). "
        f"Please reduce the length of the {where} or completion.", param=where)


def check_request_tokens(cap: int, prompt_tokens: int, n: int, prompts: int, max_tokens: int) -> int:
    """What a request may cost (`prompt_tokens` + n x max_tokens for each of `prompts` prompts),
    refused over this server's per-request cap (`caps.max_request_tokens`): before tokenizing with
    the completion budget alone, and after with the exact prompt tokens, in one place."""
    total = prompt_tokens + n * max_tokens * prompts
    if total > cap:
        raise InvalidRequestError(
            f"this request may cost {total} tokens (prompt tokens + n={n} x max_tokens={max_tokens} for each of "
            f"{prompts} prompt(s)), over this server's limit of {cap} tokens per request; lower max_tokens, n or "
            "the number of prompts", param="max_tokens", code="request_too_large")
    return total


def check_fields(caps: Caps, body: Body) -> None:
    """The operator's caps on the request's own fields (`limits.MAX_TOKENS`, `N`, `STOP`, `MESSAGES`,
    `PROMPTS`: their values are `caps`' fields), before anything is tokenized; each refusal names
    the field. A pure function of the body, so the fast tier checks it without a server."""
    max_tokens = body.requested_max_tokens
    if max_tokens is not None and max_tokens > caps.max_tokens:
        raise InvalidRequestError(f"max_tokens is {max_tokens}, over this server's limit of {caps.max_tokens}; "
                                  "ask for fewer tokens", param="max_tokens")
    if body.n > caps.max_n:
        raise InvalidRequestError(f"n is {body.n}, over this server's limit of {caps.max_n}; ask for fewer "
                                  "choices", param="n")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > caps.max_stop:
        raise InvalidRequestError(f"stop has {len(stop)} entries, over this server's limit of {caps.max_stop} "
                                  "stop sequences (caps.max_stop)",
                                  param="stop")
    if isinstance(body, ChatCompletionRequest):
        if len(body.messages) > caps.max_messages:
            raise InvalidRequestError(f"messages has {len(body.messages)} entries, over the limit of "
                                      f"{caps.max_messages}", param="messages")
    else:
        prompts = _raw_prompts(body)
        if len(prompts) > caps.max_prompts:
            raise InvalidRequestError(f"prompt has {len(prompts)} prompts, over the limit of {caps.max_prompts}",
                                      param="prompt")


def check_caps(state: AppState, dep: Deployment, body: Body) -> Floor:
    """The request's own caps, checked before anything is tokenized, and the tokens it costs at
    least, for the rate limits to be charged with before tokenizing (`intake.tokenize` makes the
    charge exact afterwards). It is a floor, not a guess: prompt bytes / the longest token's bytes,
    token-id prompts counted exactly, + n x max_tokens per prompt. A floor never refuses a request
    that its exact count would admit, so token limits stay exact; and a prompt whose floor is
    already past the context length (megabytes of text) is refused without being tokenized."""
    caps = state.config.caps
    check_fields(caps, body)
    max_tokens = body.requested_max_tokens
    per_token = max_token_bytes(dep.tokenizer)
    if isinstance(body, ChatCompletionRequest):
        where = "messages"
        floors = [sum(len(m.text().encode()) for m in body.messages) // per_token]
    else:
        where = "prompt"
        floors = [len(p.encode()) // per_token if isinstance(p, str) else len(p) for p in _raw_prompts(body)]
    # (the completion budget alone: the prompts' share is checked once they are tokenized)
    budget = check_request_tokens(caps.max_request_tokens, 0, body.n, len(floors), max_tokens or 1)
    return Floor(sum(floors) + budget, max(floors), max_tokens or 1, where)


def chat_messages(body: ChatCompletionRequest, plan: tool_calls.ToolPlan | None,
                  chat_template: str | None) -> tuple[list[dict], list[dict] | None]:
    """The conversation as the chat template takes it, and the `tools=` to pass it. Past tool
    calls are checked (a malformed one is a 400 naming it); for a template that knows no tools
    they, and the tool list, become text in tokenpath's documented format (`api/tools.py`)."""
    fmt = plan.fmt if plan else tool_calls.template_format(chat_template)
    messages: list[dict] = []
    for i, m in enumerate(body.messages):
        d: dict = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            calls = tool_calls.check_history_calls(m.tool_calls, f"messages.{i}")
            if fmt == "tagged":
                d["content"] = "\n".join(x for x in (d["content"], tool_calls.render_call_text(calls, fmt)) if x)
            else:
                d["tool_calls"] = calls
        if m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
        thought = m.reasoning_content or m.reasoning
        if m.role == "assistant" and thought:  # (a template that knows it renders it; others ignore it)
            d["reasoning_content"] = thought
        messages.append(d)
    if plan is None:
        return messages, None
    if fmt != "tagged":
        return messages, plan.template_tools()
    if plan.choice == "none":  # no calls wanted: a template without tools is told of none
        return messages, None
    listing = tool_calls.tagged_system_prompt(plan)
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + listing}
    else:
        messages.insert(0, {"role": "system", "content": listing})
    return messages, None


# A prompt of at most this many characters is tokenized on the event loop: ~0.1 ms (about 0.3 us a
# character here), less than the thread hop that keeps a long one off the loop costs (0.15-0.3 ms
# on two busy cores, the most of the gateway's tokenizing time for a short prompt).
INLINE_CHARS = 512


async def prompt_ids(state: AppState, dep: Deployment, body: Body, plan: tool_calls.ToolPlan | None = None,
                     variables: dict | None = None) -> tuple[list[list[int]], list[str]]:
    """Token ids per prompt (tokenized off the event loop, unless short: `INLINE_CHARS`) and the
    texts the policy hook sees. `variables`: more chat template variables
    (`api.reasoning.template_variables`)."""
    tok = dep.tokenizer
    if isinstance(body, ChatCompletionRequest):
        messages, tools = chat_messages(body, plan, tok.chat_template)
        extra = (variables,) if variables else ()  # (a tokenizer without variables needs none passed)
        chars = sum(len(v) if isinstance(v, str) else INLINE_CHARS + 1 for m in messages for v in m.values())
        if tools or chars > INLINE_CHARS:
            ids = await asyncio.to_thread(tok.apply_chat_template, messages, True, tools, *extra)
        else:
            ids = tok.apply_chat_template(messages, True, tools, *extra)
        return [list(ids)], [m["content"] for m in messages]
    out: list[list[int]] = []
    texts: list[str] = []
    for p in _raw_prompts(body):
        if isinstance(p, str):
            ids = await asyncio.to_thread(tok.encode, p) if len(p) > INLINE_CHARS else tok.encode(p)
            texts.append(p)
        else:
            ids = list(p)
            bad = next((t for t in ids if not 0 <= t < tok.vocab_size), None)
            if bad is not None:
                raise InvalidRequestError(f"prompt token id {bad} is outside the vocabulary "
                                          f"[0, {tok.vocab_size})", param="prompt")
            texts.append(await asyncio.to_thread(tok.decode, ids))
        if not ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        out.append(list(ids))
    return out, texts


def sampling_params(state: AppState, dep: Deployment, body: Body, prompts: list[list[int]],
                     logit_bias: dict[int, float] | None = None,
                     structured: StructuredOutput | None = None) -> SamplingParams:
    caps = state.config.caps
    where = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    max_tokens = body.requested_max_tokens
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    longest = max(len(p) for p in prompts)
    limit = dep.max_model_len
    if max_tokens is None:
        max_tokens = min(limit - longest, caps.max_tokens)
    check_context(longest, max_tokens, limit, where, floor=False)
    check_request_tokens(caps.max_request_tokens, sum(len(p) for p in prompts), body.n, len(prompts), max_tokens)

    def pick(value, default):  # noqa: ANN001, ANN202 - None means "the default"
        return default if value is None else value

    vocab = dep.tokenizer.vocab_size
    bad = next((t for t in body.stop_token_ids or () if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequestError(f"stop_token_ids has token id {bad}, outside this model's vocabulary [0, {vocab}); "
                                  "use ids its tokenizer produces", param="stop_token_ids")

    return SamplingParams(
        n=body.n,
        temperature=pick(body.temperature, 1.0),
        top_p=pick(body.top_p, 1.0),
        top_k=pick(body.top_k, -1),
        min_p=pick(body.min_p, 0.0),
        seed=body.seed,
        presence_penalty=pick(body.presence_penalty, 0.0),
        frequency_penalty=pick(body.frequency_penalty, 0.0),
        repetition_penalty=pick(body.repetition_penalty, 1.0),
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        stop=stop,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        logprobs=body.logprobs_count,
        prompt_logprobs=_prompt_logprobs(body),  # /v1/completions only
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        logit_bias=logit_bias,
        structured=structured,
    )


def _prompt_logprobs(body: Body) -> int | None:
    """vLLM's `prompt_logprobs`, or, for OpenAI's `echo` with `logprobs` (how lm-evaluation-harness
    scores a continuation), the prompt's logprobs at the same top-k: the echoed text carries them."""
    asked = getattr(body, "prompt_logprobs", None)
    if asked is None and getattr(body, "echo", False):
        return body.logprobs_count
    return asked


# -- embeddings --------------------------------------------------------------------------------
EmbeddingInputs = list[str | list[int]]


def embedding_inputs(body: EmbeddingRequest, max_inputs: int) -> EmbeddingInputs:
    """The inputs as a list of strings / token-id lists, checked for count and emptiness."""
    raw = _as_batch(body.input, "input")
    if len(raw) > max_inputs:
        raise InvalidRequestError(f"input has {len(raw)} items, over the limit of {max_inputs}; send them in "
                                  "several requests", param="input")
    for i, t in enumerate(raw):
        if isinstance(t, str) and not t:
            raise InvalidRequestError(f"input.{i} is an empty string; embed non-empty text", param=f"input.{i}")
    return raw


def embedding_estimate(raw: EmbeddingInputs) -> int:
    """Tokens for the rate limits before tokenizing: bytes / 4 for text, token ids exactly."""
    return sum(len(t.encode()) // 4 + 1 if isinstance(t, str) else len(t) for t in raw)


async def embedding_ids(dep: Deployment, raw: EmbeddingInputs) -> tuple[list[list[int]], list[str]]:
    """Token ids per input (texts tokenized off the event loop, in one batch), each checked against
    the model: not empty, within its `max_model_len` positions, inside its vocabulary."""
    tok = dep.tokenizer
    texts = [t for t in raw if isinstance(t, str)]
    encoded = iter(await asyncio.to_thread(tok.encode_batch, texts) if texts else [])
    ids = [next(encoded) if isinstance(t, str) else list(t) for t in raw]
    for i, seq in enumerate(ids):
        if not seq:
            raise InvalidRequestError(f"input[{i}] is empty", param="input")
        if len(seq) > dep.max_model_len:
            raise ContextLengthError(f"input[{i}] has {len(seq)} tokens, more than this model's maximum of "
                                     f"{dep.max_model_len} tokens; shorten it", param="input")
        bad = next((t for t in seq if not 0 <= t < tok.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"input[{i}] has token id {bad}, outside the vocabulary "
                                      f"[0, {tok.vocab_size})", param="input")
    return ids, texts
