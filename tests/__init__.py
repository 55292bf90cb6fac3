
import pytest

# The shared helpers assert; rewritten like a test module's, their failures say what the values were.
pytest.register_assert_rewrite("tests.helpers")
