{#- Generated Delta sources for the demo: a customer dimension and an orders fact. -#}
{% macro create_demo_sources(n_customers=1000, n_orders=50000) %}
  {% do run_query("create schema if not exists shop") %}
  {% do run_query("drop table if exists shop.orders") %}
  {% do run_query("drop table if exists shop.customer") %}
  {% do run_query("create table shop.customer using delta as
      select id as c_custkey, concat('Customer#', lpad(cast(id as string), 6, '0')) as c_name,
             element_at(array('EUROPE', 'ASIA', 'AMERICA', 'AFRICA'), cast(id % 4 + 1 as int)) as c_region
      from range(1, " ~ (n_customers + 1) ~ ")") %}
  {% do run_query("create table shop.orders using delta as
      select id as o_orderkey, cast(id % " ~ n_customers ~ " + 1 as bigint) as o_custkey,
             cast((id * 7919) % 100000 / 100.0 as decimal(12, 2)) as o_totalprice,
             element_at(array('O', 'F', 'P'), cast(id % 3 + 1 as int)) as o_status
      from range(1, " ~ (n_orders + 1) ~ ")") %}
  {{ log("created shop.customer (" ~ n_customers ~ " rows) and shop.orders (" ~ n_orders ~ " rows)", info=True) }}
{% endmacro %}

{#- A small change window: new orders, a price correction, cancelled orders, a renamed customer. -#}
{% macro change_demo_sources() %}
  {% do run_query("insert into shop.orders select 900000 + id, id % 50 + 1, 42.00, 'O' from range(1, 101)") %}
  {% do run_query("update shop.orders set o_totalprice = o_totalprice + 1 where o_orderkey % 1000 = 7") %}
  {% do run_query("delete from shop.orders where o_orderkey % 997 = 0") %}
  {% do run_query("update shop.customer set c_name = 'Customer#renamed' where c_custkey = 3") %}
  {{ log("changed shop.orders and shop.customer", info=True) }}
{% endmacro %}
