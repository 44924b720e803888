# Scripts run as subprocesses, not test modules.
collect_ignore = ["_crash_driver.py"]
