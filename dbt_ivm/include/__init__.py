import os

# The adapter's include path: dbt_project.yml plus macros/ (a link to the
# repository's top-level macros/ folder; the wheel carries the files themselves).
PACKAGE_PATH = os.path.dirname(__file__)
