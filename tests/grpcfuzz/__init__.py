"""The helpers of tests/test_grpc_fuzz.py: the wire and credentials (``wire``), the gateways under test
(``fleet``), the control API's requests and checks (``control``), the endpoint picker's scripts
(``scripts``) and its streams run and checked (``epp``)."""

import pytest

# Their asserts are the test's: rewritten as in a test module (pytest rewrites only test_*.py and conftest).
pytest.register_assert_rewrite(*(f"{__name__}.{m}" for m in ("control", "epp", "fleet", "scripts", "wire")))
