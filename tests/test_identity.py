from kvgate.gateway.identity import resolve

HEADERS = ["x-conversation-id", "x-session-id"]


def test_header_wins_and_is_recorded() -> None:
    ident = resolve({"x-session-id": "s1"}, {"conversation_id": "b1"}, HEADERS, "x-tenant-id")
    assert (ident.conversation_id, ident.source) == ("s1", "header:x-session-id")


def test_body_field_used_without_header() -> None:
    ident = resolve({}, {"conversation_id": "b1"}, HEADERS, "x-tenant-id")
    assert (ident.conversation_id, ident.source) == ("b1", "body")


def test_tenants_never_share_an_explicit_id() -> None:
    a = resolve({"x-conversation-id": "c", "x-tenant-id": "a"}, {}, HEADERS, "x-tenant-id")
    b = resolve({"x-conversation-id": "c", "x-tenant-id": "b"}, {}, HEADERS, "x-tenant-id")
    assert a.conversation_id != b.conversation_id


def test_derived_key_is_stable_across_turns_and_distinct_across_conversations() -> None:
    t1 = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"}]}
    t2 = {"messages": [*t1["messages"], {"role": "assistant", "content": "A"}, {"role": "user", "content": "U2"}]}
    other = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "different"}]}
    k1, k2, k3 = (resolve({}, b, HEADERS, "x-tenant-id") for b in (t1, t2, other))
    assert k1.source == "derived" and k1.conversation_id == k2.conversation_id != k3.conversation_id
    ka = resolve({"x-tenant-id": "a"}, t1, HEADERS, "x-tenant-id")
    assert ka.conversation_id != k1.conversation_id


def test_content_parts_count_as_text() -> None:
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    plain = {"messages": [{"role": "user", "content": "hi"}]}
    assert resolve({}, parts, HEADERS, "t").conversation_id == resolve({}, plain, HEADERS, "t").conversation_id
