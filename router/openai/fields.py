"""Every field of every HTTP request model (router/openai/protocol.py), accounted for: what
the server does with it and the test that shows it. tests/unit/test_openai_fields_table.py
walks the models against this table, so a field that is parsed and never read fails it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class FieldUse:
    """What the server does with one request field. `served`: it changes the answer or the
    response, shown by `test` (path::name). `refused`: a value that would change the answer
    is a 400 naming the field, shown by `test`. `elsewhere`: served by another module,
    whose tests own it (`test` names that module). `no_effect`: OpenAI defines it as having
    no effect on the answer; `test` says why."""

    kind: Literal["served", "refused", "elsewhere", "no_effect"]
    test: str


def _served(test: str) -> FieldUse:
    return FieldUse("served", test)


def _refused(test: str) -> FieldUse:
    return FieldUse("refused", test)


_FIELDS_TEST = "tests/integration/test_openai_fields.py::"
_API = "tests/integration/test_openai_api.py::"
_SAMPLING = _FIELDS_TEST + "test_sampling_fields_change_the_answer_as_offline"
_PROCESSORS = _FIELDS_TEST + "test_logits_processors_give_the_offline_answer"
_NOT_SERVED = _FIELDS_TEST + "test_fields_not_served_are_refused_naming_them"
_STRUCTURED = FieldUse("elsewhere", "router/openai/structured_output.py")
_TOKENIZER = _FIELDS_TEST + "test_tokenizer_options_reach_the_tokenizer"
_TEMPLATE = _FIELDS_TEST + "test_chat_template_kwargs_reach_the_template"
_PROMPT_LOGPROBS = FieldUse("elsewhere", "tests/integration/test_prompt_logprobs_serving.py")
_TOOLS = "tests/integration/test_openai_tools.py::"
_USER = FieldUse("no_effect", "OpenAI's end-user id, for the caller's own abuse tracking; vLLM ignores it too")

# "Model.field", keyed by the model that declares the field (completions and chat share
# _SamplingFields). tests/unit/test_openai_fields_table.py walks every model against it.
REQUEST_FIELDS: dict[str, FieldUse] = {
    "LoRAAdapterRequest.lora_name": _served("tests/integration/test_lora_serving.py::test_adapters_served_as_offline"),
    "LoRAAdapterRequest.lora_path": _served("tests/integration/test_lora_serving.py::test_adapters_served_as_offline"),
    "UnloadLoRAAdapterRequest.lora_name": _served(
        "tests/integration/test_lora_serving.py::test_adapters_served_as_offline"
    ),
    "StreamOptions.include_usage": _served(_FIELDS_TEST + "test_continuous_usage_stats_put_usage_on_every_chunk"),
    "StreamOptions.continuous_usage_stats": _served(
        _FIELDS_TEST + "test_continuous_usage_stats_put_usage_on_every_chunk"
    ),
    "_SamplingFields.model": _served("tests/integration/test_lora_serving.py::test_adapters_served_as_offline"),
    "_SamplingFields.n": _served(_API + "test_n_choices_and_seed_reproducibility"),
    "_SamplingFields.temperature": _served(_SAMPLING),
    "_SamplingFields.top_p": _served(_SAMPLING),
    "_SamplingFields.seed": _served(_API + "test_n_choices_and_seed_reproducibility"),
    "_SamplingFields.stop": _served(_SAMPLING),
    "_SamplingFields.presence_penalty": _served(_SAMPLING),
    "_SamplingFields.frequency_penalty": _served(_SAMPLING),
    "_SamplingFields.stream": _served(_API + "test_streaming_completion"),
    "_SamplingFields.stream_options": _served(_FIELDS_TEST + "test_continuous_usage_stats_put_usage_on_every_chunk"),
    "_SamplingFields.user": _USER,
    "_SamplingFields.top_k": _served(_SAMPLING),
    "_SamplingFields.min_p": _served(_SAMPLING),
    "_SamplingFields.min_tokens": _served(_SAMPLING),
    "_SamplingFields.ignore_eos": _served(_SAMPLING),
    "_SamplingFields.stop_token_ids": _served(_SAMPLING),
    "_SamplingFields.repetition_penalty": _served(_SAMPLING),
    "_SamplingFields.include_stop_str_in_output": _served(_SAMPLING),
    "_SamplingFields.skip_special_tokens": _served(_SAMPLING),
    "_SamplingFields.cache_salt": _served(_FIELDS_TEST + "test_cache_salt_separates_prefix_caches"),
    "_SamplingFields.prompt_logprobs": _PROMPT_LOGPROBS,
    "_SamplingFields.logit_bias": _served(_PROCESSORS),
    "_SamplingFields.allowed_token_ids": _served(_PROCESSORS),
    "_SamplingFields.bad_words": _served(_PROCESSORS),
    "_SamplingFields.truncate_prompt_tokens": _served(
        _FIELDS_TEST + "test_truncate_prompt_tokens_equals_sending_the_truncated_prompt"
    ),
    "_SamplingFields.priority": _served(
        "tests/correctness/test_request_fields.py::test_priority_decides_the_order_with_one_seat"
    ),
    "_SamplingFields.best_of": _refused(_NOT_SERVED),
    "_SamplingFields.response_format": _STRUCTURED,
    "_SamplingFields.structured_outputs": _STRUCTURED,
    "_SamplingFields.guided_json": _STRUCTURED,
    "_SamplingFields.guided_regex": _STRUCTURED,
    "_SamplingFields.guided_choice": _STRUCTURED,
    "_SamplingFields.guided_grammar": _STRUCTURED,
    "CompletionRequest.prompt": _served(_API + "test_completion_greedy_equals_offline_engine"),
    "CompletionRequest.max_tokens": _served(_API + "test_completion_greedy_equals_offline_engine"),
    "CompletionRequest.logprobs": _served(_API + "test_completion_logprobs"),
    "CompletionRequest.echo": _PROMPT_LOGPROBS,
    "CompletionRequest.suffix": _refused(_NOT_SERVED),
    "ContentPart.type": _refused(_NOT_SERVED),
    "ContentPart.text": _served("tests/integration/test_lora_serving.py::test_adapters_served_as_offline"),
    "ChatMessage.role": _served(_API + "test_chat_greedy_equals_offline_engine"),
    "ChatMessage.content": _served(_API + "test_chat_greedy_equals_offline_engine"),
    "ChatMessage.name": _served(_TOKENIZER),
    "ChatMessage.tool_calls": _served(_TOOLS + "test_tool_results_go_through_the_template"),
    "ChatMessage.tool_call_id": _served(_TOOLS + "test_tool_results_go_through_the_template"),
    "ToolCall.id": _served(_TOOLS + "test_tool_results_go_through_the_template"),
    "ToolCall.type": _refused(_NOT_SERVED),
    "ToolCall.function": _served(_TOOLS + "test_tool_results_go_through_the_template"),
    "FunctionCall.name": _served(_TOOLS + "test_tool_results_go_through_the_template"),
    "FunctionCall.arguments": _served(_TOOLS + "test_tool_results_go_through_the_template"),
    "ChatCompletionRequest.messages": _served(_API + "test_chat_greedy_equals_offline_engine"),
    "ChatCompletionRequest.max_tokens": _served(_API + "test_chat_greedy_equals_offline_engine"),
    "ChatCompletionRequest.max_completion_tokens": _served(
        _FIELDS_TEST + "test_chat_and_responses_limits_and_instructions"
    ),
    "ChatCompletionRequest.logprobs": _served(_API + "test_chat_logprobs"),
    "ChatCompletionRequest.top_logprobs": _served(_API + "test_chat_logprobs"),
    "ChatCompletionRequest.tools": _served(_TOOLS + "test_required_calls_sampled_validate_against_the_parameters"),
    "ChatCompletionRequest.tool_choice": _served(
        _TOOLS + "test_required_calls_sampled_validate_against_the_parameters"
    ),
    "ChatCompletionRequest.parallel_tool_calls": _served(
        _TOOLS + "test_required_calls_sampled_validate_against_the_parameters"
    ),
    "ChatCompletionRequest.add_generation_prompt": _served(_TEMPLATE),
    "ChatCompletionRequest.chat_template_kwargs": _served(_TEMPLATE),
    "ResponsesInputMessage.role": _served(_API + "test_responses_api"),
    "ResponsesInputMessage.content": _served(_API + "test_responses_api"),
    "ResponsesInputMessage.type": _refused(_NOT_SERVED),
    "ResponsesInputMessage.call_id": _served(_TOOLS + "test_responses_function_tools"),
    "ResponsesInputMessage.name": _served(_TOOLS + "test_responses_function_tools"),
    "ResponsesInputMessage.arguments": _served(_TOOLS + "test_responses_function_tools"),
    "ResponsesInputMessage.output": _served(_TOOLS + "test_responses_function_tools"),
    "ResponsesRequest.model": _served(_API + "test_responses_api"),
    "ResponsesRequest.input": _served(_API + "test_responses_api"),
    "ResponsesRequest.instructions": _served(_FIELDS_TEST + "test_chat_and_responses_limits_and_instructions"),
    "ResponsesRequest.max_output_tokens": _served(_API + "test_responses_api"),
    "ResponsesRequest.temperature": _served(_API + "test_responses_api"),
    "ResponsesRequest.top_p": _served(_FIELDS_TEST + "test_chat_and_responses_limits_and_instructions"),
    "ResponsesRequest.stream": _served(_API + "test_responses_api"),
    "ResponsesRequest.user": _USER,
    "ResponsesRequest.tools": _served(_TOOLS + "test_responses_function_tools"),
    "ResponsesRequest.tool_choice": _served(_TOOLS + "test_responses_function_tools"),
    "ResponsesRequest.parallel_tool_calls": _served(_TOOLS + "test_responses_function_tools"),
    "ResponsesRequest.previous_response_id": _refused(_NOT_SERVED),
    "ResponsesRequest.text": _served(_API + "test_responses_text_format_and_reasoning_items"),
    "ResponsesRequest.reasoning": _served(_API + "test_responses_text_format_and_reasoning_items"),
    "TokenizeRequest.model": _served(_FIELDS_TEST + "test_tokenizer_routes_check_the_model"),
    "TokenizeRequest.prompt": _served(_FIELDS_TEST + "test_tokenizer_routes_check_the_model"),
    "TokenizeRequest.messages": _served(_API + "test_tokenize_detokenize"),
    "TokenizeRequest.add_special_tokens": _served(_TOKENIZER),
    "TokenizeRequest.add_generation_prompt": _served(_TOKENIZER),
    "DetokenizeRequest.model": _served(_FIELDS_TEST + "test_tokenizer_routes_check_the_model"),
    "DetokenizeRequest.tokens": _served(_API + "test_tokenize_detokenize"),
}
