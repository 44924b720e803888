{#- dbt run-operation ivm_explain --args '{model: <name>}': the strategy a refresh of
    the incremental_mv would take when its sources change, and why, from the live
    catalog (the offline equivalent: `dbt-ivm explain`). -#}
{% macro ivm_explain(model) %}
  {%- set report = adapter.ivm_explain(graph.nodes, graph.sources, model) -%}
  {{ log(tojson(report), info=True) }}
  {{ return(report) }}
{% endmacro %}
