import os

# The adapter's include path: dbt_project.yml plus macros/ (a link to the
# repository's top-level macros/ folder; the wheel carries the files themselves).
# dbt names the internal project after this folder: dbt_spark_ivm.
PACKAGE_PATH = os.path.join(os.path.dirname(__file__), "spark_ivm")
