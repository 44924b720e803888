select c.c_custkey, c.c_name, c.c_region,
       sum(o.o_totalprice) as revenue, count(*) as n_orders,
       avg(o.o_totalprice) as avg_price, min(o.o_totalprice) as min_price, max(o.o_totalprice) as max_price
from {{ source('shop', 'orders') }} o
join {{ source('shop', 'customer') }} c on o.o_custkey = c.c_custkey
group by c.c_custkey, c.c_name, c.c_region
