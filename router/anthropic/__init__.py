"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) at the router's HTTP
front, translated to and from the OpenAI chat path, so Anthropic SDK clients work unchanged."""
