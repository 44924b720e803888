{#-
  A model that stops being an incremental_mv (now a table, a view or a dbt
  incremental model) leaves its state table behind: dbt's materializations
  for them create the relation through these macros, which drop the
  `<model>__ivm_state` dbt-ivm kept for it first (beside it, or in the Iceberg
  catalog its config names) (and log that they did), then
  render dbt-spark's own statement.
-#}
{#- The Iceberg catalog a model's state may be kept in (file_format 'iceberg'), or none. -#}
{% macro spark_ivm__iceberg_catalog() -%}
  {{ return(config.get('ivm_iceberg_catalog') or ('iceberg' if (config.get('file_format') or '') | lower == 'iceberg' else none)) }}
{%- endmacro %}

{% macro spark_ivm__create_table_as(temporary, relation, compiled_code, language='sql') -%}
  {%- if not temporary and execute -%}
    {%- do adapter.ivm_leave(relation, spark_ivm__iceberg_catalog()) -%}
  {%- endif -%}
  {{ return(spark__create_table_as(temporary, relation, compiled_code, language)) }}
{%- endmacro %}

{% macro spark_ivm__create_view_as(relation, sql) -%}
  {%- if execute -%}
    {%- do adapter.ivm_leave(relation, spark_ivm__iceberg_catalog()) -%}
  {%- endif -%}
  {{ return(spark__create_view_as(relation, sql)) }}
{%- endmacro %}
