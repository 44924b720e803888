{#-
  A model that stops being an incremental_mv (now a table, a view or a dbt
  incremental model) leaves its state table behind: dbt's materializations
  for them create the relation through these macros, which drop the
  `<model>__ivm_state` dbt-ivm kept for it first (and log that they did), then
  render dbt-spark's own statement.
-#}
{% macro spark_ivm__create_table_as(temporary, relation, compiled_code, language='sql') -%}
  {%- if not temporary and execute -%}
    {%- do adapter.ivm_leave(relation) -%}
  {%- endif -%}
  {{ return(spark__create_table_as(temporary, relation, compiled_code, language)) }}
{%- endmacro %}

{% macro spark_ivm__create_view_as(relation, sql) -%}
  {%- if execute -%}
    {%- do adapter.ivm_leave(relation) -%}
  {%- endif -%}
  {{ return(spark__create_view_as(relation, sql)) }}
{%- endmacro %}
