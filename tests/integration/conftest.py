# Scripts run as subprocesses, not test modules.
collect_ignore = ["_crash_driver.py"]


def pytest_terminal_summary(terminalreporter, config):
    """Tables the suites leave for the log (the scenario table, per target)."""
    for block in getattr(config, "dbt_ivm_summary", []):
        terminalreporter.write_sep("-", block.splitlines()[0])
        for line in block.splitlines()[1:]:
            terminalreporter.write_line(line)
