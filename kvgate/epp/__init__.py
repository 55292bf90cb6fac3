"""``kvgate epp``: kvgate as the endpoint picker of a Kubernetes Gateway API inference gateway. Envoy asks
over ext_proc v3 where each request goes and moves the bytes itself; kvgate answers with its own
routing (canonical history, the cost model on KV events and tiers) and sees the response phases, so
the session controller gets the same events as in proxy mode. ``protocol.py``: ext_proc messages and
the endpoint picker protocol's keys; ``stream.py``: one HTTP request's ext_proc stream;
``service.py``: the ExternalProcessor service; ``endpoints.py``: workers as ``ip:port``;
``trust.py``: who may call the picker (token, mutual TLS); ``probe.py``: what a reported 5xx may do
(ask for an early active check, never eject). docs/epp.md."""
