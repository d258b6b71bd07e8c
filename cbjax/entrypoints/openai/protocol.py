"""OpenAI's request and response schemas, as vLLM implements them (pydantic models)."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

# A list or dict whose validation stops at its first wrong item: a body of 100k wrong items makes
# a handful of errors, not 100k (each one built and held while the event loop waits).
FAIL_FAST = Field(fail_fast=True)
IntList = Annotated[list[int], FAIL_FAST]
StrList = Annotated[list[str], FAIL_FAST]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class RequestModel(OpenAIModel):
    """A request body. Unknown fields are kept in `model_extra`, to be logged and ignored (as vLLM
    does, so clients that send newer options still work); fields of OpenAI's or vLLM's API that
    cbjax does not implement are refused unless they hold the value that asks for nothing
    (serving.check_fields)."""

    model_config = ConfigDict(extra="allow")
    unsupported_fields: ClassVar[dict[str, tuple]] = {}  # field -> the values that ask for nothing


# Structural tags, beam search, prompt logprobs and vLLM's extension points: none is implemented,
# so a request that asks for one is refused rather than answered without it.
UNSUPPORTED_SAMPLING_FIELDS: dict[str, tuple] = {
    "structural_tag": (None,),
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
    "best_of": (None, 1),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),
    "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,),
    "spaces_between_special_tokens": (None, True),
    "logits_processors": (None, []),
    "return_tokens_as_token_ids": (None, False),
    "cache_salt": (None,),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None,),
    "mm_processor_kwargs": (None,),
}


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class SamplingFields(RequestModel):
    """The sampling fields both endpoints take (vLLM's extra ones included)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    stop: str | StrList | None = None
    stop_token_ids: IntList | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = 0  # vLLM's extra field: lower is served first (needs --scheduling-policy priority)
    # OpenAI's: token id (a string in JSON) -> bias in [-100, 100]
    logit_bias: Annotated[dict[str, float], FAIL_FAST] | None = None
    allowed_token_ids: IntList | None = None  # vLLM's extra field
    bad_words: StrList | None = None  # vLLM's extra field
    # An output constraint (structured.py): OpenAI's response_format, or vLLM's structured_outputs
    # object ({"json" | "regex" | "choice" | "grammar" | "json_object": ...}) or its older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: StrList | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields):
    unsupported_fields: ClassVar[dict[str, tuple]] = UNSUPPORTED_SAMPLING_FIELDS | {
        "suffix": (None, ""), "prompt_embeds": (None,), "add_special_tokens": (None, True),
    }

    prompt: str | StrList | IntList | Annotated[list[IntList], FAIL_FAST]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(OpenAIModel):
    role: str
    content: str | Annotated[list[dict[str, Any]], FAIL_FAST] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool's answer to that call
    name: str | None = None


class FunctionDefinition(OpenAIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatTool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCallMessage(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(ToolCallMessage):
    index: int  # which call of the choice: the client assembles each call's fields by it


class ChatCompletionRequest(SamplingFields):
    unsupported_fields: ClassVar[dict[str, tuple]] = UNSUPPORTED_SAMPLING_FIELDS | {
        "functions": (None, []),
        "function_call": (None, "none", "auto"), "reasoning_effort": (None,), "audio": (None,),
        "modalities": (None, ["text"]), "prediction": (None,), "web_search_options": (None,),
        "echo": (None, False), "continue_final_message": (None, False), "add_special_tokens": (None, False),
        "chat_template": (None,), "chat_template_kwargs": (None, {}), "documents": (None,),
    }

    messages: Annotated[list[ChatMessage], FAIL_FAST]
    tools: Annotated[list[ChatTool], FAIL_FAST] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogProbs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatTopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogProbs(OpenAIModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(OpenAIModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser: the thinking before the answer
    tool_calls: list[ToolCallMessage] = []


class ChatChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] = []


class ChatStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "cbjax"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(OpenAIModel):
    """/v1/load_lora_adapter's body (vLLM's): the name requests will give as `model`, and the PEFT folder."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(OpenAIModel):
    lora_name: str = Field(min_length=1)


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], FAIL_FAST] | None = None
    add_generation_prompt: bool = True


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: IntList


class DetokenizeResponse(OpenAIModel):
    prompt: str
