import pytest

from tests import harness


@pytest.fixture(scope="class")
def dbt_profile_target():
    """dbt-tests-adapter's profile: the test target's (the embedded session, or
    the Thrift server under DBT_IVM_TEST_TARGET=thrift); its ``project``
    fixture puts each test class in a schema of its own."""
    harness.spark()  # the embedded target: the process's one session, started once
    return harness._target("placeholder", 1, None)
