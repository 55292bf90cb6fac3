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


KVGATE = ["x-conversation-id"]


def test_kvgates_header_wins_over_every_harness_key() -> None:
    h = {"x-conversation-id": "mine", "x-claude-code-session-id": "cc", "session-id": "codex"}
    ident = resolve(h, {"prompt_cache_key": "pk"}, KVGATE, "x-tenant-id")
    assert (ident.conversation_id, ident.source) == ("mine", "header:x-conversation-id")


def test_harness_headers_in_documented_order() -> None:
    order = ["x-claude-code-session-id", "session-id", "session_id", "x-session-affinity", "x-session-id"]
    for i, name in enumerate(order):
        headers = {n: f"v-{n}" for n in order[i:]}
        ident = resolve(headers, {"prompt_cache_key": "pk", "conversation_id": "b"}, KVGATE, "x-tenant-id")
        assert (ident.conversation_id, ident.source) == (f"v-{name}", f"header:{name}")


def test_body_keys_after_headers_in_order() -> None:
    body = {"session_id": "s", "prompt_cache_key": "pk", "metadata": {"user_id": "u"}}
    assert resolve({}, body, KVGATE, "t").source == "body:session_id"
    assert resolve({}, {**body, "session_id": None}, KVGATE, "t").conversation_id == "pk"
    ident = resolve({}, {"metadata": {"user_id": "u"}, "messages": []}, KVGATE, "t")
    assert (ident.conversation_id, ident.source) == ("u", "body:metadata.user_id")
    # kvgate's own body field comes before the foreign ones.
    assert resolve({}, {**body, "conversation_id": "c"}, KVGATE, "t").source == "body"


def test_harness_keys_off_leaves_only_kvgates_and_the_derived_key() -> None:
    ident = resolve({"x-claude-code-session-id": "cc"}, {"prompt_cache_key": "pk", "messages": []}, KVGATE, "t",
                    harness=False)
    assert ident.source == "derived"


def test_claude_code_sub_agents_are_their_own_conversations_linked_to_the_parent() -> None:
    main = resolve({"x-claude-code-session-id": "S"}, {}, KVGATE, "x-tenant-id")
    child = resolve({"x-claude-code-session-id": "S", "x-claude-code-agent-id": "A"}, {}, KVGATE, "x-tenant-id")
    grandchild = resolve({"x-claude-code-session-id": "S", "x-claude-code-agent-id": "B",
                          "x-claude-code-parent-agent-id": "A"}, {}, KVGATE, "x-tenant-id")
    assert main.parent is None
    assert child.conversation_id != main.conversation_id and child.parent == main.conversation_id
    assert grandchild.parent == child.conversation_id
    assert len({main.conversation_id, child.conversation_id, grandchild.conversation_id}) == 3


def test_parent_session_header_links_any_session_header() -> None:
    child = resolve({"x-session-affinity": "kid", "x-parent-session-id": "mom", "x-tenant-id": "t"}, {}, KVGATE,
                    "x-tenant-id")
    assert (child.conversation_id, child.parent) == ("t/kid", "t/mom")
    own = resolve({"x-conversation-id": "kid", "x-parent-session-id": "mom"}, {}, KVGATE, "x-tenant-id")
    assert own.parent == "mom"


def test_foreign_keys_outside_kvgates_alphabet_are_hashed_not_refused() -> None:
    odd = "user 42/🙂" + "x" * 300
    a = resolve({"session-id": odd}, {}, KVGATE, "x-tenant-id")
    b = resolve({}, {"prompt_cache_key": odd}, KVGATE, "x-tenant-id")
    assert a.conversation_id.startswith("h-") and a.conversation_id == b.conversation_id
    assert "/" not in a.conversation_id and len(a.conversation_id) < 64


def test_tenants_never_share_a_harness_session() -> None:
    a = resolve({"x-claude-code-session-id": "S", "x-tenant-id": "a"}, {}, KVGATE, "x-tenant-id")
    b = resolve({"x-claude-code-session-id": "S", "x-tenant-id": "b"}, {}, KVGATE, "x-tenant-id")
    assert a.conversation_id != b.conversation_id
    ca = resolve({"x-claude-code-session-id": "S", "x-claude-code-agent-id": "A", "x-tenant-id": "a"}, {}, KVGATE,
                 "x-tenant-id")
    assert ca.parent == a.conversation_id
