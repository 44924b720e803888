# dbt's own adapter-test fixtures (dbt-tests-adapter: `project`, `run_dbt`'s
# profiles and schemas), used by tests/adapter/. pytest takes pytest_plugins
# from the top-level conftest only.
pytest_plugins = ["dbt.tests.fixtures.project"]
