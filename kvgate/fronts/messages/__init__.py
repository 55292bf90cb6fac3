"""The Anthropic Messages API door (``POST /v1/messages``, ``/v1/messages/count_tokens``) over the chat pipeline."""
