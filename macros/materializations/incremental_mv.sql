{#-
  incremental_mv: a materialized view kept up to date from the sources' Delta
  change data feed. The model's relation is a view over the Delta state table
  `<model>__ivm_state`; the Python side (dbt_ivm) decides each refresh's
  strategy — CREATE, NOOP, INCREMENTAL, FULL — runs it, and reports why.
-#}
{% materialization incremental_mv, adapter='spark_ivm' %}
  {{ return(ivm_materialize()) }}
{% endmaterialization %}

{#- dbt's name for a materialized view: the same materialization. -#}
{% materialization materialized_view, adapter='spark_ivm' %}
  {{ return(ivm_materialize()) }}
{% endmaterialization %}

{% macro ivm_materialize() %}

  {#-- Validate config first: nothing runs on a bad config. An incremental_mv of
       this project reading this one (directly or through ephemeral models) reads
       its state's change feed: ivm_change_feed='auto' keeps it on only then. --#}
  {%- set ivm_values = {} -%}
  {%- for key in adapter.ivm_config_keys() -%}
    {%- do ivm_values.update({key: config.get(key)}) -%}
  {%- endfor -%}
  {%- do ivm_values.update({
        'ivm_target_schema': target.schema,
        'ivm_invocation_id': invocation_id,
        'ivm_mv_dependents': adapter.ivm_has_mv_readers(graph.nodes, model.unique_id),
      }) -%}
  {%- set ivm_config = adapter.ivm_validate_config(ivm_values, model.name, (model.config or {}).keys() | list) -%}
  {#-- An enforced contract: the query's columns must match the declared names and
       data types, checked as dbt-spark checks a table (nothing runs otherwise).
       The relation is a view over the state table: Spark puts no constraint on a
       view, so declared constraints are warned about, not applied. --#}
  {%- set contract_config = config.get('contract') -%}
  {%- if contract_config and contract_config.enforced -%}
    {%- do get_assert_columns_equivalent(sql) -%}
    {%- set constraint_types = model.get('constraints', []) | map(attribute='type') | list -%}
    {%- for column in (model.get('columns') or {}).values() -%}
      {%- do constraint_types.extend(column.get('constraints', []) | map(attribute='type') | list) -%}
    {%- endfor -%}
    {%- if constraint_types -%}
      {%- do exceptions.warn("incremental_mv " ~ model.name ~ ": constraints (" ~ (constraint_types | unique | join(', '))
            ~ ") are not applied: the model's relation is a view over its state table, and Spark views take no constraints.") -%}
    {%- endif -%}
  {%- endif -%}
  {%- set target_relation = this.incorporate(type='view') -%}
  {%- set existing_relation = load_cached_relation(this) -%}
  {%- set grant_config = config.get('grants') -%}

  {{ run_hooks(pre_hooks) }}

  {#-- A table left in the model's place by another materialization makes way for the view --#}
  {%- if existing_relation is not none and not existing_relation.is_view -%}
    {%- do adapter.drop_relation(existing_relation) -%}
  {%- endif -%}

  {#-- persist_docs: the model's and its columns' descriptions go on the view --#}
  {%- set ivm_docs = {'relation': none, 'columns': {}} -%}
  {%- if config.persist_relation_docs() and model.description -%}
    {%- do ivm_docs.update({'relation': model.description}) -%}
  {%- endif -%}
  {%- if config.persist_column_docs() -%}
    {%- for name, column in (model.columns or {}).items() if column.description -%}
      {%- do ivm_docs['columns'].update({name: column.description}) -%}
    {%- endfor -%}
  {%- endif -%}

  {#-- Plan and apply the refresh; the response carries the strategy and the reason --#}
  {%- set response = adapter.ivm_refresh(sql, target_relation, ivm_config, should_full_refresh(), ivm_docs) -%}
  {%- do store_result('main', response=response) -%}

  {{ run_hooks(post_hooks) }}

  {#-- Open-source Spark has no GRANT (nor SHOW GRANTS): grants are said, not applied.
       The descriptions are on the view already (persist_docs above). --#}
  {%- if grant_config -%}
    {%- do exceptions.warn("incremental_mv " ~ model.name ~ ": grants are not applied: open-source Spark has "
          ~ "no GRANT statement (use your catalog's access control, e.g. Unity Catalog or Ranger).") -%}
  {%- endif -%}

  {{ return({'relations': [target_relation]}) }}

{% endmacro %}
