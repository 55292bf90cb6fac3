"""kvgate's gRPC control API (``proto/kvgate/v1``), served by the gateway process with ``grpc.aio``:
``services.py`` (the four services), ``explain.py`` (where a request would go, without sending it),
``decisions.py`` (the live decision stream), ``auth.py`` (the authentication and role hook),
``status.py`` (errors as gRPC status codes), ``malformed.py`` (requests whose bytes do not parse:
INVALID_ARGUMENT, on both servers), ``server.py`` (ports, health, reflection), ``ctl.py``
(``kvgate ctl``). Generated code lives in ``gen/`` (``kvgate/dev/protos.py``)."""
