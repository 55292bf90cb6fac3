"""``kvgate ctl``: a small client of the gRPC control API (what ``grpcurl`` does, without the protos at
hand). Output is the answer as JSON (proto field names); an error prints its gRPC status, the
OpenAI-style code and parameter, and exits 1."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import grpc
    from google.protobuf.message import Message

    from kvgate.grpc.gen.kvgate.v1 import policy_pb2 as ppb

DEFAULT_TARGET = os.environ.get("KVGATE_GRPC_TARGET", "127.0.0.1:50051")


def add_parser(sub: Any) -> None:
    c = sub.add_parser("ctl", help="the gRPC control API: explain, watch, conversation, next-prefix, policy, workers",
                       description="A client of kvgate's gRPC control API (grpc_port). Prints JSON.")
    c.add_argument("--target", default=DEFAULT_TARGET, help="HOST:PORT of the control API (default: "
                   "$KVGATE_GRPC_TARGET or 127.0.0.1:50051)")
    c.add_argument("--api-key", default=os.environ.get("KVGATE_API_KEY", ""),
                   help="an operator's API key or JWT, sent as 'authorization: Bearer' (default: $KVGATE_API_KEY)")
    c.add_argument("--timeout", type=float, default=10.0, help="deadline of each call, s (watch: none unless given)")
    cs = c.add_subparsers(dest="ctl", required=True, metavar="ACTION")
    e = cs.add_parser("explain", help="where a request would go and why, without sending it")
    e.add_argument("body", help="the request body (JSON file, or - for stdin)")
    e.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    e.add_argument("--header", action="append", default=[], metavar="NAME:VALUE", help="repeatable")
    e.add_argument("--exclude", action="append", default=[], metavar="WORKER", help="as if it failed (repeatable)")
    e.add_argument("--subset", action="append", default=[], metavar="IP:PORT", help="allowed endpoints (repeatable)")
    w = cs.add_parser("watch", help="routing decisions as they happen (one JSON line each)")
    w.add_argument("--model", default="")
    w.add_argument("--conversation", default="")
    w.add_argument("--tenant", default="")
    w.add_argument("--scores", action="store_true", help="every scored worker's score")
    w.add_argument("--count", type=int, default=0, help="stop after this many (0: until interrupted)")
    cv = cs.add_parser("conversation", help="a conversation's record")
    cv.add_argument("id")
    cv.add_argument("--turns", action="store_true", help="with its turn records")
    n = cs.add_parser("next-prefix", help="the prefix the conversation's next request starts with")
    n.add_argument("id")
    n.add_argument("--reasoning-policy", default="")
    n.add_argument("--ids", action="store_true", help="with the token ids")
    p = cs.add_parser("policy", help="the cost model: show, `set FIELD=VALUE ...`, or `log`")
    p.add_argument("action", nargs="?", choices=["show", "set", "log"], default="show")
    p.add_argument("changes", nargs="*", metavar="FIELD=VALUE")
    p.add_argument("--reason", default="")
    p.add_argument("--limit", type=int, default=0)
    f = cs.add_parser("workers", help="workers: health, load, index size, event streams")
    f.add_argument("--model", default="")


def _show(msg: Message) -> None:
    from google.protobuf import json_format

    print(json_format.MessageToJson(msg, preserving_proto_field_name=True, indent=2))


def _cost(changes: Sequence[str]) -> ppb.CostParams:
    from kvgate.grpc.gen.kvgate.v1 import policy_pb2 as ppb

    fields = ppb.CostParams.DESCRIPTOR.fields_by_name
    out = ppb.CostParams()
    for c in changes:
        name, sep, value = c.partition("=")
        if not sep or name not in fields:
            raise SystemExit(f"policy set: expected FIELD=VALUE with FIELD one of {', '.join(fields)}; got {c!r}")
        try:
            kind = fields[name].cpp_type
            setattr(out, name, value if kind == fields[name].CPPTYPE_STRING
                    else int(value) if kind == fields[name].CPPTYPE_INT64 else float(value))
        except ValueError:
            raise SystemExit(f"policy set: {name}: not a number: {value!r}") from None
    return out


def _call(args: argparse.Namespace, ch: grpc.Channel) -> None:
    # Imported here: `kvgate --help` and the other commands do not load gRPC.
    from google.protobuf import json_format

    from kvgate.grpc.gen.kvgate.v1 import conversations_pb2 as cpb
    from kvgate.grpc.gen.kvgate.v1 import conversations_pb2_grpc as cgrpc
    from kvgate.grpc.gen.kvgate.v1 import fleet_pb2 as fpb
    from kvgate.grpc.gen.kvgate.v1 import fleet_pb2_grpc as fgrpc
    from kvgate.grpc.gen.kvgate.v1 import policy_pb2 as ppb
    from kvgate.grpc.gen.kvgate.v1 import policy_pb2_grpc as pgrpc
    from kvgate.grpc.gen.kvgate.v1 import routing_pb2 as rpb
    from kvgate.grpc.gen.kvgate.v1 import routing_pb2_grpc as rgrpc

    t = args.timeout
    if args.ctl == "explain":
        text = sys.stdin.read() if args.body == "-" else Path(args.body).read_text()
        headers = dict(h.split(":", 1) for h in args.header)
        ep = rpb.ENDPOINT_COMPLETIONS if args.endpoint == "completions" else rpb.ENDPOINT_CHAT
        _show(rgrpc.RoutingStub(ch).Explain(rpb.ExplainRequest(
            body_json=text, endpoint=ep, headers={k.strip().lower(): v.strip() for k, v in headers.items()},
            exclude_workers=args.exclude, endpoint_subset=args.subset), timeout=t))
    elif args.ctl == "watch":
        req = rpb.WatchDecisionsRequest(model=args.model, conversation_id=args.conversation, tenant=args.tenant,
                                        include_scores=args.scores)
        for i, ev in enumerate(rgrpc.RoutingStub(ch).WatchDecisions(req, timeout=None), 1):
            print(json.dumps(json_format.MessageToDict(ev, preserving_proto_field_name=True)), flush=True)
            if args.count and i >= args.count:
                break
    elif args.ctl == "conversation":
        _show(cgrpc.ConversationsStub(ch).GetConversation(
            cpb.GetConversationRequest(conversation_id=args.id, include_turns=args.turns), timeout=t))
    elif args.ctl == "next-prefix":
        _show(cgrpc.ConversationsStub(ch).GetNextPrefix(cpb.GetNextPrefixRequest(
            conversation_id=args.id, reasoning_policy=args.reasoning_policy, include_token_ids=args.ids), timeout=t))
    elif args.ctl == "policy":
        stub = pgrpc.PolicyStub(ch)
        if args.action == "set":
            _show(stub.UpdatePolicy(ppb.UpdatePolicyRequest(cost=_cost(args.changes), reason=args.reason), timeout=t))
        elif args.action == "log":
            _show(stub.ListPolicyChanges(ppb.ListPolicyChangesRequest(limit=args.limit), timeout=t))
        else:
            _show(stub.GetPolicy(ppb.GetPolicyRequest(), timeout=t))
    else:
        _show(fgrpc.FleetStub(ch).ListWorkers(fpb.ListWorkersRequest(model=args.model), timeout=t))


def _bearer(token: str) -> Any:
    """A client interceptor adding ``authorization: Bearer <token>`` to every call."""
    import collections

    import grpc

    class Details(collections.namedtuple("Details", ("method", "timeout", "metadata", "credentials",
                                                     "wait_for_ready", "compression")),
                  grpc.ClientCallDetails):
        pass

    class Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
        def _with(self, d: Any) -> Any:
            md = [*(d.metadata or ()), ("authorization", f"Bearer {token}")]
            return Details(d.method, d.timeout, md, d.credentials, d.wait_for_ready, d.compression)

        def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
            return continuation(self._with(details), request)

        def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
            return continuation(self._with(details), request)

    return Bearer()


def run(args: argparse.Namespace) -> int:
    import grpc

    with grpc.insecure_channel(args.target) as raw:
        ch = grpc.intercept_channel(raw, _bearer(args.api_key)) if args.api_key else raw
        try:
            _call(args, ch)
        except grpc.RpcError as exc:
            call: Any = exc  # a failed call's error is also its grpc.Call (code, details, trailing metadata)
            md: dict[str, str] = {k: v for k, v in call.trailing_metadata() or ()}
            extra = ", ".join(f"{k.removeprefix('kvgate-error-')}={v}" for k, v in md.items()
                              if k.startswith("kvgate-error-") and v)
            print(f"error: {call.code().name}: {call.details()}" + (f" ({extra})" if extra else ""), file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
    return 0
