"""The OpenAI Responses API door (``POST /v1/responses``) over the chat pipeline: ``translate`` reads a
request into a chat body and a chat answer into a response, ``items`` the input items into chat
messages, ``stream`` the chat SSE into Responses events, ``store`` keeps retrievable responses,
``routes`` the Front and the HTTP handlers."""
