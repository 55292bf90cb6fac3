"""The OpenAI Responses API door (``POST /v1/responses``) over the chat pipeline: ``translate`` turns a
request into a chat body and a chat answer into a response, ``stream`` the chat SSE into Responses
events, ``store`` keeps retrievable responses, ``routes`` the HTTP handlers."""
